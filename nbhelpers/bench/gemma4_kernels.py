"""flex_attention kernel options for Gemma-4's head dims (256 sliding, 512 full) on one GPU.

What: compiles the engine's paged attention (same BlockMasks as the runner: packed prefill and
one-query-per-row decode over a shared page pool, GQA 8:1 as on E2B) with candidate
``kernel_options`` per head_dim, checks each against the unfused flex reference and times it.
Why: flex's Triton templates keep a ``BLOCK_M x D`` query tile plus ``num_stages`` buffers of
``BLOCK_N x D`` K and V tiles in shared memory; at D=512 and bf16 the runner's prefill tiles
(64, 64, 2 stages) need 64 + 2 x 128 = 320 KiB, over the H200's 227 KiB per block
(CUDA C programming guide, compute capability 9.0), so the full-attention layers need their own.

Run (on the GPU host): ``python -c "from nbhelpers.bench.gemma4_kernels import main;
main()"``; writes ``$OUT/gemma4_kernels.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

CANDIDATES: dict[tuple[int, bool], list[dict[str, Any] | None]] = {
    (512, False): [{"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 8},
                   {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4},
                   {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 8}],
    (512, True): [None, {"num_warps": 4, "num_stages": 1},
                  {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}],
    (256, False): [{"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4},
                   {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "num_warps": 8}],
    (256, True): [None, {"num_warps": 4, "num_stages": 1}],
}
"""Candidates per (head_dim, is_decode); ``None`` = torch's default config."""


def paged_case(head_dim: int, is_decode: bool, batch: int = 32, prompt_len: int = 152,
               page_size: int = 128, num_heads: int = 8, seed: int = 0,
               device: str = "cuda") -> dict[str, Any]:
    """Random bf16 q/k/v and the engine's BlockMask for ``batch`` rows of ``prompt_len`` tokens.

    Shapes: prefill ``q [1, H, T, D]`` (T = batch * prompt_len padded to 128), decode
    ``q [B, H, 1, D]``; ``k, v [1, 1, S, D]`` with S = pages * page_size.
    """
    import torch

    from nbhelpers.engine.attention import decode_block_mask, prefill_block_mask, prefill_pages
    from nbhelpers.engine.kv_cache import phys_to_logical
    dev, g = device, torch.Generator(device=device).manual_seed(seed)
    per_row = -(-(prompt_len + 1) // page_size)
    num_pages = batch * per_row + 1
    tables = [[1 + r * per_row + j for j in range(per_row)] for r in range(batch)]
    bt = torch.tensor(tables + [[0] * per_row], device=dev)
    used = torch.tensor([per_row] * batch + [0], device=dev)
    p2l = phys_to_logical(bt, used, num_pages)
    slots = num_pages * page_size
    kv = [torch.randn(1, 1, slots, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
          for _ in range(2)]
    if is_decode:
        pos = torch.full((batch,), prompt_len, device=dev)
        mask = decode_block_mask(p2l[:batch], bt[:batch], used[:batch], pos, page_size, slots)
        q = torch.randn(batch, num_heads, 1, head_dim, device=dev, dtype=torch.bfloat16,
                        generator=g)
    else:
        rows = [r for r in range(batch) for _ in range(prompt_len)]
        pos = [p for _ in range(batch) for p in range(prompt_len)]
        pad = (-len(rows)) % 128
        rows, pos = rows + [-1] * pad, pos + [0] * pad
        counts, lists = prefill_pages(rows, pos, tables, page_size, num_pages)
        q_row = torch.tensor([r if r >= 0 else batch for r in rows], device=dev)
        mask = prefill_block_mask(p2l, q_row, torch.tensor(pos, device=dev),
                                  torch.tensor(counts, dtype=torch.int32, device=dev),
                                  torch.tensor(lists, dtype=torch.int32, device=dev),
                                  page_size, slots)
        q = torch.randn(1, num_heads, len(rows), head_dim, device=dev, dtype=torch.bfloat16,
                        generator=g)
    return {"q": q, "k": kv[0], "v": kv[1], "mask": mask}


def try_options(case: dict[str, Any], options: dict[str, Any] | None, ref: Any,
                iters: int = 20) -> dict[str, Any]:
    """Compile, check against ``ref`` (max abs error) and time one candidate (median ms)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    torch._dynamo.reset()
    fn = torch.compile(flex_attention, dynamic=False)
    args = (case["q"], case["k"], case["v"])
    kw = {"block_mask": case["mask"], "scale": 1.0, "enable_gqa": True,
          "kernel_options": dict(options) if options else None}
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kw)
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - an over-limit config fails to compile: record it
        return {"error": f"{type(err).__name__}: {str(err)[:300]}",
                "compile_s": time.perf_counter() - t0}
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kw)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    err = (out.float() - ref.float()).abs().max().item()
    return {"ms": sorted(times)[iters // 2], "max_abs_err": err, "compile_s": compile_s,
            "error": None}


def sweep(deadline_s: float = 150.0) -> list[dict[str, Any]]:
    """Every candidate of :data:`CANDIDATES` (d=512 first) until ``deadline_s`` has passed."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    t_end, rows = time.perf_counter() + deadline_s, []
    for (d, is_decode), cands in CANDIDATES.items():
        case = paged_case(d, is_decode)
        with torch.no_grad():
            ref = flex_attention(case["q"].float(), case["k"].float(), case["v"].float(),
                                 block_mask=case["mask"], scale=1.0, enable_gqa=True)
        for opts in cands:
            if time.perf_counter() > t_end:
                return rows
            row = {"head_dim": d, "is_decode": is_decode, "options": opts,
                   **try_options(case, opts, ref)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    rows = sweep(float(os.environ.get("SWEEP_DEADLINE_S", "150")))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gemma4_kernels.json"), "w") as f:
            json.dump(rows, f, indent=1)
