"""SiLU / GELU-tanh x up with the gate_up group's LoRA B folded in: one launch over row blocks x
column blocks, B read once per column block for all rows (``lora_expand="consumer"``).

Contract: :func:`act_mul_lora` computes, for ``gate, up [R, I]`` (the gate_up group's base
outputs, views of its ``y``) and a two-part ``lora_pending.PendingLora`` (``xa [R, r_g + r_u]``,
``B_g [I, r_g]``, ``B_u [I, r_u]``, PEFT's own ``lora_B`` weights read at call time),

    ``g = rnd(gate + s * xa_g @ B_g^T)``, ``u = rnd(up + s * xa_u @ B_u^T)``
    ``out = rnd(rnd(act(g)) * u)``

(``rnd``: to the model dtype; fp32 math inside), the dtype order and the casts of
``lora_expand`` followed by :func:`.fused_norm.act_mul` (``g``/``u`` rounded as the expand's
store, then that kernel's own casts), so the result equals that pair up to fp32 summation order
over r (bit-equal in the interpreter, where both reduce r with one ``tl.dot``).

Why this grid (issue 12, the H200 A/B of 2026-12-01: the consumer mode's elementwise class grew
0.31 -> 1.22 ms at batch 4): the first consumer ran one program per (row, 1024 columns) and
reduced r in a loop of 4 ranks, so every row re-read all of B (``R x 2 x 9728 x 32`` elements a
layer) in 16 dependent loads a program. Here a program owns ``BLOCK_N`` columns of every row:
``xa`` tile ``[BLOCK_M, BLOCK_R]`` and both B tiles ``[BLOCK_R, BLOCK_N]`` are one load each, the
products one ``tl.dot`` each, so B is read once (2.5 MB fp32 / 1.2 MB bf16 at Qwen3-4B's r 32)
by ``cdiv(I, BLOCK_N)`` programs (152 at I 9728): the grid of vLLM's / punica's sgmv expand
(``vllm/lora/ops/triton_ops/lora_expand_op.py``; Chen et al. 2023, arXiv:2310.18547) with the
activation in its epilogue. Rows: up to ``lora_pending.CONSUMER_MAX_ROWS`` (64), one row block.

Numerics: fp32 B multiplies in IEEE fp32 (no TF32); bf16/fp16 B with bf16/fp16 ``xa`` in the
operand dtype with fp32 accumulation (the products are exact). Under ``TRITON_INTERPRET=1`` every
operand is upcast before ``tl.dot`` (the interpreter's bf16 ``tl.dot`` is wrong, see
``lora_expand``) and bf16 rounds by bit arithmetic. PDL as :mod:`.fused_norm`; with ``PREWAIT``
(``pdl="early"``) both B tiles (weights, addressed by the program's column block) are loaded
before the wait, gate, up and xa after it: the same operations (bit-identical in the interpreter;
bf16 on the H200: pdl.py).

Run the tests on the CPU with ``TRITON_INTERPRET=1`` (``tests/engine/test_lora_consumer.py``).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels import lora_prologue as lp
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.act import act_fn
from nbhelpers.engine.kernels.lora_prologue import round_once

BLOCK_N = 64
"""Columns a program owns: Qwen3-4B's I 9728 -> 152 programs (132 SMs), Llama-3.2-3B's 8192 ->
128; a ``[64, 64]`` B tile at r 64."""


@triton.jit
def _b_tile(b_ptr, rank, cols, cm, BLOCK_R: tl.constexpr):
    """B's transpose tile ``[BLOCK_R, BLOCK_N]`` (B ``[I, rank]`` row-major; ranks ``>= rank``
    and columns past ``I`` read 0): a weight, so it may be loaded before the PDL wait."""
    ks = tl.arange(0, BLOCK_R)
    return tl.load(b_ptr + cols.to(tl.int64)[None, :] * rank + ks[:, None],
                   mask=(ks < rank)[:, None] & cm[None, :], other=0.0)


@triton.jit
def _lora_dot(xa_ptr, stride_xa, roff, b_ptr, rank, rows, rm, cols, cm, BLOCK_R: tl.constexpr,
              DOT_FP32: tl.constexpr, b, PRE: tl.constexpr):
    """``xa[rows, roff:roff + rank] @ B[cols, :rank]^T`` in fp32, ``[BLOCK_M, BLOCK_N]``;
    ``PRE``: B's tile is ``b`` (:func:`_b_tile`, loaded before the PDL wait)."""
    ks = tl.arange(0, BLOCK_R)
    km = ks < rank
    a = tl.load(xa_ptr + rows[:, None] * stride_xa + roff + ks[None, :],
                mask=rm[:, None] & km[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    if not PRE:
        b = _b_tile(b_ptr, rank, cols, cm, BLOCK_R)
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _act_mul_lora_kernel(g_ptr, u_ptr, o_ptr, xa_ptr, bg_ptr, bu_ptr, n_rows, n_cols, stride_g,
                         stride_u, stride_xa, r_g, r_u, scaling, ACT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                         DOT_FP32: tl.constexpr, RNE: tl.constexpr, USE_GDC: tl.constexpr,
                         PREWAIT: tl.constexpr, EARLY_TRIGGER: tl.constexpr = False):
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if EARLY_TRIGGER:  # pdl="prefetch": the next kernel (a GEMM) may launch now (pdl.py)
            tl.extra.cuda.gdc_launch_dependents()
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if not PREWAIT:  # PDL (pdl.py): gate, up and xa come from the previous kernel
            tl.extra.cuda.gdc_wait()
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = rows < n_rows, cols < n_cols
    m2 = rm[:, None] & cm[None, :]
    DT: tl.constexpr = o_ptr.dtype.element_ty
    bg, bu = 0.0, 0.0  # the PREWAIT tiles
    if PREWAIT:  # "early" (pdl.py): both B tiles (weights) before the wait
        bg = _b_tile(bg_ptr, r_g, cols, cm, BLOCK_R)
        bu = _b_tile(bu_ptr, r_u, cols, cm, BLOCK_R)
        if USE_GDC:  # gate, up and xa only after the previous kernel
            tl.extra.cuda.gdc_wait()
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=m2, other=0.0)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=m2, other=0.0)
    lg = _lora_dot(xa_ptr, stride_xa, 0, bg_ptr, r_g, rows, rm, cols, cm, BLOCK_R, DOT_FP32, bg,
                   PREWAIT)
    lu = _lora_dot(xa_ptr, stride_xa, r_g, bu_ptr, r_u, rows, rm, cols, cm, BLOCK_R, DOT_FP32,
                   bu, PREWAIT)
    if USE_GDC:  # noqa: SIM102 (every input read: the next kernel may start its prologue)
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    g = round_once(g.to(tl.float32) + scaling * lg, DT, RNE)
    u = round_once(u.to(tl.float32) + scaling * lu, DT, RNE)
    a = act_fn(g, ACT).to(DT).to(tl.float32)  # the casts of fused_norm._act_mul_kernel
    tl.store(o_ptr + rows[:, None] * n_cols + cols[None, :], (a * u).to(DT), mask=m2)


