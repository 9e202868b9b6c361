"""Issue 13 part 4: ``compile_scope`` (regional compilation of the trainer's decoder layers).

The H200's first compiled step of the Qwen3-4B backbone took 252 s (session 17); compiling each
decoder layer on its own lets dynamo compile one layer's graph and reuse it for the others. These
tests compile for real on the CPU (tiny models) and count what dynamo compiled.
"""

from types import SimpleNamespace

import pytest
import torch

from nbhelpers.grpo.compile_report import (
    COMPILE_SCOPES,
    LAYER_SCOPE_BACKENDS,
    CompileWatch,
    compile_trainer_models,
    decoder_layers,
    resolve_compile_scope,
)


@pytest.mark.parametrize("backend", ["flex", "vllm"])
def test_auto_is_layers_where_rollouts_never_run_the_hf_forward(backend):
    assert backend in LAYER_SCOPE_BACKENDS
    assert resolve_compile_scope("auto", backend) == "layers"
    assert resolve_compile_scope(None, backend) == "layers"


@pytest.mark.parametrize("backend", ["hf_generate", "hf_cb", "unsloth"])
def test_auto_is_backbone_where_generation_runs_the_layers_with_a_kv_cache(backend):
    assert resolve_compile_scope("auto", backend) == "backbone"
    if backend == "unsloth":  # its own model class: 'layers' asked for is kept
        assert resolve_compile_scope("layers", backend) == "layers"
    else:  # KV-cache generation through the layers: per-layer recompiles, then eager
        with pytest.raises(ValueError, match=rf"compile_scope='layers' with backend="
                                             rf"'{backend}'.*use compile_scope='auto' or "
                                             r"'backbone'"):
            resolve_compile_scope("layers", backend)


def test_a_bad_scope_names_the_choices():
    with pytest.raises(ValueError, match=r"compile_scope='model': use one of \('auto', "
                                         r"'backbone', 'layers'\)"):
        resolve_compile_scope("model", "flex")
    assert COMPILE_SCOPES == ("auto", "backbone", "layers")
    with pytest.raises(ValueError, match="resolve 'auto'"):
        compile_trainer_models(SimpleNamespace(model=None, ref_model=None), "default",
                               scope="auto")


