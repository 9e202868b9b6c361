"""``sample_kernel="triton"`` in the engine (``engine/kernels/vocab_sample.py`` through
``fused.Elementwise``): option values and resolution, tokens and logprobs against
``sample_kernel="torch"`` for GRPO's min_p sampling, plain temperature and greedy, one kernel
call per decode step, and top-k steps kept on the torch sampler. On CUDA the same tests run under
CUDA graphs (the runner's default there). The kernel itself: ``test_vocab_sample.py``.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); skipped when
triton is not importable.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="sample_kernel='triton' needs the triton package")

from _kernels import DEV, skip_unless_runnable
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import vocab_sample as vs
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_sample_kernel

skip_unless_runnable(vs)


def test_option_values():
    assert RunnerOptions().sample_kernel == "auto"
    assert resolve_sample_kernel(RunnerOptions(sample_kernel="triton"), on_cuda=True) == "triton"
    assert resolve_sample_kernel(RunnerOptions(), on_cuda=True) == "triton"  # auto on CUDA
    assert resolve_sample_kernel(RunnerOptions(sample_kernel="torch"), on_cuda=True) == "torch"
    assert resolve_sample_kernel(RunnerOptions(sample_kernel="triton", compile_decode=True),
                                 on_cuda=True) == "torch"
    with pytest.raises(ValueError, match=r"sample_kernel='fast'.*\('auto', 'torch', 'triton'\)"):
        RunnerOptions(sample_kernel="fast")
    with pytest.raises(ValueError, match="sample_kernel"):
        LLM(tiny_model("qwen3").to(DEV), page_size=64, num_pages=4, max_model_len=32,
            sample_kernel="flashinfer")


def _count(monkeypatch):
    calls = []
    real = vs.vocab_sample
    monkeypatch.setattr(vs, "vocab_sample", lambda logits, *a, **k: (
        calls.append(tuple(logits.shape)), real(logits, *a, **k))[1])
    return calls


GRPO = SamplingParams(temperature=1.0, min_p=0.1, seed=3407, max_new_tokens=5, ignore_eos=True)
CASES = {  # (sampling, other options)
    "grpo": (GRPO, {}),
    "t07": (SamplingParams(temperature=0.7, seed=11, max_new_tokens=5, ignore_eos=True), {}),
    "greedy": (SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True), {}),
    "grpo_fused_triton": (GRPO, {"fused_elementwise": "triton"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_torch_sampler(monkeypatch, case):
    """Tiny Qwen3 (vocab 512): ``sample_kernel="triton"`` generates the tokens and logprobs
    (|d| < 1e-5) of ``"torch"``, also beside the Triton norm/RoPE/SwiGLU pieces; each decode
    step is one kernel call (prefill keeps torch). On CUDA under CUDA graphs (the runner's
    default there)."""
    sampling, opts = CASES[case]
    model = tiny_model("qwen3").to(DEV)
    prompts = random_prompts(3, 5, 12, seed=2)
    calls = _count(monkeypatch)
    outs = {}
    for kernel in ("torch", "triton"):
        llm = LLM(model, page_size=64, num_pages=8, max_model_len=64, sample_kernel=kernel,
                  **opts)
        outs[kernel] = llm.generate(prompts, sampling)
        if DEV == "cuda":
            assert llm.runner.timings["graph_captures"] > 0
    for got, want in zip(outs["triton"], outs["torch"]):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
    if DEV == "cpu":  # eager steps: one call a decode step, bucket of 4 rows
        assert calls == [(4, 512)] * (sampling.max_new_tokens - 1)


def test_engine_top_k_keeps_torch(monkeypatch):
    """A top-k step (``use_sort=True``) never reaches the kernel."""
    calls = _count(monkeypatch)
    llm = LLM(tiny_model("qwen3").to(DEV), page_size=64, num_pages=8, max_model_len=64,
              sample_kernel="triton")
    llm.generate(random_prompts(2, 5, 9, seed=4), SamplingParams(
        temperature=1.0, top_k=20, seed=1, max_new_tokens=4, ignore_eos=True))
    assert not calls
