"""Skinny decode GEMM with LoRA B in its epilogue (``lora_expand="epilogue"``), one launch a group.

Contract: :func:`skinny_lora_gemm` returns ``y [M, n_out]`` (contiguous, x's dtype) with

    ``y[:, part i] = x W_i^T (+ bias_i) + scaling * round(x A_i^T) B_i^T``

for ``x [M, K]`` (``M <= skinny_gemm.MAX_ROWS``) and a LiveGroup's ``ext`` buffer ``W' [n_out +
R, K]`` = ``[W; A]`` (``R = sum(r_i)``, A's rows last), ``bs[i] [out_i, r_i]`` each part's live
``lora_B`` (pointers read at call time: an in-place optimizer step is seen by the next call),
``round`` = rounding of the fp32 ``x A^T`` to B's dtype (what the default path's ext GEMM
output is before :mod:`.lora_expand` reads it; exact products in fp32 after it). fp32
accumulation throughout; ``y`` is rounded once (the default path rounds ``x W^T`` and then the
sum). Works on CUDA and under ``TRITON_INTERPRET=1``.

Design: the grid of :mod:`.skinny_gemm` flattened (``tiles x splits`` programs, serial split-K
with a per-tile ticket), plus the dependency "every y tile's epilogue needs ``xA``", which is the
output of the ext tiles (columns ``>= n_out``; ``n_out`` a multiple of ``BLOCK_N`` so no tile is
both). Ordering without deadlock: each program first draws a *dynamic id* from an atomic
counter; ids are handed out in the order programs actually start, so every program with a
smaller id is already resident (CUB's decoupled look-back, Merrill & Garland 2016, "Single-pass
Parallel Prefix Scan with Decoupled Look-back", NVR-2016-002; the dynamic tile index of Stream-K,
Osama et al., arXiv:2301.03598). Ids map to ``(tile, split)`` with the ext tiles' splits first, so
the ext tiles' programs never wait on anything and every waiter waits only on smaller ids.
The ext tile's last ticket writes its ``xA`` columns (fp32) to a workspace and increments a
flag (release); each y tile's last-ticket program, after its own K loop and reduce, spins until
the flag counts every ext tile, loads ``xA``, adds ``scaling * xA B^T`` (B's tile from
up to three part pointers, masked per part, so a tile may straddle parts) and rounds once.
y tiles increment the same flag when done; the program drawing its last value resets it and
subtracts the program count from the id counter (ids are ``counter % programs``: with PDL the
next launch may draw ids before this reset, and the residues stay exact), tickets reset as in
:mod:`.skinny_gemm`: every counter is back at 0 after a launch (CUDA-graph replays). Under the
interpreter programs run one after another in grid order, so the ids equal the grid order and
the ext tiles finish first: no spin ever waits there (tested).

Spin and ordering (PTX ISA, "Memory Consistency Model"): the wait spins on ``ld.volatile``
(relaxed loads, no read-modify-write queued at the flag's L2 line, no CTA barrier per turn;
the counters sit 128 B apart, :data:`_FLAG`), then an acquire (thread 0; its value feeds a
loop, else Triton 3.6 drops it) reads the flag: it observes the release sequence of every ext tile's release add (later adds are RMWs
too), so the ext tiles' ``xA`` stores, ordered before their release by ``bar.sync``, happen
before the ``bar.sync`` that follows and every thread's ``xA`` load (``.cg``, L2): the pattern of
CUTLASS's ``Semaphore`` (``cutlass/semaphore.h``: thread 0 acquires, then ``__syncthreads``).

Loads: only ``m`` is unspecialised (as in :mod:`.skinny_gemm`): ``n``, ``k``, ``n_out`` and the
part bounds keep Triton's divisible-by-16 hints, without which the K loop's masks (``kk <
min(k_lo + k_per_split, k)``) and the workspace rows (``rows * n``) lose their alignment and the
W / x tiles move in 4-byte ``cp.async`` copies and 2-byte loads instead of 16-byte ones, with
less staged in shared memory than skinny_gemm's pipeline (sm_90, Triton 3.9, 32 rows, 64 x 128
x 3 stages: 16 KB against 48 KB, 221 registers against 108; tested). The cost: one compile per
group shape (and row tile, config).

PDL (``USE_GDC``, :mod:`.pdl`): the dynamic id and the first W tile are taken before
``gdc_wait()``, everything else after it, as in :mod:`.skinny_gemm`. The id's relaxed atomic
is the one exception to pdl.py's "no write before the wait": W is never written in a decode
step, and the id counter belongs to this kernel and workspace key only. If the kernel right
before is a launch on the same counter, all of its programs drew their ids before they
triggered this launch, and its only later access is the final subtraction of ``P``
(commutative), so the ids drawn here are still ``0..P-1`` in start order modulo ``P`` and the
counter stays below ``2P`` (tested by starting from ``P``).

Tests: ``tests/engine/test_skinny_lora_epilogue.py`` (kernel), and
``tests/engine/test_skinny_lora_epilogue_engine.py`` (engine routing, tokens, launch count).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels.lora_expand import _bf16_rne

MAX_PARTS = 3
"""Parts one launch serves (q/k/v is the widest group)."""
BLOCK_R = 32
"""The rank chunk of the epilogue's ``xA B^T`` loop."""
INTERPRETED = sg.INTERPRETED
_IDS, _FLAG, _TICKETS = tl.constexpr(0), tl.constexpr(32), tl.constexpr(64)
"""Slots of the int32 counters: dynamic id, ext-ready / done flag, then one ticket a tile; 32
ints (128 B, one L2 line) apart, so the spinning loads of the flag do not queue behind the id
and ticket atomics of the same line at its L2 slice."""