def _peft_policy(layers: int = 2):
    """tiny-llama (2 layers) or, for ``layers`` > 2, a tiny Qwen3 of that depth (random)."""
    from peft import LoraConfig, get_peft_model

    from nbhelpers import models
    torch.manual_seed(0)
    if layers == 2:
        lm, _ = models.load_model("tiny-llama", dtype="float32", device="cpu")
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM
        lm = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64))
    return lm, get_peft_model(lm, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


def test_layers_scope_compiles_each_layer_not_the_backbone_under_peft():
    lm, policy = _peft_policy()
    layers = decoder_layers(policy)
    assert layers is lm.model.layers and len(layers) >= 2
    trainer = SimpleNamespace(model=policy, ref_model=None)
    assert compile_trainer_models(trainer, "default", scope="layers") == ["policy"]
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert lm.model._compiled_call_impl is None and lm._compiled_call_impl is None


def test_layers_scope_compiles_one_layer_graph_per_grad_mode_and_matches_eager():
    """TRL's forwards (use_cache=False), training and no-grad scoring: the
    compiled layers reuse one graph for every layer (no recompile per layer), and the logits and
    the LoRA gradients equal eager's within fp32 noise."""
    torch._dynamo.reset()
    torch.set_num_threads(1)
    lm, policy = _peft_policy(layers=10)
    _, eager = _peft_policy(layers=10)
    eager.load_state_dict(policy.state_dict())
    trainer = SimpleNamespace(model=policy, ref_model=None)
    n_layers = len(decoder_layers(policy))
    with CompileWatch("default", scope="layers") as watch:
        compile_trainer_models(trainer, "default", scope="layers")
        for length in (7,):
            x = torch.randint(0, lm.config.vocab_size, (2, length))
            for model in (policy, eager):
                model.zero_grad()
                model(input_ids=x, use_cache=False).logits.float().square().mean().backward()
            for (name, p), (_, q) in zip(policy.named_parameters(), eager.named_parameters()):
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
            with torch.no_grad():
                torch.testing.assert_close(policy(input_ids=x, use_cache=False).logits,
                                           eager(input_ids=x, use_cache=False).logits,
                                           rtol=1e-5, atol=1e-5)
    rep = watch.report()
    assert rep["compile_scope"] == "layers"
    assert rep["graph_breaks"] == 0
    # graphs are per grad mode and per input regime (layer 0's input needs no grad, the others'
    # do under LoRA), not per layer: 2 here (at most 3 allowed); a recompile per layer would be
    # 9 for these 10 layers (dynamo stops at its recompile_limit of 8)
    assert n_layers == 10 and 1 <= rep["recompiles"] <= 3, rep["recompile_reasons"]
    assert not any("layer_idx" in r or "layers[" in r for r in rep["recompile_reasons"]), rep


def test_flex_grpo_run_compiles_its_trainer_layer_by_layer(tmp_path):
    """End to end: a flex GRPO run with compile_mode default and the auto scope compiles the
    policy's layers (not the backbone), trains, and reports the scope and compile seconds."""
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import train
    torch._dynamo.reset()
    torch.set_num_threads(1)
    settings = GRPOSettings(max_steps=2, num_generations=2, per_device_train_batch_size=2,
                            max_completion_length=4)
    res = train("tiny-llama", settings, backend="flex", n_questions=2, progress=False,
                output_dir=tmp_path, skip_first=0, compile_mode="default")
    rep = res.config["compile_report"]
    assert rep["compile_scope"] == "layers" and rep["compiled"] == ["policy"]
    assert rep["frames_ok"] >= 1
    assert rep["compile_s"] is None or rep["compile_s"] > 0
    assert len(res.records) == 2
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in res.records), res.records


@pytest.mark.parametrize("backend,scope", [("flex", "layers"), ("hf_generate", "backbone")])
def test_train_compiles_with_the_resolved_scope(backend, scope, tmp_path, monkeypatch):
    """train() hands the resolved scope to the compile (auto: layers for flex, backbone for
    hf_generate); the compile is recorded, not run (the end-to-end test above runs one)."""
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import compile_report, train
    seen = []
    monkeypatch.setattr(compile_report, "compile_trainer_models",
                        lambda trainer, mode, dynamic=None, scope="backbone":
                        seen.append(scope) or ["policy"])
    torch.set_num_threads(1)
    settings = GRPOSettings(max_steps=1, num_generations=2, per_device_train_batch_size=2,
                            max_completion_length=4)
    res = train("tiny-llama", settings, backend=backend, n_questions=2, progress=False,
                output_dir=tmp_path, skip_first=0, compile_mode="default")
    assert seen == [scope] and res.config["compile_report"]["compile_scope"] == scope


def test_bad_compile_words_are_refused_before_a_multi_process_launch(tmp_path, monkeypatch):
    """num_processes > 1 hands off to distributed.launch: the compile words are checked first
    (a bad scope used to fail 11 s later inside `accelerate launch` without naming the word)."""
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import distributed, train
    monkeypatch.setattr(distributed, "launch", lambda *a, **k: pytest.fail("launched"))
    for kwargs, match in (({"compile_scope": "bogus"}, "compile_scope='bogus'"),
                          ({"compile_mode": "max"}, "compile_mode='max'"),
                          ({"compile_dynamic": "yes"}, "compile_dynamic='yes'"),
                          ({"compile_scope": "layers", "backend": "hf_generate"},
                           "compile_scope='layers' with backend='hf_generate'")):
        with pytest.raises(ValueError, match=match):
            train("tiny-llama", GRPOSettings(), output_dir=tmp_path, num_processes=2, **kwargs)
