"""Host-side batch preparation of :class:`nbhelpers.engine.model_runner.ModelRunner`.

:func:`pack_prefill` packs the admitted prompts into one query sequence (token ids, positions,
row ids, KV slots; padded where a shape costs a compile); :func:`prefill_attention_batch` builds
the per-layer prefill masks (document-causal paged BlockMask for flex, page spans for SDPA);
:func:`flex_prefill_tensors` / :func:`flex_prefill_masks` are its flex half in two steps (the
CUDA-graph prefill of ``prefill_graphs.py`` fills static copies of the tensors); :func:`layer_masks`
builds one mask per distinct layer mask (prefill and decode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbhelpers.engine.attention import prefill_block_mask, prefill_pages, prefill_sdpa_mask
from nbhelpers.engine.kv_cache import phys_to_logical
from nbhelpers.engine.layers import AttnBatch
from nbhelpers.engine.prefill_fa4 import fa4_prefill_plan
from nbhelpers.engine.scheduler import Sequence


def pack_prefill(seqs: list[Sequence], opt: Any,
                 pad_prefill: bool) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(ids, pos, rows, slots)`` of the packed prompts, each of one length ``N``; with
    ``pad_prefill`` padded to a multiple of ``opt.prefill_pad`` (1024 past 8 of them) by
    token 0, position 0, row -1 and slot 0 (the null page)."""
    ids, pos, rows, slots, ps = [], [], [], [], opt.page_size
    for r, seq in enumerate(seqs):
        n = seq.num_tokens
        ids += seq.tokens
        pos += list(range(n))
        rows += [r] * n
        slots += [seq.block_table[p // ps] * ps + p % ps for p in range(n)]
    unit = opt.prefill_pad if len(ids) <= 8 * opt.prefill_pad else 1024
    pad = (-len(ids)) % unit if pad_prefill else 0  # few compiled shapes
    return ids + [0] * pad, pos + [0] * pad, rows + [-1] * pad, slots + [0] * pad


def prefill_attention_batch(model: Any, opt: Any, seqs: list[Sequence], rows: list[int],
                            pos: list[int], attention: str, max_pages: int,
                            kv: Any) -> AttnBatch:
    """Per-layer prefill masks for the packed batch of ``seqs`` (``rows``/``pos`` from
    :func:`pack_prefill`): SDPA page spans when ``attention == "sdpa"``, FA4 varlen plans
    (``prefill_fa4.fa4_prefill_plan``) when ``"fa4"``, else flex BlockMasks (with
    ``opt.prefill_kernel_options`` on CUDA) over the pool ``kv``."""
    dev, ps, n_rows = model.device, opt.page_size, len(seqs)
    tables = [s.block_table for s in seqs]
    if attention in ("sdpa", "fa4"):
        ends = [sum(s.num_tokens for s in seqs[:i + 1]) for i in range(n_rows)]
        spans = list(zip([0] + ends[:-1], ends))
        plan = prefill_sdpa_mask if attention == "sdpa" else fa4_prefill_plan
        return layer_masks(model, lambda extra: plan(
            tables, spans, [0] * n_rows, ps, dev, extra), is_decode=False)
    return flex_prefill_masks(model, opt, flex_prefill_tensors(opt, seqs, rows, pos, max_pages,
                                                                  dev), kv)


def flex_prefill_tensors(opt: Any, seqs: list[Sequence], rows: list[int], pos: list[int],
                         max_pages: int, device: Any) -> dict[str, Any]:
    """The tensors of the flex prefill BlockMask of the packed ``seqs`` (``rows``/``pos`` from
    :func:`pack_prefill`, ``T`` tokens, ``R = len(seqs)``), on ``device``: ``p2l [R + 1,
    num_pages]`` int64 inverse page tables (last row all -1: padding), ``q_row [T]`` int64 (padding
    -> ``R``), ``q_pos [T]`` int64, ``counts [ceil(T / 128)]`` int32 and ``lists [ceil(T / 128),
    num_pages]`` int32 (``attention.prefill_pages``). Shapes depend on ``(T, R)`` only."""
    import torch
    n_rows, tables = len(seqs), [s.block_table for s in seqs]
    bt = torch.zeros(n_rows + 1, max_pages, dtype=torch.long)
    for r, t in enumerate(tables):
        bt[r, :len(t)] = torch.tensor(t)
    used = torch.tensor([len(t) for t in tables] + [0])
    counts, lists = prefill_pages(rows, pos, tables, opt.page_size, opt.num_pages)
    return {"p2l": phys_to_logical(bt, used, opt.num_pages).to(device),
            "q_row": torch.tensor([r if r >= 0 else n_rows for r in rows], device=device),
            "q_pos": torch.tensor(pos, device=device),
            "counts": torch.tensor(counts, dtype=torch.int32, device=device),
            "lists": torch.tensor(lists, dtype=torch.int32, device=device)}


def flex_prefill_masks(model: Any, opt: Any, t: dict[str, Any], kv: Any) -> AttnBatch:
    """:class:`AttnBatch` of flex prefill BlockMasks over the pool ``kv`` from the tensors ``t``
    of :func:`flex_prefill_tensors` (on ``model.device``; the masks hold views of them, so new
    values copied into ``t`` reach the masks: ``prefill_graphs.py``), with
    ``opt.prefill_kernel_options`` on CUDA."""
    dev = model.device
    return layer_masks(model, lambda extra: prefill_block_mask(
        t["p2l"], t["q_row"], t["q_pos"], t["counts"], t["lists"], opt.page_size, kv.num_slots,
        extra), is_decode=False, kernel_options=opt.prefill_kernel_options
        if dev.type == "cuda" else None)


def layer_masks(model: Any, build: Callable[[Any], Any], is_decode: bool,
                kernel_options: Any = None) -> AttnBatch:
    """:class:`AttnBatch` with ``build(extra)`` per layer, built once per distinct layer mask
    ``model.spec.mask_for_layer(i)`` (``None``, or e.g. a sliding window)."""
    cache: dict[int, Any] = {}
    masks = []
    for i in range(len(model.layers)):
        extra = model.spec.mask_for_layer(i)
        if id(extra) not in cache:
            cache[id(extra)] = build(extra)
        masks.append(cache[id(extra)])
    return AttnBatch(masks, is_decode, kernel_options)
