"""``lora_expand="epilogue"`` in the engine (``LiveGroup._cublas_path`` ->
``SkinnyLinear.lora_epilogue`` -> ``engine/kernels/skinny_lora_epilogue.py``): option values,
greedy tokens/logprobs against ``lora_expand="triton"`` (the CUDA default path: skinny GEMM over
``[W; A]`` + one expand launch) before and after an in-place update of the adapters, through
the ``ext`` layout and the bf16 shadows, the fallback for fp32 adapters and prefill, and the
Triton launches of one decode step (one fewer per LoRA group). The kernel:
``test_skinny_lora_epilogue.py``.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); on CUDA the same
parity tests run under CUDA graphs. Skipped when triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="lora_expand='epilogue' needs the triton package")

from _kernels import (
    DEV,
    decode_step_launches,
    inplace_lora_step,
    peft_tiny,
    skip_unless_runnable,
)
from _tiny import random_prompts
from test_skinny_gemm_engine import _force_kernel

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import skinny_gemm_tune as tune
from nbhelpers.engine.kernels import skinny_lora_epilogue as ep
from nbhelpers.engine.lora import check_lora_expand
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_kernels

skip_unless_runnable(ep)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
LAYERS = 2
COUNTS_PER_STEP = DEV == "cpu"
"""Python launch calls equal launches per step only without CUDA graphs (the CPU engine)."""


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path, monkeypatch):
    """Every served decode GEMM runs the kernel with its default config (CUDA's tuner may keep
    cuBLAS for the tiny shapes, and no tuning cache of the user's is touched)."""
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_TUNER", None)
    _force_kernel(monkeypatch)


def _count(monkeypatch):
    """Record ``(M, rows of W')`` of every epilogue-kernel launch."""
    calls = []
    real = ep.skinny_lora_gemm
    monkeypatch.setattr(ep, "skinny_lora_gemm", lambda x, w, *a: (
        calls.append((x.shape[0], w.shape[0])), real(x, w, *a))[1])
    return calls


def _generate(model, prompts, mode, sampling=GREEDY, **options):
    llm = LLM(model, page_size=64, num_pages=8, max_model_len=64, skinny_gemm="triton",
              lora_expand=mode, **options)
    outs = llm.generate(prompts, sampling)
    return [(o.token_ids, o.logprobs) for o in outs]


def test_option_values():
    assert RunnerOptions(lora_expand="epilogue").lora_expand == "epilogue"
    assert check_lora_expand("epilogue") == "epilogue"
    assert resolve_kernels(RunnerOptions(), on_cuda=True)[1] == "consumer"  # "auto": not epilogue
    with pytest.raises(ValueError, match="'epilogue'"):
        RunnerOptions(lora_expand="epilog")


CASES = {  # (model dtype, fp32 adapters, options, epilogue serves the groups)
    "fp32_ext": (torch.float32, False, {}, True),
    "bf16_ext": (torch.bfloat16, False, {}, True),
    "bf16_shadow": (torch.bfloat16, True, {"lora_dtype": "model"}, True),
    "bf16_fp32_adapters": (torch.bfloat16, True, {"lora_dtype": "adapter"}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_triton_before_and_after_update(monkeypatch, case):
    """Tiny Qwen3, LoRA r=4 on every projection: the tokens of ``lora_expand="triton"`` and its
    logprobs (fp32: within 1e-5, xA and y are fp32 either way but the BLAS's order is the
    host's; bf16: |dlogprob| < 2e-2, y
    rounded once instead of twice), before and after an in-place optimizer step (live LoRA,
    the shadows re-copied). Every decode group runs the epilogue kernel (4 a layer a step),
    prefill none; fp32 adapters without shadows keep the old path."""
    dtype, autocast, opts, served = CASES[case]
    model = peft_tiny(dtype, autocast)
    prompts = random_prompts(3, 5, 12, seed=2)
    calls = _count(monkeypatch)
    seen = []
    for _ in range(2):
        want = _generate(model, prompts, "triton", **opts)
        assert not calls
        got = _generate(model, prompts, "epilogue", **opts)
        for (gt, glp), (wt, wlp) in zip(got, want):
            assert gt == wt
            diff = max(abs(a - b) for a, b in zip(glp, wlp))
            # fp32: <= 1e-5, not 0.0: the plain path's xA comes from the CPU BLAS, whose
            # summation order depends on the host (bit-equal on Intel, not on the AMD CI host)
            assert diff <= 1e-5 if dtype == torch.float32 else diff < 2e-2
        if COUNTS_PER_STEP:
            steps = GREEDY.max_new_tokens - 1  # the first token comes from prefill
            assert len(calls) == (4 * LAYERS * steps if served else 0)
            assert not served or {m for m, _ in calls} == {4}  # decode rows (bucket of 4)
            assert not served or 128 + 12 in {n for _, n in calls}  # q/k/v + 3 x r4
        elif served:
            assert calls  # captured into the graphs
        calls.clear()
        seen.append([t for t, _ in want])
        inplace_lora_step(model)
    assert seen[0] != seen[1]  # the update changed the output


def test_prefill_only_request_launches_no_epilogue(monkeypatch):
    """A request whose only token comes from prefill: no decode GEMM, no epilogue launch."""
    model = peft_tiny(torch.float32, False)
    calls = _count(monkeypatch)
    _generate(model, random_prompts(2, 5, 9, seed=4), "epilogue",
              SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    assert not calls


@pytest.mark.skipif(DEV != "cpu", reason="counts the Triton interpreter's launches; on CUDA "
                    "bench_flex.py's kernels/step column counts them (H200 host)")
def test_decode_step_launch_count_drops_one_per_group():
    """Triton launches of one eager decode step (batch 4, 2 layers, 4 LoRA groups a layer;
    ``bench.profile``'s step): "epilogue" makes 4 fewer a layer than "triton": no expand
    launch, and each group's GEMM is the epilogue kernel; the LM head keeps the plain kernel."""
    from collections import Counter

    model = peft_tiny(torch.float32, False)
    prompts = random_prompts(4, 5, 12, seed=2)
    launches: dict[str, Counter] = {}
    for mode in ("triton", "epilogue"):
        llm = LLM(model, page_size=64, num_pages=8, max_model_len=64, skinny_gemm="triton",
                  lora_expand=mode)
        llm.generate(prompts, GREEDY)
        launches[mode] = decode_step_launches(llm)
    tri, epi = launches["triton"], launches["epilogue"]
    groups = 4 * LAYERS
    assert tri["_lora_expand_gemm"] == groups and tri["_skinny_gemm"] == groups + 1
    assert "_lora_expand_gemm" not in epi and epi["_skinny_gemm"] == 1
    assert epi["_skinny_lora"] == groups
    assert sum(tri.values()) - sum(epi.values()) == groups
