"""A stand-in ``flash_attn.cute`` for the CPU tests of ``nbhelpers/engine/prefill_fa4.py``.

:func:`install` puts a package ``flash_attn`` and a module ``flash_attn.cute`` into
``sys.modules`` (through pytest's ``monkeypatch``, so they go away after the test) whose
``flash_attn_varlen_func`` computes FlashAttention's varlen forward with torch, written from
FA4 4.0.0b36's documented semantics (``flash_attn/cute/interface.py``), not from the engine's
code: per sequence ``b`` the queries ``q[cu_q[b]:cu_q[b+1]]`` attend to the keys
``k[cu_k[b]:cu_k[b+1]]``; query head ``h`` reads KV head ``h // (H / H_kv)``; scores are
``softmax_scale * q.k``, then ``softcap * tanh(s / softcap)`` when ``softcap > 0``; ``causal``
keeps key ``j`` for query ``i`` when ``j <= i + L_k - L_q`` (bottom-right aligned), and
``window_size=(left, right)`` also drops ``j < i + L_k - L_q - left``. Returns ``(out, None)``
like b36 without ``return_lse``. It checks the argument shapes FA4 asserts and records every
call's arguments in ``calls``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

# transformers probes flash_attn with find_spec at import: let it see the real environment first
import transformers.modeling_flash_attention_utils  # noqa: F401


def varlen_reference(q, k, v, cu_q, cu_k, scale, causal=True, window=(None, None), softcap=0.0):
    """FlashAttention varlen forward in fp32 (see the module docstring); ``out`` like ``q``."""
    h, h_kv = q.shape[1], k.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb = q[qs:qe].float()
        kb = k[ks:ke].float().repeat_interleave(h // h_kv, dim=1)
        vb = v[ks:ke].float().repeat_interleave(h // h_kv, dim=1)
        s = torch.einsum("ihd,jhd->hij", qb, kb) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)  # bottom-right aligned
        j = torch.arange(ke - ks)[None, :]
        keep = j <= i if causal else torch.ones_like(j <= i)
        if window[0] is not None:
            keep = keep & (j >= i - window[0])
        s = s.masked_fill(~keep, float("-inf"))
        out[qs:qe] = torch.einsum("hij,jhd->ihd", s.softmax(-1), vb)
    return out.to(q.dtype)


def install(monkeypatch):
    """Install the fake; returns its ``flash_attn.cute`` module (``.calls``: list of dicts)."""
    cute = types.ModuleType("flash_attn.cute")
    cute.calls = []

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                               max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                               causal=False, window_size=(None, None), softcap=0.0, **kw):
        assert q.dim() == k.dim() == v.dim() == 3, "varlen takes (total, heads, dim)"
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "last dim must be contiguous"
        assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0]
        assert max_seqlen_q == int(cu_seqlens_q.diff().max())
        assert max_seqlen_k == int(cu_seqlens_k.diff().max())
        cute.calls.append({"cu_q": cu_seqlens_q.tolist(), "cu_k": cu_seqlens_k.tolist(),
                           "max_q": max_seqlen_q, "max_k": max_seqlen_k,
                           "scale": softmax_scale, "causal": causal, "window": window_size,
                           "softcap": softcap, "heads": q.shape[1], "kv_heads": k.shape[1],
                           "head_dim": q.shape[2], "extra": kw})
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal,
                                window_size, softcap), None

    cute.flash_attn_varlen_func = flash_attn_varlen_func
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []  # a package
    for mod in (pkg, cute):  # find_spec reads __spec__ of modules in sys.modules
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None,
                                                      is_package=mod is pkg)
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return cute


def as_hopper(monkeypatch, dtypes=("bfloat16", "float16", "float32")):
    """Make ``prefill_fa4`` see compute capability 9.0 and accept ``dtypes`` (fp32 on the CPU:
    the fake computes any dtype; the real FA4 takes bf16/fp16 only)."""
    from nbhelpers.engine import prefill_fa4
    monkeypatch.setattr(prefill_fa4, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(prefill_fa4, "FA4_DTYPES", tuple(dtypes))
