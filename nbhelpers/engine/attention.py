"""Mask and score factories (attention-gym style) and the paged flex_attention BlockMasks.

Contract: a *logical mask* is ``f(q_pos, kv_pos) -> bool tensor`` over token positions of one
request (``causal`` is always applied; a model adds e.g. ``sliding_window(w)``); a *score mod* is
flex_attention's ``score_mod(score, b, h, q_idx, kv_idx)`` (e.g. ``soft_cap(c)``). The paged
wrappers here turn a logical mask into a mask over physical KV slots through the
``phys_to_logical`` table (see ``kv_cache.py``), after torch's ``convert_logical_block_mask``
(torch/nn/attention/experimental/_paged_attention.py) and attention-gym's ``mask_mod`` factories
(github.com/meta-pytorch/attention-gym, ``attn_gym/masks``).

Prefill packs several prompts in one query sequence (``q: [1, H, T, D]``, document-causal by
``q_row``); decode puts one query per row in the batch dimension (``q: [B, H, 1, D]``) against the
shared pool (``k: [1, H_kv, S, D]``, broadcast over B) with ``kv_indices = block_table``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LogicalMask = Callable[[Any, Any], Any]


def sliding_window(window: int) -> LogicalMask:
    """Keep keys less than ``window`` positions behind the query (Gemma/Mistral sliding layers).

    The closure carries ``.window`` so non-flex kernels (``paged_decode.py``) can read it.
    """
    def mask(q_pos: Any, kv_pos: Any) -> Any:
        return q_pos - kv_pos < window
    mask.window = window  # type: ignore[attr-defined]
    return mask


def soft_cap(cap: float) -> Callable[..., Any]:
    """score_mod ``cap * tanh(score / cap)`` (Gemma-2 attention logit soft-cap); ``.cap`` = cap."""
    import torch

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)
    score_mod.cap = cap  # type: ignore[attr-defined]
    return score_mod


def _paged_mask(p2l: Any, page_size: int, row_of: Callable, pos_of: Callable,
                extra: LogicalMask | None) -> Callable:
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        row, q_pos = row_of(b, q_idx), pos_of(b, q_idx)
        lpage = p2l[row, kv_idx // page_size]
        kv_pos = lpage * page_size + kv_idx % page_size
        keep = (lpage >= 0) & (kv_pos <= q_pos)
        return keep & extra(q_pos, kv_pos) if extra is not None else keep
    return mask_mod


def prefill_block_mask(p2l: Any, q_row: Any, q_pos: Any, kv_num_blocks: Any, kv_indices: Any,
                       page_size: int, num_slots: int, extra: LogicalMask | None = None,
                       q_block: int = 128) -> Any:
    """Document-causal BlockMask for packed prefill, from host-computed page lists.

    Args:
        p2l: ``[R + 1, num_pages]`` inverse page tables (last row all -1, used by padding).
        q_row: ``[T]`` row of each packed token (padding -> ``R``); q_pos: ``[T]`` positions.
        kv_num_blocks: ``[T // q_block]`` int32, kv_indices ``[T // q_block, K]`` int32: the
            physical pages each query block may read (see :func:`prefill_pages`).
    Returns: a ``BlockMask`` of shape ``(1, 1, T, num_slots)``; no dense ``T x S`` mask is built.
    """
    from torch.nn.attention.flex_attention import BlockMask
    mm = _paged_mask(p2l, page_size, lambda b, q: q_row[q], lambda b, q: q_pos[q], extra)
    return BlockMask.from_kv_blocks(kv_num_blocks.view(1, 1, -1), kv_indices.view(1, 1,
                                    *kv_indices.shape), BLOCK_SIZE=(q_block, page_size),
                                    mask_mod=mm, seq_lengths=(q_row.shape[0], num_slots),
                                    compute_q_blocks=False)


def prefill_pages(rows: list[int], positions: list[int], block_tables: list[list[int]],
                  page_size: int, num_pages: int,
                  q_block: int = 128) -> tuple[list[int], list[list[int]]]:
    """Host-side page lists per query block: pages of every row present, up to its max position.

    Args: ``rows``/``positions`` per packed token (padding rows are ``-1``), ``block_tables`` per
    row. Returns ``(kv_num_blocks, kv_indices)``, each list padded with the null page 0 to
    ``num_pages`` entries (the compiled kernel wants kv_indices as wide as the KV length).
    """
    counts, lists = [], []
    for start in range(0, len(rows), q_block):
        need: dict[int, int] = {}
        for r, p in zip(rows[start:start + q_block], positions[start:start + q_block]):
            if r >= 0:
                need[r] = max(need.get(r, 0), p // page_size + 1)
        pages = [pg for r, n in need.items() for pg in block_tables[r][:n]]
        counts.append(len(pages))
        lists.append(pages)
    width = num_pages
    return counts, [pg + [0] * (width - len(pg)) for pg in lists]


def decode_block_mask(p2l: Any, block_table: Any, num_pages_used: Any, pos: Any, page_size: int,
                      num_slots: int, extra: LogicalMask | None = None) -> Any:
    """Decode BlockMask from the page table, built on the device with no host sync.

    ``kv_indices[b] = block_table[b]`` and ``kv_num_blocks[b] = num_pages_used[b]`` visit exactly
    the row's pages; the mask_mod hides slots past ``pos[b]`` in the last page.
    Shapes: ``block_table [B, max_pages]``, ``num_pages_used/pos [B]``; BlockMask ``(B, 1, 1, S)``.
    """
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    rows, width = block_table.shape
    mm = _paged_mask(p2l, page_size, lambda b, q: b, lambda b, q: pos[b], extra)
    # the compiled kernel wants kv_indices as wide as the KV length in blocks (inductor asserts it)
    wide = torch.nn.functional.pad(block_table, (0, num_slots // page_size - width))
    return BlockMask.from_kv_blocks(num_pages_used.view(rows, 1, 1).int(),  # [B, H, Q_blocks]
                                    wide.view(rows, 1, 1, -1).int(), BLOCK_SIZE=page_size,
                                    mask_mod=mm, seq_lengths=(1, num_slots),
                                    compute_q_blocks=False)  # forward only; kv_indices is
    # narrower than the page count, which the q-block transpose cannot take
