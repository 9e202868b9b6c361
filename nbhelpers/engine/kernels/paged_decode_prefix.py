"""Shared-prefix decode attention: a GRPO group's prompt pages read once for all its samples.

Why: GRPO decodes ``num_generations`` samples of each prompt together, and the engine prefills
the prompt once and shares its full pages between the samples (``scheduler._allocate_group``).
The split-KV kernel (:mod:`.paged_decode_kernel`) still reads those pages once per sample: at 8
prompts x 8 samples, a ~150-token prompt and ~256 generated tokens, 7/8 of the prompt reads
(about a third of all KV bytes of the step) are repeats of pages another program just read.

What: ``paged_decode_prefix`` runs one program per ``(group, kv head)``. Its ``tl.dot`` tile
holds the q heads of that kv head for every member row of the group (``GMAX`` rows x ``H / H_kv``
heads: 8 x 4 = 32 rows for Qwen3-4B), walks the group's shared pages (positions ``[0,
group_len[g])`` through the first member's block table) with the online softmax, and writes
each member's normalised partial output ``pre_o [B, H, D]`` and log-sum-exp ``pre_lse [B, H]``
(fp32). The split-KV kernel then attends row ``b`` from ``row_prefix[b]`` on and merges the
prefix partial (stage 2's formula over one more partial: in stage 1 when it writes the output
directly, in stage 2 otherwise). Rows outside any group have ``row_prefix[b] == 0`` and their
prefix partial weighs 0. Same math as one pass over all keys, another summation order.

This is the two-level ("cascade") attention of Hydragen (Juravsky et al. 2024, "Hydragen:
High-Throughput LLM Inference with Shared Prefixes": the shared prefix's attention batched over
the queries of every sequence that shares it, merged by log-sum-exp) and FlashInfer's
``MultiLevelCascadeAttentionWrapper`` / ``merge_state`` (``include/flashinfer/attention/
cascade.cuh``); vLLM's cascade attention (``vllm/v1/attention/backends/flash_attn.py``,
``use_cascade_attention``) does it only for a prefix common to the whole batch, which 8 different
prompts never have. Here the groups are per prompt and the group table is device data, so one
CUDA graph per batch bucket serves any grouping.

Group table (:class:`PrefixGroups`, static shapes per bucket for CUDA graphs; rewritten before
each decode window by :func:`load_groups` from :func:`.paged_decode_plan.plan_prefix_groups`):
``group_rows [G, GMAX]`` int32 member rows (``-1`` pads; the first is the block table read),
``group_len [G]`` int32 shared tokens (``0``: an unused slot, its programs exit),
``row_prefix [B]`` int32. ``G = B // 2`` (a group has at least two rows).

PDL (:mod:`.pdl`): wait first (q and the KV written by the q/k/RoPE kernel), then let the
split-KV kernel launch at once: its programs read q and the KV (complete: this grid passed its
wait) and walk the rows' own pages while these programs walk the shared ones, and wait for this
grid only before they merge and store (``HAS_PREFIX`` in ``_paged_attention_stage1``). The
first GPU A/B (H100, 2026-12-07, step ``s25p``) launched it after the prefix loop and waited
at its start: the two ran one after the other and the step lost 0.18 ms at batch 64.

Run: ``TRITON_INTERPRET=1 pytest tests/engine/test_paged_decode_prefix.py`` (CPU interpreter).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.paged_decode_kernel import _kv_tiles
from nbhelpers.engine.kernels.paged_decode_plan import default_block_n

GROUP_MAX = 8
"""Member rows per group slot (``GMAX``): a prompt's samples beyond it form further slots (each
reads the prefix once). 8 is TRL's common ``num_generations``; with Qwen3-4B's 4 q heads a kv
head the tile has 32 rows."""


class PrefixGroups(NamedTuple):
    """One batch bucket's group table and prefix partials (module docstring for the fields)."""

    group_rows: Any  # [G, GMAX] int32
    group_len: Any  # [G] int32
    row_prefix: Any  # [B] int32
    pre_o: Any  # [B, H, D] fp32
    pre_lse: Any  # [B, H] fp32


