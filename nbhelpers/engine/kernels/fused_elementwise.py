"""The :class:`~nbhelpers.engine.fused.Elementwise` pieces on the Triton kernels
(``Elementwise(kind="triton")``, ``RunnerOptions.fused_elementwise="triton"``).

Contract: each function has the signature and result of its torch twin in
:mod:`nbhelpers.engine.fused` (same shapes, same dtype order, results equal up to rounding:
see :mod:`.fused_norm` and :mod:`.qk_rope_cache`) and falls back to that twin where the kernel
cannot serve the operands (``supported`` is False, or a weight dtype torch would promote).
:func:`qk_rope_cache` is new: q/k norm + RoPE *and* the paged KV write (today's two
``index_copy_``) in one launch.

Kernels per Llama/Qwen3 decode layer through these: 1 ``qk_rope_cache`` + 2 ``add_rms_norm`` +
1 ``silu_mul`` (vs 2 compiled q/k norm-RoPE kernels + 2 ``index_copy_`` + 2-4 compiled norm
kernels + 1 SwiGLU kernel with ``kind="compile"``).
"""

from __future__ import annotations

from typing import Any

from nbhelpers.engine import fused
from nbhelpers.engine.kernels import fused_norm as fn
from nbhelpers.engine.kernels import qk_rope_cache as qrc


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """:func:`nbhelpers.engine.fused.rms_norm` in one launch."""
    if not (fn.supported(x, weight) and weight.dtype == x.dtype):
        return fused.rms_norm(x, weight, eps)
    return fn.add_norm(x, out_norm=(weight, eps, "llama"), store_res=False)[1]


def add_rms_norm(x: Any, delta: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """:func:`nbhelpers.engine.fused.add_rms_norm` (``(x + delta, norm(x + delta))``), one launch."""
    if not (fn.supported(x, delta, weight) and weight.dtype == x.dtype == delta.dtype):
        return fused.add_rms_norm(x, delta, weight, eps)
    return fn.add_norm(delta, x, out_norm=(weight, eps, "llama"))


def silu_mul(gate: Any, up: Any) -> Any:
    """:func:`nbhelpers.engine.fused.silu_mul` in one launch."""
    if not (fn.supported(gate, up) and gate.dtype == up.dtype):
        return fused.silu_mul(gate, up)
    return fn.act_mul(gate, up, "silu")


def qk_rope_cache(q: Any, k: Any, v: Any, wq: Any, wk: Any, eps: float, cos: Any, sin: Any,
                  kv: tuple[Any, Any, Any], heads: tuple[int, int, int]) -> Any:
    """q/k RMSNorm (skipped when ``wq`` is ``None``) + RoPE + KV write; returns q ``[1, H, T, D]``.

    Args: ``q, k, v`` the q/k/v projections ``[1, T, *]``; ``cos/sin [1, T, D]``; ``kv =
    (k_cache, v_cache, slot_mapping)`` with caches ``[1, H_kv, S, D]`` and ``slot_mapping [T]``;
    ``heads = (H, H_kv, D)``. Writes ``k_cache[0, :, slot_mapping]`` and ``v_cache[...]`` as
    ``layers.EngineModel._attention``'s ``index_copy_`` did.
    """
    kc, vc, slots = kv
    h, hkv, d = heads
    t = q.shape[1]
    if not qrc.supported(q, cos, kc, d) or (wq is not None and wq.dtype != q.dtype):
        qr, kr = fused.qk_norm_rope(q.view(1, t, h, d), k.view(1, t, hkv, d), wq, wk, eps, cos,
                                    sin)
        kc[0].index_copy_(1, slots, kr[0])
        vc[0].index_copy_(1, slots, v.view(1, t, hkv, d).transpose(1, 2)[0])
        return qr
    out = qrc.qk_norm_rope_cache(q, k, v, h, hkv, d, cos, sin, kc, vc, slots,
                                 qk_norm=None if wq is None else (wq, wk, eps, "llama"))
    return out.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D] (a view)
