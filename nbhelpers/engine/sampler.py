"""Sampler: temperature, min_p, top_k, top_p, per-request seeds; graph-capturable, no host sync.

Contract: :func:`sample` maps ``logits [B, V]`` (fp32) and per-row parameters (``[B]`` tensors) to
``(tokens [B] int64, logprobs [B] fp32)``. Filters follow vLLM v1's order (vllm/v1/sample/
sampler.py): temperature, then min_p (an argmax-invariant logits processor: drop tokens whose
probability is below ``min_p * max prob``), then top-k, then top-p over the renormalised rest
(vllm/v1/sample/ops/topk_topp_sampler.py ``apply_top_k_top_p``). ``temperature == 0`` rows are
greedy (argmax of the raw logits). The returned logprob is the log-probability of the sampled token
under the processed distribution (greedy rows: the raw ``log_softmax``, as vLLM's raw logprobs).
``sample(..., full_logprobs=True)`` returns ``logprobs [B, 2]`` instead: column 0 as above, column 1
the sampled token's log-probability under the *full* softmax at the same temperature
(``log_softmax(logits / T)``, what TRL's trainer computes). Their difference is the log of the
probability mass the filters kept, ``lp_filtered - lp_full = -log(kept mass) >= 0``: every filter
keeps a set S and renormalises by ``sum_{v in S} p_v``. That one float per token is what the trainer
needs to put the engine's logprob on its own (full) support (TRL PR #7269 does the same with the
trainer's mass over vLLM's returned support ids); no ``[B, V]`` mask leaves the step. Same shapes
every call, no host sync (the decode CUDA graph captures it); only on the CPU, where a check costs
no sync, a batch whose rows are all greedy skips the race (:func:`_all_greedy_on_cpu`: same
results).

Randomness without RNG state: the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, draws a token
with probability ``p`` (the Gumbel-max trick in another form). ``E = -log(u)`` with ``u`` from a
counter-based hash of ``(seed, gen_idx, token id)`` (Chris Wellons' ``lowbias32`` integer hash), so a
request's draw depends only on its seed and the index of the token it samples: reproducible across
batch composition, preemption/resumption, CPU vs GPU and CUDA-graph replays.

``RunnerOptions.sample_kernel="triton"`` (what ``"auto"``, the default, picks on CUDA) runs the
decode steps without top-k/top-p (``use_sort=False``) as two split-vocabulary Triton launches with the same hash, filters and
logprobs (``engine/kernels/vocab_sample.py``); :func:`sample` stays the reference.
"""

from __future__ import annotations

import contextlib
from typing import Any

_M32 = 0xFFFFFFFF
SAMPLE_KERNELS = ("auto", "torch", "triton")
"""Values of ``RunnerOptions.sample_kernel``: decode sampling by :func:`sample` (torch, compiled
with the decode pieces) or, for steps without top-k/top-p, ``engine/kernels/vocab_sample.py``;
``"auto"``: ``"triton"`` on CUDA when triton imports, else ``"torch"``
(``engine/runner_resolve.py`` ``resolve_sample_kernel``)."""


def check_sample_kernel(value: Any, owner: str = "sample_kernel") -> str:
    """``value`` if it is one of :data:`SAMPLE_KERNELS`, else ``ValueError`` naming them."""
    if value not in SAMPLE_KERNELS:
        raise ValueError(f"{owner}={value!r}: must be one of {SAMPLE_KERNELS}.")
    return value


