"""Bad input to the flex engine's API found by a fresh-user trial, third round: each is refused
before any engine state is built (or, at ``generate``, before any step runs), with a TypeError /
ValueError that names the fix; vLLM's ``TokensPrompt`` dict form is accepted (CPU; tiny random
models from ``tests/engine/_tiny.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _tiny import VOCAB, tiny_model

from nbhelpers.config import SamplingParams

OPTIONS = {"page_size": 16, "num_pages": 24, "max_model_len": 96}
GREEDY = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model):
    from nbhelpers.engine import LLM
    return LLM(model, **OPTIONS)


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if the engine model is built (every check must come first)."""
    from nbhelpers.engine import llm
    built = []
    monkeypatch.setattr(llm, "ModelRunner", lambda *a, **k: built.append(a))
    return built


@pytest.fixture
def no_step(llm, monkeypatch):
    """Fail the test if ``generate`` schedules a step (its checks must come first)."""
    monkeypatch.setattr(llm, "_step", lambda *a, **k: pytest.fail("a step ran"))
    return llm


# ------------------------------------------------------------- the model and its EOS ids
def test_a_base_model_without_lm_head_names_the_causal_lm(model, no_build):
    from nbhelpers.engine import LLM
    with pytest.raises(TypeError) as err:
        LLM(model.model, **OPTIONS)
    msg = str(err.value)
    assert "LlamaModel has no LM head (lm_head)" in msg
    assert "pass the *ForCausalLM model" in msg and "AutoModelForCausalLM" in msg
    assert not no_build


@pytest.mark.parametrize("eos", [-1, 10**9, VOCAB, [3, VOCAB]])
def test_eos_ids_outside_the_vocabulary_are_refused(model, no_build, eos):
    from nbhelpers.engine import LLM
    with pytest.raises(ValueError, match=rf"LLM: eos_token_id=.*outside the vocabulary \[0, "
                                         rf"vocab_size={VOCAB}\).*eos_token_id=tokenizer"):
        LLM(model, eos_token_id=eos, **OPTIONS)
    assert not no_build


def test_eos_ids_at_the_vocabulary_edges_pass(model):
    from nbhelpers.engine import LLM
    assert LLM(model, eos_token_id=[0, VOCAB - 1], **OPTIONS).eos_ids == {0, VOCAB - 1}


def test_stop_ids_outside_the_vocabulary_are_refused(no_step):
    with pytest.raises(ValueError, match=rf"stop_token_ids: \[{VOCAB}\] outside \[0, vocab_size"):
        no_step.generate([[1, 2]], SamplingParams(max_new_tokens=2, stop_token_ids=[VOCAB]))


def test_a_pool_too_small_explains_the_reserved_null_page(model):
    from nbhelpers.engine import LLM
    small = LLM(model, page_size=16, num_pages=2, max_model_len=96)
    with pytest.raises(ValueError) as err:
        small.generate([[1] * 20], GREEDY)
    msg = str(err.value)
    assert "needs 3 pages" in msg and "the pool has 1 usable" in msg
    assert "num_pages=2 counts page 0, the null page" in msg
    assert "; raise num_pages to >= 4" in msg


def test_a_request_that_cannot_finish_in_the_pool_is_refused_before_any_step(model, monkeypatch):
    """Admission counted the prompt's pages plus one a sample, so a short prompt's completion
    was decoded and then lost when a long one ran out of pages mid-decode (fresh-user report,
    2026-12-01); the whole request is now checked against prompt + max_new_tokens first."""
    from nbhelpers.engine import LLM
    small = LLM(model, page_size=16, num_pages=9, max_model_len=256)  # 8 usable pages
    sampling = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    real_step = small._step
    monkeypatch.setattr(small, "_step", lambda *a, **k: pytest.fail("a step ran"))
    with pytest.raises(ValueError) as err:
        small.generate([[5] * 10, [6] * 100], sampling)
    msg = str(err.value)
    assert "a 100-token prompt + max_new_tokens=40 needs 9 pages of 16 tokens" in msg
    assert "8 usable" in msg and "raise num_pages to >= 10" in msg
    monkeypatch.setattr(small, "_step", real_step)
    # exactly at the edge: 100 + 29 new tokens = 128 KV positions = 8 pages (the last sampled
    # token needs no KV slot); the engine still serves after the refusal
    edge = SamplingParams(temperature=0, max_new_tokens=29, ignore_eos=True)
    (out,) = small.generate([[6] * 100], edge)
    assert len(out.token_ids) == 29


