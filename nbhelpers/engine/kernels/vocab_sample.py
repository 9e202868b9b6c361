"""Split-vocabulary decode sampler: :func:`nbhelpers.engine.sampler.sample` without top-k/top-p
(``use_sort=False``, ``full_logprobs=True``) in two Triton launches (runner option
``sample_kernel="triton"``, what the default ``"auto"`` runs on CUDA).

Contract: :func:`vocab_sample` maps ``logits [B, V]`` (fp32, bf16 or fp16, unit column stride, any
row stride; read in its dtype and upcast in registers) and ``temperature, min_p [B]`` fp32,
``seeds, gen_idx [B]`` int64 to ``(tokens [B] int64, logprobs [B, 2] fp32)``, the same as
``sampler.sample(..., use_sort=False, full_logprobs=True)``: ``T <= 0`` rows greedy (argmax of the
raw logits, first index on ties; both columns the raw ``log_softmax`` there), else ``x = logits / T``
(IEEE division, as torch), min_p keeps ``exp(x_v - max x) >= min_p`` (the sampler's ``p_v >= min_p *
max p`` with the common ``1 / sum`` cancelled), the token is the first argmax over kept ``v`` of
``exp(x_v - max x) / E_v``, ``E_v = -log(u_v)``, ``u`` bit for bit the sampler's ``uniform_noise``
(lowbias32 of seed, gen_idx and token id, :func:`_mix32` in uint32). Column 0: ``x_tok - max -
log(kept mass)``, column 1: ``x_tok - max - log(sum exp(x - max))``. The race compares the exp form
``p / E`` (not ``x - log E``): the sampler's own expression up to its common ``1 / kept mass``
factor, one transcendental per token fewer. Tokens can differ from torch's only where two race
values tie to fp32 rounding. NaN logits are not handled (torch's argmax would pick them).

Design (grid ``(B, C)``, ``C = cdiv(V, chunk)``, chunk 4096 tokens by default): kernel 1 per
(row, chunk) writes the chunk max of ``x``, ``sum exp(x - chunk max)`` and the chunk's first
argmax; kernel 2 per (row, chunk) combines the row's ``C`` stats into the global max and
log-sum-exp (online softmax merge, Milakov & Gimelshein arXiv:1805.02867), races its chunk among
the kept tokens and writes (best race value, its ``x``, its id, kept mass); the row's last program
(atomic ticket, ``sem="acq_rel"``, as :mod:`.skinny_gemm`'s serial split-K) reduces the ``C``
partials in chunk order (ties: the smaller id, as ``argmax``), writes the outputs and resets the
row's counter to 0. Splitting the vocabulary over many programs per row follows FlashInfer's
sampling kernels (``include/flashinfer/sampling.cuh``: a block per row walking the vocabulary)
made two-level as vLLM's split-vocab top-k/argmax reductions; one program per row walking 152k
logits serially is what made inductor's reduction slow. Workspace and counters are allocated once
per (device, B, V, chunk) (:func:`workspace`) and reused: no host sync, no allocation but the
outputs, CUDA-graph capturable; calls must be stream-ordered (the engine's one stream). The kernel
names hold "softmax" / "argmax" so ``bench.profile.kernel_class`` counts them as sort/sample.

PDL (:mod:`.pdl`, ``USE_GDC``): every program of both kernels calls ``gdc_wait()`` first (logits,
parameters and the workspace are written by earlier kernels or read by the previous call);
kernel 1 calls ``gdc_launch_dependents()`` after its reductions. Works on CUDA and under
``TRITON_INTERPRET=1`` (programs run in order there, so the last ticket is the last chunk's).

Tests: ``tests/engine/test_vocab_sample.py`` (hash bits, parity with torch, workspace reuse, the
chi-square of the sampler tests, the engine option; GPU: Qwen3-4B's vocabulary at batch 4 and 32).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from triton.language.extra import libdevice

from nbhelpers.engine.kernels import pdl

INTERPRETED = bool(triton.knobs.runtime.interpret)
CHUNK = 4096
"""Tokens per program (Qwen3's 151,936 -> 38 chunks: 152 programs at batch 4, 1,216 at 32)."""
NUM_WARPS = 8


@triton.jit
def _mix32(x):
    """lowbias32 (sampler._mix32) on a uint32 tensor; products wrap mod 2^32 as there."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform(seed, gen_idx, vid):
    """``u`` of ``sampler.uniform_noise`` for one row's ``seed``/``gen_idx`` (int64 scalars) and
    token ids ``vid`` (int32): bit-identical fp32 in (0, 1)."""
    lo = seed.to(tl.uint32)  # low 32 bits (int64 -> uint32 truncates)
    hi = (seed >> 32).to(tl.uint32)
    g = gen_idx.to(tl.uint32) * 0x85EBCA6B
    row = _mix32(_mix32(lo) ^ _mix32(hi ^ 0x9E3779B9) ^ g)
    h = _mix32(row ^ _mix32(vid.to(tl.uint32) + 0x27D4EB2F))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _vocab_sample_softmax_stats(logits_ptr, temp_ptr, ws_ptr, idx_ptr, stride_row, V, B, C,
                                CHUNK: tl.constexpr, USE_GDC: tl.constexpr):
    """Kernel 1: chunk max of ``x``, ``sum exp(x - chunk max)`` and first argmax, per (row, chunk)."""
    row, c = tl.program_id(0), tl.program_id(1)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    temp = tl.load(temp_ptr + row)
    t = tl.where(temp > 0, temp, 1.0)  # greedy rows: T = 1, as the sampler (x = raw logits)
    raw = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=ok,
                  other=float("-inf"))
    x = tl.math.div_rn(raw.to(tl.float32), t)  # IEEE division, as torch's logits / T
    mc = tl.max(x, 0)
    arg = tl.argmax(x, 0, tie_break_left=True)
    safe = tl.where(mc == float("-inf"), 0.0, mc)  # an all -inf chunk: sum 0, not NaN
    sc = tl.sum(tl.exp(x - safe), 0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    slot = row * C + c
    tl.store(ws_ptr + slot, mc)
    tl.store(ws_ptr + B * C + slot, sc)
    tl.store(idx_ptr + slot, c * CHUNK + arg)


@triton.jit
def _row_stats(ws_ptr, idx_ptr, row, B, C, BLOCK_C: tl.constexpr):
    """``(max, sum exp(x - max), first argmax id)`` of the row from kernel 1's ``C`` chunks."""
    cs = tl.arange(0, BLOCK_C)
    ok = cs < C
    mc = tl.load(ws_ptr + row * C + cs, mask=ok, other=float("-inf"))
    sc = tl.load(ws_ptr + B * C + row * C + cs, mask=ok, other=0.0)
    m = tl.max(mc, 0)
    total = tl.sum(tl.where(ok, sc * tl.exp(mc - m), 0.0), 0)
    first = tl.argmax(mc, 0, tie_break_left=True)  # chunk order = token order
    arg = tl.load(idx_ptr + row * C + first)
    return m, total, arg


@triton.jit
def _vocab_sample_argmax_race(logits_ptr, temp_ptr, min_p_ptr, seed_ptr, gen_ptr, ws_ptr,
                              idx_ptr, cnt_ptr, tok_ptr, lp_ptr, stride_row, V, B, C,
                              CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                              ACCURATE_LOG: tl.constexpr, USE_GDC: tl.constexpr):
    """Kernel 2: race over the chunk's kept tokens; the row's last ticket writes the outputs."""
    row, c = tl.program_id(0), tl.program_id(1)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    m, total, greedy_tok = _row_stats(ws_ptr, idx_ptr, row, B, C, BLOCK_C)
    temp = tl.load(temp_ptr + row)
    best = -1.0
    x_best = m
    tok = greedy_tok
    mass = 0.0
    if temp > 0:  # sampled row (greedy rows: kernel 1's argmax, no second read)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ok = offs < V
        raw = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=ok,
                      other=float("-inf"))
        x = tl.math.div_rn(raw.to(tl.float32), temp)
        p = tl.exp(x - m)  # [CHUNK] probability relative to the max token
        kept = ok & (p >= tl.load(min_p_ptr + row))
        mass = tl.sum(tl.where(kept, p, 0.0), 0)
        u = _uniform(tl.load(seed_ptr + row), tl.load(gen_ptr + row), offs)
        if ACCURATE_LOG:  # libdevice logf: -log(u) near u = 1 needs relative accuracy
            e = -libdevice.log(u)
        else:  # the interpreter (numpy's log) has no libdevice
            e = -tl.log(u)
        race = tl.where(kept, p / e, -1.0)
        best = tl.max(race, 0)
        arg = tl.argmax(race, 0, tie_break_left=True)
        x_best = tl.max(tl.where(offs == c * CHUNK + arg, x, float("-inf")), 0)
        tok = c * CHUNK + arg
    slot = row * C + c
    tl.store(ws_ptr + 2 * B * C + slot, best)
    tl.store(ws_ptr + 3 * B * C + slot, x_best)
    tl.store(ws_ptr + 4 * B * C + slot, mass)
    tl.store(idx_ptr + B * C + slot, tok)
    tl.debug_barrier()  # every thread's stores precede the release (skinny_gemm.py)
    ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
    if ticket == C - 1:
        _finish(ws_ptr, idx_ptr, tok_ptr, lp_ptr, row, B, C, m, total, temp <= 0, greedy_tok,
                BLOCK_C)
        tl.atomic_xchg(cnt_ptr + row, 0)  # ready for the next call (graph replays too)


