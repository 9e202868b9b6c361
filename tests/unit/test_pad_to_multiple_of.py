"""Phase 2's ``pad_to_multiple_of`` (TRL's ``GRPOConfig`` field through ``GRPOSettings``): checked,
passed to TRL, recorded, part of the comparison shape, and a real run with it trains the same.

Why it exists: on the H200 (2026-12-03) a ``compile_mode="default"`` run recompiled the trainer for
every new sequence length (344 -> 345 tokens at step 2, after two compiles at step 1), so bucketing
the lengths is what bounds the recompiles (``GRPOSettings.pad_to_multiple_of``'s docstring).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nbhelpers.config import GRPOSettings, LoraSpec

REPO = Path(__file__).resolve().parents[2]
NB20 = REPO / "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"


def test_negative_padding_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=-1: must be >= 0 \(0 = no padding"):
        GRPOSettings(pad_to_multiple_of=-1)
    assert GRPOSettings().pad_to_multiple_of == 0
    # no bigger than the longer length: 100000 passed validation and then asked TRL for 40 GB
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=100000: must be <= 256 \(the longer"):
        GRPOSettings(pad_to_multiple_of=100000)
    assert GRPOSettings(pad_to_multiple_of=256).pad_to_multiple_of == 256
    assert GRPOSettings(max_completion_length=512, pad_to_multiple_of=512).pad_to_multiple_of == 512


def test_build_config_passes_it_to_trl_and_zero_is_trls_none(tmp_path):
    pytest.importorskip("trl")
    from nbhelpers.grpo.setup import build_config
    assert build_config(GRPOSettings(), tmp_path).pad_to_multiple_of is None
    assert build_config(GRPOSettings(pad_to_multiple_of=64), tmp_path).pad_to_multiple_of == 64


def test_the_runner_refuses_a_bad_value_before_launch():
    from nbhelpers.run.params import UserInputError, plan_parameters
    with pytest.raises(UserInputError, match=r"pad_to_multiple_of.*>= 0"):
        plan_parameters([NB20], "cpu", {"pad_to_multiple_of": -8}, REPO)
    with pytest.raises(UserInputError, match=r"pad_to_multiple_of.*must be <= 256"):
        plan_parameters([NB20], "cpu", {"pad_to_multiple_of": 100000}, REPO)
    plan_parameters([NB20], "cpu", {"pad_to_multiple_of": 64}, REPO)  # accepted


def test_shape_label_names_padding_and_older_sidecars_read_as_none():
    from nbhelpers.grpo.compare_shapes import run_shape, shape_label
    padded = {"config": {"pad_to_multiple_of": 64, "num_generations": 4,
                         "per_device_train_batch_size": 4, "max_completion_length": 256},
              "request": {"settings": {"pad_to_multiple_of": 64}}}
    older = {"config": {"num_generations": 4, "per_device_train_batch_size": 4,
                        "max_completion_length": 256}}
    trl_none = {"config": dict(older["config"], pad_to_multiple_of=None),
                "request": {"settings": {"pad_to_multiple_of": 0}}}
    assert run_shape(padded)["pad_to_multiple_of"] == 64
    assert "pad64" in shape_label(run_shape(padded)).split()
    for run in (older, trl_none):
        assert run_shape(run)["pad_to_multiple_of"] == 0
        assert "pad" not in shape_label(run_shape(run))


def _reward(prompts=None, completions=(), **kwargs):
    return [float(str(c).count("e")) for c in completions]


def _train(backend: str, pad: int, out: Path):
    from nbhelpers.grpo import step_rows, train
    torch.set_num_threads(1)
    settings = GRPOSettings(max_steps=2, num_generations=4, per_device_train_batch_size=4,
                            max_completion_length=8, learning_rate=2e-2, warmup_ratio=0.0,
                            lr_scheduler_type="constant", min_p=0.1, beta=0.04,
                            lora=LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj")),
                            pad_to_multiple_of=pad)
    res = train("tiny-llama", settings, backend=backend, n_questions=4, progress=False,
                output_dir=str(out), skip_first=0,
                reward_funcs=[_reward])
    return res, step_rows(res)


@pytest.mark.parametrize("backend", ["hf_generate", "flex"])
def test_a_padded_run_trains_as_the_unpadded_one(backend, tmp_path):
    """Same seed, same tokens: padded positions are masked, so loss, KL and grad norm agree to fp32
    noise on the CPU (measured here: |d grad_norm| ~1e-8 for hf_generate), and flex's
    importance-sampling ratio stays at 1 (its per-token quantities are padded by TRL with the
    ids). On CUDA (bf16, other attention kernels for the padded lengths) within bf16 noise, and
    finite: SDPA's cuDNN backward gave NaN gradients there until the trainer excluded it for
    padded runs (H100, 2026-12-07: with it excluded, grad norms 0.20417 vs 0.20414 at step 1 for
    hf_generate; flex's step 2 0.2799 vs 0.2827)."""
    import math
    pytest.importorskip("trl")
    plain, rows0 = _train(backend, 0, tmp_path / "plain")
    padded, rows64 = _train(backend, 64, tmp_path / "padded")
    assert padded.config["pad_to_multiple_of"] == 64 and plain.config["pad_to_multiple_of"] is None
    on_cuda = any("pad_to_multiple_of=64 on CUDA: SDPA runs without its cuDNN backend" in n
                  for n in padded.config["notes"])
    assert on_cuda == torch.cuda.is_available()  # the note, only where it applies
    assert [r["step"] for r in rows64] == [1, 2]
    cuda = torch.cuda.is_available()
    for a, b in zip(rows0, rows64):
        assert math.isfinite(b["grad_norm"]) and b["grad_norm"] > 0
        if cuda:  # bf16; step 2's rollout already follows a bf16-noisy update
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-3)
            assert b["kl"] == pytest.approx(a["kl"], rel=0.25, abs=1e-4)
            continue
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-7)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    if backend == "flex":  # bf16 on CUDA: the engine's and the trainer's logprobs differ more
        for r in rows64:
            assert r["is_token_ratio_mean"] == pytest.approx(1.0, abs=5e-3 if cuda else 1e-5)
            assert r["is_token_outside_0.9_1.1"] <= (0.05 if cuda else 0.0)
