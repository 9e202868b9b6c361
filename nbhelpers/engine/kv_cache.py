"""Paged KV cache: page allocator, ``block_table``, ``slot_mapping`` and paged BlockMasks.

Contract: the KV pool is one tensor per layer, ``k_cache[i]``/``v_cache[i]`` of shape
``[1, H_kv, num_pages * page_size, D]`` (physical slots), the layout vLLM calls paged attention.
Physical page 0 is a null page that is never handed out: padded rows and padded tokens write there
and every mask hides it (vLLM's trick for static shapes). A request owns a ``block_table`` (list of
physical page ids, logical page ``j`` -> physical page). ``PagePool`` counts references so that the
``n`` samples of one GRPO prompt can share the prompt's full pages (prefix sharing).

The logical-to-physical mask conversion follows torch's
``torch/nn/attention/experimental/_paged_attention.py`` (``convert_logical_block_mask``): a
``phys_to_logical[row, page]`` table (-1 = not this row's page) turns a mask over logical positions
into one over physical slots.

Run: ``pytest tests/engine/test_kv_cache.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NULL_PAGE = 0
FLEX_Q_BLOCK = 128
"""Query rows per prefill BlockMask block (``attention.prefill_block_mask``'s ``q_block``)."""
FLEX_DEFAULT_BLOCK_N = 128
"""Largest ``BLOCK_N`` of torch inductor's default flex forward tiles on CUDA (torch
``_inductor/template_heuristics/triton.py``, ``h100_default_flex_config``: 128 for bf16/fp16 at
head_dim 64), the tile compiled prefill gets when ``prefill_kernel_options`` names no BLOCK_N."""


def check_page_size(page_size: int, device_type: str, compiled_attention: bool,
                    prefill_kernel_options: dict | None) -> None:
    """Raise when the CUDA kernels cannot serve ``page_size`` (checked at ``LLM`` construction).

    Why: the paged BlockMasks use one page as the KV block (``BLOCK_SIZE=(q, page_size)``), and
    torch's compiled CUDA flex_attention requires the KV block to be a multiple of the kernel's
    ``BLOCK_N`` and the Q block a multiple of ``BLOCK_M`` (torch ``_inductor/kernel/flex/
    flex_attention.py``: "Q and KV block size must be divisible by BLOCK_M and BLOCK_N"). The
    tile is ``prefill_kernel_options`` (default BLOCK_N 64), else :data:`FLEX_DEFAULT_BLOCK_N`.
    Decode (flex clips its BLOCK_N to the page; the Triton kernel takes any page) adds nothing.
    On the CPU and with eager flex_attention every ``page_size >= 1`` works (tests use 4, 8, 16).

    Args: ``device_type``: ``"cuda"`` or ``"cpu"``; ``compiled_attention``: the runner's
    resolved ``compile_attention``; ``prefill_kernel_options``: ``RunnerOptions``' field.
    Raises:
        ValueError: naming the valid page sizes (multiples of BLOCK_N) or the bad BLOCK_M.
    """
    if device_type != "cuda" or not compiled_attention:
        return
    opts = prefill_kernel_options or {}
    block_m, block_n = opts.get("BLOCK_M"), opts.get("BLOCK_N", FLEX_DEFAULT_BLOCK_N)
    if block_m and FLEX_Q_BLOCK % block_m:
        raise ValueError(f"prefill_kernel_options BLOCK_M={block_m} must divide the prefill "
                         f"query block {FLEX_Q_BLOCK}: use 16, 32, 64 or 128.")
    if page_size % block_n:
        raise ValueError(
            f"page_size={page_size} cannot be served by the compiled CUDA flex_attention "
            f"prefill: a page is one KV block and must be a multiple of its tile BLOCK_N="
            f"{block_n}. Valid page sizes: {block_n}, {2 * block_n}, {4 * block_n}, ... (any "
            f"multiple of {block_n}); or set prefill_kernel_options BLOCK_N to a power of 2 >= "
            "16 dividing page_size, or compile_attention=False (slow).")


class OutOfPages(RuntimeError):
    """Raised by :meth:`PagePool.allocate` when the pool is exhausted (the scheduler preempts)."""


class PagePool:
    """Reference-counted allocator over physical pages ``1..num_pages-1`` (0 is the null page).

    Raises:
        ValueError: ``num_pages < 2`` or ``page_size < 1``.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"PagePool(num_pages={num_pages}, page_size={page_size}): need "
                             "num_pages >= 2 (page 0 is the null page) and page_size >= 1.")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` slots (ceil division)."""
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int = 1) -> list[int]:
        """``count`` fresh pages with refcount 1. Raises :class:`OutOfPages` (nothing taken)."""
        if count > len(self._free):
            raise OutOfPages(f"need {count} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add one reference to each page (a forked sequence now also reads them)."""
        for p in pages:
            self._check_live(p)
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; a page with no reference left returns to the pool."""
        for p in pages:
            self._check_live(p)
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _check_live(self, p: int) -> None:
        if p == NULL_PAGE or self._refs[p] <= 0:
            raise ValueError(f"page {p} is not allocated: double free or foreign page id.")


@dataclass
class KVCache:
    """Per-layer K/V tensors ``[1, H_kv, num_pages * page_size, D]`` (bf16 on the GPU)."""

    k: list[Any]
    v: list[Any]
    page_size: int

    @classmethod
    def allocate(cls, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int, dtype: Any, device: Any) -> KVCache:
        import torch
        shape = (1, num_kv_heads, num_pages * page_size, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k, v, page_size)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[2]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one physical page's K/V in every layer (copy-on-write of a partial page)."""
        self.copy_pages([(src, dst)])

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """:meth:`copy_page` for every ``(src, dst)`` pair in one ``_foreach_copy_`` over all
        layers (one dispatch instead of ``2 * layers`` per pair: 216 copies for a Qwen3-4B GRPO
        group of 4, ``scripts/count_prefill_ops.py``). ``dst`` pages must not be ``src`` pages of
        another pair (forks copy a leader's page into its followers' own pages)."""
        import torch
        ps = self.page_size
        src = [t[:, :, s * ps:(s + 1) * ps] for s, _ in pairs for t in self.k + self.v]
        dst = [t[:, :, d * ps:(d + 1) * ps] for _, d in pairs for t in self.k + self.v]
        if dst:
            torch._foreach_copy_(dst, src)


def slot_mapping(block_table: Any, positions: Any, page_size: int) -> Any:
    """Physical slot of each token: ``block_table[row, pos // page_size] * page_size + pos % ps``.

    Args:
        block_table: ``[R, max_pages]`` int tensor (pad with the null page 0).
        positions: ``[R]`` (one token per row, decode) int64 tensor.
    Returns: ``[R]`` int64 slots. Device-side only (no host sync), so it runs inside a CUDA graph.
    """
    import torch
    page = torch.gather(block_table, 1, (positions // page_size).unsqueeze(1)).squeeze(1)
    return page.long() * page_size + positions % page_size


def phys_to_logical(block_table: Any, num_pages_used: Any, num_pages: int) -> Any:
    """Inverse page table ``[R, num_pages]``: logical page index of a physical page, or -1.

    Args:
        block_table: ``[R, max_pages]`` int tensor padded with the null page.
        num_pages_used: ``[R]`` int tensor, valid entries per row.
    Device-side (scatter), capturable in a CUDA graph.
    """
    import torch
    rows, max_pages = block_table.shape
    logical = torch.arange(max_pages, device=block_table.device).expand(rows, -1)
    valid = logical < num_pages_used.unsqueeze(1)
    src = torch.where(valid, logical, torch.full_like(logical, -1))
    out = torch.full((rows, num_pages), -1, dtype=torch.long, device=block_table.device)
    # padded entries point at the null page; scatter the valid ones last so they win
    out.scatter_(1, torch.where(valid, block_table.long(), 0), torch.where(valid, src, -1))
    out[:, NULL_PAGE] = -1
    return out
