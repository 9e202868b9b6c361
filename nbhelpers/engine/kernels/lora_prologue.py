"""LoRA B as a prologue of a consumer kernel: ``y = y_base + scaling * xa[row] @ B^T`` per row.

Contract: :func:`lora_cols` is a ``@triton.jit`` helper for kernels that hold one row (or one
head of one row) of a projection output in registers (``fused_norm``'s add+RMSNorm and SiLU x up,
``qk_rope_cache``'s q/k/v heads): given that row's ``xa`` (``x @ A^T``, ``r`` values) and the
part's ``B [out, r]`` (row-major, the PEFT module's own ``lora_B`` weight), it returns
``sum_k xa[k] * B[col, k]`` for a block of output columns, in fp32 (16-bit operands are upcast:
a bf16 x bf16 product is exact in fp32). The caller adds ``scaling`` times it to the fp32 base
value and rounds once to the model dtype: the dtype order of ``lora_expand`` (``addmm_`` in B's
dtype when B has ``y``'s dtype; PEFT's ``(y.to(fp32) + B(xa) * s).to(bf16)`` for fp32 B on a bf16
base), so the consumer gives the separate expand's result up to fp32 summation order.

Reduction shape: punica's / vLLM's ``bgmv_expand`` (Chen et al. 2023, "Punica: Multi-Tenant LoRA
Serving", arXiv:2310.18547; vLLM ``vllm/lora/ops/triton_ops/`` ``bgmv_expand``): one token row
against a ``[out, r]`` slice, r reduced in registers, ``LORA_K`` ranks per step (a
``[cols, LORA_K]`` tile of B). ``STEPS`` 0 loops over r (a wide row: add+RMSNorm's 2560
columns, one ``[4096, 4]`` tile live); ``STEPS`` 1 with ``LORA_K >= r`` (:func:`one_load_k`)
loads every rank at once (one q/k/v head: ``[64, 32]``), so a program waits for one load
instead of r / 4 dependent ones. Unlike sgmv there is no row block and no ``tl.dot``: each row
program re-reads B from L2. The gate_up consumer (:mod:`.lora_act_mul`) is the sgmv shape
instead (column blocks over all rows, B once); ``engine/lora_pending.py`` says which groups
defer and why o_proj / down_proj do not.

:func:`supported` checks a :class:`~nbhelpers.engine.lora_pending.PendingLora` for a consumer.
Run the tests on the CPU with ``TRITON_INTERPRET=1`` (``tests/engine/test_lora_consumer.py``).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels.lora_expand import _bf16_rne

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""``TRITON_INTERPRET=1`` at import: the kernels then run on CPU tensors."""

MAX_RANK = 64
"""Largest rank per part a consumer takes (r 8-64 is the range this shape is for; above it the
per-row B re-read grows and the expand kernel's tiles serve better: ``lora_expand="triton"``)."""

LORA_K = 4
"""Ranks reduced per loop step (a ``[BLOCK, LORA_K]`` tile of B in registers)."""


@triton.jit
def lora_cols(xa_row, b_ptr, rank, b_rows, m, BLOCK: tl.constexpr, LORA_K: tl.constexpr,
              STEPS: tl.constexpr, b0, PRE: tl.constexpr):
    """``sum_k xa_row[k] * B[b_rows, k]`` in fp32, ``[BLOCK]``; ``b_rows`` the output columns
    (B's rows, within the part), masked by ``m``; B row-major ``[out, rank]``. ``STEPS`` 0: a
    loop over ``rank`` in steps of ``LORA_K`` (one ``[BLOCK, LORA_K]`` tile live: wide rows);
    ``STEPS`` > 0: ``STEPS`` unrolled steps, ``STEPS * LORA_K >= rank`` (the caller's promise;
    straight-line code, so the loads of several calls are in flight together: one head).
    ``PRE``: ``b0`` is the first step's tile, :func:`lora_b_tile` of ranks ``[0, LORA_K)``,
    loaded by the caller before its PDL wait; the first step is peeled (same sums, same order)."""
    ks = tl.arange(0, LORA_K)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if PRE:
        acc += _lora_dot(xa_row, b0, rank, ks)
    if STEPS == 0:
        for k0 in range(LORA_K if PRE else 0, rank, LORA_K):
            acc += _lora_step(xa_row, b_ptr, rank, b_rows, m, k0 + ks)
    else:
        for i in tl.static_range(1 if PRE else 0, STEPS):
            acc += _lora_step(xa_row, b_ptr, rank, b_rows, m, i * LORA_K + ks)
    return acc


