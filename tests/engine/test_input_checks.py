"""The flex engine rejects bad options and bad prompts with errors that name the fix."""

from __future__ import annotations

import pytest
from _tiny import VOCAB, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM


@pytest.mark.parametrize("option,value", [("page_size", 0), ("num_pages", 1),
                                          ("max_model_len", 0), ("sync_every", 0)])
def test_bad_runner_options_name_the_field(option, value):
    with pytest.raises(ValueError, match=f"RunnerOptions.{option}={value}: must be an int"):
        LLM(tiny_model(), **{option: value})


def test_decode_attention_names_the_accepted_values():
    with pytest.raises(ValueError, match=r"decode_attention='fa3': must be one of \('auto', "
                       r"'flex', 'triton', 'sdpa'\)"):
        LLM(tiny_model(), decode_attention="fa3")


def test_triton_decode_without_triton_names_the_install(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ImportError, match="pip install triton"):
        LLM(tiny_model(), decode_attention="triton")


@pytest.mark.parametrize("bad_id", [-1, VOCAB])
def test_out_of_vocab_token_ids_are_rejected(bad_id):
    llm = LLM(tiny_model(), page_size=16, num_pages=16, max_model_len=64)
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, vocab_size={VOCAB}\)"):
        llm.generate([[1, 2, bad_id]], SamplingParams(temperature=0, max_new_tokens=2))


def test_prompts_of_the_wrong_shape_name_the_fix():
    from nbhelpers.engine.llm import normalize_prompts
    with pytest.raises(TypeError, match="flat list of ids: wrap one prompt"):
        normalize_prompts([1, 2, 3])
    with pytest.raises(TypeError, match="not text"):
        normalize_prompts("hello")
    with pytest.raises(TypeError, match="prompt 0 is text"):
        normalize_prompts(["hello"])
    with pytest.raises(TypeError, match="token ids must be ints, got float"):
        normalize_prompts([[1.0, 2.0]])
    with pytest.raises(TypeError, match="got bool"):
        normalize_prompts([[True, 2]])
    import torch
    assert normalize_prompts(p for p in [[1, 2], torch.tensor([3, 4])]) == [[1, 2], [3, 4]]


def test_a_generator_of_prompts_is_read_once_and_generates():
    from nbhelpers.config import SamplingParams
    llm = LLM(tiny_model(), page_size=16, num_pages=16, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    from_list = llm.generate([[1, 2, 3], [4, 5]], sp)
    from_gen = llm.generate((p for p in [[1, 2, 3], [4, 5]]), sp)
    assert [c.token_ids for c in from_gen] == [c.token_ids for c in from_list]
    assert len(from_gen) == 2


def test_llm_needs_a_loaded_model_and_compile_decode_needs_compiled_attention():
    with pytest.raises(TypeError, match="load_model"):
        LLM("tiny-qwen3")
    with pytest.raises(ValueError, match="compile_decode=True"):
        LLM(tiny_model(), compile_decode=True, compile_attention=False)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": float("inf")}, "finite"), ({"seed": 2**64}, r"seed=.*2\*\*62"),
    ({"stop_token_ids": (-5,)}, "stop_token_ids"),
])
def test_sampling_params_reject_values_the_engine_cannot_take(kwargs, match):
    from nbhelpers.config import SamplingParams
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_engine_option_names_the_close_match():
    from _tiny import tiny_model

    from nbhelpers.engine import LLM
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['page_sz'\].*did you mean "
                                        r"'page_size'"):
        LLM(tiny_model("llama"), page_sz=16)
    # a name inside a field comes first (helper-9's probe, 2026-12-03: `pdl_prefetch=8` got
    # only "did you mean 'l2_prefetch'?", another option)
    with pytest.raises(TypeError, match=r"'pdl_prefetch': did you mean 'pdl_prefetch_mib' or "
                                        r"'pdl'\?"):
        LLM(tiny_model("llama"), pdl_prefetch=8)


def test_an_empty_prompt_says_so():
    llm = LLM(tiny_model(), page_size=16, num_pages=16, max_model_len=64)
    with pytest.raises(ValueError, match="prompt 0 is empty: every prompt needs >= 1 token id"):
        llm.generate([[]], SamplingParams(temperature=0, max_new_tokens=2))
