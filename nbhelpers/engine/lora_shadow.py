"""Shadow copies for ``lora_dtype="model"`` (:meth:`nbhelpers.engine.lora.LiveGroup.set_lora_dtype`).

TRL's GRPO trains PEFT adapters in fp32 on a bf16 base (``autocast_adapter_dtype=True``). Read
as fp32 every decode step they cost an fp32 GEMM or a cast per projection (H200, Qwen3-4B, batch
4: +2.1 ms a step over cuBLAS alone, against +0.5 ms for bf16 adapters;
``scripts/device/ab_lora_gemm.py``, 2026-12-01). Here A's rows are cast once into the group's base
weight buffer ``[sum(out) + sum(r), in]`` (one GEMM then gives ``y`` and ``xa``, as for 16-bit
adapters) and B into bf16 tensors beside it; the copies are refreshed when any of the trainer's
tensors changed, read from their ``_version`` counters (every in-place op, an optimizer step
included, bumps them), so an optimizer step is seen by the next rollout with no user call.
Replaced storage (``.data =``) changes ``data_ptr`` and the group fuses again. vLLM likewise runs
LoRA in the model dtype (its LoRA weights are copied into model-dtype slots).
"""

from __future__ import annotations

from typing import Any


def fuse_shadow(parts: list[Any], ws: list[Any], a_list: list[Any]) -> dict[str, Any]:
    """The fused-buffer dict of :meth:`LiveGroup._fuse_storage` with shadows.

    ``parts``: the group's ``LiveLinear`` parts (all with LoRA, one scaling); ``ws``: their base
    weights ``[out_i, in]`` (16-bit, re-pointed into the new buffer's first rows, as ``_repoint``
    does); ``a_list``: their fp32 A ``[r_i, in]`` (left alone). Returns ``W [sum(out) + sum(r),
    in]``, ``B`` (bf16 copies ``[out_i, r_i]``) and ``shadow = (sources, copies)``.
    """
    import torch
    b_list = [p.lora_tensors()[1] for p in parts]
    n_out = sum(w.shape[0] for w in ws)
    with torch.no_grad():
        buf = torch.cat([w.detach() for w in ws] + [a.detach().to(ws[0].dtype) for a in a_list])
        start = 0
        for w in ws:
            w.data = buf[start:start + w.shape[0]]
            start += w.shape[0]
        b_dst = [b.detach().to(ws[0].dtype) for b in b_list]
    a_dst = list(buf[n_out:].split([a.shape[0] for a in a_list], 0))
    return {"W": buf, "ext": True, "n_out": n_out, "lora": True, "bias": None, "A": None,
            "B": b_dst, "scaling": parts[0].lora_tensors()[2],
            "shadow": (a_list + b_list, a_dst + b_dst)}


def lora_versions(parts: list[Any]) -> tuple[int, ...]:
    """The ``_version`` counters of every part's LoRA A and B (host-side, no device work)."""
    return tuple(t._version for p in parts if p.has_lora for t in p.lora_tensors()[:2])


def refresh_shadow(fused: dict[str, Any], parts: list[Any], versions: tuple) -> tuple:
    """Copy the trainer's A and B into the shadows (one ``_foreach_copy_``, casting) if any
    version differs from ``versions``; returns the current versions."""
    now, stale = stale_shadow(fused, parts, versions)
    if stale is not None:
        copy_shadows([stale])
    return now


def stale_shadow(fused: dict[str, Any], parts: list[Any],
                 versions: tuple) -> tuple[tuple, tuple[list, list] | None]:
    """``(current versions, (sources, shadows) to copy or None when all are current)``; the
    caller copies them (:func:`copy_shadows`) before the shadows are read."""
    now = lora_versions(parts)
    return now, (fused["shadow"] if now != versions else None)


def copy_shadows(pairs: list[tuple[list, list]]) -> None:
    """One ``_foreach_copy_`` (casting fp32 -> the shadows' dtype) over every ``(sources,
    shadows)`` pair: the runner refreshes all stale groups of a model in one call (one dispatch
    instead of one per group; 144 for Qwen3-4B: ``scripts/count_prefill_ops.py``)."""
    import torch
    src = [t for s, _ in pairs for t in s]
    dst = [t for _, d in pairs for t in d]
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


def refresh_all(groups: list[Any]) -> None:
    """``LiveGroup.refresh`` for every group (``engine/lora.py``), with all stale shadow copies
    (``lora_dtype="model"``) in one ``_foreach_copy_`` (:func:`copy_shadows`)."""
    copy_shadows([p for g in groups if (p := g.stale_shadows()) is not None])
