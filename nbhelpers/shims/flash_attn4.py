"""Shim: FlashAttention-4 (``flash-attn-4``, CuTeDSL) as ``flash_attention_4`` /
``paged|flash_attention_4`` on transformers versions without native FA4 dispatch.

Why: transformers 5.x registers ``flash_attention_4`` and ``paged|flash_attention_4`` in
``AttentionInterface`` (5.17.0: ``modeling_utils.AttentionInterface._global_mapping``); older
releases (the 4.57 of Unsloth PR #5108) do not, and that PR needed two monkey-patches
(``scripts/benchmarks/flash_attn_fa4_shim.py``) for continuous batching to reach FA4. On the H200
FA4 matters only through ``hf_cb``'s ``paged|flash_attention_4`` option.

What: ``apply()`` is a no-op when both names are registered (our pin). Otherwise it registers
:func:`fa4_attention_forward`, a varlen/dense adapter over ``flash_attn.cute``'s
``flash_attn_varlen_func`` / ``flash_attn_func`` that reads transformers' CB kwargs
(``cu_seq_lens_q/k``, ``max_length_q/k``, with the ``max_seqlen_q/k`` aliases). Paged KV reads
(``block_table``) are not supported by this fallback: CB's varlen path passes contiguous K/V.

Second patch, :func:`fix_paged_varlen_call` (applied by :func:`apply` whenever FA4 is installed):
transformers 5.17's ``integrations/flash_paged.py`` ``paged_attention_forward`` (the
``paged|flash_attention_*`` prefill/varlen path of continuous batching) calls
``flash_attn_varlen_func(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_seqlen_q, max_seqlen_k, ...)``
positionally, FA2/FA3's order. flash-attn-4 4.0.0b36's ``flash_attn.cute.flash_attn_varlen_func``
has ``qv`` as its 4th parameter, so ``cu_seq_lens_q`` lands in ``qv`` and the int
``max_seqlen_q`` in ``cu_seqlens_k``: every request failed with "'int' object has no attribute
'shape'" (``assert cu_seqlens_k.shape == ...`` in ``_flash_attn_fwd``), on the H200 on
2026-12-03 (``executed/phase1_rollout/10_lora_rollout/20261203T221010Z_h200_f297e02*``, phase 1
``hf_cb_fa4``). The patch wraps the varlen function that transformers' paged import returns for an
FA4 implementation in one that passes those four by keyword. Removal condition: transformers
passes them by keyword, or FA4 moves ``qv`` after them (the wrapper is skipped then: it checks
the signature).

Install: ``pip install -e '.[fa4]'`` (research/gpu_stack.md section 4: keep FA4 in its own site
dir; cutlass-dsl needs ``site.addsitedir``). Removal condition: when the oldest supported
transformers has native FA4 (already true for 5.17.0).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from typing import Any

FA4_NAMES = ("flash_attention_4", "paged|flash_attention_4")


def fa4_installed() -> bool:
    """True when the ``flash-attn-4`` distribution (or ``flash_attn.cute``) is importable."""
    try:
        metadata.version("flash-attn-4")
        return True
    except metadata.PackageNotFoundError:
        pass
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


def native(mapping: dict[str, Any] | None = None) -> bool:
    """True when transformers' attention registry already has both FA4 names."""
    if mapping is None:
        from transformers import AttentionInterface

        mapping = AttentionInterface._global_mapping
    return all(name in mapping for name in FA4_NAMES)


