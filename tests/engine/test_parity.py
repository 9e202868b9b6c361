"""Greedy parity of the flex engine with HF forwards (tiny Qwen3 / Llama-3 configs, SmolLM2)."""

from __future__ import annotations

import pytest
from _tiny import hf_greedy, random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_matches_hf(arch):
    model = tiny_model(arch)
    prompts = random_prompts(3, 5, 40)  # crosses page boundaries (page_size 16)
    outs = LLM(model, page_size=16, num_pages=64, max_model_len=128).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert out.token_ids == ref
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lp)) < 1e-4
        assert out.finish_reason == "length"


def test_eos_stops_and_reports_stop():
    model = tiny_model("qwen3")
    prompt = random_prompts(1, 8, 8)[0]
    ref, _ = hf_greedy(model, prompt, 6)
    stop = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(ref[2],))
    out = LLM(model, page_size=16, num_pages=16, max_model_len=64).generate([prompt], stop)[0]
    assert out.token_ids == ref[:ref.index(ref[2]) + 1] and out.finish_reason == "stop"


def test_unknown_architecture_is_a_clear_error():
    model = tiny_model("qwen3")
    model.config.architectures = ["MambaForCausalLM"]
    with pytest.raises(ValueError, match="not supported"):
        LLM(model)


def test_prompt_too_long_names_the_fix():
    llm = LLM(tiny_model("llama"), page_size=16, num_pages=16, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 30], GREEDY)


def _smollm2():
    try:
        from nbhelpers.models import load_model
    except ImportError as err:
        pytest.skip(f"nbhelpers.models (helper A) not available yet: {err}")
    from _tiny import skip_if_assets_missing
    name = "smollm2-135m-instruct"
    try:
        return skip_if_assets_missing(name, load_model, name, dtype="float32", device="cpu")
    except (FileNotFoundError, OSError, KeyError, ValueError) as err:
        pytest.skip(f"SmolLM2 weights not loadable offline here: {err}")


def test_greedy_matches_hf_smollm2_real_weights():
    model, tok = _smollm2()
    prompt = tok("The capital of France is")["input_ids"]
    out = LLM(model.eval(), page_size=16, num_pages=32, max_model_len=128).generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))[0]
    ref, ref_lp = hf_greedy(model, prompt, 8)
    assert out.token_ids == ref
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lp)) < 1e-3