def grid_for(rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
    """``((row blocks, column blocks), BLOCK_M)`` of :func:`act_mul_lora`: ``BLOCK_M`` the power
    of two >= ``rows`` in 16..64 (``tl.dot``'s smallest M is 16)."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    return (triton.cdiv(rows, block_m), triton.cdiv(n_cols, BLOCK_N)), block_m


def act_mul_lora(g2: Any, u2: Any, out: Any, act: int, lora: Any) -> None:
    """``out [R, I] = act(gate + LoRA) * (up + LoRA)`` (module docstring); ``g2, u2 [R, I]``
    unit column stride, ``act`` a :data:`.fused_norm.ACTS` value, ``lora`` a record
    :func:`.fused_norm.lora_supported` accepted for two parts (the caller checks)."""
    import torch
    rows, n = g2.shape
    if rows == 0:
        return
    xa, sxa, bg, bu, rg, ru, _, _, s = lp.kernel_args(lora)
    grid, block_m = grid_for(rows, n)
    interp = lp.INTERPRETED
    _act_mul_lora_kernel[grid](
        g2, u2, out, xa, bg, bu, rows, n, g2.stride(0), u2.stride(0), sxa, rg, ru, s, ACT=act,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(max(rg, ru))),
        DOT_FP32=xa.dtype == torch.float32 or interp, RNE=lp.rne(out.dtype), num_warps=4,
        **pdl.launch_kwargs(prewait=True, trigger=True))