def _mix32(x: Any) -> Any:
    """lowbias32 (nullprogram.com/blog/2018/07/31): int64 tensor holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


_TOKEN_HASH: dict[tuple[int, str], Any] = {}
"""``{(vocab_size, device): token_hash}``: filled by :func:`token_hash` outside compilation and
CUDA-graph capture (a tensor made during capture lives in the graph's private pool)."""


def token_hash(vocab_size: int, device: Any) -> Any:
    """``_mix32(arange(V) + 0x27D4EB2F)`` ``[V]`` int64: the per-token half of
    :func:`uniform_noise`, the same every step, so computed once per (V, device) and kept
    (1.2 MB at Qwen3's 151,936). Recomputed inline while ``torch.compile`` traces or a CUDA graph
    captures. CPU, one thread, V 49,152, batch 1, sampled row (2026-12-07, :func:`sample` timed
    alone): 1.36-2.50 ms a call before, 1.10-1.16 ms with this and the cache."""
    import torch
    if torch.compiler.is_compiling():  # traced inline: no module state read into the graph
        return _mix32(torch.arange(vocab_size, device=device, dtype=torch.long) + 0x27D4EB2F)
    key = (vocab_size, str(device))
    cached = _TOKEN_HASH.get(key)
    if cached is not None:
        return cached
    keep = not (torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing())
    with torch.inference_mode(False) if keep else contextlib.nullcontext():
        vid = _mix32(torch.arange(vocab_size, device=device, dtype=torch.long) + 0x27D4EB2F)
    if keep:
        _TOKEN_HASH[key] = vid
    return vid


def uniform_noise(seeds: Any, gen_idx: Any, vocab_size: int) -> Any:
    """``u [B, V]`` in (0, 1): a pure function of ``(seeds[b], gen_idx[b], v)``.

    Args: ``seeds [B]`` int64 (any 64-bit value), ``gen_idx [B]`` int64.
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    row = _mix32(_mix32(lo) ^ _mix32(hi ^ 0x9E3779B9) ^ ((gen_idx * 0x85EBCA6B) & _M32))
    h = _mix32(row.unsqueeze(1) ^ token_hash(vocab_size, seeds.device).unsqueeze(0))
    # 23 bits: (2^23 - 0.5) is exact in float32, so u < 1 strictly (24 bits rounded the top value
    # to 1.0, E = -log(u) = 0 and p / E gave inf/NaN: a filtered-out token could win)
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def filtered_probs(logits: Any, temperature: Any, min_p: Any, top_k: Any, top_p: Any,
                   use_sort: bool = True) -> Any:
    """Processed distribution ``[B, V]`` (rows sum to 1) for non-greedy sampling.

    ``top_k`` ``[B]`` int64 (``>= V`` or ``<= 0`` disables), ``top_p`` ``[B]`` (1.0 disables).
    ``use_sort=False`` skips top-k/top-p (callers pass it when no row uses them: the sort of a
    151k vocabulary is the most expensive op of the sampler).
    """
    import torch
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits / t.unsqueeze(1)
    probs = torch.softmax(x, dim=-1)
    thresh = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    x = x.masked_fill(probs < thresh, float("-inf"))
    if use_sort:
        x = _top_k_top_p(x, top_k, top_p)
    return torch.softmax(x, dim=-1)


def _top_k_top_p(x: Any, top_k: Any, top_p: Any) -> Any:
    import torch
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_x = sorted_x.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    p = torch.softmax(sorted_x, dim=-1)
    mass_before = p.cumsum(dim=-1) - p  # probability of strictly better tokens
    sorted_x = sorted_x.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def full_logprob(logits: Any, temperature: Any, tokens: Any) -> Any:
    """``log_softmax(logits / T)[b, tokens[b]]`` ``[B]`` fp32 (``T <= 0`` rows: ``T = 1``).

    Args: ``logits [B, V]``, ``temperature [B]``, ``tokens [B]`` int64.
    """
    import torch
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits.float() / t.unsqueeze(1)
    return x.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(x, dim=-1)


def _all_greedy_on_cpu(logits: Any, temperature: Any) -> bool:
    """Whether every row is greedy (``temperature <= 0``), asked only on the CPU outside
    ``torch.compile`` (there the check costs no device sync and no graph break): :func:`sample`
    then returns what its general path gives greedy rows (argmax, raw ``log_softmax`` in both
    columns) without the filters, the noise hash and the race. CPU, one thread, SmolLM2's V
    49,152, batch 1 (2026-12-07): 1.50-2.65 ms a call before, 0.13 ms after, of a ~70 ms decode
    step; end to end, 32 greedy tokens moved within the shared host's +-10 % noise."""
    import torch
    return (logits.device.type == "cpu" and not torch.compiler.is_compiling()
            and bool((temperature <= 0).all()))


def sample(logits: Any, temperature: Any, min_p: Any, top_k: Any, top_p: Any, seeds: Any,
           gen_idx: Any, use_sort: bool = True, full_logprobs: bool = False) -> tuple[Any, Any]:
    """Sample one token per row. Returns ``(tokens [B] int64, logprobs [B] fp32)``, or with
    ``full_logprobs=True`` ``(tokens, [B, 2])``: (filtered, full-softmax) logprob (module
    docstring)."""
    import torch
    logits = logits.float()
    if _all_greedy_on_cpu(logits, temperature):  # the rows below, without the race's work
        greedy = logits.argmax(dim=-1)
        lp = torch.log_softmax(logits, -1).gather(1, greedy.unsqueeze(1)).squeeze(1)
        return greedy, (torch.stack([lp, lp], dim=1) if full_logprobs else lp)
    probs = filtered_probs(logits, temperature, min_p, top_k, top_p, use_sort)
    race = probs / -torch.log(uniform_noise(seeds, gen_idx, logits.shape[-1]))
    sampled = race.argmax(dim=-1)
    greedy = logits.argmax(dim=-1)
    is_greedy = temperature <= 0
    tokens = torch.where(is_greedy, greedy, sampled)
    lp_sampled = torch.log(probs.gather(1, sampled.unsqueeze(1))).squeeze(1)
    lp_greedy = torch.log_softmax(logits, -1).gather(1, greedy.unsqueeze(1)).squeeze(1)
    lp = torch.where(is_greedy, lp_greedy, lp_sampled)
    if not full_logprobs:
        return tokens, lp
    full = torch.where(is_greedy, lp_greedy, full_logprob(logits, temperature, sampled))
    return tokens, torch.stack([lp, full], dim=1)
