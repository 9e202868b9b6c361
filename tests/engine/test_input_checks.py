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
                       r"'flex', 'triton'\)"):
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