# ------------------------------------------------------------- prompts
def test_a_tokenizer_batch_encoding_says_to_pass_its_input_ids(no_step):
    from transformers import BatchEncoding
    enc = BatchEncoding({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]})
    with pytest.raises(TypeError) as err:
        no_step.generate(enc, GREEDY)
    msg = str(err.value)
    assert "got a tokenizer BatchEncoding" in msg and "pass its .input_ids as a list of lists" in msg
    assert "is text" not in msg


def test_vllm_tokens_prompt_dicts_give_the_same_tokens_as_id_lists(llm):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    as_dicts = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)
    as_lists = llm.generate(ids, GREEDY)
    assert [c.token_ids for c in as_dicts] == [c.token_ids for c in as_lists]
    assert [c.prompt_ids for c in as_dicts] == ids


def test_one_tokens_prompt_dict_says_to_wrap_it(no_step):
    with pytest.raises(TypeError, match=r"one TokensPrompt dict: wrap it in a list"):
        no_step.generate({"prompt_token_ids": [1, 2]}, GREEDY)


@pytest.mark.parametrize("row, match", [
    ({"prompt": "hello"}, r"vLLM TextPrompt .*\{'prompt_token_ids': tokenizer\(text\)"),
    ({"prompt_token_ids": [1], "multi_modal_data": {}}, (r"take only \['prompt_token_ids'\].*"
                                                        r"\['multi_modal_data'\]")),
    ({}, r"empty dict: pass \{'prompt_token_ids': ids\}"),
    ({"prompt_token_ids": "abc"}, r"prompt 0 is text"),
])
def test_other_dict_prompts_name_the_fix(no_step, row, match):
    with pytest.raises(TypeError, match=match):
        no_step.generate([row], GREEDY)


# ------------------------------------------------------------- vLLM keyword names
@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 8}, r"generate\(max_tokens=\.\.\.\): .*SamplingParams\(max_new_tokens"),
    ({"temperature": 0.5}, r"generate\(temperature=\.\.\.\): .*SamplingParams\(temperature"),
    ({"presence_penalty": 1.0}, r"do not implement presence_penalty"),
    ({"best_of": 2}, r"use n=\.\.\."),
    ({"use_tqdm": False}, r"use_tqdm=\.\.\.\): the flex engine shows no progress bar"),
    ({"sampling_parms": GREEDY}, r"sampling_parms=\.\.\.\): unexpected keyword argument"),
])
def test_generate_keywords_it_lacks_name_where_they_belong(no_step, kwargs, match):
    with pytest.raises(TypeError, match=match):
        no_step.generate([[1, 2]], GREEDY, **kwargs)


def test_the_suggested_num_pages_clears_every_check(model):
    """A fresh-user trial: num_pages=2, a 10-token prompt, 64 new tokens: the message said
    'raise num_pages to >= 3', then at 3 'needs 5 pages ... >= 6'. One number that is enough."""
    from nbhelpers.engine import LLM
    sampling = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    with pytest.raises(ValueError) as err:
        LLM(model, page_size=16, num_pages=2, max_model_len=96).generate([[1] * 10], sampling)
    msg = str(err.value)
    assert "raise num_pages to >= 6" in msg and "each sample alone needs 5 pages" in msg
    (out,) = LLM(model, page_size=16, num_pages=6, max_model_len=96).generate([[1] * 10],
                                                                             sampling)
    assert len(out.token_ids) == 64
