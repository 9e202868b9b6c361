"""L2 prefetch on a CUDA GPU (runner option ``l2_prefetch``, ``engine/l2_prefetch.py``; the H200
suite): the compiled kernel's scratch at Qwen3-4B's o_proj size, the fork/join captured into a
CUDA graph (the prefetch runs on every replay), and greedy tokens and logprobs of
``l2_prefetch="o_proj"`` equal to ``"off"`` on a tiny Qwen3 (bf16; bf16 LoRA in the ``ext``
buffer; fp32 adapters through the bf16 shadow; the fused base + LoRA kernel), under captured CUDA
graphs (no eager fallback) and eagerly. CPU checks: ``test_l2_prefetch.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the prefetch kernel needs the triton package")

from _kernels import peft_tiny
from _tiny import random_prompts, tiny_model
from test_l2_prefetch import GREEDY, _expected
from test_pdl import KERNEL_OPTS, _force_skinny

from nbhelpers.engine import LLM
from nbhelpers.engine.decode_graphs import WARMUP_STEPS
from nbhelpers.engine.kernels import l2_prefetch as kern
from nbhelpers.engine.l2_prefetch import L2Prefetch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: runs on the H200 suite "
    "(pytest -m gpu tests/engine/test_l2_prefetch_gpu.py on the H200 host)")]


def test_gpu_kernel_reads_every_byte_of_an_o_proj_weight():
    """Qwen3-4B's o_proj weight (bf16 ``[2560, 4096]``, 21 MB) and an odd-sized uint8 tensor:
    each program's scratch word is the XOR of the words it read (compiled kernel)."""
    torch.manual_seed(0)
    for t in (torch.randn(2560, 4096, device="cuda", dtype=torch.bfloat16),
              torch.randint(0, 256, (12345,), device="cuda", dtype=torch.uint8)):
        scratch = torch.full((kern.DEFAULT_PROGRAMS,), -1, dtype=torch.int32, device="cuda")
        kern.l2_prefetch(t, scratch)
        torch.cuda.synchronize()
        want = _expected(t, kern.DEFAULT_PROGRAMS, kern.BLOCK)
        assert np.array_equal(scratch.cpu().numpy(), want)


class _Weight:
    """A stand-in projection group: ``gemm_weight()`` is ``w``."""

    def __init__(self, w: torch.Tensor):
        self.w = w

    def gemm_weight(self) -> torch.Tensor:
        return self.w


def test_gpu_fork_join_captures_into_one_graph_and_replays_the_prefetch():
    """The side-stream fork and join inside ``torch.cuda.graph``: capture succeeds, the main
    stream's result is right, and each replay runs the prefetch again (the scratch, zeroed
    between replays, comes back)."""
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, device="cuda")
    pf = L2Prefetch("o_proj", torch.device("cuda"))
    assert pf.enabled

    def body() -> torch.Tensor:
        with pf.decoding():
            y = x * 2
            pf.fork(_Weight(w))
            z = y + 1
            pf.join()
            return z * 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up: compile the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    want = _expected(w, pf.scratch.numel(), kern.BLOCK)
    for _ in range(2):
        pf.scratch.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert np.array_equal(pf.scratch.cpu().numpy(), want)
        torch.testing.assert_close(out, (x * 2 + 1) * 3, rtol=0, atol=0)


CASES = {  # model builder, engine options, LoRA rank in o_proj's buffer
    "bf16": (lambda: tiny_model("qwen3").to(device="cuda", dtype=torch.bfloat16), {}, 0),
    "bf16_lora_ext": (lambda: peft_tiny(torch.bfloat16, autocast_adapter_dtype=False), {}, 4),
    "bf16_fp32_adapters": (lambda: peft_tiny(torch.bfloat16), {"lora_dtype": "model"}, 4),
    "lora_fused": (lambda: peft_tiny(torch.bfloat16, autocast_adapter_dtype=False),
                   {"lora_fused": "triton"}, 4),
}


def _run(model, mode: str, graphs: bool, opts: dict) -> tuple[list, LLM]:
    llm = LLM(model, l2_prefetch=mode, use_cuda_graphs=graphs, **KERNEL_OPTS, **opts)
    assert llm.runner.l2.enabled is (mode == "o_proj")
    outs = [(o.token_ids, o.logprobs) for o in llm.generate(random_prompts(3, 5, 12, seed=2),
                                                           GREEDY)]
    return outs, llm


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_o_proj_prefetch_matches_off(monkeypatch, tmp_path, case, graphs):
    """Same greedy tokens and logprobs as ``"off"``; with graphs every bucket captured (no
    eager fallback) and the prefetch issued once per layer in each warm-up and capture call;
    eagerly once per layer per decode step; the buffer prefetched is o_proj's GEMM operand."""
    build, opts, rank = CASES[case]
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    _force_skinny(monkeypatch)  # deterministic configs: the same kernels in both runs
    model = build()
    want, _ = _run(model, "off", graphs, opts)
    got, llm = _run(model, "o_proj", graphs, opts)
    run, em = llm.runner, llm.runner.model
    if graphs:
        assert run.timings["graph_captures"] > 0 and run.states
        assert all(st.graph is not None for st in run.states.values())  # captured, not eager
        calls = (WARMUP_STEPS + 1) * run.timings["graph_captures"]
    else:
        calls = run.timings["decode_steps"]
    assert run.l2.launches == calls * len(em.layers) > 0
    assert em.o[0].gemm_weight().shape[0] == em.config.hidden_size + rank
    for (t_on, lp_on), (t_off, lp_off) in zip(got, want, strict=True):
        assert t_on == t_off
        torch.testing.assert_close(torch.tensor(lp_on), torch.tensor(lp_off), rtol=0, atol=1e-6)
