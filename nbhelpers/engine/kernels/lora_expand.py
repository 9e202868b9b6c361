"""LoRA B of a projection group as one Triton kernel ("expand"), in place into the base output.

Contract: :func:`lora_expand` computes, for every part ``i`` of a :class:`~.lora.LiveGroup`
(q/k/v, gate/up, or one projection),

    ``y[:, off_i:off_i + out_i] += scaling * xa[:, roff_i:roff_i + r_i] @ B_i^T``

in one launch, where ``B_i [out_i, r_i]`` is each PEFT module's own ``lora_B`` weight (up to
:data:`MAX_PARTS` separate pointers, read at call time: live LoRA, no copy), ``xa [N, sum(r)]``
is ``x @ A^T`` and ``y [N, sum(out)]`` may be a strided view (row stride > width, e.g. the first
``sum(out)`` columns of the ``[N, sum(out) + sum(r)]`` output of LiveGroup's ``ext`` GEMM). The
product accumulates in fp32 and is added to ``y`` in fp32, rounded once to ``y``'s dtype: the
dtype order of ``addmm_`` on ``y`` when B has ``y``'s dtype, and of PEFT's
``(y.to(B.dtype) + B(xa) * scaling).to(y.dtype)`` when B is fp32 on a bf16 base (no fp32 copy of
``y`` needed). fp32 operands multiply in IEEE fp32 (no TF32). Under ``TRITON_INTERPRET=1`` the
16-bit operands are upcast to fp32 before ``tl.dot`` (the interpreter's bf16 ``tl.dot`` returned
garbage, ~1e10, with triton 3.6.0 and 3.9.0 on CPU); the products are the same (a bf16 x bf16
product is exact in fp32), as is the fp32 accumulation; and the interpreter's fp32 -> bf16 cast
truncates (compiled Triton rounds to nearest even), so there the kernel rounds by bit arithmetic.

Grid: ``(cdiv(N, BLOCK_M), sum(out) / BLOCK_OUT)``; ``BLOCK_OUT`` divides every ``out_i`` so a
column block never straddles two parts (:func:`block_out` returns ``None`` otherwise: the caller
keeps its per-part ``addmm_`` path). No allocation and no host sync per call, so it can be
captured in a CUDA graph; the launch itself is Python (~tens of us) outside a graph.

Source: the shape of punica's / vLLM's LoRA expand kernels (Chen et al. 2023, "Punica: Multi-Tenant
LoRA Serving", arXiv:2310.18547; vLLM ``vllm/lora/ops/triton_ops/lora_expand_op.py``
``_lora_expand_kernel`` and ``bgmv_expand_slice``: one launch over (row blocks x column blocks x
slices), each slice its own B pointer and output offset). Here there is one adapter (no token ->
LoRA mapping), and the parts are few, so their pointers are kernel arguments instead of vLLM's
device pointer table.

PDL (runner option ``pdl``, :mod:`.pdl`; ``USE_GDC``): ``gdc_wait()`` first in every program
(xa and y are the previous kernels' outputs), ``gdc_launch_dependents()`` after the rank loop
(the read-add-store of y remains). With ``PREWAIT`` (``pdl="early"``) the program picks its
part (from its program id and the arguments only) and loads its first ``BLOCK_R`` ranks of B
before the wait, the first rank iteration peeled as :mod:`.skinny_gemm` peels its first W tile
(B is a weight: no decode kernel writes it); xa and y still after it. Same operations, same
order: bit-identical to ``PREWAIT`` off in the interpreter (bf16 on the H200: pdl.py).
(``PREWAIT`` without ``USE_GDC``, which no launcher
passes, only peels the loop.)

Run the tests on the CPU with ``TRITON_INTERPRET=1`` (``tests/engine/test_lora_expand.py``).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels import pdl

MAX_PARTS = 3
"""Parts one launch serves (q/k/v is the widest group)."""

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""``TRITON_INTERPRET=1`` when this module was imported (the kernel below is then the
interpreter's, and runs on CPU tensors)."""

BLOCK_OUT_CHOICES = (64, 128, 32, 16)
"""Column tiles tried in order; 64 first: Qwen3-4B's q/k/v (4096/1024/1024) gives 96 tiles."""


