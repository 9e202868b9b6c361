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
