"""Triton programs and host launcher of the paged split-KV decode attention.

The design, layouts and split policies are documented in :mod:`.paged_decode` (the public module,
which re-exports :func:`paged_decode_attention` and :func:`new_workspace` from here); the split
planning lives in :mod:`.paged_decode_plan`. Requires ``triton`` (imported at module import).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.paged_decode_plan import (
    KERNELS,
    MIN_SPLIT_TOKENS_V2,
    default_block_n,
)


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1  # tanh via sigmoid, as vLLM's kernel (portable to HIP)


@triton.jit
def _split_tiles(seq_len, window, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 USE_WINDOW: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """``(lo, s_lo, s_hi)``: first visible position and this split's ``BLOCK_N`` tiles.

    Tiles wholly behind the window are never visited. ``MIN_SPLIT_TILES > 0`` (kernel "v2"): no
    split of this row gets fewer tiles, so short rows use fewer of the ``NUM_SPLITS`` programs
    (the rest exit at once); SGLang's per-request ``num_kv_splits`` with ``MIN_BLOCK_KV``."""
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    return _split_tiles_from(lo, seq_len, split, BLOCK_N, NUM_SPLITS, MIN_SPLIT_TILES)


@triton.jit
def _split_tiles_from(lo, seq_len, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      MIN_SPLIT_TILES: tl.constexpr):
    """:func:`_split_tiles` from a given first visible position ``lo`` (a window's, or the end
    of a group's shared prefix, which :mod:`.paged_decode_prefix` attends to)."""
    t_lo = lo // BLOCK_N  # tiles are aligned to absolute positions
    t_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(t_hi - t_lo, NUM_SPLITS)
    if MIN_SPLIT_TILES > 0:
        per_split = tl.maximum(per_split, MIN_SPLIT_TILES)
    s_lo = t_lo + split * per_split
    return lo, s_lo, tl.minimum(s_lo + per_split, t_hi)


