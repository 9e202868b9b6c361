"""The flex engine inside TRL's GRPOTrainer on the CPU: two GRPO steps on a tiny random model.

Checks issue 6 item 2 (zero copy, live LoRA) and item 6: the LoRA weights change, the engine
reads the trainer's own tensors, the second rollout's logprobs are those of the *updated* weights
(and not of the initial ones), the engine-vs-trainer logprob metric is logged, and the coherence
gate passes on this run and fails when a NaN loss is injected into it.
"""

import math

import pytest
import torch
from transformers import TrainerCallback

from nbhelpers.backends.base import BackendNotInstalled
from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.grpo import flex_rollout as grpo_flex
from nbhelpers.grpo import step_rows, train
from nbhelpers.grpo.compile_report import CompileWatch, check_compile_mode
from nbhelpers.grpo.flex_rollout import group_prompts, logprob_mismatch
from nbhelpers.grpo.gate import MISMATCH_MEAN, GateFailed, assert_gate, check_run, thresholds_for
from nbhelpers.grpo.plans import plan_backend


# a step-varying reward so advantages (and the LoRA update) are non-zero on random weights
def letter_e_reward(prompts=None, completions=(), **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.count("e")) for t in texts]


class Snapshots(TrainerCallback):
    """LoRA tensors before training and after each optimiser step."""

    def __init__(self):
        self.states = {}

    @staticmethod
    def lora(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.states[0] = self.lora(model)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.states[state.global_step] = self.lora(model)


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16, CUDA-graph decode)")])


@pytest.fixture(scope="module", params=["cpu", ON_CUDA])
def flex_run(request, tmp_path_factory):
    """Two flex GRPO steps; ``cpu`` (fp32, eager) is forced even on GPU hosts, ``cuda`` runs
    bf16 with the engine's CUDA-graph decode (the captured graphs must see the update too)."""
    from nbhelpers.grpo import setup as grpo_setup
    torch.set_num_threads(1)  # tiny GEMMs on 2 shared cores (tests/engine/_tiny.py)
    made = []

    class Recorded(grpo_flex.FlexRollout):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    settings = GRPOSettings(max_steps=2, num_generations=4, per_device_train_batch_size=4,
                            max_completion_length=8, learning_rate=2e-2, warmup_ratio=0.0,
                            lr_scheduler_type="constant", min_p=0.0, beta=0.04,
                            lora=LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj")))
    snaps = Snapshots()
    mp = pytest.MonkeyPatch()
    mp.setattr(grpo_flex, "FlexRollout", Recorded)
    mp.setattr(grpo_setup, "is_cuda", lambda: request.param == "cuda")
    try:
        result = train("tiny-llama", settings, backend="flex", n_questions=4, progress=False,
                       output_dir=tmp_path_factory.mktemp("grpo_flex"), skip_first=0,
                       reward_funcs=[letter_e_reward], callbacks=[snaps],
                       flex_options={"keep_history": True})
    finally:
        mp.undo()
    return result, made[0], snaps, request.param


def test_lora_weights_changed(flex_run):
    snaps = flex_run[2]
    assert set(snaps.states) == {0, 1, 2}
    for step in (1, 2):
        delta = max((snaps.states[step][k] - snaps.states[step - 1][k]).abs().max().item()
                    for k in snaps.states[0])
        assert delta > 1e-3, f"step {step} did not move the LoRA weights"


def test_engine_reads_the_trainers_own_tensors(flex_run):
    rollout = flex_run[1]
    from nbhelpers.engine.lora import LiveLinear
    live = {id(p.module.lora_A["default"].weight) for p in _live_linears(rollout)}
    trainer_params = {id(p) for n, p in rollout.policy.named_parameters() if "lora_A" in n}
    assert live and live == trainer_params  # the same Parameter objects: no copy, no sync
    assert all(isinstance(p, LiveLinear) for p in _live_linears(rollout))


def _live_linears(rollout):
    from nbhelpers.engine.lora import LiveGroup, LiveLinear
    found, seen = [], set()

    def walk(obj, depth=0):
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, LiveLinear) and obj.has_lora:
            found.append(obj)
        elif isinstance(obj, LiveGroup):
            found.extend(p for p in obj.parts if p.has_lora)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, depth + 1)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("nbhelpers.engine"):
            for x in vars(obj).values():
                walk(x, depth + 1)

    walk(rollout.llm.runner)
    return found


