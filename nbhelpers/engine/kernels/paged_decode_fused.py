"""Kernel "fused" of the paged decode attention: split-KV in one launch, splits merged in-kernel.

What: the same attention as kernels "v1"/"v2" (:mod:`.paged_decode`; ``q [B, H, D]`` against the
paged pool ``[1, H_kv, num_slots, D]`` through ``block_table [B, max_pages]``, ``seq_lens [B]``,
sliding window, soft-cap; output ``[B, H, D]`` in q's dtype), with the same stage-1 program
(GQA-packed ``tl.dot`` tiles, online softmax over ``BLOCK_N``-token tiles, the helpers of
:mod:`.paged_decode_kernel`), but no stage-2 kernel: each ``(row, kv head, split)`` program
writes its normalised partial output and log-sum-exp to the workspace, then takes a ticket
(``tl.atomic_add`` on a per-``(row, kv head)`` counter, ``acq_rel``) and the program that draws
the last ticket merges the ``S`` partials of its ``H / H_kv`` heads (``out = sum_s exp(lse_s - m)
o_s / sum_s exp(lse_s - m)``) and resets the counter to 0 for the next call. That is the serial
split-K fix-up of :mod:`.skinny_gemm` (CUTLASS ``Semaphore``, ``SplitKSerial``; the Stream-K
fix-up, arXiv:2301.03598) applied to flash-decoding's combine step, which vLLM
(``reduce_segments`` of ``vllm/v1/attention/ops/triton_unified_attention.py``), SGLang
(``_fwd_kernel_stage2`` of ``triton_ops/decode_attention.py``) and FlashAttention
(``flash_fwd_splitkv_combine``) run as a second kernel. ``S == 1`` writes the output directly.

Why: at the GRPO rollout shapes the kernel is latency-bound, not bandwidth-bound (H200,
2026-12-01, Qwen3-4B, 36 layers: 0.26-0.31 ms a step at batch 4 against a 0.06-0.09 ms KV
floor; ~8 us a layer of fixed cost at batch 32): the stage-2 launch, its ramp and its wait for
the whole stage-1 grid are part of that fixed cost. Here a row's merge starts as soon as its
own splits are done, while other programs still stream K/V.

PDL (``USE_GDC``, :mod:`.pdl`): the row's ``seq_len`` (hence its split bounds) is loaded *before*
``gdc_wait()``, through L2 (``.cg``). Sound for the engine's call: ``seq_lens`` is ``pos + 1``,
computed at the start of the decode step, many kernels before any attention kernel, and a
PDL launch only overlaps the kernel right before it, whose programs start our grid only after
their own ``gdc_wait()`` (so every kernel before that one has completed and flushed). q, the
K/V pool (the new token's K/V comes from the previous kernel), the block table lookups, the
workspace and the counters are touched only after the wait.

Contract of the counters: ``int32 [B * H_kv]`` zeros before the first call; every call leaves
them at 0 (calls must be stream-ordered, as the engine's are). CUDA graphs: no host sync, no
allocation when ``workspace`` and ``counters`` are given (:class:`.paged_decode.PagedDecode`
keeps one of each per batch bucket, shared by all layers).
Requires ``triton`` (imported at module import).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.paged_decode_kernel import (
    _kv_tiles,
    _split_tiles,
)


@triton.jit
def _merge_group(MidO, MidLse, Out, b, kvh, stride_mb, stride_mh, stride_ms, stride_lb,
                 stride_lh, stride_ob, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the ``NUM_SPLITS`` partials of the ``GROUP`` heads of ``(b, kvh)`` into ``Out``
    (log-sum-exp weights; empty splits have ``lse = -inf``, weight 0). Loads go through L2
    (``.cg``): the partials were written by other programs."""
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for g in tl.static_range(GROUP):
        h = kvh * GROUP + g
        lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                      other=float("-inf"), cache_modifier=".cg")
        o = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms
                    + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0,
                    cache_modifier=".cg")  # [BLOCK_S, BLOCK_D]
        w = tl.exp(lse - tl.max(lse, 0))
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
                 mask=mask_d)


