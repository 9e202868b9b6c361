"""Shim: zero-fill the paged KV cache of transformers continuous batching at allocation.

Why: ``PagedAttentionCache.__init__`` allocates every layer's key/value cache with
``torch.empty`` and zeroes only the "read trash" block (transformers 5.17.0,
``generation/continuous_batching/cache.py``). ``ContinuousBatchingManager.warmup`` (on by default
in ``generate_batch(warmup=True)``, ``continuous_api.py``) then runs the varlen path with
``max_kv_read = num_blocks * block_size - max_batch_tokens`` cache tokens that were never written
(``model_runner.py``, ``warmup`` / ``run_one_warmup``) and samples from the result. Whatever the
allocator hands back decides whether those bytes hold NaN/inf bit patterns, so the warm-up fails
nondeterministically with ``Assertion `probability tensor contains either inf, nan or element <
0``` followed by a dead CUDA context. Seen on the H200 (2026-11-30, run
``executed/phase1_rollout/10_lora_rollout/20261130T080953Z_h200_2477739*``): ``hf_cb`` and
``cb_sync`` with LoRA died in warm-up, the same engines without LoRA (different allocator history)
ran; the earlier standalone measurement (docs/reference_measurements) happened to get clean
memory. Zero K/V give finite attention (softmax over equal scores), so the warm-up's tokens are
valid and the real run overwrites every slot it reads.

Cost: one ``fill_(0)`` of the cache at allocation (W: 120 blocks x 256 tokens x 36 layers x
8 heads x 128 x 2 (K, V) x 2 bytes = 4.5 GB, ~1 ms at H200 bandwidth).

Affected versions: transformers 5.17.0 (the project's pin; the code path exists since continuous
batching gained ``warmup``). :func:`apply` patches only a ``PagedAttentionCache`` whose
``__init__`` still calls ``torch.empty`` (read from its source), so a fixed upstream is left alone.

Removal condition: delete when transformers allocates the cache with ``torch.zeros`` or its
warm-up stops sampling from unwritten slots; ``tests/unit/test_shim_cb_cache_zero.py`` checks
the source test that gates the patch.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

_PATCHED = "_nbhelpers_zero_fill"


def needs_patch(cache_cls: Any) -> bool:
    """True when ``cache_cls.__init__`` allocates with ``torch.empty`` (the affected code)."""
    try:
        src = inspect.getsource(cache_cls.__init__)
    except (OSError, TypeError):
        return False
    return "torch.empty(" in src


def zero_fill(cache: Any) -> int:
    """Fill every tensor of ``cache.key_cache`` / ``cache.value_cache`` with 0; returns the count."""
    n = 0
    for name in ("key_cache", "value_cache"):
        for t in getattr(cache, name, None) or []:
            t.zero_()
            n += 1
    return n


def apply(cache_cls: Any = None) -> bool:
    """Patch ``PagedAttentionCache.__init__`` to zero-fill its K/V after allocation.

    Args:
        cache_cls: the class to patch (default: transformers' ``PagedAttentionCache``).
    Returns:
        True when the class is (now or already) patched; False when it is absent or unaffected.
    Idempotent.
    """
    if cache_cls is None:
        try:
            from transformers.generation.continuous_batching.cache import PagedAttentionCache
        except ImportError:
            return False
        cache_cls = PagedAttentionCache
    if getattr(cache_cls.__init__, _PATCHED, False):
        return True
    if not needs_patch(cache_cls):
        return False
    original = cache_cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        zero_fill(self)

    setattr(__init__, _PATCHED, True)
    cache_cls.__init__ = __init__
    return True