@torch.no_grad()
def _hf_logprobs(model, state, prompt, completion):
    params = dict(model.named_parameters())
    for name, value in state.items():
        params[name].copy_(value)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    picked = torch.tensor(completion, device=device)[:, None]
    return torch.log_softmax(logits, -1).gather(1, picked)[:, 0].cpu()


def test_second_rollout_used_the_updated_weights(flex_run):
    _, rollout, snaps, device = flex_run
    assert [h["global_step"] for h in rollout.history] == [0, 1]
    atol = 1e-4 if device == "cpu" else 0.1  # fp32 eager vs bf16 (engine graph vs HF forward)
    second = rollout.history[1]
    model, final = rollout.policy, Snapshots.lora(rollout.policy)
    was_training = model.training
    model.eval()
    try:
        for i in range(len(second["prompt_ids"])):
            args = (second["prompt_ids"][i], second["completion_ids"][i])
            engine = torch.tensor(second["logprobs"][i])
            after_step1 = _hf_logprobs(model, snaps.states[1], *args)
            before = _hf_logprobs(model, snaps.states[0], *args)
            assert torch.allclose(engine, after_step1, atol=atol), (engine, after_step1)
            # the old weights give other logprobs: the engine followed the update
            assert (engine - after_step1).abs().mean() < (engine - before).abs().mean() / 2
    finally:
        _hf_logprobs(model, final, [0], [0])
        model.train(was_training)


def test_mismatch_metric_and_gate_on_the_real_run(flex_run):
    result, _, _, device = flex_run
    rows = step_rows(result)
    limit = 1e-4 if device == "cpu" else 0.05
    assert len(rows) == 2 and all(r[MISMATCH_MEAN] < limit for r in rows)
    assert all(r["generate_s"] > 0 for r in rows)
    # IS on by default: one support (and min_p 0 here, so the filtered ratio is the same number)
    for key in ("is_token_ratio_mean", "is_filtered_ratio_mean", "is_ratio_applied_mean"):
        assert all(abs(r[key] - 1) < (1e-4 if device == "cpu" else 0.05) for r in rows), key
    assert all(r["is_token_outside_0.9_1.1"] == 0.0 for r in rows if device == "cpu")
    th = thresholds_for("random", reward_range=(0.0, 8.0))  # letter_e_reward: 0..8 per 8 tokens
    assert check_run("flex", rows, th).passed
    rows[1]["loss"] = math.nan  # injected NaN loss
    with pytest.raises(GateFailed, match="flex.loss_finite"):
        assert_gate({"flex": check_run("flex", rows, th)})


def test_vllm_and_unsloth_fail_naming_the_extra(tmp_path):
    """Neither engine installs on this CPU host: train() stops before loading anything."""
    for backend in ("vllm", "unsloth"):
        with pytest.raises(BackendNotInstalled, match=rf"\.\[{backend}\]"):
            train("tiny-llama", GRPOSettings(), backend=backend, output_dir=tmp_path)


def test_compile_watch_counts_recompiles_and_rejects_bad_mode():
    # A clean dynamo cache: an earlier test's compile of the same wrapper code object with another
    # backend would count as one more recompile (BACKEND_MATCH guard failure), seen in a full run.
    torch._dynamo.reset()
    with CompileWatch("default") as watch:
        f = torch.compile(torch.nn.Linear(4, 4), backend="eager", dynamic=False)
        f(torch.randn(2, 4))
        f(torch.randn(3, 4))  # new static shape: one recompile
    report = watch.report()
    assert report["recompiles"] == 1 and "size mismatch" in next(iter(report["recompile_reasons"]))
    assert report["graph_breaks"] == 0 and report["unique_graphs"] == 2
    with pytest.raises(ValueError, match="max-autotune-no-cudagraphs"):
        check_compile_mode("max-autotune")


def test_plan_rejects_bad_choices_and_notes_vllm_only_settings():
    with pytest.raises(ValueError, match="use one of"):
        plan_backend("tgi", GRPOSettings())
    notes = plan_backend("hf_generate", GRPOSettings(), flex_options={"page_size": 16}).notes
    assert notes == ["flex_options apply to backend='flex' only: ignored for 'hf_generate'."]
    plan = plan_backend("hf_cb", GRPOSettings(), vllm_sleep_mode=True)
    assert plan.config_overrides == {"use_transformers_continuous_batching": True}
    assert "ignored" in plan.notes[0]


