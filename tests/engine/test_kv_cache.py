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


def test_page_size_check_names_the_valid_cuda_sizes():
    """Pure check of what the CUDA flex kernels serve (no GPU needed: the device is an argument)."""
    from nbhelpers.engine.kv_cache import check_page_size
    from nbhelpers.engine.runner_options import RunnerOptions
    tiles = RunnerOptions().prefill_kernel_options  # BLOCK_N 64
    for ok in (64, 128, 256):
        check_page_size(ok, "cuda", True, tiles)
    with pytest.raises(ValueError, match=r"page_size=8 .*Valid page sizes: 64, 128, 256"):
        check_page_size(8, "cuda", True, tiles)
    with pytest.raises(ValueError, match="multiple of 128"):  # torch's default tile
        check_page_size(64, "cuda", True, None)
    check_page_size(16, "cuda", True, {"BLOCK_M": 64, "BLOCK_N": 16})
    with pytest.raises(ValueError, match="BLOCK_M=48"):
        check_page_size(128, "cuda", True, {"BLOCK_M": 48, "BLOCK_N": 64})
    for small in (1, 4, 8, 16):  # CPU and eager flex: every page size that works today
        check_page_size(small, "cpu", True, tiles)
        check_page_size(small, "cpu", False, tiles)
        check_page_size(small, "cuda", False, tiles)


def test_llm_rejects_a_page_size_the_cuda_kernels_cannot_serve(monkeypatch):
    """The runner calls the check at construction, before it touches the weights."""
    from _tiny import tiny_model

    from nbhelpers.engine import LLM, model_runner
    seen = []
    real = model_runner.check_page_size
    monkeypatch.setattr(model_runner, "check_page_size",
                        lambda ps, dev, comp, opts: (seen.append((ps, dev, comp)),
                                                     real(ps, "cuda", True, opts)))
    with pytest.raises(ValueError, match="Valid page sizes: 64, 128"):
        LLM(tiny_model("qwen3"), page_size=8, num_pages=8, max_model_len=32)
    assert seen == [(8, "cpu", False)]
