"""A decode MLP block (gate/up GEMM, SiLU x up, down GEMM) in one Triton launch: a probe for
``docs/decode_floor_plan.md`` piece 1, not yet used by the engine.

Contract: :func:`mlp_block` returns ``acc [M, H]`` fp32, ``down(silu(gate(x)) * up(x))`` for
``x [M, H]`` (``M <= 16``, bf16/fp16/fp32, unit column stride), ``w_gate_up [2I, H]`` (gate rows
then up rows, nn.Linear layout) and ``w_down [H, I]``, rounded as a transformers
Llama/Qwen3 MLP in the weights' dtype rounds: gate and up outputs once to the dtype, the SiLU
once, the product once; the down GEMM's sum stays fp32 (the caller rounds it once, as a GEMM
epilogue would). ``acc`` must be zero on entry (:func:`mlp_block` zeroes the one it allocates;
pass ``out=`` a zeroed buffer to reuse one, e.g. under CUDA graphs). No LoRA, no bias. Works on
CUDA and under ``TRITON_INTERPRET=1``.

Design: grid ``cdiv(I, BLOCK_J)``; program ``p`` owns intermediate columns ``[p BLOCK_J, (p+1)
BLOCK_J)``: it streams their gate and up rows over the full ``H`` (no split-K: the activation
needs whole sums), applies SiLU x up in registers, then streams the matching ``BLOCK_J`` columns
of ``w_down`` in ``BLOCK_N`` chunks and adds each ``[M, BLOCK_N]`` partial into ``acc`` with
``tl.atomic_add`` (fp32, relaxed): the down GEMM is split over the intermediate dimension across
programs, with no grid barrier and no second launch. Every weight byte is read once. The order
of the atomic adds is not fixed: results vary in the last fp32 bits run to run (the engine's
serial split-K in ``skinny_gemm.py`` is deterministic; this is the price to measure).

Why a probe: at batch 4 on the H200 the three launches this replaces (gate_up GEMM, act x up,
down GEMM) take 26.8 + 2.7 + 16.4 us a layer against 36.0 us of weight bytes at 4.17 TB/s
(2026-12-07, ``docs/decode_floor_plan.md``). Whether one launch gets closer depends on what the
H200 charges for ``M x H`` fp32 atomics per program: ``scripts/device/ab_mlp_block.py`` times it
against the engine's kernels with cold weights.

Run: ``TRITON_INTERPRET=1 pytest tests/engine/test_mlp_block.py``.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels.skinny_gemm import INTERPRETED, _dot

MAX_ROWS = 16


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """``v`` rounded to the weights' dtype and back to fp32 (one rounding, as torch's op in that
    dtype)."""
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def _mlp_block_kernel(x_ptr, wgu_ptr, wd_ptr, acc_ptr, m, hidden, inter, stride_x, stride_gu,
                      stride_d, stride_acc, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    col_ok = cols < inter
    acc_g = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        g_ptrs = wgu_ptr + cols[:, None].to(tl.int64) * stride_gu + kk[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(g_ptrs + inter.to(tl.int64) * stride_gu, mask=w_mask, other=0.0)
        acc_g = _dot(x, tl.trans(wg), acc_g, UPCAST)
        acc_u = _dot(x, tl.trans(wu), acc_u, UPCAST)
    dtype = wgu_ptr.dtype.element_ty
    g = _round(acc_g, dtype)
    act = _round(g * tl.sigmoid(g), dtype)
    h = (act * _round(acc_u, dtype)).to(dtype)  # [BLOCK_M, BLOCK_J], zero in masked columns
    for n0 in range(0, hidden, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        n_ok = nn < hidden
        wd = tl.load(wd_ptr + nn[:, None].to(tl.int64) * stride_d + cols[None, :],
                     mask=n_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_J]
        part = _dot(h, tl.trans(wd), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        tl.atomic_add(acc_ptr + rows[:, None] * stride_acc + nn[None, :], part,
                      mask=row_ok[:, None] & n_ok[None, :], sem="relaxed")


def mlp_block(x: Any, w_gate_up: Any, w_down: Any, out: Any = None, block_j: int = 64,
              block_k: int = 128, block_n: int = 128, num_warps: int = 4,
              num_stages: int = 3) -> Any:
    """``acc [M, H]`` fp32 (module docstring). ``out``: a zeroed fp32 ``[M, H]`` buffer (else one
    is allocated and zeroed here).

    Raises:
        ValueError: more than :data:`MAX_ROWS` rows, shapes that do not chain (``w_gate_up
            [2I, H]``, ``w_down [H, I]``), mixed dtypes, a non-unit column stride, or an ``out``
            that is not a contiguous fp32 ``[M, H]``.
    """
    import torch
    m, hidden = x.shape
    inter = w_down.shape[1]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"mlp_block: {m} rows; 1-{MAX_ROWS} supported (keep the unfused path).")
    if tuple(w_gate_up.shape) != (2 * inter, hidden) or w_down.shape[0] != hidden:
        raise ValueError(f"mlp_block: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
                         f"w_down {tuple(w_down.shape)}: need w_gate_up [2I, H] (gate rows, then "
                         "up rows) and w_down [H, I].")
    if not x.dtype == w_gate_up.dtype == w_down.dtype:
        raise ValueError(f"mlp_block: dtypes {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}: "
                         "one dtype for x and both weights.")
    if x.stride(1) != 1 or w_gate_up.stride(1) != 1 or w_down.stride(1) != 1:
        raise ValueError("mlp_block: x and the weights need unit column stride.")
    if out is None:
        out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    elif (out.dtype != torch.float32 or tuple(out.shape) != (m, hidden)
          or not out.is_contiguous()):
        raise ValueError(f"mlp_block: out {tuple(out.shape)} {out.dtype}: need a zeroed "
                         f"contiguous fp32 [{m}, {hidden}].")
    upcast = INTERPRETED or x.dtype == torch.float32
    _mlp_block_kernel[(triton.cdiv(inter, block_j),)](
        x, w_gate_up, w_down, out, m, hidden, inter, x.stride(0), w_gate_up.stride(0),
        w_down.stride(0), out.stride(0), BLOCK_M=16, BLOCK_J=block_j, BLOCK_K=block_k,
        BLOCK_N=block_n, UPCAST=upcast, num_warps=num_warps, num_stages=num_stages)
    return out