@triton.jit(do_not_specialize=["n_rows", "end0", "end1", "roff1", "roff2", "r0", "r1", "r2"])
def _lora_expand_gemm(xa_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr, n_rows, stride_xa, stride_y,
                   end0, end1, roff1, roff2, r0, r1, r2, scaling,
                   NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr,
                   BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, BF16_RNE: tl.constexpr,
                   USE_GDC: tl.constexpr, PREWAIT: tl.constexpr, ROUND_TO: tl.constexpr = 0,
                   XA_ROUND: tl.constexpr = 0):
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if not PREWAIT:  # PDL (pdl.py): xa and y come from the previous kernels
            tl.extra.cuda.gdc_wait()
    col0 = tl.program_id(1) * BLOCK_OUT  # first output column of this tile (global)
    b_ptr, start, roff, rank = b0_ptr, end0 * 0, roff1 * 0, r0  # part 0
    # constexpr tests stand alone so the compiler prunes unused parts
    if NUM_PARTS > 1:  # noqa: SIM102
        if col0 >= end0:
            b_ptr, start, roff, rank = b1_ptr, end0, roff1, r1
    if NUM_PARTS > 2:  # noqa: SIM102
        if col0 >= end1:
            b_ptr, start, roff, rank = b2_ptr, end1, roff2, r2
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    cols = tl.arange(0, BLOCK_OUT)  # [BLOCK_OUT], within the tile
    ks = tl.arange(0, BLOCK_R)
    row_ok = rows[:, None] < n_rows
    acc = tl.zeros((BLOCK_M, BLOCK_OUT), dtype=tl.float32)
    k_start = 0
    if PREWAIT:  # "early" (pdl.py): the first rank chunk peeled, its B load before the wait
        b0 = _b_tile(b_ptr, col0 - start + cols, rank, ks)
        if USE_GDC:  # xa and y only after the previous kernel
            tl.extra.cuda.gdc_wait()
        a0 = _xa_round(_xa_tile(xa_ptr, rows, stride_xa, roff, ks, rank, row_ok), XA_ROUND,
                       BF16_RNE)
        acc = _dot(a0, b0, acc, DOT_FP32)
        k_start = BLOCK_R
    for k0 in range(k_start, rank, BLOCK_R):
        a = _xa_round(_xa_tile(xa_ptr, rows, stride_xa, roff, k0 + ks, rank, row_ok), XA_ROUND,
                      BF16_RNE)
        b = _b_tile(b_ptr, col0 - start + cols, rank, k0 + ks)
        acc = _dot(a, b, acc, DOT_FP32)
    if USE_GDC:  # rank loop done: the next kernel may start its prologue
        tl.extra.cuda.gdc_launch_dependents()
    y_ptrs = y_ptr + rows[:, None] * stride_y + (col0 + cols)[None, :]
    y = tl.load(y_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    if ROUND_TO != 0:  # an fp32 y holding a 16-bit model's unrounded GEMM sum: PEFT's order,
        # base rounded to the model dtype, LoRA added in fp32, rounded again (kept in fp32)
        out = _round_to(_round_to(y, ROUND_TO, BF16_RNE) + scaling * acc, ROUND_TO, BF16_RNE)
        tl.store(y_ptrs, out, mask=row_ok)
    elif BF16_RNE and y_ptr.dtype.element_ty == tl.bfloat16:  # (BF16_RNE: also xa's rounding)
        tl.store(y_ptrs, _bf16_rne(y + scaling * acc), mask=row_ok)
    else:
        tl.store(y_ptrs, (y + scaling * acc).to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _b_tile(b_ptr, b_rows, rank, kk):
    """B_i^T's ``[BLOCK_R, BLOCK_OUT]`` tile: ranks ``kk``, B rows ``b_rows`` (B_i is
    ``[out_i, r_i]`` row-major: element (n, k) at n * r_i + k); ranks ``>= rank`` read 0."""
    return tl.load(b_ptr + b_rows[None, :] * rank + kk[:, None], mask=kk[:, None] < rank,
                   other=0.0)


@triton.jit
def _xa_tile(xa_ptr, rows, stride_xa, roff, kk, rank, row_ok):
    """``xa[rows, roff + kk]``, ``[BLOCK_M, BLOCK_R]``; ranks ``>= rank`` and rows past the end
    read 0."""
    return tl.load(xa_ptr + rows[:, None] * stride_xa + (roff + kk)[None, :],
                   mask=row_ok & (kk[None, :] < rank), other=0.0)


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """``acc + a @ b`` in fp32 (IEEE for fp32 operands)."""
    if DOT_FP32:  # exact products either way: bf16 x bf16 fits fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _xa_round(a, XA_ROUND: tl.constexpr, BF16_RNE: tl.constexpr):
    """An fp32 ``xa`` tile holding an unrounded ``x @ A^T`` of 16-bit adapters, as their dtype
    (``XA_ROUND`` 1 bf16, by bit arithmetic when ``BF16_RNE``; 2 fp16; 0: as loaded), so both
    ``tl.dot`` operands share B's dtype."""
    if XA_ROUND == 1:
        if BF16_RNE:
            a = _bf16_rne(a)
        else:
            a = a.to(tl.bfloat16)
    elif XA_ROUND == 2:
        a = a.to(tl.float16)
    return a


@triton.jit
def _round_to(x, ROUND_TO: tl.constexpr, BF16_RNE: tl.constexpr):
    """fp32 ``x`` rounded to bf16 (``ROUND_TO`` 1; by bit arithmetic when ``BF16_RNE``) or fp16
    (2), back in fp32."""
    if ROUND_TO == 1:
        if BF16_RNE:
            return _bf16_rne(x).to(tl.float32)
        return x.to(tl.bfloat16).to(tl.float32)
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16 rounding to nearest even by bit arithmetic (finite values; the interpreter's
    own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def block_out(sizes: list[int]) -> int | None:
    """The first of :data:`BLOCK_OUT_CHOICES` dividing every ``out_i``, else ``None``."""
    return next((b for b in BLOCK_OUT_CHOICES if all(s % b == 0 for s in sizes)), None)


def supported(y: Any, xa: Any, bs: list[Any], sizes: list[int], ranks: list[int],
              xa_sum: bool = False) -> bool:
    """Whether :func:`lora_expand` serves these operands (else use the per-part ``addmm_``).

    Needs 1 to :data:`MAX_PARTS` parts with ``out_i`` a multiple of 16, ``xa`` and every B of one
    dtype (bf16/fp16/fp32; with ``xa_sum``, :func:`lora_expand`'s ``round_to`` case, ``xa`` may
    also be an fp32 sum for 16-bit B), contiguous B of shape ``[out_i, r_i]``, unit column stride
    in ``y`` and ``xa``, all on one CUDA device (or CPU tensors under the interpreter).
    """
    import torch
    floats = (torch.bfloat16, torch.float16, torch.float32)
    return (0 < len(bs) <= MAX_PARTS and block_out(sizes) is not None
            and y.dim() == 2 and xa.dim() == 2 and y.stride(1) == 1 and xa.stride(1) == 1
            and y.shape == (xa.shape[0], sum(sizes)) and xa.shape[1] == sum(ranks)
            and y.dtype in floats and xa.dtype in floats
            and all((b.dtype == xa.dtype or (xa_sum and xa.dtype == torch.float32
                                             and b.dtype in floats))
                    and b.is_contiguous() and tuple(b.shape) == (o, r)
                    and b.device == y.device for b, o, r in zip(bs, sizes, ranks))
            and xa.device == y.device and (y.is_cuda or INTERPRETED))


def lora_expand(y: Any, xa: Any, bs: list[Any], sizes: list[int], ranks: list[int],
                scaling: float, round_to: Any = None) -> None:
    """``y[:, part i] += scaling * xa[:, ranks of i] @ bs[i]^T`` for every part, in place.

    Shapes: ``y [N, sum(sizes)]`` (row stride free, column stride 1), ``xa [N, sum(ranks)]``,
    ``bs[i] [sizes[i], ranks[i]]`` contiguous. ``round_to`` (``torch.bfloat16`` /
    ``torch.float16``, with an fp32 ``y``: the unrounded sum of a 16-bit model's GEMM, e.g.
    :mod:`.mlp_block`'s accumulator): ``y = rnd(rnd(y) + scaling * xa @ B^T)``, PEFT's order
    for adapters on that base, stored back in fp32 (exactly representable in ``round_to``); an
    fp32 ``xa`` with 16-bit B is then an unrounded ``x @ A^T`` sum too, rounded to B's dtype
    first (PEFT's ``lora_A`` output in the adapter dtype).

    Raises:
        ValueError: :func:`supported` is false (the caller checks first), or ``round_to`` with
            a ``y`` that is not fp32 or a dtype other than bf16/fp16.
    """
    import torch
    if not supported(y, xa, bs, sizes, ranks, xa_sum=round_to is not None):
        raise ValueError(f"lora_expand: unsupported operands y {tuple(y.shape)} {y.dtype}, xa "
                         f"{tuple(xa.shape)} {xa.dtype}, parts {sizes} ranks {ranks}; use addmm_.")
    rounds = {None: 0, torch.bfloat16: 1, torch.float16: 2}
    if round_to not in rounds or (round_to is not None and y.dtype != torch.float32):
        raise ValueError(f"lora_expand: round_to={round_to} with y {y.dtype}: round_to is "
                         "torch.bfloat16 / torch.float16 and needs an fp32 y (or pass None).")
    n_rows, parts = y.shape[0], len(bs)
    if n_rows == 0:
        return
    ends = [sum(sizes[:i + 1]) for i in range(parts)] + [0] * (MAX_PARTS - parts)
    roffs = [sum(ranks[:i]) for i in range(parts)] + [0] * (MAX_PARTS - parts)
    rs = list(ranks) + [ranks[0]] * (MAX_PARTS - parts)
    b_args = list(bs) + [bs[0]] * (MAX_PARTS - parts)  # unused slots: never read
    tile_m = min(64, max(16, triton.next_power_of_2(n_rows)))
    tile_r = min(64, max(16, triton.next_power_of_2(max(ranks))))
    tile_n = block_out(sizes)
    grid = (triton.cdiv(n_rows, tile_m), sum(sizes) // tile_n)
    _lora_expand_gemm[grid](xa, y, *b_args, n_rows, xa.stride(0), y.stride(0), ends[0], ends[1],
                         roffs[1], roffs[2], rs[0], rs[1], rs[2], float(scaling),
                         NUM_PARTS=parts, BLOCK_M=tile_m, BLOCK_OUT=tile_n, BLOCK_R=tile_r,
                         DOT_FP32=xa.dtype == torch.float32 or INTERPRETED,
                         BF16_RNE=INTERPRETED and torch.bfloat16 in (y.dtype, round_to,
                                                                     bs[0].dtype),
                         ROUND_TO=rounds[round_to],
                         XA_ROUND=rounds[bs[0].dtype] if xa.dtype != bs[0].dtype else 0,
                         num_warps=4,
                         **pdl.launch_kwargs(prewait=True))
