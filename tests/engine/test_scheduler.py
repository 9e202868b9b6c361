"""Preemption and resumption under a tiny page pool; prefix sharing vs no sharing."""

from __future__ import annotations

import pytest
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, min_p=0.05, seed=7, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_preemption_resumes_with_same_tokens(model, sampling):
    prompts = random_prompts(4, 6, 10, seed=3)
    big = LLM(model, page_size=4, num_pages=64, max_model_len=32, sync_every=4)
    ref = big.generate(prompts, sampling)
    assert big.last_stats["num_preemptions"] == 0
    tiny = LLM(model, page_size=4, num_pages=13, max_model_len=32, sync_every=4)
    outs = tiny.generate(prompts, sampling)
    assert tiny.last_stats["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) == sampling.max_new_tokens for o in outs)  # no truncation


def test_request_larger_than_pool_is_a_clear_error(model):
    llm = LLM(model, page_size=4, num_pages=4, max_model_len=64)
    with pytest.raises(ValueError, match="raise num_pages"):
        llm.generate([[1] * 20], GREEDY)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_prefix_sharing_gives_same_tokens(model, sampling):
    prompts = random_prompts(2, 9, 14, seed=5)  # partial last page: copy-on-write path
    grpo = SamplingParams(**{**sampling.to_dict(), "n": 3})
    shared = LLM(model, page_size=4, num_pages=64, max_model_len=32, share_prefix=True)
    plain = LLM(model, page_size=4, num_pages=64, max_model_len=32, share_prefix=False)
    a, b = shared.generate(prompts, grpo), plain.generate(prompts, grpo)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert shared.last_stats["prefill_tokens"] < plain.last_stats["prefill_tokens"]


def test_sleep_wake_up(model):
    llm = LLM(model, page_size=4, num_pages=32, max_model_len=32)
    ref = llm.generate([[1, 2, 3]], GREEDY)
    llm.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.generate([[1, 2, 3]], GREEDY)
    llm.wake_up()
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == ref[0].token_ids


def test_extend_records_and_decides_as_append_one_at_a_time():
    """``Sequence.extend`` (a decode window's tokens in one call) leaves the sequence as
    ``append`` token by token with a break at the finishing token: same tokens, logprobs,
    finish reason and return value, over random windows, stop ids and remaining lengths
    (a stop id on the last allowed token is "stop", as in ``append``)."""
    import random

    from nbhelpers.engine.scheduler import Sequence
    rng = random.Random(0)
    for _ in range(2000):
        stop = frozenset(rng.sample(range(8), rng.randint(0, 2)))
        max_new = rng.randint(1, 12)
        done = rng.randint(0, max_new - 1)
        window = rng.randint(1, 10)
        toks = [rng.randrange(8) for _ in range(window)]
        lps = [-rng.random() for _ in toks]
        fulls = [v - rng.random() for v in lps]

        def fresh():
            s = Sequence(0, [1, 2], 0, max_new, stop)
            for j in range(done):
                s.append(9, -0.5, -0.7)  # 9: never a stop id
            return s

        a, b = fresh(), fresh()
        got = a.extend(toks, lps, fulls)
        want = False
        for t, lp, full in zip(toks, lps, fulls):
            if b.append(t, lp, full):
                want = True
                break
        assert (got, a.out_ids, a.out_logprobs, a.out_full_logprobs, a.finish_reason) == (
            want, b.out_ids, b.out_logprobs, b.out_full_logprobs, b.finish_reason)