def test_group_prompts_and_mismatch_helpers():
    assert group_prompts([[1], [1], [2], [2]], 2) == ([[1], [2]], 2)
    assert group_prompts([[1], [2], [1], [2]], 2) == ([[1], [2], [1], [2]], 1)
    t = torch.tensor([[-1.0, -2.0, 0.0]])
    s = torch.tensor([[-1.5, float("nan"), 9.0]])
    assert logprob_mismatch(t, s, torch.tensor([[1, 1, 0]])) == (0.5, 0.5)
    with pytest.raises(ValueError, match="kv_tokens"):
        grpo_flex.FlexRollout(max_model_len=64, kv_tokens=8)


def test_vllm_max_model_length_covers_trls_fixed_batched_tokens():
    from nbhelpers.grpo.plans import TRL_VLLM_MAX_NUM_BATCHED_TOKENS, vllm_max_model_length
    phase2 = GRPOSettings(per_device_train_batch_size=4, num_generations=4,
                          max_prompt_length=256, max_completion_length=256)
    assert vllm_max_model_length(phase2) == 1024  # 4 seqs x 1024 = 4096, not 4 x 512 = 2048
    long = GRPOSettings(per_device_train_batch_size=16, num_generations=4,
                        max_prompt_length=1024, max_completion_length=1024)
    assert vllm_max_model_length(long) == 2048  # 16 x 2048 >= 4096 already: prompt + completion
    for s in (phase2, long):
        seqs = s.per_device_train_batch_size * s.gradient_accumulation_steps
        assert seqs * vllm_max_model_length(s) >= TRL_VLLM_MAX_NUM_BATCHED_TOKENS


