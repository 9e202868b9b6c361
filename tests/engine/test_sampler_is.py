"""The sampler's full-softmax logprob (issue 13 part 2): ``filtered - full == -log(kept mass)``.

Run: ``pytest tests/engine/test_sampler_is.py`` (CPU, fp32).
"""

from __future__ import annotations

import math

import pytest
import torch
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine.sampler import filtered_probs, full_logprob, sample

B, V = 64, 512


def _rows(t: float, min_p: float, top_k: int, top_p: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    full = lambda v, **k: torch.full((B,), v, **k)
    return (logits, full(t), full(min_p), full(top_k, dtype=torch.long), full(top_p),
            torch.arange(B, dtype=torch.long) * 7919, torch.zeros(B, dtype=torch.long))


@pytest.mark.parametrize("t,min_p,top_k,top_p", [(1.0, 0.1, 0, 1.0), (0.7, 0.0, 20, 1.0),
                                                  (1.3, 0.05, 0, 0.8), (1.0, 0.0, 0, 1.0)])
def test_filtered_minus_full_is_log_kept_mass(t, min_p, top_k, top_p):
    args = _rows(t, min_p, top_k, top_p)
    use_sort = top_k > 0 or top_p < 1
    tok, lp = sample(*args, use_sort=use_sort, full_logprobs=True)
    tok2, lp1 = sample(*args, use_sort=use_sort)
    assert lp.shape == (B, 2) and torch.equal(tok, tok2) and torch.equal(lp[:, 0], lp1)
    logits, temp = args[0], args[1]
    kept = filtered_probs(logits, *args[1:5], use_sort=use_sort) > 0      # the support S [B, V]
    soft = torch.softmax(logits / temp.unsqueeze(1), -1)
    log_mass = torch.log((soft * kept).sum(-1))                           # log sum_{v in S} p_v
    ref_full = torch.log_softmax(logits / temp.unsqueeze(1), -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp[:, 1], ref_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[:, 1] - lp[:, 0], log_mass, atol=1e-5, rtol=0)
    if min_p > 0 or top_k > 0 or top_p < 1:  # the filters drop mass: a real gap
        assert float(log_mass.mean()) < -0.01
    else:
        assert float(log_mass.abs().max()) < 1e-6


def test_greedy_rows_full_equals_raw_logprob():
    logits, *rest = _rows(0.0, 0.1, 0, 1.0)
    tok, lp = sample(logits, *rest, full_logprobs=True)
    raw = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp[:, 0], raw)
    torch.testing.assert_close(lp[:, 1], raw)
    torch.testing.assert_close(full_logprob(logits, torch.zeros(B), tok), raw)


def peaked_tiny_model(scale: float = 3.0):
    """:func:`tiny_model` with its (tied) LM head scaled: random init gives near-uniform logits
    (min_p 0.1 would keep every token); scaled, min_p drops real mass."""
    model = tiny_model("qwen3")
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def test_engine_completions_carry_full_logprobs():
    """Prefill and decode both report (filtered, full); full matches an HF forward at T."""
    from nbhelpers.engine import LLM
    model = peaked_tiny_model()
    llm = LLM(model, page_size=16, num_pages=64, max_model_len=128)
    sp = SamplingParams(temperature=0.9, min_p=0.1, n=2, max_new_tokens=12, seed=3)
    outs = llm.generate(random_prompts(2, 5, 9), sp)
    for o in outs:
        assert len(o.full_logprobs) == len(o.token_ids) == len(o.logprobs)
        ids = torch.tensor([o.prompt_ids + o.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(o.prompt_ids) - 1:-1].float() / 0.9
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.full_logprobs), ref, atol=1e-4, rtol=0)
        gap = [f - p for f, p in zip(o.full_logprobs, o.logprobs)]
        assert all(g <= 1e-6 for g in gap) and min(gap) < -1e-3 and not math.isnan(sum(gap))
