"""Pull a weight tensor into the GPU's L2 cache ahead of the GEMM that reads it (``l2_prefetch``).

Contract: :func:`l2_prefetch` ``(t, scratch)`` reads every byte of the contiguous tensor ``t``
(any dtype; viewed as int32 words, or uint8 when its size is no multiple of 4 bytes) with a grid
of ``programs = scratch.numel()`` programs, each striding over ``BLOCK``-word blocks
(program ``p`` reads blocks ``p, p + programs, ...``), with ``eviction_policy="evict_last"``
(keep the lines in L2 ahead of streaming traffic). No ``cache_modifier=".cg"`` (L2 only): ptxas
rejects it beside the eviction hint ("Modifier '.evict_last' cannot be combined with modifier
'.cg'", Triton 3.9's bundled ptxas for sm_90a, 2026-12-02). A load whose value is unused is
dead code, so each program XORs its words and stores that one word to ``scratch[p]`` (int32,
allocated once by the caller and reused: the launch allocates nothing, so it is
CUDA-graph capturable). The grid is small on purpose (64 programs of the H200's 132 SMs by
default): the prefetch runs beside attention, which needs the rest.

Why: at batch 4 the decode GEMMs pay a fixed ~4 us each beyond bytes / bandwidth, and between a
layer's qkv GEMM and its o_proj only latency-bound kernels run (q/k norm + RoPE, two paged
attention stages; ~9 us, ~4.5 MB of KV reads), so HBM sits mostly idle; o_proj's 21 MB weight
fits in the H200's 50 MB L2. A persistent "megakernel" gets this overlap for free (Hazy
Research, "Look Ma, No Bubbles!", 2025); CUTLASS example 63
(``63_hopper_gemm_with_weight_prefetch``) prefetches a GEMM's weights into L2 before its PDL
wait. Here it is a separate launch on a side stream (:mod:`nbhelpers.engine.l2_prefetch`).

PTX (sm_90, Triton 3.9 here): ``createpolicy.fractional.L2::evict_last.b64 pol, 1.0`` once,
then ``ld.global.L1::evict_last.L2::cache_hint.v4.b32 ..., pol`` (``tests/engine/
test_l2_prefetch.py`` asserts it). Loads in flight: each thread's ``BLOCK / (32 * num_warps)``
words of one iteration (the XOR of iteration k comes before the loads of k + 1), so a program
keeps one 32 KiB block in flight: 64 programs, ~2 MiB, about what ~4 TB/s at ~0.5 us latency
needs (Little's law). A fire-and-forget ``prefetch.global.L2::evict_last`` or TMA
``cp.async.bulk.prefetch.L2`` (inline PTX) would need no registers, but has no interpreter form.
No PDL: this kernel has no ``griddepcontrol.wait`` and is never launched with ``launch_pdl``
(:mod:`.pdl`'s contract: a PDL launch may only follow the kernel right before it in its stream).

Tests: ``tests/engine/test_l2_prefetch.py`` (the scratch words under ``TRITON_INTERPRET=1`` equal
the XOR of the bytes each program read; the sm_90 PTX).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

BLOCK = 8192
"""Words one program loads per iteration (32 KiB of int32; at :data:`NUM_WARPS` 32 a thread)."""
NUM_WARPS = 8
DEFAULT_PROGRAMS = 64
"""Grid size: about half the H200's 132 SMs, leaving the rest to attention."""


@triton.jit
def _l2_prefetch_kernel(src_ptr, scratch_ptr, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, step):
        offs = start + tl.arange(0, BLOCK)
        w = tl.load(src_ptr + offs, mask=offs < n_words, other=0,
                    eviction_policy="evict_last")
        acc = acc ^ w.to(tl.int32)
    tl.store(scratch_ptr + pid, tl.xor_sum(acc, axis=0))


def words(t: Any) -> Any:
    """``t``'s bytes as a flat int32 view (uint8 when ``t.nbytes % 4``); no copy.

    Raises:
        ValueError: ``t`` not contiguous (its bytes are not one span), or 2**30 words or more
            (the kernel's int32 offsets run up to ``n_words + programs * BLOCK``).
    """
    import torch
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch: tensor of shape {tuple(t.shape)} strides "
                         f"{t.stride()} is not contiguous; pass the buffer the GEMM reads.")
    flat = t.detach().reshape(-1).view(torch.uint8)
    out = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    if out.numel() >= 2 ** 30:
        raise ValueError(f"l2_prefetch: {out.numel()} words exceed int32 offsets.")
    return out


def l2_prefetch(t: Any, scratch: Any, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """Read ``t``'s bytes into L2 with ``scratch.numel()`` programs of ``block`` words an
    iteration (a power of 2; module docstring); ``scratch``: int32 ``[programs]`` on ``t``'s
    device, overwritten with each program's XOR. Launches on the current stream, without PDL.
    Raises ``ValueError`` as :func:`words`, or for a bad ``scratch``."""
    import torch
    if scratch.dtype != torch.int32 or scratch.dim() != 1 or scratch.device != t.device:
        raise ValueError(f"l2_prefetch: scratch must be int32 [programs] on {t.device}, got "
                         f"{scratch.dtype} {tuple(scratch.shape)} on {scratch.device}.")
    w = words(t)
    if w.numel() == 0:
        return
    _l2_prefetch_kernel[(scratch.numel(),)](w, scratch, w.numel(), BLOCK=block,
                                            num_warps=num_warps)