def test_compile_trainer_models_compiles_the_backbone_not_the_lm_head():
    """TRL's patched LM forward (its Triton log-prob kernel) must stay outside the compiled
    region (compile_report module docstring); the backbone under PEFT is what gets compiled."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from nbhelpers import models
    from nbhelpers.grpo.compile_report import backbone, compile_trainer_models
    lm, _ = models.load_model("tiny-llama", dtype="float32", device="cpu")
    policy = get_peft_model(lm, LoraConfig(r=2, target_modules=["q_proj"]))
    trainer = SimpleNamespace(model=policy, ref_model=None)
    assert backbone(policy) is lm.model
    assert compile_trainer_models(trainer, "none") == []
    assert compile_trainer_models(trainer, "default") == ["policy"]
    assert lm.model._compiled_call_impl is not None
    assert lm._compiled_call_impl is None  # the LM head / TRL's fused forward stay eager
    x = torch.randint(0, lm.config.vocab_size, (1, 5))
    with torch.no_grad():
        out = policy(input_ids=x).logits
    assert out.shape == (1, 5, lm.config.vocab_size) and torch.isfinite(out).all()


def test_format_warmup_is_merged_then_grpo_trains_a_fresh_adapter(tmp_path):
    """Phase 2's format warm-up: SFT steps on a LoRA adapter, merged into the base, then GRPO
    (flex rollouts) on that base with a new adapter (no merged folder: flex reads the trainer's
    tensors); unsloth, which loads its own model class from the merged folder, is refused with
    ``warmup_adapter="continue"`` naming the fix (vllm and unsloth run the merged warm-up too:
    tests/unit/test_warmup_vllm_folder.py, tests/unit/test_warmup_unsloth.py)."""
    from nbhelpers.grpo import setup as grpo_setup
    torch.set_num_threads(1)
    settings = GRPOSettings(max_steps=1, num_generations=4, per_device_train_batch_size=4,
                            max_completion_length=8, min_p=0.0,
                            lora=LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj")))
    mp = pytest.MonkeyPatch()
    mp.setattr(grpo_setup, "is_cuda", lambda: False)
    try:
        result = train("tiny-llama", settings, backend="flex", n_questions=4, progress=False,
                       output_dir=tmp_path, skip_first=0, format_warmup_steps=2,
                       warmup_adapter="merge")
    finally:
        mp.undo()
    warm = result.config["format_warmup"]
    assert warm["steps"] == 2 and len(warm["losses"]) == 2
    assert all(math.isfinite(x) for x in warm["losses"])
    assert len(result.records) == 1 and math.isfinite(result.records[0]["loss"])
    assert warm["vllm_model_folder"] is None and warm["model_folder"] is None
    assert not (tmp_path / "format_warmup" / "merged").exists()
    with pytest.raises(ValueError, match=r"format_warmup_steps=3 with backend='unsloth' and "
                                         r"warmup_adapter='continue'.*pass "
                                         r"warmup_adapter='merge'.*or format_warmup_steps=0"):
        train("tiny-llama", settings, backend="unsloth", output_dir=tmp_path,
              format_warmup_steps=3)  # warmup_adapter: "continue", train's default


def test_step_rows_split_the_step_and_the_engine(flex_run):
    """Issue 13: every step row has the trainer split (time/*) and the flex engine split
    (flex/*); parts are non-negative and sum to no more than their wall."""
    from nbhelpers.grpo.step_timing import FLEX_KEYS, TIME_KEYS
    result, rollout, _, _ = flex_run
    rows = step_rows(result)
    assert len(rows) == 2
    for row in rows:
        assert all(row[k] is not None and row[k] >= 0 for k in (*TIME_KEYS, *FLEX_KEYS)), row
        parts = sum(row[k] for k in TIME_KEYS[:3])
        assert parts <= row["wall_s"] + 1e-3
        assert parts + row["time/other_s"] == pytest.approx(row["wall_s"], abs=1e-3)
        engine = row["flex/prefill_s"] + row["flex/decode_s"] + row["flex/host_s"]
        assert engine <= row["flex/generate_wall_s"] + 1e-6
        assert row["flex/generate_wall_s"] <= row["flex/rollout_s"] + 1e-6
        assert row["flex/rollout_s"] <= row["generate_s"] + 1e-3  # rollout_func inside _generate
        assert row["generate_s"] <= row["time/generate_and_score_s"] + 1e-3
        assert row["flex/decode_steps"] >= 1
    # one rollout per step here: the row's engine numbers are that rollout's own
    assert [r["flex/decode_s"] for r in rows] == pytest.approx(
        [s["flex/decode_s"] for s in rollout.engine_stats])
    assert len(rollout.engine_stats) == len(rollout.generate_s) == 2


def test_sidecar_rates_divide_tokens_by_the_real_rollout_seconds(flex_run):
    """The sidecar's decode tok/s is over each step's rollout (``generate_s``), which the real
    run logs, and so above the whole step's tokens per second (fresh-user trial, 2026-12-07)."""
    from nbhelpers.grpo.phase0_report import phase0_sidecar
    result, _, _, _ = flex_run
    side = phase0_sidecar(result, GRPOSettings(), {"name": "tiny-llama"}, skip_first=0)
    rounds = side["rounds"]
    assert len(rounds) == 2 and all(0 < r["generate_s"] < r["wall_s"] for r in rounds)
    assert all(r["new_tokens"] > 0 for r in rounds)
    per_step = sorted(r["new_tokens"] / r["wall_s"] for r in rounds)
    assert side["decode_tok_per_s_median"] > sum(per_step) / 2


def test_flex_plan_pads_prefill_to_the_prompt_limit_so_attention_compiles_once():
    from nbhelpers.grpo.plans import prefill_pad_for
    assert [prefill_pad_for(n) for n in (1, 128, 129, 256, 300)] == [128, 128, 256, 256, 384]
    rollout = plan_backend("flex", GRPOSettings(max_prompt_length=200)).rollout
    assert rollout.engine_options["prefill_pad"] == 256
    mine = plan_backend("flex", GRPOSettings(), flex_options={"prefill_pad": 64}).rollout
    assert mine.engine_options["prefill_pad"] == 64


def test_flex_freeze_gc_travels_from_flex_options_to_the_engine():
    """Phase 2's ``-p flex_freeze_gc true`` (``compare.flex_options(freeze_gc=True)``) reaches
    the rollout's engine options, which ``build_llm`` hands to ``RunnerOptions.freeze_gc``."""
    from nbhelpers.grpo.compare import flex_options
    rollout = plan_backend("flex", GRPOSettings(), flex_options=flex_options(freeze_gc=True)).rollout
    assert rollout.engine_options["freeze_gc"] is True
    assert "freeze_gc" not in plan_backend("flex", GRPOSettings()).rollout.engine_options
