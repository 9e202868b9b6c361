"""Sampler: filters equal the exact filtered softmax, empirical distribution (chi-square), seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.sampler import filtered_probs, sample

SETTINGS = [  # (temperature, top_p, top_k, min_p)
    (1.0, 1.0, -1, 0.1), (0.7, 0.9, -1, 0.0), (1.3, 1.0, 5, 0.0), (1.0, 0.8, 8, 0.05),
]


def reference_probs(logits: np.ndarray, t: float, top_p: float, top_k: int, min_p: float):
    """Plain numpy filtered softmax in vLLM v1's order: temperature, min_p, top-k, top-p."""
    x = logits / t
    p = np.exp(x - x.max())
    p /= p.sum()
    x = np.where(p < min_p * p.max(), -np.inf, x)
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        x[order[top_k:]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    x[order[before >= top_p]] = -np.inf
    p = np.exp(x - x.max())
    return p / p.sum()


def _params(n, t, top_p, top_k, min_p):
    return (torch.full((n,), t), torch.full((n,), min_p), torch.full((n,), top_k),
            torch.full((n,), top_p))


@pytest.mark.parametrize("t,top_p,top_k,min_p", SETTINGS)
def test_filtered_probs_match_reference(t, top_p, top_k, min_p):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2
    temp, mp, tk, tp = _params(3, t, top_p, top_k, min_p)
    got = filtered_probs(logits, temp, mp, tk, tp).numpy()
    for row in range(3):
        np.testing.assert_allclose(got[row], reference_probs(logits[row].double().numpy(), t,
                                                             top_p, top_k, min_p), atol=1e-6)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value over the support (survival function via torch.special)."""
    keep = probs > 0
    exp = probs[keep] * counts.sum()
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize("t,top_p,top_k,min_p", SETTINGS)
def test_empirical_distribution_chi_square(t, top_p, top_k, min_p):
    vocab, n = 24, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)).expand(n, vocab)
    temp, mp, tk, tp = _params(n, t, top_p, top_k, min_p)
    toks, lps = sample(logits, temp, mp, tk, tp, torch.arange(n) * 7919 + 11,
                       torch.zeros(n, dtype=torch.long))
    exact = reference_probs(logits[0].double().numpy(), t, top_p, top_k, min_p)
    counts = np.bincount(toks.numpy(), minlength=vocab)
    assert counts[exact == 0].sum() == 0  # filtered tokens never drawn
    assert chi_square_p(counts, exact) > 1e-3
    np.testing.assert_allclose(lps.exp().numpy(), exact[toks.numpy()], rtol=1e-4)


def test_greedy_rows_take_argmax():
    logits = torch.randn(4, 30)
    temp, mp, tk, tp = _params(4, 0.0, 1.0, -1, 0.0)
    toks, lps = sample(logits, temp, mp, tk, tp, torch.arange(4), torch.zeros(4, dtype=torch.long))
    assert toks.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).max(-1).values)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model("qwen3"), page_size=8, num_pages=64, max_model_len=64)


def test_seeds_reproducible_and_independent_of_batch(llm):
    prompts = random_prompts(3, 4, 9, seed=4)
    sp = SamplingParams(temperature=1.0, top_k=50, seed=123, max_new_tokens=10, ignore_eos=True)
    a, b = llm.generate(prompts, sp), llm.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = llm.generate(prompts, SamplingParams(**{**sp.to_dict(), "seed": 124}))
    assert [o.token_ids for o in other] != [o.token_ids for o in a]
    torch.manual_seed(0)
    c = llm.generate(prompts, SamplingParams(**{**sp.to_dict(), "seed": None}))
    torch.manual_seed(0)
    d = llm.generate(prompts, SamplingParams(**{**sp.to_dict(), "seed": None}))
    assert [o.token_ids for o in c] == [o.token_ids for o in d]


def test_uniform_noise_strictly_inside_unit_interval():
    from nbhelpers.engine.sampler import uniform_noise
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 1 << 16)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    # the largest hash value maps below 1 in float32 (the bug this guards against)
    top = ((torch.tensor([0xFFFFFFFF]) >> 9).float() + 0.5) * (1.0 / (1 << 23))
    assert float(top) < 1.0


@pytest.mark.parametrize("full", [False, True])
def test_all_greedy_cpu_shortcut_equals_the_general_path(full):
    """A batch of greedy rows only takes ``_all_greedy_on_cpu``'s shortcut on the CPU; one sampled
    row sends the same greedy rows through the general path (filters, hash, race): their tokens
    and both logprob columns must be the same bits either way."""
    from nbhelpers.engine import sampler
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 97, generator=g) * 3
    temp, mp, tk, tp = _params(5, 0.0, 0.9, 7, 0.1)  # filters on: the shortcut must ignore them
    seeds, gen = torch.arange(5) * 31 + 1, torch.arange(5)
    assert sampler._all_greedy_on_cpu(logits, temp)
    fast = sample(logits, temp, mp, tk, tp, seeds, gen, full_logprobs=full)
    temp_mixed = torch.cat([temp, torch.ones(1)])
    assert not sampler._all_greedy_on_cpu(logits, temp_mixed)
    general = sample(torch.cat([logits, logits[:1]]), temp_mixed, *(
        torch.cat([p, p[:1]]) for p in (mp, tk, tp, seeds, gen)), full_logprobs=full)
    assert torch.equal(fast[0], general[0][:5])
    assert torch.equal(fast[1], general[1][:5])
    assert fast[0].tolist() == logits.argmax(-1).tolist()


def test_token_hash_is_cached_once_and_equals_the_formula():
    """``token_hash`` (the per-token half of ``uniform_noise``) is computed once per (V, device),
    as a normal tensor even under inference mode, and is the formula's value."""
    from nbhelpers.engine import sampler
    v = 4099  # a size no other test uses
    sampler._TOKEN_HASH.pop((v, "cpu"), None)
    with torch.inference_mode():
        first = sampler.token_hash(v, torch.device("cpu"))
    assert not first.is_inference()
    assert sampler.token_hash(v, "cpu") is first
    want = sampler._mix32(torch.arange(v, dtype=torch.long) + 0x27D4EB2F)
    assert torch.equal(first, want)
    u = sampler.uniform_noise(torch.tensor([3, -7]), torch.tensor([0, 5]), v)
    row = sampler._mix32(sampler._mix32(torch.tensor([3, -7]) & sampler._M32)
                         ^ sampler._mix32(((torch.tensor([3, -7]) >> 32) & sampler._M32)
                                          ^ 0x9E3779B9)
                         ^ ((torch.tensor([0, 5]) * 0x85EBCA6B) & sampler._M32))
    h = sampler._mix32(row.unsqueeze(1) ^ want.unsqueeze(0))
    assert torch.equal(u, ((h >> 9).float() + 0.5) * (1.0 / (1 << 23)))


def test_token_hash_not_kept_while_compiling(monkeypatch):
    """While ``torch.compile`` traces, the hash is computed inline and not stored (a traced
    tensor in the module cache would outlive its graph)."""
    from nbhelpers.engine import sampler
    v = 4111
    sampler._TOKEN_HASH.pop((v, "cpu"), None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = sampler.token_hash(v, "cpu")
    assert (v, "cpu") not in sampler._TOKEN_HASH
    assert not sampler._all_greedy_on_cpu(torch.zeros(1, 3), torch.zeros(1))
    monkeypatch.undo()
    assert torch.equal(out, sampler.token_hash(v, "cpu"))