@triton.jit
def _finish(ws_ptr, idx_ptr, tok_ptr, lp_ptr, row, B, C, m, total, greedy, greedy_tok,
            BLOCK_C: tl.constexpr):
    """The row's outputs from the ``C`` partials, read in chunk order (deterministic sums)."""
    cs = tl.arange(0, BLOCK_C)
    ok = cs < C
    base = row * C + cs
    best = tl.load(ws_ptr + 2 * B * C + base, mask=ok, other=-2.0, cache_modifier=".cg")
    x_best = tl.load(ws_ptr + 3 * B * C + base, mask=ok, other=0.0, cache_modifier=".cg")
    mass = tl.load(ws_ptr + 4 * B * C + base, mask=ok, other=0.0, cache_modifier=".cg")
    win = tl.argmax(best, 0, tie_break_left=True)  # first chunk: the smaller id on ties
    tok = tl.load(idx_ptr + B * C + row * C + win, cache_modifier=".cg")
    x_tok = tl.sum(tl.where(cs == win, x_best, 0.0), 0)
    # greedy rows: kernel 1's raw argmax, x_tok = max, kept = all: both columns log_softmax
    tok = tl.where(greedy, greedy_tok, tok)
    x_tok = tl.where(greedy, m, x_tok)
    kept = tl.where(greedy, total, tl.sum(mass, 0))
    full = x_tok - m - tl.log(total)
    filtered = x_tok - m - tl.log(kept)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + 2 * row, filtered)
    tl.store(lp_ptr + 2 * row + 1, full)


