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


# ---------------------------------------------------------------- SDPA path (CPU default)
class SdpaMask:
    """One step's attention plan for ``torch.nn.functional.scaled_dot_product_attention``: the
    paged keys each query may see, gathered through the block table, plus a boolean mask.

    It stands in a layer's ``AttnBatch.block_masks`` slot; :func:`paged_attention` routes a call
    whose ``block_mask`` is an ``SdpaMask`` here instead of flex_attention, so every model's
    attention call site is unchanged. Unlike eager flex_attention (which materialises scores over
    the whole pool, ``S = num_pages * page_size`` slots), it reads only the rows' own pages.

    Fields: ``slots [B, L]`` physical slots gathered per query row group (decode: ``B`` rows, one
    query each; prefill: one entry per packed request); ``mask [B, 1, Q, L]`` bool or ``None``
    (causal via ``is_causal``); ``lengths``: prefill keys per request; ``spans``: prefill ``(start, end)`` of each request's queries in
    the packed sequence (``None`` for decode). Sliding windows (``sliding_window``'s ``.window``)
    go into ``mask``; flex ``score_mod``s cannot be expressed (:func:`sdpa_supports`).
    """

    def __init__(self, slots: Any, mask: Any, spans: list[tuple[int, int]] | None = None,
                 causal: list[bool] | None = None, lengths: list[int] | None = None):
        self.slots, self.mask, self.spans, self.causal = slots, mask, spans, causal
        self.lengths = lengths  # prefill: keys per request

    def attend(self, q: Any, k_cache: Any, v_cache: Any, scale: float) -> Any:
        """``q`` decode ``[B, H, 1, D]`` / prefill ``[1, H, T, D]``; caches ``[1, H_kv, S, D]``.
        Returns the flex-shaped output (same shape as ``q``)."""
        if self.spans is None:
            return _sdpa(q, _gather(k_cache, self.slots), _gather(v_cache, self.slots),
                         self.mask, scale, False)
        out = q.new_zeros(q.shape)  # padded packed tokens (if any) stay 0, as flex gives them
        for r, (s, e) in enumerate(self.spans):
            slots = self.slots[r:r + 1, :int(self.lengths[r])]
            mask = None if self.causal[r] else self.mask[r:r + 1, :, :e - s, :slots.shape[1]]
            out[:, :, s:e] = _sdpa(q[:, :, s:e], _gather(k_cache, slots),
                                   _gather(v_cache, slots), mask, scale, self.causal[r])
        return out


def _gather(cache: Any, slots: Any) -> Any:
    """``cache [1, H_kv, S, D]`` at ``slots [B, L]`` -> ``[B, H_kv, L, D]``."""
    b, n = slots.shape
    return cache[0].index_select(1, slots.reshape(-1)).view(
        cache.shape[1], b, n, cache.shape[3]).transpose(0, 1)


def _sdpa(q: Any, k: Any, v: Any, mask: Any, scale: float, causal: bool) -> Any:
    import torch
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


def sdpa_supports(score_mod: Any, masks: list[Any]) -> str | None:
    """``None`` when the SDPA path can run a model with this ``score_mod`` and these per-layer
    logical masks (``None`` or ``sliding_window``), else the reason it cannot."""
    if score_mod is not None:
        return f"score_mod {getattr(score_mod, '__name__', score_mod)!r} (e.g. a logit " \
               "soft-cap) has no SDPA form"
    bad = [m for m in masks if m is not None and not hasattr(m, "window")]
    return f"mask {bad[0]!r} is not a sliding window" if bad else None


def _keep(q_pos: Any, kv_pos: Any, extra: LogicalMask | None) -> Any:
    keep = kv_pos <= q_pos
    return keep & (q_pos - kv_pos < extra.window) if extra is not None else keep


def decode_sdpa_mask(block_table: Any, pos: Any, num_pages: int, page_size: int,
                     extra: LogicalMask | None = None) -> SdpaMask:
    """Decode plan: each row's first ``num_pages`` pages (host-sized for the whole decode window,
    so no device sync), keys at positions ``<= pos[b]`` (and in the window).

    Shapes: ``block_table [B, max_pages]`` (padded rows all null page), ``pos [B]``; plan slots
    ``[B, num_pages * page_size]``, mask ``[B, 1, 1, L]``.
    """
    import torch
    offs = torch.arange(page_size, device=pos.device)
    slots = (block_table[:, :num_pages, None] * page_size + offs).reshape(pos.shape[0], -1)
    kv_pos = torch.arange(slots.shape[1], device=pos.device)
    mask = _keep(pos[:, None], kv_pos[None, :], extra)
    return SdpaMask(slots, mask[:, None, None, :])


def prefill_sdpa_mask(block_tables: list[list[int]], spans: list[tuple[int, int]],
                      starts: list[int], page_size: int, device: Any,
                      extra: LogicalMask | None = None) -> SdpaMask:
    """Prefill plan: request ``r``'s queries (packed tokens ``spans[r]``, positions from
    ``starts[r]``) attend to its keys at positions ``0 .. starts[r] + len - 1``, read from the
    pool through ``block_tables[r]`` (the K/V of this step are written there first).
    ``is_causal`` where the queries start at 0 and no window cuts in, else a bool mask.
    """
    import torch
    lengths = [st + e - s for (s, e), st in zip(spans, starts)]
    width = max(lengths)
    slots = torch.zeros(len(spans), width, dtype=torch.long)
    for r, (bt, n) in enumerate(zip(block_tables, lengths)):
        p = torch.arange(n)
        slots[r, :n] = torch.tensor(bt)[p // page_size] * page_size + p % page_size
    q_len = max(e - s for s, e in spans)
    q_pos = torch.tensor(starts)[:, None] + torch.arange(q_len)[None, :]  # [R, Q]
    mask = _keep(q_pos[:, :, None], torch.arange(width)[None, None, :], extra)[:, None]
    window = getattr(extra, "window", None)
    causal = [st == 0 and (window is None or n <= window) for st, n in zip(starts, lengths)]
    return SdpaMask(slots.to(device), mask.to(device), spans, causal, lengths)


def paged_attention(flex: Callable) -> Callable:
    """flex_attention's signature over the paged pool, routing ``block_mask=SdpaMask`` plans to
    SDPA (:meth:`SdpaMask.attend`), plans tagged ``kernel == "fa4"`` (``prefill_fa4.Fa4Prefill``,
    not imported here: it imports nothing of this module either) to FlashAttention-4, and
    everything else to ``flex``.

    Raises:
        ValueError: an ``SdpaMask`` with a ``score_mod`` (the runner's auto choice avoids it).
    """
    def attention(q: Any, k: Any, v: Any, score_mod: Any = None, block_mask: Any = None,
                  scale: float | None = None, enable_gqa: bool = False, **kw: Any) -> Any:
        if getattr(block_mask, "kernel", None) == "fa4":
            return block_mask.attend(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale,
                                     score_mod)
        if isinstance(block_mask, SdpaMask):
            if score_mod is not None:
                raise ValueError("SDPA attention cannot apply a score_mod: use "
                                 "decode_attention='flex' / prefill_attention='flex'.")
            return block_mask.attend(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                    enable_gqa=enable_gqa, **kw)
    attention.flex = flex  # type: ignore[attr-defined]
    return attention
