"""Page allocator, slot_mapping, inverse page tables and paged block masks."""

from __future__ import annotations

import pytest
import torch

from nbhelpers.engine.attention import decode_block_mask
from nbhelpers.engine.kv_cache import KVCache, OutOfPages, PagePool, phys_to_logical, slot_mapping


def test_pool_allocates_shares_and_frees():
    pool = PagePool(num_pages=5, page_size=4)
    assert pool.num_free == 4  # page 0 is the null page
    a = pool.allocate(3)
    assert 0 not in a and pool.num_free == 1
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    pool.share(a[:2])
    pool.release(a)
    assert pool.num_free == 2 and pool.refcount(a[0]) == 1
    pool.release(a[:2])
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        pool.release([a[0]])
    assert pool.pages_for(9) == 3


def test_slot_mapping_and_inverse_table():
    bt = torch.tensor([[3, 1, 0], [2, 0, 0]])
    slots = slot_mapping(bt, torch.tensor([5, 2]), page_size=4)
    assert slots.tolist() == [1 * 4 + 1, 2 * 4 + 2]
    p2l = phys_to_logical(bt, torch.tensor([2, 1]), num_pages=4)
    assert p2l.tolist() == [[-1, 1, -1, 0], [-1, -1, 0, -1]]


def test_decode_block_mask_matches_dense_reference():
    from torch.nn.attention.flex_attention import flex_attention
    ps, num_pages = 4, 6
    bt = torch.tensor([[5, 2, 0], [1, 3, 4]])
    pos = torch.tensor([5, 9])  # row 0: 6 tokens, row 1: 10 tokens
    used = pos // ps + 1
    p2l = phys_to_logical(bt, used, num_pages)
    bm = decode_block_mask(p2l, bt, used, pos, ps, num_pages * ps)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 1, 8), torch.randn(1, 1, 24, 8), torch.randn(1, 1, 24, 8)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    for b in range(2):
        slots = [bt[b, p // ps].item() * ps + p % ps for p in range(pos[b] + 1)]
        w = torch.softmax(q[b, :, 0] @ k[0, 0, slots].T / 8 ** 0.5, -1)
        torch.testing.assert_close(out[b, :, 0], w @ v[0, 0, slots])


def test_kv_copy_page():
    kv = KVCache.allocate(1, 1, 2, num_pages=3, page_size=2, dtype=torch.float32, device="cpu")
    kv.k[0][0, 0, 2:4] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    kv.copy_page(1, 2)
    assert kv.k[0][0, 0, 4:6].tolist() == [[1.0, 2.0], [3.0, 4.0]]