def fa4_attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                          scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[Any, None]:
    """transformers attention-interface function over FA4.

    Shapes: ``query`` ``[1 or B, H, T, D]``, ``key``/``value`` ``[1 or B, H_kv, S, D]``; returns
    ``([B, T, H, D], None)``. With ``cu_seq_lens_q`` (CB varlen batches, batch dim 1) the
    sequences are packed and the varlen kernel is used; otherwise the dense causal kernel.

    Raises:
        ValueError: a padding ``attention_mask`` on the dense path (FA4 has no padding mask:
            use CB / varlen inputs) or ``dropout`` > 0.
    """
    from flash_attn import cute

    if dropout:
        raise ValueError("flash_attention_4 has no dropout: set attention_dropout=0.")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, T, H, D]
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        out = cute.flash_attn_varlen_func(
            q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=kwargs["cu_seq_lens_k"],
            max_seqlen_q=kwargs.get("max_length_q", kwargs.get("max_seqlen_q")),
            max_seqlen_k=kwargs.get("max_length_k", kwargs.get("max_seqlen_k")),
            softmax_scale=scaling, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        return out.unsqueeze(0), None
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("flash_attention_4 (dense) cannot apply a padding mask: use "
                         "continuous batching (paged|flash_attention_4) or sdpa.")
    out = cute.flash_attn_func(q, k, v, softmax_scale=scaling, causal=True)
    return (out[0] if isinstance(out, tuple) else out), None


def apply(interface: Any = None) -> bool:
    """Register :func:`fa4_attention_forward` under the FA4 names when transformers lacks them.

    Returns True when it registered. ``interface`` defaults to ``transformers.AttentionInterface``.
    Raises ``ImportError`` naming the ``fa4`` extra when registration is needed but FA4 is absent.
    """
    if interface is None:
        from transformers import AttentionInterface as interface
    if fa4_installed():
        fix_paged_varlen_call()
    if native(interface._global_mapping):
        return False
    if not fa4_installed():
        raise ImportError("flash_attention_4 needs flash-attn-4: pip install -e '.[fa4]'.")
    for name in FA4_NAMES:
        interface.register(name, fa4_attention_forward)
    return True


PAGED_VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
"""What transformers' paged path passes positionally after ``q, k, v`` (module docstring)."""


def positional_order_differs(fn: Any) -> bool:
    """True when ``fn``'s 4th to 7th parameters are not :data:`PAGED_VARLEN_ARGS` in that order
    (FA4 b36: ``qv`` 4th). False when the signature cannot be read (leave ``fn`` alone)."""
    import inspect
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(names[3:7]) != PAGED_VARLEN_ARGS and set(PAGED_VARLEN_ARGS) <= set(names)


def keyword_varlen(fn: Any) -> Any:
    """``fn`` called as transformers' paged path calls FA2/FA3 (``q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k`` positionally, the rest by keyword), passing the
    four after ``v`` by keyword. Shapes and return value: ``fn``'s."""
    import functools

    @functools.wraps(fn)
    def varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
               max_seqlen_q: Any = None, max_seqlen_k: Any = None, **kwargs: Any) -> Any:
        return fn(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **kwargs)
    varlen.nbh_keyword_varlen = True
    return varlen


def fix_paged_varlen_call(flash_paged: Any = None) -> bool:
    """Patch ``flash_paged.lazy_import_paged_flash_attention`` (default: transformers'
    ``transformers.integrations.flash_paged``) so that for a ``flash_attention_4`` implementation
    it returns :func:`keyword_varlen` of the varlen function when :func:`positional_order_differs`
    (module docstring). The paged path asks in every layer of every forward: the signature is
    read and the wrapper built once per varlen function, the same wrapper returned after.
    Idempotent; returns True when it patched now, False when already patched or the module has
    no such function (another transformers layout: nothing to fix)."""
    if flash_paged is None:
        try:
            from transformers.integrations import flash_paged
        except ImportError:
            return False
    orig = getattr(flash_paged, "lazy_import_paged_flash_attention", None)
    if orig is None or getattr(orig, "nbh_fa4_fix", False):
        return False
    chosen: dict[Any, Any] = {}  # varlen function -> what to return for it (wrapper or itself)

    def for_fa4(varlen: Any) -> Any:
        if getattr(varlen, "nbh_keyword_varlen", False) or not positional_order_differs(varlen):
            return varlen
        return keyword_varlen(varlen)

    def lazy_import_paged_flash_attention(implementation: Any, *args: Any, **kwargs: Any):
        varlen, kvcache = orig(implementation, *args, **kwargs)
        if varlen is not None and "flash_attention_4" in str(implementation):
            try:
                if varlen not in chosen:
                    chosen[varlen] = for_fa4(varlen)
                varlen = chosen[varlen]
            except TypeError:  # unhashable callable: decide on every call
                varlen = for_fa4(varlen)
        return varlen, kvcache
    lazy_import_paged_flash_attention.nbh_fa4_fix = True
    flash_paged.lazy_import_paged_flash_attention = lazy_import_paged_flash_attention
    return True
