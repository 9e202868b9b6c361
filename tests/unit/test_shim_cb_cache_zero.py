"""transformers_cb_cache_zero on both paths: an affected class (``torch.empty``) is patched and
its K/V come out zero even when the allocation held NaNs; an unaffected one is left alone; the
real transformers 5.17 class is affected (canary) and a CB backend load patches it."""

from __future__ import annotations

import torch

from nbhelpers.config import SamplingParams
from nbhelpers.shims import transformers_cb_cache_zero as shim


class Affected:
    def __init__(self, n: int = 2):
        self.key_cache = [torch.empty(4, 3) for _ in range(n)]
        self.value_cache = [torch.empty(4, 3) for _ in range(n)]
        for t in self.key_cache + self.value_cache:  # what torch.empty may hand back
            t.fill_(float("nan"))


class Fixed:
    def __init__(self):
        self.key_cache = [torch.zeros(4, 3)]
        self.value_cache = [torch.zeros(4, 3)]


def test_affected_class_is_zero_filled_and_patch_is_idempotent():
    assert shim.needs_patch(Affected)
    assert shim.apply(Affected) is True
    first = Affected.__init__
    assert shim.apply(Affected) is True and Affected.__init__ is first
    cache = Affected(3)
    assert len(cache.key_cache) == 3
    for t in cache.key_cache + cache.value_cache:
        assert torch.equal(t, torch.zeros(4, 3))


def test_unaffected_class_is_left_alone():
    before = Fixed.__init__
    assert shim.needs_patch(Fixed) is False
    assert shim.apply(Fixed) is False
    assert Fixed.__init__ is before


def test_zero_fill_counts_tensors():
    class C:
        def __init__(self):
            self.key_cache = [torch.ones(2)]
            self.value_cache = [torch.ones(2), torch.ones(2)]
    c = C()
    assert shim.zero_fill(c) == 3
    assert all(t.sum() == 0 for t in c.key_cache + c.value_cache)


def test_real_transformers_cache_is_affected_and_patched_by_hf_cb_load():
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from nbhelpers.backends.hf_cb import HFCBBackend
    from nbhelpers.models import get_spec

    # canary: fails once transformers stops allocating the cache with torch.empty (remove shim)
    assert shim.needs_patch(PagedAttentionCache) or getattr(
        PagedAttentionCache.__init__, shim._PATCHED, False)
    backend = HFCBBackend()
    backend.load(get_spec("tiny-qwen3"), None, use_cuda_graph=False)
    try:
        assert backend.info["cb_cache_zero_fill"] is True
        assert getattr(PagedAttentionCache.__init__, shim._PATCHED, False)
        out = backend.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=2))
        assert len(out[0].token_ids) == 2 and backend.info["cb_cache_zero_fill"] is True
    finally:
        backend.close()