@triton.jit
def _tile_slots(bt_row, start, offs_n, valid, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Physical slots ``[BLOCK_N]`` of logical positions ``offs_n`` through the block table."""
    if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one scalar page lookup
        page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
        slots = page * PAGE_SIZE + start % PAGE_SIZE + tl.arange(0, BLOCK_N)
    else:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slots = page * PAGE_SIZE + offs_n % PAGE_SIZE
    return slots


@triton.jit
def _online_softmax_tile(q, k, v, valid, m_i, l_i, acc, scale, soft_cap,
                         USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax: ``q [BLOCK_H, D]``, ``k [D, BLOCK_N]``, ``v [BLOCK_N, D]``;
    returns the updated ``(m_i, l_i, acc)`` (running max, denominator, unnormalised output)."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile has a visible key: m_new is finite
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _kv_tiles(q, K, V, bt_row, kvh, s_lo, s_hi, seq_len, lo, offs_d, mask_d, stride_kh,
              stride_ks, stride_vh, stride_vs, scale, soft_cap, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
              USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of ``q [BLOCK_H, BLOCK_D]`` over KV tiles ``s_lo..s_hi`` of one (row, kv
    head): positions in ``[lo, seq_len)``, pages through the row's block table ``bt_row``.
    Returns ``(m_i, l_i, acc)`` (running max, sum and unnormalised output, fp32); shared by
    stage 1 and the fused kernel (:mod:`.paged_decode_fused`)."""
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for t in range(s_lo, s_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (offs_n < seq_len) & (offs_n >= lo)
        slots = _tile_slots(bt_row, t * BLOCK_N, offs_n, valid, BLOCK_N, PAGE_SIZE)
        k = tl.load(K + kvh * stride_kh + slots[None, :] * stride_ks + offs_d[:, None],
                    mask=valid[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(V + kvh * stride_vh + slots[:, None] * stride_vs + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = _online_softmax_tile(q, k, v, valid, m_i, l_i, acc, scale, soft_cap,
                                             USE_SOFT_CAP, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _merge_prefix(o, lse, PreO, PreLse, b, heads, offs_d, mask_h, mask_d, has_prefix,
                  stride_pb, stride_ph, stride_plb, stride_plh):
    """Merge a normalised partial ``o [BLOCK_H, BLOCK_D]`` with log-sum-exp ``lse [BLOCK_H]``
    (finite: a row's suffix holds at least its own token) with row ``b``'s shared-prefix
    partial (:mod:`.paged_decode_prefix`; weight 0 unless ``has_prefix``): the stage-2 formula
    ``sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m)`` over the two."""
    lp = tl.load(PreLse + b * stride_plb + heads * stride_plh, mask=mask_h, other=0.0)
    lp = tl.where(has_prefix, lp, float("-inf"))  # buffers [B, H, D]: in bounds either way
    op = tl.load(PreO + b * stride_pb + heads[:, None] * stride_ph + offs_d[None, :],
                 mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    op = tl.where(has_prefix, op, 0.0)
    m = tl.maximum(lse, lp)
    w, wp = tl.exp(lse - m), tl.exp(lp - m)
    return (o * w[:, None] + op * wp[:, None]) / (w + wp)[:, None]


@triton.jit
def _paged_attention_stage1(Q, K, V, BlockTable, SeqLens, MidO, MidLse, Out, scale, soft_cap,
            window, RowPrefix, PreO, PreLse,
            stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
            stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_pb, stride_ph,
            stride_plb, stride_plh,
            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
            DOT_PRECISION: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, DIRECT: tl.constexpr,
            USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr = False,
            HAS_PREFIX: tl.constexpr = False):
    """Stage 1: one program per ``(row, kv head, split)``, all ``GROUP`` q heads of the kv head
    as the ``BLOCK_H`` rows of the ``tl.dot`` tiles (each K/V tile is read once per kv head).
    ``DIRECT``: ``Out`` (strides ``stride_mb/mh`` then) gets the final output. ``USE_GDC``
    (PDL, :mod:`.pdl`): wait first (q, the KV just written, seq lens and the block table come
    from earlier kernels; the shared workspace may still be read by the previous layer's
    stage 2), let the next kernel launch after the KV loop (``EARLY_TRIGGER``: first).
    ``HAS_PREFIX``: row ``b`` attends only from ``RowPrefix[b]`` on (its group's shared prompt
    pages were attended by :mod:`.paged_decode_prefix`, partials ``PreO [B, H, D]``, ``PreLse
    [B, H]``); ``DIRECT`` merges that partial here, stage 2 otherwise. No window then. With
    PDL the prefix kernel (launched just before) lets this grid launch right after its own
    wait, so this program reads q and the KV before its wait (the q/k/RoPE kernel that wrote
    them had completed and flushed before the prefix grid passed its wait, hence before this
    grid launched) and waits for the prefix grid after its KV loop, before any store: the
    prefix and the per-row loops run at the same time."""
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if EARLY_TRIGGER:  # pdl="prefetch": the next kernel may launch now (pdl.py)
            tl.extra.cuda.gdc_launch_dependents()
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if not HAS_PREFIX:  # with a prefix: after the KV loop (docstring)
            tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)  # positions in int32, slots in int64
    first = seq_len * 0  # positions before RowPrefix[b]: the group's prefix kernel
    if HAS_PREFIX:  # (no window then)
        first = tl.load(RowPrefix + b).to(tl.int32)
        lo, s_lo, s_hi = _split_tiles_from(first, seq_len, split, BLOCK_N, NUM_SPLITS,
                                           MIN_SPLIT_TILES)
    else:
        lo, s_lo, s_hi = _split_tiles(seq_len, window, split, BLOCK_N, NUM_SPLITS, USE_WINDOW,
                                      MIN_SPLIT_TILES)
    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    m_i, l_i, acc = _kv_tiles(q, K, V, BlockTable + b * stride_bt, kvh, s_lo, s_hi, seq_len, lo,
                              offs_d, mask_d, stride_kh, stride_ks, stride_vh, stride_vs, scale,
                              soft_cap, BLOCK_H, BLOCK_D, BLOCK_N, PAGE_SIZE, USE_SOFT_CAP,
                              DOT_PRECISION)
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if HAS_PREFIX:  # the prefix grid done (its partials; the workspace is free again)
            tl.extra.cuda.gdc_wait()
    if USE_GDC:  # noqa: SIM102 (KV loop done: the next kernel may start its prologue)
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    has = l_i > 0  # False for an empty split (more splits than tiles)
    l_safe = tl.where(has, l_i, 1.0)
    mask_hd = mask_h[:, None] & mask_d[None, :]
    if DIRECT:  # one split (kernel "v2"): the normalised output is final, no stage 2
        out = Out + b * stride_mb + heads * stride_mh
        o = acc / l_safe[:, None]
        if HAS_PREFIX:  # the row's suffix is never empty (its own token): lse is finite
            o = _merge_prefix(o, m_i + tl.log(l_safe), PreO, PreLse, b, heads, offs_d, mask_h,
                              mask_d, first > 0, stride_pb, stride_ph, stride_plb, stride_plh)
        tl.store(out[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty), mask=mask_hd)
    else:
        mid = MidO + b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(mid[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=mask_hd)
        lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _paged_attention_stage2(MidO, MidLse, Out, RowPrefix, PreO, PreLse, stride_mb, stride_mh,
            stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, stride_pb, stride_ph,
            stride_plb, stride_plh,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
            BLOCK_S: tl.constexpr, USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr = False,
            HAS_PREFIX: tl.constexpr = False):
    """Stage 2: one program per ``(row, head)`` merges its splits (``HAS_PREFIX``: and the
    row's shared-prefix partial when ``RowPrefix[b] > 0``); ``USE_GDC`` (PDL): wait
    first (stage 1's partials), let the next kernel launch once they are read
    (``EARLY_TRIGGER``: first, so o_proj launches during the attention)."""
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if EARLY_TRIGGER:  # pdl="prefetch": the next kernel may launch now (pdl.py)
            tl.extra.cuda.gdc_launch_dependents()
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    base = b * stride_mb + h * stride_mh
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    o = tl.load(MidO + base + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    if HAS_PREFIX:  # one more partial: the group's shared prefix (weight 0 without one)
        has_prefix = tl.load(RowPrefix + b) > 0  # buffers [B, H, D]: in bounds either way
        lp = tl.where(has_prefix, tl.load(PreLse + b * stride_plb + h * stride_plh),
                      float("-inf"))
        op = tl.where(has_prefix, tl.load(PreO + b * stride_pb + h * stride_ph + offs_d,
                                          mask=mask_d, other=0.0), 0.0)
        m = tl.maximum(tl.max(lse, 0), lp)  # finite: the suffix holds the row's own token
        w, wp = tl.exp(lse - m), tl.exp(lp - m)
        out = (tl.sum(w[:, None] * o, 0) + wp * op) / (tl.sum(w, 0) + wp)
    else:
        w = tl.exp(lse - tl.max(lse, 0))  # empty splits: exp(-inf) = 0
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=mask_d)


def paged_decode_attention(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any,
                           scale: float, page_size: int, num_splits: int,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           workspace: tuple[Any, Any] | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int = 2, kernel: str = "v1",
                           min_split_tokens: int | None = None,
                           prefix: tuple[Any, Any, Any] | None = None) -> Any:
    """Decode attention of ``q [B, H, D]`` over the paged pool; returns ``[B, H, D]``.

    Args:
        k_cache, v_cache: ``[1, H_kv, num_slots, D]`` (unit stride on D); ``H % H_kv == 0``.
            A KV-shared layer (Gemma-4) passes its store layer's tensors.
        block_table: ``[B, max_pages]`` int32/int64 physical page ids (logical page order).
        seq_lens: ``[B]`` int, tokens visible to the query (``pos + 1``), each ``>= 1``.
        workspace: ``(mid_o [B, H, S, D], mid_lse [B, H, S])`` fp32, contiguous; ``None`` =
            allocate here (fine under CUDA-graph capture: the shape is static).
        block_n: keys per tile (power of 2, >= 16); default :func:`default_block_n`.
        kernel: ``"v1"`` (each row's tiles split evenly over all ``num_splits``, stage 2 always)
            or ``"v2"`` (splits of at least ``min_split_tokens`` per row; ``num_splits == 1``
            writes the output from stage 1, one launch). Same math, same stage-1 program.
            ``"fused"`` (one launch at any ``num_splits``, the splits merged in-kernel by the
            last program of each (row, kv head)) goes through :func:`.paged_decode.
            paged_decode_attention` to :mod:`.paged_decode_fused`, which imports this module.
        min_split_tokens: fewest tokens per split of a row (v2, "fused"); default 128 for v2
            (:data:`MIN_SPLIT_TOKENS_V2`), one tile for "fused".
        prefix: ``(row_prefix [B] int32, pre_o [B, H, D] fp32, pre_lse [B, H] fp32)``: row
            ``b`` attends from position ``row_prefix[b]`` on and merges the partial that
            :func:`.paged_decode_prefix.paged_decode_prefix` left for its group's shared prompt
            pages (kernels "v1", "v2"; no ``sliding_window``).
    Raises:
        ValueError: shapes or dtypes that do not fit (heads, head dim, workspace, block_n), an
            unknown ``kernel``, ``prefix`` with a ``sliding_window``.
    """
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    block_n = block_n or default_block_n(dim)
    _check(q, k_cache, v_cache, heads, kv_heads, block_n, kernel)
    if kernel == "fused":  # its launcher imports this module, so it is dispatched one level up
        raise ValueError("paged decode: kernel 'fused' launches through nbhelpers.engine.kernels."
                         "paged_decode.paged_decode_attention (paged_decode_fused).")
    if prefix is not None and sliding_window:
        raise ValueError("paged decode: a shared prefix with a sliding window; pass prefix=None "
                         "for windowed layers (the prefix kernel attends to every prefix key).")
    min_split_tokens = min_split_tokens or MIN_SPLIT_TOKENS_V2
    direct = kernel == "v2" and num_splits == 1
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    mid_o, mid_lse = _mid_buffers(out, workspace, num_splits, direct)
    block_d = triton.next_power_of_2(max(dim, 16))
    min_tiles = max(1, min_split_tokens // block_n) if kernel == "v2" else 0
    row_prefix, pre_o, pre_lse = prefix or (seq_lens, mid_o, mid_lse)  # unread without prefix
    _paged_attention_stage1[(bsz, kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse, out, scale, soft_cap or 1.0,
        sliding_window or 0, row_prefix, pre_o, pre_lse, q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), block_table.stride(0), mid_o.stride(0),
        mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        *_prefix_strides(prefix), HAS_PREFIX=prefix is not None,
        GROUP=heads // kv_heads, BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, USE_WINDOW=bool(sliding_window), USE_SOFT_CAP=bool(soft_cap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MIN_SPLIT_TILES=min_tiles, DIRECT=direct, num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_kwargs(trigger=True))
    if not direct:
        _merge_splits(mid_o, mid_lse, out, block_d, prefix)
    return out


def _prefix_strides(prefix: tuple[Any, Any, Any] | None) -> tuple[int, int, int, int]:
    """``(stride_pb, stride_ph, stride_plb, stride_plh)`` of ``pre_o`` / ``pre_lse`` (zeros
    without a prefix: the kernels read nothing there)."""
    if prefix is None:
        return 0, 0, 0, 0
    _, pre_o, pre_lse = prefix
    return pre_o.stride(0), pre_o.stride(1), pre_lse.stride(0), pre_lse.stride(1)


def _mid_buffers(out: Any, workspace: tuple[Any, Any] | None, num_splits: int,
                 direct: bool) -> tuple[Any, Any]:
    """Stage-1 targets: ``out`` itself when ``direct`` (``mid_lse`` unused), else the checked
    ``(mid_o [B, H, S, D], mid_lse [B, H, S])`` workspace (allocated when ``None``)."""
    bsz, heads, dim = out.shape
    if direct:
        return out.unsqueeze(2), out  # strides of out; mid_lse unused
    mid_o, mid_lse = workspace or new_workspace(bsz, heads, num_splits, dim, out.device)
    if mid_o.shape != (bsz, heads, num_splits, dim) or not mid_o.is_contiguous():
        raise ValueError(f"paged decode: workspace {tuple(mid_o.shape)} != "
                         f"{(bsz, heads, num_splits, dim)} (contiguous fp32).")
    return mid_o, mid_lse


def _merge_splits(mid_o: Any, mid_lse: Any, out: Any, block_d: int,
                  prefix: tuple[Any, Any, Any] | None = None) -> None:
    """Stage 2: merge the ``S`` partial outputs of each ``(row, head)`` (and, with ``prefix``,
    the row's shared-prefix partial) into ``out [B, H, D]``."""
    bsz, heads, num_splits, dim = mid_o.shape
    row_prefix, pre_o, pre_lse = prefix or (mid_lse, mid_o, mid_lse)  # unread without prefix
    _paged_attention_stage2[(bsz, heads)](
        mid_o, mid_lse, out, row_prefix, pre_o, pre_lse, mid_o.stride(0), mid_o.stride(1),
        mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        *_prefix_strides(prefix), HEAD_DIM=dim,
        BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        HAS_PREFIX=prefix is not None, num_warps=4, **pdl.launch_kwargs(trigger=True))


def new_workspace(batch: int, heads: int, num_splits: int, dim: int,
                  device: Any) -> tuple[Any, Any]:
    """``(mid_o [B, H, S, D], mid_lse [B, H, S])`` fp32 partial outputs and log-sum-exps."""
    return (torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=device),
            torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device))


def _check(q: Any, k_cache: Any, v_cache: Any, heads: int, kv_heads: int, block_n: int,
           kernel: str = "v1") -> None:
    if kernel not in KERNELS:
        raise ValueError(f"paged decode: kernel={kernel!r}; choose one of {list(KERNELS)}.")
    if (heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1]
            or not q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"paged decode: q {tuple(q.shape)} {q.dtype} vs k/v pool "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}: need H % H_kv == 0 and equal "
                         "head dims and dtypes.")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged decode: q and the k/v pools need unit stride on the head dim.")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged decode: BLOCK_N={block_n} must be a power of 2 >= 16.")
