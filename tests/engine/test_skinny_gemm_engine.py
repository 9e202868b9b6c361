"""``skinny_gemm="triton"`` in the engine (``engine/skinny_linear.py``): option values, decode-only
routing, and greedy tokens/logprobs against ``skinny_gemm="off"`` before and after an in-place
LoRA update, through the ``ext`` layout, the bf16 shadows, ``lora_expand="consumer"`` and a model
without LoRA. On CUDA the same tests run under CUDA graphs (the runner's default there). The
kernel itself: ``test_skinny_gemm.py``.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); skipped when
triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="skinny_gemm='triton' needs the triton package")

from _kernels import DEV, inplace_lora_step, peft_tiny, skip_unless_runnable
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels import skinny_gemm_tune as tune
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_skinny_gemm
from nbhelpers.engine.skinny_linear import SkinnyLinear, check_skinny_gemm

skip_unless_runnable(sg)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
LAYERS = 2


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path, monkeypatch):
    """GPU runs tune the tiny shapes: into a cache of this test's own, not the user's."""
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_TUNER", None)


def test_option_values():
    assert RunnerOptions(skinny_gemm="triton").skinny_gemm == "triton"
    # "auto" (the default): the kernel where ModelRunner.kernels_ok (CUDA, 16/32-bit model)
    assert RunnerOptions().skinny_gemm == "auto"
    assert resolve_skinny_gemm(RunnerOptions(), kernels_ok=True) == "triton"
    assert resolve_skinny_gemm(RunnerOptions(skinny_gemm="auto"), kernels_ok=False) == "off"
    assert resolve_skinny_gemm(RunnerOptions(skinny_gemm="off"), kernels_ok=True) == "off"
    with pytest.raises(ValueError, match=r"skinny_gemm='fast'.*\('auto', 'off', 'triton'\)"):
        RunnerOptions(skinny_gemm="fast")
    with pytest.raises(ValueError, match=r"\('off', 'triton'\)"):
        check_skinny_gemm("auto")  # the engine-side check takes resolved values only
    with pytest.raises(ValueError, match="skinny_gemm"):
        LLM(tiny_model("qwen3").to(DEV), page_size=64, num_pages=4, max_model_len=32,
            skinny_gemm="on")


def test_route_runs_kernel_only_while_decoding(monkeypatch):
    _force_kernel(monkeypatch)
    calls = _count(monkeypatch)
    x, w = torch.randn(3, 64, device=DEV), torch.randn(40, 64, device=DEV)
    route = SkinnyLinear("triton")
    torch.testing.assert_close(route(x, w), x @ w.t())
    assert not calls  # outside a decode window: F.linear
    with route.decoding():
        torch.testing.assert_close(route(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
        route(torch.randn(33, 64, device=DEV), w)  # more than max_rows (32) rows: F.linear
    assert calls == [(3, 40)] and not route.decode
    assert not SkinnyLinear("off").enabled


@pytest.mark.skipif(DEV != "cpu", reason="CUDA tunes the shape (tests/engine/test_skinny_gemm.py "
                    "times the tuner); this checks the interpreter's fixed default")
def test_interpreter_uses_default_config_unrecorded():
    route = SkinnyLinear("triton")
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    assert route.config(x, w, None) == sg.default_config(40, 64)
    assert route.choices == {}  # no timing off CUDA: nothing recorded


def _force_kernel(monkeypatch):
    """Every served decode GEMM runs the kernel with its default config: on CUDA the tuner may
    keep cuBLAS for the tiny test shapes (then no launch to count), and its timing runs would
    be counted as launches. These tests check the routing, not the tuner."""
    monkeypatch.setattr(SkinnyLinear, "config",
                        lambda self, x2, w, bias: sg.default_config(w.shape[0], x2.shape[1]))


def _count(monkeypatch):
    """Record ``(M, N)`` of every kernel launch."""
    calls = []
    real = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda x, w, *a: (
        calls.append((x.shape[0], w.shape[0])), real(x, w, *a))[1])
    return calls


def _generate(model, prompts, num_pages=8, sampling=GREEDY, **options):
    """Greedy ``(token_ids, logprobs)`` per prompt of a fresh engine over ``model``."""
    llm = LLM(model, page_size=64, num_pages=num_pages, max_model_len=64, **options)
    outs = llm.generate(prompts, sampling)
    if DEV == "cuda":
        assert llm.runner.timings["graph_captures"] > 0  # parity under CUDA graphs
    return [(o.token_ids, o.logprobs) for o in outs]


def _assert_same(got, want, tol):
    for (gt, glp), (wt, wlp) in zip(got, want):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(glp, wlp)) < tol


CASES = {  # (model dtype, fp32 adapters, options, LoRA A's rows in the GEMM: ext / shadow)
    "fp32_ext": (torch.float32, False, {}, True),
    "bf16_ext": (torch.bfloat16, False, {}, True),
    "bf16_shadow": (torch.bfloat16, True, {"lora_dtype": "model"}, True),
    "bf16_fp32_adapters": (torch.bfloat16, True, {"lora_dtype": "adapter"}, False),
    "bf16_consumer": (torch.bfloat16, False, {"lora_expand": "consumer",
                                              "fused_elementwise": "triton"}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_off_before_and_after_update(monkeypatch, case):
    """Tiny Qwen3 with LoRA r=4 on every projection: the tokens of ``skinny_gemm="off"`` and its
    logprobs (|dlogprob| < 1e-4 for fp32, the lora_expand tests' bound; 2e-2 for bf16 on CUDA,
    where cuBLAS and tl.dot sum in their own order), before and after an in-place optimizer
    step (live LoRA). The kernel serves every decode GEMM (4 groups a layer + lm_head a step)
    and no prefill GEMM."""
    dtype, autocast, opts, ext = CASES[case]
    model = peft_tiny(dtype, autocast)
    prompts = random_prompts(3, 5, 12, seed=2)
    calls = _count(monkeypatch)
    tol = 1e-4 if dtype == torch.float32 or DEV == "cpu" else 2e-2
    seen = []
    for _ in range(2):
        want = _generate(model, prompts, skinny_gemm="off", **opts)
        assert not calls
        got = _generate(model, prompts, skinny_gemm="triton", **opts)
        _assert_same(got, want, tol)
        if DEV == "cpu":  # eager steps: one launch per GEMM (CUDA replays graphs)
            steps = GREEDY.max_new_tokens - 1  # the first token comes from prefill
            assert len(calls) == (4 * LAYERS + 1) * steps
            assert {m for m, _ in calls} == {4}  # decode rows only (3 in the bucket of 4)
            n_out = {n for _, n in calls}
            assert 512 in n_out and 64 + 32 + 32 + 12 * ext in n_out  # lm_head, q/k/v
        calls.clear()
        seen.append([t for t, _ in want])
        inplace_lora_step(model)
    assert seen[0] != seen[1]  # the update changed the output


def test_engine_without_lora_and_prefill_only(monkeypatch):
    """Plain projections and the LM head (no LoRA): the tokens of ``"off"``; a request whose
    only token comes from prefill launches no kernel (prefill keeps cuBLAS)."""
    model = tiny_model("qwen3").to(DEV)
    prompts = random_prompts(2, 5, 9, seed=4)
    calls = _count(monkeypatch)
    want = _generate(model, prompts, skinny_gemm="off")
    _assert_same(_generate(model, prompts, skinny_gemm="triton"), want, 1e-4)
    if DEV == "cpu":
        assert {n for _, n in calls} == {64 + 32 + 32, 64, 256, 512}
    calls.clear()
    llm = LLM(model, page_size=64, num_pages=8, max_model_len=64, skinny_gemm="triton")
    llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    assert not calls


def test_profiler_step_uses_kernel(monkeypatch):
    """``bench.profile`` steps ``runner._step_body`` directly: its GEMMs are decode GEMMs too."""
    model = tiny_model("qwen3").to(DEV)
    llm = LLM(model, page_size=64, num_pages=8, max_model_len=64, skinny_gemm="triton",
              use_cuda_graphs=False)
    llm.generate(random_prompts(2, 5, 9, seed=4), GREEDY)
    _force_kernel(monkeypatch)
    calls = _count(monkeypatch)
    st = next(iter(llm.runner.states.values()))
    st.col.zero_()
    with torch.no_grad():
        llm.runner._step_body(st, st.use_sort)
    assert len(calls) == 4 * LAYERS + 1


@pytest.mark.skipif(DEV != "cpu", reason="tiny-gemma4 engine tests run on the CPU (16-token "
                    "pages); Gemma-4 on CUDA: test_gemma4.test_gpu_compiled_graphs_match_hf")
def test_engine_gemma4_matches_off(monkeypatch):
    """Gemma-4's own block calls its groups (PLE ones too): the tokens and logprobs of "off"."""
    from test_gemma4 import SMALL, VOCAB, tiny_gemma4
    model = tiny_gemma4()
    prompt = random_prompts(1, 12, 12, seed=5, vocab=VOCAB)
    calls = _count(monkeypatch)
    outs = [LLM(model, **SMALL, skinny_gemm=mode).generate(prompt, GREEDY)[0]
            for mode in ("off", "triton")]
    assert calls
    assert outs[0].token_ids == outs[1].token_ids
    assert max(abs(a - b) for a, b in zip(outs[0].logprobs, outs[1].logprobs)) < 1e-4