@triton.jit
def _k_loop(x_ptr, w_ptr, rows, cols, row_ok, col_ok, k_lo, k_hi, stride_x, stride_w,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            UPCAST: tl.constexpr, USE_GDC: tl.constexpr):
    """``x[:, k_lo:k_hi] @ W[cols, k_lo:k_hi]^T`` in fp32 (the K loop of skinny_gemm)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = k_lo
    if USE_GDC:  # PDL: the first W tile before the wait (W is never written during decode)
        kk0 = k_lo + tl.arange(0, BLOCK_K)
        k0_ok = kk0 < k_hi
        w0 = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + kk0[None, :],
                     mask=col_ok[:, None] & k0_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        tl.extra.cuda.gdc_wait()
        x0 = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + kk0[None, :],
                     mask=row_ok[:, None] & k0_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        acc = sg._dot(x0, tl.trans(w0), acc, UPCAST)
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = sg._dot(x, tl.trans(w), acc, UPCAST)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    return acc


@triton.jit
def _part_tile(b_ptr, cols, kk, start, end, roff, rank):
    """``B_p^T``'s ``[BLOCK_R, BLOCK_N]`` tile for output columns ``cols`` and global ranks
    ``kk``, zero outside part p (columns ``[start, end)``, ranks ``[roff, roff + rank)``)."""
    ok = ((cols >= start) & (cols < end))[None, :] & ((kk >= roff) & (kk < roff + rank))[:, None]
    # B_p is [out_p, r_p] row-major: element (c, j) at c * r_p + j
    return tl.load(b_ptr + (cols - start)[None, :] * rank + (kk - roff)[:, None], mask=ok,
                   other=0.0)


@triton.jit
def _add_lora_b(acc, xa_ptr, r_total, rows, cols, col0, row_ok, b0_ptr, b1_ptr, b2_ptr, n_out,
                end0, end1, roff1, roff2, r0, r1, r2, scaling, NUM_PARTS: tl.constexpr,
                BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, BF16_RNE: tl.constexpr):
    """``acc + scaling * round(xA) @ B^T`` over this tile's columns ``[col0, col0 + BLOCK_N)``,
    in fp32. Only the ranks of the parts the tile overlaps are read (one part's ``r_i`` for a
    tile inside one part), each part's B tile only where the tile overlaps it. Part ``i`` spans
    columns ``[end_{i-1}, end_i)`` (``end0, end1``, then ``n_out``) and ranks ``[roff_i,
    roff_i + r_i)``."""
    col1 = tl.minimum(col0 + acc.shape[1], n_out) - 1  # the tile's last output column
    k_lo, k_hi = 0, r0  # rank range of the parts holding col0 .. col1
    if NUM_PARTS > 1:
        k_lo = tl.where(col0 >= end0, roff1, k_lo)
        k_hi = tl.where(col1 >= end0, roff1 + r1, k_hi)
    if NUM_PARTS > 2:
        k_lo = tl.where(col0 >= end1, roff2, k_lo)
        k_hi = tl.where(col1 >= end1, roff2 + r2, k_hi)
    end_1 = end1 if NUM_PARTS > 2 else n_out
    lora = tl.zeros(acc.shape, dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_R):
        kk = k0 + tl.arange(0, BLOCK_R)
        xa = tl.load(xa_ptr + rows[:, None] * r_total + kk[None, :],
                     mask=row_ok[:, None] & (kk < k_hi)[None, :], other=0.0,
                     cache_modifier=".cg")  # [BLOCK_M, BLOCK_R] fp32, from the ext tiles
        b = tl.zeros((BLOCK_R, acc.shape[1]), dtype=b0_ptr.dtype.element_ty)
        if col0 < end0:  # [BLOCK_R, BLOCK_N], zero outside each part
            b += _part_tile(b0_ptr, cols, kk, 0, end0, 0, r0)
        if NUM_PARTS > 1:  # noqa: SIM102 (constexpr tests stand alone: pruned)
            if (col0 < end_1) & (col1 >= end0):
                b += _part_tile(b1_ptr, cols, kk, end0, end_1, roff1, r1)
        if NUM_PARTS > 2:  # noqa: SIM102
            if col1 >= end1:
                b += _part_tile(b2_ptr, cols, kk, end1, n_out, roff2, r2)
        if BF16_RNE:  # the interpreter's own cast truncates
            xa = _bf16_rne(xa)
        else:
            xa = xa.to(b.dtype)  # the ext GEMM output's rounding (module docstring)
        lora = sg._dot(xa, b, lora, UPCAST)
    return acc + scaling * lora


@triton.jit(do_not_specialize=["m"])  # the rest specialised: see "Loads" in the module docstring
def _skinny_lora(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, xa_ptr, cnt_ptr, b0_ptr, b1_ptr,
                 b2_ptr, m, n, n_out, k, stride_x, stride_w, k_per_split, splits, end0, end1,
                 roff1, roff2, r0, r1, r2, scaling, HAS_BIAS: tl.constexpr,
                 SPLIT: tl.constexpr, NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 UPCAST: tl.constexpr, BF16_RNE: tl.constexpr, USE_GDC: tl.constexpr):
    programs = tl.num_programs(0)
    pid = tl.atomic_add(cnt_ptr + _IDS, 1, sem="relaxed") % programs  # dynamic id (start order)
    y_tiles = n_out // BLOCK_N
    ext_tiles = tl.cdiv(n - n_out, BLOCK_N)
    n_ext = ext_tiles * splits  # ids [0, n_ext): the ext tiles' splits, never waiting
    is_ext = pid < n_ext
    q = tl.where(is_ext, pid, pid - n_ext)
    tile = q // splits + tl.where(is_ext, y_tiles, 0)
    split_id = q % splits
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    k_lo = split_id * k_per_split
    acc = _k_loop(x_ptr, w_ptr, rows, cols, row_ok, col_ok, k_lo,
                  tl.minimum(k_lo + k_per_split, k), stride_x, stride_w, BLOCK_M, BLOCK_N,
                  BLOCK_K, UPCAST, USE_GDC)
    out_ok = row_ok[:, None] & col_ok[None, :]
    last = True
    if SPLIT:  # serial split-K as in skinny_gemm: the tile's last ticket sums in split order
        ws = ws_ptr + rows[:, None] * n + cols[None, :]
        tl.store(ws + split_id.to(tl.int64) * BLOCK_M * n, acc, mask=out_ok)
        tl.debug_barrier()  # all threads' stores precede the release (CUTLASS Semaphore)
        ticket = tl.atomic_add(cnt_ptr + _TICKETS + tile, 1, sem="acq_rel")
        last = ticket == splits - 1
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(splits):  # fixed order: deterministic sums
                acc += tl.load(ws + s * BLOCK_M * n, mask=out_ok, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + _TICKETS + tile, 0)  # ready for the next call
    if last:
        if is_ext:  # publish xA [M, R] (fp32), then count this ext tile as ready
            r_total = n - n_out
            tl.store(xa_ptr + rows[:, None] * r_total + (cols - n_out)[None, :], acc,
                     mask=out_ok)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + _FLAG, 1, sem="release")
        else:
            ready = tl.load(cnt_ptr + _FLAG, volatile=True)  # spin on plain loads (docstring)
            while ready < ext_tiles:  # only smaller ids (ext programs, never waiting) to wait on
                ready = tl.load(cnt_ptr + _FLAG, volatile=True)
            ready = tl.atomic_add(cnt_ptr + _FLAG, 0, sem="acquire")  # the acquire, once set
            while ready < ext_tiles:  # never taken; the value is used, so the acquire is kept
                ready = tl.atomic_add(cnt_ptr + _FLAG, 0, sem="acquire")
            tl.debug_barrier()
            acc = _add_lora_b(acc, xa_ptr, n - n_out, rows, cols, tile * BLOCK_N, row_ok,
                              b0_ptr, b1_ptr, b2_ptr, n_out, end0, end1, roff1, roff2, r0, r1,
                              r2, scaling, NUM_PARTS, BLOCK_R, UPCAST, BF16_RNE)
            sg._epilogue(acc, bias_ptr, y_ptr, n_out, rows, cols, out_ok, col_ok, HAS_BIAS,
                         BF16_RNE)
            done = tl.atomic_add(cnt_ptr + _FLAG, 1, sem="relaxed")
        if done == y_tiles + ext_tiles - 1:  # the last tile: every counter back to 0
            tl.atomic_xchg(cnt_ptr + _FLAG, 0)
            tl.atomic_add(cnt_ptr + _IDS, -programs, sem="relaxed")


def supported(x: Any, w: Any, n_out: int, bs: list[Any], sizes: list[int], ranks: list[int],
              bias: Any = None, block_n: int = 64) -> bool:
    """Whether :func:`skinny_lora_gemm` serves these operands (else the caller keeps its
    GEMM + :mod:`.lora_expand` path): :func:`.skinny_gemm.supported` for ``x``, ``w`` (``bias``
    ``[n_out]`` or ``None``), 1 to :data:`MAX_PARTS` parts with ``sum(sizes) == n_out``, ``n_out``
    a multiple of ``block_n``, ``w [n_out + sum(ranks), K]``, every ``bs[i]`` contiguous
    ``[sizes[i], ranks[i]]`` in w's dtype on w's device."""
    r_total = sum(ranks)
    if not (0 < len(bs) <= MAX_PARTS and len(bs) == len(sizes) == len(ranks) and n_out > 0
            and sum(sizes) == n_out and n_out % block_n == 0 and r_total > 0
            and w.dim() == 2 and w.shape[0] == n_out + r_total
            and sg.supported(x, w)):
        return False
    if bias is not None and not (bias.dim() == 1 and bias.shape[0] == n_out
                                 and bias.dtype == x.dtype and bias.is_contiguous()
                                 and bias.device == x.device):
        return False
    return all(b.dtype == w.dtype and b.is_contiguous() and tuple(b.shape) == (o, r)
               and b.device == w.device for b, o, r in zip(bs, sizes, ranks))


_WORKSPACES: dict[tuple, tuple[Any, Any, Any]] = {}


def workspace(device: Any, n: int, n_out: int, split: int, bm: int,
              block_n: int) -> tuple[Any, Any, Any]:
    """``(partials [split * bm * n] fp32, xa [bm * (n - n_out)] fp32, counters int32 zeros)``
    for this (device, N, n_out, split, BLOCK_M, BLOCK_N), allocated once and reused (the kernel
    leaves the counters at 0). One key per program count: the id counter's modulo (module
    docstring) needs consecutive launches on one counter to have the same grid."""
    import torch
    key = (str(device), n, n_out, split, bm, block_n)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (
            torch.empty(split * bm * n if split > 1 else 1, dtype=torch.float32,
                        device=device),
            torch.empty(bm * (n - n_out), dtype=torch.float32, device=device),
            torch.zeros(_TICKETS.value + triton.cdiv(n, block_n), dtype=torch.int32,
                        device=device))
    return _WORKSPACES[key]


def skinny_lora_gemm(x: Any, w: Any, n_out: int, bs: list[Any], sizes: list[int],
                     ranks: list[int], scaling: float, bias: Any = None,
                     config: sg.Config | None = None) -> Any:
    """``x W^T (+ bias) + scaling * round(x A^T) B^T`` per part in one launch (module
    docstring). Shapes: ``x [M, K]``, ``w [n_out + sum(ranks), K]`` (``[W; A]``), ``bs[i]
    [sizes[i], ranks[i]]``, ``bias [n_out]`` or ``None``; returns a new contiguous ``y [M,
    n_out]``. ``config``: default :func:`.skinny_gemm.default_config` of ``w``'s shape. Raises
    ``ValueError`` when :func:`supported` is false for the config's ``block_n``."""
    import torch
    m, k = x.shape
    n = w.shape[0]
    cfg = config or sg.default_config(n, k)
    if not supported(x, w, n_out, bs, sizes, ranks, bias, cfg.block_n):
        raise ValueError(f"skinny_lora_gemm: unsupported operands x {tuple(x.shape)} {x.dtype}, "
                         f"W' {tuple(w.shape)} {w.dtype}, n_out {n_out}, parts {sizes} ranks "
                         f"{ranks}, BLOCK_N {cfg.block_n}; use skinny_gemm + lora_expand.")
    split, k_per = sg.launch_split(k, cfg)
    bm = sg.block_m(m)
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    ws, xa, cnt = workspace(x.device, n, n_out, split, bm, cfg.block_n)
    parts = len(bs)
    ends = [sum(sizes[:i + 1]) for i in range(parts)] + [0] * (MAX_PARTS - parts)
    roffs = [sum(ranks[:i]) for i in range(parts)] + [0] * (MAX_PARTS - parts)
    rs = list(ranks) + [ranks[0]] * (MAX_PARTS - parts)
    b_args = list(bs) + [bs[0]] * (MAX_PARTS - parts)  # unused slots: never read
    grid = (triton.cdiv(n, cfg.block_n) * split,)
    _skinny_lora[grid](
        x, w, y if bias is None else bias, y, ws, xa, cnt, *b_args, m, n, n_out, k,
        x.stride(0), w.stride(0), k_per, split, ends[0], ends[1], roffs[1], roffs[2], *rs,
        float(scaling), HAS_BIAS=bias is not None, SPLIT=split > 1, NUM_PARTS=parts,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=BLOCK_R,
        UPCAST=INTERPRETED, BF16_RNE=INTERPRETED and y.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs())
    return y
