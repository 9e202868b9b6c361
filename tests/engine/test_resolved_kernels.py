"""``tuner_tables.resolved_kernels``: what the runner runs once ``"auto"`` and the silent device
fallbacks are resolved, recorded in every flex point's ``breakdown["resolved"]``
(``bench.flex_sweep.run_flex_point``: scripts/bench_flex.py's A/B sidecars, notebook 33's points).

Why (fresh-user trial, 2026-12-02): ``--variants '{"name": "a", "options": {"sample_kernel":
"triton"}}'`` on a CPU host without ``TRITON_INTERPRET=1`` ran the torch sampler and its sidecar
said only ``"sample_kernel": "triton"``; ``skinny_gemm_cublas="never"`` with the skinny path
off changes nothing (with ``skinny_gemm="off"`` it is now refused). Tiny Qwen3 on the CPU; the
tests run under the interpreter (``tests/conftest.py``) unless they patch ``pdl.interpreted``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from _tiny import tiny_model

from nbhelpers.bench import flex_sweep as eb
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.tuner_tables import resolved_kernels

TRITON = importlib.util.find_spec("triton") is not None
POOL = {"page_size": 8, "num_pages": 16, "max_model_len": 64}


def test_cpu_defaults():
    got = resolved_kernels(LLM(tiny_model("qwen3"), **POOL).runner)
    assert got == {"decode_attention": "sdpa", "prefill_attention": "sdpa",
                   "lora_expand": "addmm", "skinny_gemm": "off", "skinny_gemm_cublas": None,
                   "pdl": False, "pdl_mode": "off", "pdl_prefetch_mib": None,
                   "sample_kernel": "torch", "prefill_graphs": "off"}


@pytest.mark.skipif(not TRITON, reason="sample_kernel='triton' needs triton: pip install triton "
                    "(scripts/test.sh installs the interp extra)")
def test_what_was_asked_and_what_ran_differ_off_cuda_without_the_interpreter(monkeypatch):
    opts = {"sample_kernel": "triton", "skinny_gemm_cublas": "never", "pdl": "on"}
    monkeypatch.setattr(pdl, "interpreted", lambda: True)  # a CUDA host runs it un-interpreted
    llm = LLM(tiny_model("qwen3"), **POOL, **opts)
    assert resolved_kernels(llm.runner)["sample_kernel"] == "triton"  # interpreted: it runs
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    llm = LLM(tiny_model("qwen3"), **POOL, **opts)
    assert (llm.opt.sample_kernel, llm.opt.skinny_gemm_cublas, llm.opt.pdl) == \
        ("triton", "never", "on")  # asked
    got = resolved_kernels(llm.runner)
    assert (got["sample_kernel"], got["skinny_gemm_cublas"], got["pdl"]) == ("torch", None, False)


def test_every_flex_point_records_them():
    model = tiny_model("qwen3")
    res = eb.run_flex_point(model, 2, 5, 3, rounds=1, warmup=0, sync_every=2, floor=False,
                            decode_attention="flex")
    got = res["breakdown"]["resolved"]
    assert got["decode_attention"] == "flex" and got["sample_kernel"] == "torch"
    assert got["prefill_graphs"] == "off"  # and its counters ride in the breakdown
    brk = res["breakdown"]
    assert brk["prefill_graph_captures"] == brk["prefill_graph_replays"] == 0
    side = eb.flex_sidecar("t_b2", {"name": "tiny"}, None, 2, 5, 3, res, run_id="r")
    assert json.loads(json.dumps(side))["breakdown"]["resolved"] == got


def test_never_with_the_skinny_path_off_is_refused():
    """``skinny_gemm="off", skinny_gemm_cublas="never"`` was accepted and ran cuBLAS for every
    decode GEMM (fresh-user trial, 2026-12-02); an A/B variant gets the same one message."""
    from nbhelpers.bench import flex_ab
    from nbhelpers.engine.runner_options import RunnerOptions
    with pytest.raises(ValueError, match=r"skinny_gemm_cublas='never' with skinny_gemm='off'.*"
                       r"use skinny_gemm='auto'"):
        RunnerOptions(skinny_gemm="off", skinny_gemm_cublas="never")
    with pytest.raises(ValueError, match=r"x: RunnerOptions.skinny_gemm_cublas='never' with"):
        flex_ab.check_engine_options({"skinny_gemm": "off", "skinny_gemm_cublas": "never"}, "x")
    assert RunnerOptions(skinny_gemm="off").skinny_gemm_cublas == "auto"
    assert RunnerOptions(skinny_gemm_cublas="never").skinny_gemm == "auto"  # auto: no refusal


@pytest.mark.parametrize("asked, on_cuda, interpreted, compile_decode, ran", [
    ("auto", True, False, False, "triton"),   # the default on CUDA (H200 A/B: n15a/n15b)
    ("auto", False, True, False, "torch"),    # the interpreter is a test tool, not a CPU path
    ("auto", False, False, False, "torch"),
    ("auto", True, False, True, "torch"),     # compile_decode keeps the torch sampler
    ("triton", False, True, False, "triton"),
    ("triton", False, False, False, "torch"),
    ("torch", True, False, False, "torch"),
])
@pytest.mark.skipif(not TRITON, reason="'auto' picks triton only when it imports: pip install "
                    "triton (scripts/test.sh installs the interp extra)")
def test_sample_kernel_resolution(monkeypatch, asked, on_cuda, interpreted, compile_decode, ran):
    from nbhelpers.engine.runner_options import RunnerOptions
    from nbhelpers.engine.runner_resolve import resolve_sample_kernel
    monkeypatch.setattr(pdl, "interpreted", lambda: interpreted)
    opt = RunnerOptions(sample_kernel=asked, compile_decode=compile_decode)
    assert resolve_sample_kernel(opt, on_cuda) == ran


def test_sample_kernel_default_is_auto():
    from nbhelpers.engine.runner_options import RunnerOptions
    assert RunnerOptions().sample_kernel == "auto"