def new_prefix_groups(batch: int, heads: int, dim: int, device: Any,
                      group_max: int = GROUP_MAX) -> PrefixGroups:
    """An empty table (no groups: every ``row_prefix`` 0) for a ``batch``-row bucket."""
    if batch < 1 or group_max < 4:
        raise ValueError(f"new_prefix_groups: batch={batch}, group_max={group_max}; need "
                         "batch >= 1 and group_max >= 4 (plan_prefix_groups).")
    slots = max(1, batch // 2)
    i32 = {"dtype": torch.int32, "device": device}
    return PrefixGroups(torch.full((slots, group_max), -1, **i32), torch.zeros(slots, **i32),
                        torch.zeros(batch, **i32),
                        torch.zeros(batch, heads, dim, dtype=torch.float32, device=device),
                        torch.zeros(batch, heads, dtype=torch.float32, device=device))


def load_groups(groups: PrefixGroups, plan: tuple[list[list[int]], list[int], list[int]]
                ) -> None:
    """Write a :func:`.paged_decode_plan.plan_prefix_groups` result into ``groups`` in place
    (host -> device copies; the captured graph keeps reading the same tensors).

    Raises:
        ValueError: more groups, members or rows than the table holds.
    """
    rows, lens, row_prefix = plan
    slots, gmax = groups.group_rows.shape
    if len(rows) > slots or any(len(r) > gmax for r in rows) or (
            len(row_prefix) > groups.row_prefix.shape[0]):
        raise ValueError(f"load_groups: {len(rows)} groups (largest {max(map(len, rows), default=0)}"
                         f" rows) and {len(row_prefix)} rows do not fit a table of {slots} x "
                         f"{gmax} for {groups.row_prefix.shape[0]} rows; plan with "
                         f"group_max={gmax} and at most {groups.row_prefix.shape[0]} rows.")
    table = [r + [-1] * (gmax - len(r)) for r in rows] + [[-1] * gmax] * (slots - len(rows))
    groups.group_rows.copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
    groups.group_len.copy_(torch.tensor(lens + [0] * (slots - len(lens)), dtype=torch.int32),
                           non_blocking=True)
    pad = groups.row_prefix.shape[0] - len(row_prefix)
    groups.row_prefix.copy_(torch.tensor(row_prefix + [0] * pad, dtype=torch.int32),
                            non_blocking=True)


def clear_groups(groups: PrefixGroups) -> None:
    """No groups (every row attends to all its keys in the split-KV kernel)."""
    groups.group_rows.fill_(-1)
    groups.group_len.zero_()
    groups.row_prefix.zero_()


@triton.jit
def _paged_attention_prefix(Q, K, V, BlockTable, GroupRows, GroupLen, PreO, PreLse, scale,
            soft_cap, stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
            stride_bt, stride_gr, stride_pb, stride_ph, stride_plb, stride_plh,
            GROUP: tl.constexpr, GMAX: tl.constexpr, BLOCK_H: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGE_SIZE: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
            USE_GDC: tl.constexpr):
    """One program per ``(group slot, kv head)``: tile row ``i`` is member ``i // GROUP``'s q
    head ``kvh * GROUP + i % GROUP``; the group's ``group_len`` shared keys through the first
    member's block table; each member's partial and log-sum-exp out."""
    if USE_GDC:  # q and the KV come from the q/k/RoPE kernel; then the split-KV grid may
        tl.extra.cuda.gdc_wait()  # launch and run its per-row loops beside this one
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    plen = tl.load(GroupLen + g).to(tl.int32)
    if plen > 0:
        offs_h = tl.arange(0, BLOCK_H)
        member = offs_h // GROUP
        rows = tl.load(GroupRows + g * stride_gr + member, mask=member < GMAX, other=-1)
        mask_h = rows >= 0
        rows = tl.where(mask_h, rows, 0).to(tl.int64)
        heads = kvh * GROUP + offs_h % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        mask_hd = mask_h[:, None] & mask_d[None, :]
        q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_hd, other=0.0)  # [BLOCK_H, BLOCK_D]
        lead = tl.load(GroupRows + g * stride_gr).to(tl.int64)
        zero = plen * 0
        m_i, l_i, acc = _kv_tiles(q, K, V, BlockTable + lead * stride_bt, kvh, zero,
                                  tl.cdiv(plen, BLOCK_N), plen, zero, offs_d, mask_d, stride_kh,
                                  stride_ks, stride_vh, stride_vs, scale, soft_cap, BLOCK_H,
                                  BLOCK_D, BLOCK_N, PAGE_SIZE, USE_SOFT_CAP, DOT_PRECISION)
        tl.store(PreO + rows[:, None] * stride_pb + heads[:, None] * stride_ph + offs_d[None, :],
                 acc / l_i[:, None], mask=mask_hd)  # l_i > 0: plen >= 1 key every row sees
        tl.store(PreLse + rows * stride_plb + heads * stride_plh, m_i + tl.log(l_i),
                 mask=mask_h)


def paged_decode_prefix(q: Any, k_cache: Any, v_cache: Any, block_table: Any,
                        groups: PrefixGroups, scale: float, page_size: int,
                        soft_cap: float | None = None, block_n: int | None = None,
                        num_warps: int = 4, num_stages: int = 2) -> None:
    """Fill ``groups.pre_o [B, H, D]`` / ``groups.pre_lse [B, H]`` for the member rows of every
    group of ``groups`` (module docstring); ``q [B, H, D]``, pools and ``block_table`` as
    :func:`.paged_decode_kernel.paged_decode_attention`. Rows of no group are not written.

    Raises:
        ValueError: ``groups`` built for another batch, head count or head dim than ``q``.
    """
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if groups.pre_o.shape != (bsz, heads, dim):
        raise ValueError(f"paged decode prefix: groups for {tuple(groups.pre_o.shape)} "
                         f"(rows, heads, head dim), q is {tuple(q.shape)}; build them with "
                         "new_prefix_groups(B, H, D, device) for this bucket.")
    slots, gmax = groups.group_rows.shape
    group = heads // kv_heads
    block_n = block_n or default_block_n(dim)
    _paged_attention_prefix[(slots, kv_heads)](
        q, k_cache, v_cache, block_table, groups.group_rows, groups.group_len, groups.pre_o,
        groups.pre_lse, scale, soft_cap or 1.0, q.stride(0), q.stride(1), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        groups.group_rows.stride(0), groups.pre_o.stride(0), groups.pre_o.stride(1),
        groups.pre_lse.stride(0), groups.pre_lse.stride(1), GROUP=group, GMAX=gmax,
        BLOCK_H=max(16, triton.next_power_of_2(group * gmax)), HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(max(dim, 16)), BLOCK_N=block_n, PAGE_SIZE=page_size,
        USE_SOFT_CAP=bool(soft_cap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=num_stages, **pdl.launch_kwargs())