_WORKSPACES: dict[tuple, tuple[Any, Any, Any]] = {}


def workspace(device: Any, rows: int, vocab: int, chunk: int = CHUNK) -> tuple[Any, Any, Any]:
    """``(ws [5 * B * C] fp32, ids [2 * B * C] int32, counters [B] int32 zeros)`` for this
    (device, B, V, chunk), ``C = cdiv(V, chunk)``; allocated at the first call and reused (the
    kernel leaves the counters at 0)."""
    import torch
    key = (str(device), rows, vocab, chunk)
    if key not in _WORKSPACES:
        n = rows * triton.cdiv(vocab, chunk)
        _WORKSPACES[key] = (torch.empty(5 * n, dtype=torch.float32, device=device),
                            torch.empty(2 * n, dtype=torch.int32, device=device),
                            torch.zeros(rows, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def supported(logits: Any) -> bool:
    """Whether :func:`vocab_sample` serves ``logits``: ``[B, V]`` with ``B >= 1``, ``1 <= V <
    2**31``, unit column stride, fp32/bf16/fp16, on CUDA or under the interpreter."""
    import torch
    return (logits.dim() == 2 and logits.shape[0] >= 1 and 0 < logits.shape[1] < 2 ** 31
            and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (logits.is_cuda or INTERPRETED))


def vocab_sample(logits: Any, temperature: Any, min_p: Any, seeds: Any, gen_idx: Any,
                 chunk: int = CHUNK, num_warps: int = NUM_WARPS) -> tuple[Any, Any]:
    """``(tokens [B] int64, logprobs [B, 2] fp32)`` (module docstring) in two launches.
    ``temperature``/``min_p`` ``[B]`` fp32, ``seeds``/``gen_idx`` ``[B]`` int64, contiguous on
    logits' device; ``chunk`` a power of two. Raises ``ValueError`` when :func:`supported` is
    false."""
    import torch
    if not supported(logits):
        raise ValueError(f"vocab_sample: unsupported logits {tuple(logits.shape)} {logits.dtype} "
                         f"strides {logits.stride()} on {logits.device}; use sampler.sample.")
    rows, vocab = logits.shape
    c = triton.cdiv(vocab, chunk)
    ws, ids, cnt = workspace(logits.device, rows, vocab, chunk)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    lps = torch.empty(rows, 2, dtype=torch.float32, device=logits.device)
    gdc = pdl.launch_kwargs()
    _vocab_sample_softmax_stats[(rows, c)](logits, temperature, ws, ids, logits.stride(0), vocab,
                                           rows, c, CHUNK=chunk, num_warps=num_warps, **gdc)
    _vocab_sample_argmax_race[(rows, c)](
        logits, temperature, min_p, seeds, gen_idx, ws, ids, cnt, tokens, lps, logits.stride(0),
        vocab, rows, c, CHUNK=chunk, BLOCK_C=triton.next_power_of_2(c),
        ACCURATE_LOG=not INTERPRETED, num_warps=num_warps, **gdc)
    return tokens, lps


def routed_sample(logits: Any, temperature: Any, min_p: Any, top_k: Any, top_p: Any, seeds: Any,
                  gen_idx: Any, use_sort: bool = True, full_logprobs: bool = False,
                  fallback: Any = None) -> tuple[Any, Any]:
    """``sampler.sample``'s signature: :func:`vocab_sample` when no row uses top-k/top-p
    (``use_sort=False``) and :func:`supported`, else ``fallback`` (the torch sampler, eager or
    compiled). ``full_logprobs=False`` returns column 0 (the filtered logprob)."""
    if use_sort or not supported(logits):
        return fallback(logits, temperature, min_p, top_k, top_p, seeds, gen_idx,
                        use_sort=use_sort, full_logprobs=full_logprobs)
    tokens, lps = vocab_sample(logits, temperature, min_p, seeds, gen_idx)
    return (tokens, lps) if full_logprobs else (tokens, lps[:, 0])