@triton.jit
def _paged_attention_fused(Q, K, V, BlockTable, SeqLens, MidO, MidLse, Counters, Out, scale,
            soft_cap, window,
            stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
            stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, USE_WINDOW: tl.constexpr,
            USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
            MIN_SPLIT_TILES: tl.constexpr, USE_GDC: tl.constexpr):
    """One program per ``(row, kv head, split)``: the stage-1 loop of
    :func:`.paged_decode_kernel._paged_attention_stage1`, then (``NUM_SPLITS > 1``) partial +
    ticket + merge by the last program, or (``NUM_SPLITS == 1``) the output itself."""
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b, cache_modifier=".cg").to(tl.int32)  # before the wait: doc
    lo, s_lo, s_hi = _split_tiles(seq_len, window, split, BLOCK_N, NUM_SPLITS, USE_WINDOW,
                                  MIN_SPLIT_TILES)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_hd,
                other=0.0)  # [BLOCK_H, BLOCK_D]
    m_i, l_i, acc = _kv_tiles(q, K, V, BlockTable + b * stride_bt, kvh, s_lo, s_hi, seq_len, lo,
                              offs_d, mask_d, stride_kh, stride_ks, stride_vh, stride_vs, scale,
                              soft_cap, BLOCK_H, BLOCK_D, BLOCK_N, PAGE_SIZE, USE_SOFT_CAP,
                              DOT_PRECISION)
    if USE_GDC:  # KV loop done: the next kernel may start its prologue
        tl.extra.cuda.gdc_launch_dependents()
    has = l_i > 0  # False for an empty split (more splits than the row's tiles)
    l_safe = tl.where(has, l_i, 1.0)
    if NUM_SPLITS == 1:
        out = Out + b * stride_ob + heads * stride_oh
        tl.store(out[:, None] + offs_d[None, :], (acc / l_safe[:, None]).to(Out.dtype.element_ty),
                 mask=mask_hd)
    else:
        mid = MidO + b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(mid[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=mask_hd)
        lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)
        tl.debug_barrier()  # all threads' stores precede the release (CUTLASS Semaphore)
        counter = Counters + b * tl.num_programs(1) + kvh
        ticket = tl.atomic_add(counter, 1, sem="acq_rel")
        if ticket == NUM_SPLITS - 1:  # the last split of (b, kvh): merge, then reset
            _merge_group(MidO, MidLse, Out, b, kvh, stride_mb, stride_mh, stride_ms, stride_lb,
                         stride_lh, stride_ob, stride_oh, GROUP, HEAD_DIM, BLOCK_D, NUM_SPLITS,
                         BLOCK_S)
            tl.atomic_xchg(counter, 0)  # ready for the next call (graph replays too)


def new_counters(batch: int, kv_heads: int, device: Any) -> Any:
    """``int32 [B * H_kv]`` zeros: the tickets of kernel "fused" (left at 0 by every call)."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


def paged_decode_fused(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any,
                       scale: float, page_size: int, num_splits: int, sliding_window: int | None,
                       soft_cap: float | None, workspace: tuple[Any, Any] | None,
                       counters: Any, block_n: int, num_warps: int, num_stages: int,
                       min_split_tokens: int) -> Any:
    """Launch kernel "fused"; arguments as :func:`.paged_decode_kernel.paged_decode_attention`
    (which checks them and calls this), plus ``counters`` (:func:`new_counters`; ``None`` =
    allocate here). Returns ``[B, H, D]`` in q's dtype.

    Raises:
        ValueError: ``counters`` not ``int32 [B * H_kv]``; a workspace that does not fit.
    """
    from nbhelpers.engine.kernels.paged_decode_kernel import _mid_buffers
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    direct = num_splits == 1
    mid_o, mid_lse = _mid_buffers(out, workspace, num_splits, direct)
    if counters is None:
        counters = new_counters(bsz, kv_heads, q.device)
    if counters.dtype != torch.int32 or counters.numel() < bsz * kv_heads:
        raise ValueError(f"paged decode fused: counters {counters.dtype} [{counters.numel()}] "
                         f"must be int32 with >= B * H_kv = {bsz * kv_heads} zeros "
                         "(new_counters).")
    group = heads // kv_heads
    _paged_attention_fused[(bsz, kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse, counters, out, scale,
        soft_cap or 1.0, sliding_window or 0, q.stride(0), q.stride(1), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(max(dim, 16)), BLOCK_N=block_n, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        USE_WINDOW=bool(sliding_window), USE_SOFT_CAP=bool(soft_cap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MIN_SPLIT_TILES=max(1, min_split_tokens // block_n), num_warps=num_warps,
        num_stages=num_stages, **pdl.launch_kwargs())
    return out