@triton.jit
def lora_b_tile(b_ptr, rank, b_rows, m, kk):
    """``B[b_rows, kk]`` as fp32 ``[BLOCK, LORA_K]`` (rows masked by ``m``, ranks ``>= rank``
    read 0): a weight, so a PDL kernel may load it before its wait (``pdl.py``)."""
    return tl.load(b_ptr + b_rows.to(tl.int64)[:, None] * rank + kk[None, :],
                   mask=m[:, None] & (kk < rank)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _lora_dot(xa_row, b, rank, kk):
    """``sum_{k in kk} xa_row[k] * b[:, k]`` (fp32, ``[BLOCK]``); ``b`` a :func:`lora_b_tile`."""
    a = tl.load(xa_row + kk, mask=kk < rank, other=0.0).to(tl.float32)  # [LORA_K]
    return tl.sum(b * a[None, :], axis=1)


@triton.jit
def _lora_step(xa_row, b_ptr, rank, b_rows, m, kk):
    """``sum_{k in kk} xa_row[k] * B[b_rows, k]`` (fp32, ``[BLOCK]``), ranks ``>= rank`` masked:
    :func:`_lora_dot` of :func:`lora_b_tile`, the same loads and sums as a peeled step."""
    return _lora_dot(xa_row, lora_b_tile(b_ptr, rank, b_rows, m, kk), rank, kk)


@triton.jit
def round_once(out, DT: tl.constexpr, RNE: tl.constexpr):
    """fp32 ``out`` rounded to ``DT`` and back to fp32; ``RNE``: bf16 by bit arithmetic (the
    interpreter's own cast truncates; the same rounding as ``lora_expand``'s store there)."""
    if RNE:
        return _bf16_rne(out).to(tl.float32)
    return out.to(DT).to(tl.float32)


@triton.jit
def add_lora(y, xa_row, b_ptr, rank, b_rows, m, scaling, DT: tl.constexpr, RNE: tl.constexpr,
             BLOCK: tl.constexpr, LORA_K: tl.constexpr, STEPS: tl.constexpr, b0,
             PRE: tl.constexpr):
    """``y + scaling * lora_cols(...)`` (fp32 ``y`` ``[BLOCK]``) rounded once to ``DT`` and
    back to fp32 (:func:`round_once`); ``b0``, ``PRE``: :func:`lora_cols`."""
    return round_once(y + scaling * lora_cols(xa_row, b_ptr, rank, b_rows, m, BLOCK, LORA_K,
                                              STEPS, b0, PRE), DT, RNE)


def warps_for(block: int, warps: int, lora_k: int = LORA_K) -> int:
    """Warps for a row program with the prologue: at least ``warps``, doubled (up to 16) until
    the ``[block, lora_k]`` B tile is at most 64 fp32 values a thread (a register budget, not a
    measured optimum: hidden 2560 -> 4096 columns -> 8 warps instead of add_norm's 4)."""
    while block * lora_k > 64 * 32 * warps and warps < 16:
        warps *= 2
    return warps


def one_load_k(ranks: list[int]) -> int:
    """``LORA_K`` for ``STEPS=1`` (every rank of a part in one load): the power of two >= the
    largest rank (at most :data:`MAX_RANK`, :func:`supported`), at least :data:`LORA_K`."""
    return max(LORA_K, triton.next_power_of_2(max(ranks)))


def rne(dtype: Any) -> bool:
    """The ``RNE`` constant of :func:`add_lora` for a model dtype."""
    import torch
    return INTERPRETED and dtype == torch.bfloat16


def supported(pending: Any, num_parts: int, like: Any) -> bool:
    """Whether a consumer of ``num_parts`` parts can add ``pending``'s LoRA B while reading
    ``like`` (its model-dtype input): that many parts, each rank 1..:data:`MAX_RANK`, ``xa``
    ``[N, sum(r)]`` with unit column stride, every B contiguous ``[out_i, r_i]`` of ``xa``'s
    dtype (bf16/fp16/fp32), all on ``like``'s device (CUDA, or CPU under the interpreter)."""
    import torch
    floats = (torch.bfloat16, torch.float16, torch.float32)
    xa = pending.xa
    dev_ok = like.is_cuda or (INTERPRETED and like.device.type == "cpu")
    return (dev_ok and len(pending.bs) == num_parts and xa.dim() == 2 and xa.stride(1) == 1
            and xa.dtype in floats and xa.device == like.device
            and xa.shape == (pending.y.shape[0], sum(pending.ranks))
            and all(0 < r <= MAX_RANK for r in pending.ranks)
            and all(b.dtype == xa.dtype and b.is_contiguous() and tuple(b.shape) == (o, r)
                    and b.device == like.device
                    for b, o, r in zip(pending.bs, pending.sizes, pending.ranks)))


def kernel_args(pending: Any) -> tuple[Any, ...]:
    """``(xa, stride_xa, *B_i, *r_i, *roff_i, scaling)``: the prologue's kernel arguments for
    every part (``roff_i``: part ``i``'s first column in ``xa``)."""
    ranks = list(pending.ranks)
    roffs = [sum(ranks[:i]) for i in range(len(ranks))]
    return (pending.xa, pending.xa.stride(0), *pending.bs, *ranks, *roffs,
            float(pending.scaling))
