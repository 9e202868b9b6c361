"""Shim flash_attn4 on both paths: transformers 5.17 has native FA4 (no-op); an older registry
without it gets :func:`fa4_attention_forward` registered, checked here against SDPA with a fake
``flash_attn.cute`` built on torch (dense and varlen). Run:
``pytest tests/unit/test_shims_flash_attn4.py -q``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nbhelpers.shims import flash_attn4 as shim


def _sdpa_bthd(q, k, v, softmax_scale=None, causal=True):  # [B, T, H, D] like FA
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal):  # [total, H, D]
    outs = [_sdpa_bthd(q[None, a:b], k[None, c:d], v[None, c:d], softmax_scale, causal)[0]
            for a, b, c, d in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(),
                                  cu_seqlens_k[:-1].tolist(), cu_seqlens_k[1:].tolist())]
    return torch.cat(outs), None


class FakeInterface:
    def __init__(self):
        self._global_mapping = {"sdpa": object()}

    def register(self, name, fn):
        self._global_mapping[name] = fn


@pytest.fixture
def fake_fa4(monkeypatch):
    cute = types.SimpleNamespace(flash_attn_func=_sdpa_bthd, flash_attn_varlen_func=_varlen)
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setattr(shim, "fa4_installed", lambda: True)


def test_native_transformers_is_a_noop():
    assert shim.native()
    assert shim.apply() is False


def test_registration_needs_fa4(monkeypatch):
    monkeypatch.setattr(shim, "fa4_installed", lambda: False)
    with pytest.raises(ImportError, match=r"\.\[fa4\]"):
        shim.apply(FakeInterface())


def test_registers_and_matches_sdpa_dense_and_varlen(fake_fa4):
    iface = FakeInterface()
    assert shim.apply(iface) is True
    fn = iface._global_mapping["paged|flash_attention_4"]
    assert fn is shim.fa4_attention_forward and shim.apply(iface) is False
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    out, _ = fn(None, q, k, v, None, scaling=0.3)  # [B, T, H, D]
    assert torch.allclose(out, _sdpa_bthd(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), 0.3), atol=1e-5)
    packed = [t[:1] for t in (q, k, v)]  # one packed batch of 2 sequences (2 + 4 tokens)
    cu = torch.tensor([0, 2, 6])
    out, _ = fn(None, *packed, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=4, max_length_k=4)
    first = _sdpa_bthd(*(t[:, :, :2].transpose(1, 2) for t in packed), 0.3)
    assert out.shape == (1, 6, 4, 8) and torch.allclose(out[:, :2], first, atol=1e-5)


def test_dense_padding_mask_is_refused(fake_fa4):
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="padding mask"):
        shim.fa4_attention_forward(None, q, q, q, torch.tensor([[0, 1, 1]]))
