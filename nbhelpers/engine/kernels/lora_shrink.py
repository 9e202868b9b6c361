"""LoRA A of a projection group as one Triton kernel ("shrink") for adapters wider than the base.

Contract: :func:`lora_shrink` returns ``xa = x.to(A.dtype) @ A^T`` (``[N, R]``, fp32) from the
bf16/fp16 input ``x [N, K]`` and the group's fused fp32 ``A [R, K]`` (``R = sum(r_i)``) in one
launch: the input is upcast in registers (no fp32 copy of ``x``), products and sums are IEEE fp32
(no TF32), as PEFT's ``lora_A(x.to(lora_A.weight.dtype))`` computes them with fp32 adapters; only
the summation order differs from cuBLAS (fp32 rounding, ~1e-7 relative).

Why: TRL's ``GRPOTrainer`` builds its PEFT model with PEFT's default
``autocast_adapter_dtype=True`` (trl 1.15.0 grpo_trainer.py, "PEFT's default
autocast_adapter_dtype=True upcasts LoRA adapter params to fp32"), so in GRPO the adapters are fp32
on a bf16 base and A cannot join the base GEMM. The torch path then costs a cast kernel plus an
fp32 cuBLAS GEMM per projection group: on the H200 at GRPO's rollout shape (Qwen3-4B, LoRA r32,
batch 4) a decode step took 6.43 ms with fp32 adapters vs 4.33 ms with bf16 ones, 1161 vs 729
kernels (``executed/phase2_grpo/bench/diag_grpo_rollout/diag_grpo_rollout.json``, 2026-11-30).

Grid: ``(cdiv(N, BLOCK_M), cdiv(R, BLOCK_R), SPLIT_K)``. Decode has few rows, so one row block
and ``R / 16`` rank blocks would leave most SMs idle while the program streams ``K`` columns of A:
the K loop is split over ``SPLIT_K`` programs that ``atomic_add`` into a zeroed ``xa`` (so with
``SPLIT_K > 1`` the fp32 sum order, hence the last bit, can vary run to run). No host sync; the
zeroed output is a graph-capturable allocation + memset.

Source: vLLM's LoRA shrink kernel (``vllm/lora/ops/triton_ops/lora_shrink_op.py``
``_lora_shrink_kernel``: grid over row blocks x rank blocks x ``SPLIT_K``, ``tl.atomic_add``
into a zero-initialised output when ``SPLIT_K > 1``), after Punica's SGMV shrink (Chen et al.
2023, arXiv:2310.18547). One adapter here, so no token -> LoRA index.

PDL (runner option ``pdl``, :mod:`.pdl`; ``USE_GDC``): ``gdc_wait()`` first in every program,
``gdc_launch_dependents()`` after the K loop (the store or ``atomic_add`` of xa remains).

Tests: ``tests/engine/test_lora_shrink.py`` (CPU, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels import pdl

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""``TRITON_INTERPRET=1`` when this module was imported (CPU tensors then)."""

TARGET_PROGRAMS = 128
"""Programs :func:`split_k` aims for (the H200 has 132 SMs)."""


@triton.jit(do_not_specialize=["n_rows", "k", "r_total"])
def _lora_shrink_gemm(x_ptr, a_ptr, xa_ptr, n_rows, k, r_total, stride_x, stride_a, stride_xa,
                      k_per_split, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # PDL (pdl.py): x and the zeroed xa come from the previous kernels
        tl.extra.cuda.gdc_wait()
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < n_rows
    r_ok = rs[None, :] < r_total
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                    mask=row_ok & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_ptr + rs[None, :].to(tl.int64) * stride_a + kk[:, None],
                    mask=r_ok & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_R] = A^T tile
        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
    if USE_GDC:  # K loop done: the next kernel may start its prologue
        tl.extra.cuda.gdc_launch_dependents()
    out_ptrs = xa_ptr + rows[:, None] * stride_xa + rs[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=row_ok & r_ok)
    else:
        tl.atomic_add(out_ptrs, acc, mask=row_ok & r_ok)


def supported(x: Any, a: Any) -> bool:
    """Whether :func:`lora_shrink` serves ``x [N, K]`` and ``A [R, K]``: A fp32 and contiguous,
    x bf16/fp16 with unit column stride, same device, CUDA (or the interpreter)."""
    import torch
    return (x.dim() == 2 and a.dim() == 2 and x.shape[1] == a.shape[1] and x.stride(1) == 1
            and a.is_contiguous() and a.dtype == torch.float32
            and x.dtype in (torch.bfloat16, torch.float16) and x.device == a.device
            and (x.is_cuda or INTERPRETED))


def split_k(n_rows: int, r_total: int, k: int, block_m: int, block_r: int, block_k: int) -> int:
    """K splits so that about :data:`TARGET_PROGRAMS` programs run, each at least 2 K tiles."""
    tiles = triton.cdiv(n_rows, block_m) * triton.cdiv(r_total, block_r)
    return max(1, min(TARGET_PROGRAMS // tiles, k // (2 * block_k)))


def lora_shrink(x: Any, a: Any, splits: int | None = None) -> Any:
    """``x.to(A.dtype) @ A^T`` as fp32 ``[N, R]`` in one launch (module docstring).

    Shapes: ``x [N, K]`` bf16/fp16 (row stride free), ``a [R, K]`` fp32 contiguous. ``splits``:
    K splits (default :func:`split_k`). Raises ``ValueError`` when :func:`supported` is false.
    """
    import torch
    if not supported(x, a):
        raise ValueError(f"lora_shrink: unsupported operands x {tuple(x.shape)} {x.dtype}, A "
                         f"{tuple(a.shape)} {a.dtype}; use F.linear(x.to(A.dtype), A).")
    n_rows, k = x.shape
    r_total = a.shape[0]
    block_m = min(64, max(16, triton.next_power_of_2(n_rows)))
    block_r, block_k = 16, 128
    s = splits or split_k(n_rows, r_total, k, block_m, block_r, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, s), block_k) * block_k
    s = triton.cdiv(k, k_per_split)  # no empty split
    alloc = torch.zeros if s > 1 else torch.empty
    xa = alloc(n_rows, r_total, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return xa
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(r_total, block_r), s)
    _lora_shrink_gemm[grid](x, a, xa, n_rows, k, r_total, x.stride(0), a.stride(0), xa.stride(0),
                            k_per_split, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                            SPLIT_K=s, num_warps=4, **pdl.launch_kwargs())
    return xa
