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


def _fa4_b36_varlen(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None)):
    """flash-attn-4 4.0.0b36's parameter order (``qv`` 4th), checking what FA4 checks."""
    assert qv is None, "cu_seq_lens_q landed in qv"
    assert cu_seqlens_k.shape == (cu_seqlens_q.shape[0],)  # FA4: (batch_size + 1,)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal)


class _Cache:
    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        # [1, H_kv, S, D] -> [S, H_kv, D], as PagedAttentionCache.update returns them
        return key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)


def _paged_forward(monkeypatch, flash_paged):
    """transformers' own paged_attention_forward over two packed sequences (3 and 5 tokens),
    with the FA4-ordered fake as the varlen function its paged import returns."""
    monkeypatch.setattr(flash_paged, "lazy_import_paged_flash_attention",
                        lambda impl, *a, **k: (_fa4_b36_varlen, None))
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    cu = torch.tensor([0, 3, 8])
    module = types.SimpleNamespace(config=types.SimpleNamespace(
        _attn_implementation="paged|flash_attention_4"), scaling=0.25, layer_idx=0)

    def run():
        out, _ = flash_paged.paged_attention_forward(
            module, q, k, v, None, _Cache(), cu, cu, 5, 5, None, read_index=None,
            write_index=None)
        return out
    want = torch.cat([_sdpa_bthd(q.transpose(1, 2)[:, a:b], k.transpose(1, 2)[:, a:b],
                                 v.transpose(1, 2)[:, a:b], 0.25)[0]
                      for a, b in ((0, 3), (3, 8))])
    return run, want


def test_transformers_paged_call_breaks_on_fa4_order_and_the_fix_repairs_it(monkeypatch):
    """The H200 failure of 2026-12-03 reproduced on the CPU through transformers' own
    paged_attention_forward: unpatched, cu_seq_lens_q lands in FA4's qv; patched, the output is
    SDPA's per sequence."""
    from transformers.integrations import flash_paged
    run, want = _paged_forward(monkeypatch, flash_paged)
    with pytest.raises(AssertionError, match="landed in qv"):
        run()
    assert shim.fix_paged_varlen_call(flash_paged) is True
    assert shim.fix_paged_varlen_call(flash_paged) is False  # idempotent
    torch.testing.assert_close(run(), want)


def test_fix_leaves_other_implementations_and_fa2_order_alone(monkeypatch):
    from transformers.integrations import flash_paged
    calls = []
    monkeypatch.setattr(flash_paged, "lazy_import_paged_flash_attention",
                        lambda impl, *a, **k: calls.append(impl) or (
                            _fa4_b36_varlen if impl.endswith("4") else _varlen, "kv"))
    shim.fix_paged_varlen_call(flash_paged)
    fa3, kv = flash_paged.lazy_import_paged_flash_attention("paged|flash_attention_3")
    fa4, _ = flash_paged.lazy_import_paged_flash_attention("paged|flash_attention_4")
    assert fa3 is _varlen and kv == "kv"  # not FA4: as transformers returned it
    assert fa4 is not _fa4_b36_varlen and fa4.__wrapped__ is _fa4_b36_varlen
    assert calls == ["paged|flash_attention_3", "paged|flash_attention_4"]
    assert not shim.positional_order_differs(_varlen)  # FA2/FA3 order: nothing to wrap
    assert shim.positional_order_differs(_fa4_b36_varlen)
    assert not shim.positional_order_differs(print)  # no readable signature: left alone


def test_apply_patches_the_paged_call_when_fa4_is_installed(monkeypatch):
    # no fake flash_attn module here: on the H200 the real FA4 is on the path, and transformers
    # imports flash_attn's spec while loading flash_paged (a fake module has no __spec__)
    from transformers.integrations import flash_paged
    monkeypatch.setattr(shim, "fa4_installed", lambda: True)
    monkeypatch.setattr(flash_paged, "lazy_import_paged_flash_attention",
                        lambda impl, *a, **k: (_fa4_b36_varlen, None))
    assert shim.apply() is False  # native registry: nothing registered ...
    assert flash_paged.lazy_import_paged_flash_attention.nbh_fa4_fix  # ... but the call fixed


def test_the_fixed_lookup_wraps_once_not_in_every_layer_call(monkeypatch):
    """transformers' paged path asks for the varlen function in every layer of every forward:
    the fix reads FA4's signature and builds its wrapper once per function, then hands back the
    same wrapper (no per-call inspect.signature / new function on the decode hot path)."""
    module = types.SimpleNamespace(
        lazy_import_paged_flash_attention=lambda impl, *a, **k: (_fa4_b36_varlen, None))
    reads = []
    real = shim.positional_order_differs
    monkeypatch.setattr(shim, "positional_order_differs", lambda fn: reads.append(fn) or real(fn))
    assert shim.fix_paged_varlen_call(module) is True
    first = [module.lazy_import_paged_flash_attention("paged|flash_attention_4")[0]
             for _ in range(5)]
    assert all(f is first[0] for f in first) and first[0].__wrapped__ is _fa4_b36_varlen
    assert reads == [_fa4_b36_varlen]
