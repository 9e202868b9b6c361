"""GPU checks of the flex engine: compiled flex_attention + CUDA graphs give HF's greedy tokens,
graph and eager decode agree, live LoRA is seen by a captured graph."""

from __future__ import annotations

import pytest
import torch

from nbhelpers.bench import flex_sweep as eb
from nbhelpers.config import LoraSpec, SamplingParams
from nbhelpers.engine import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def _tiny():
    return eb.random_qwen3(eb.TINY_QWEN3_SHAPE, dtype="float32", device="cuda")


def test_graphs_match_hf_and_eager():
    model = _tiny()
    prompts = eb.random_prompt_ids(3, 37, model.config.vocab_size, seed=1)
    graphs = LLM(model, page_size=128, num_pages=16, max_model_len=256)
    assert eb.parity(model, graphs, prompts, 16)["all_identical"]
    eager = LLM(model, page_size=128, num_pages=16, max_model_len=256, use_cuda_graphs=False)
    sp = SamplingParams(temperature=1.0, min_p=0.1, seed=3, max_new_tokens=16, ignore_eos=True)
    assert ([o.token_ids for o in graphs.generate(prompts, sp)]
            == [o.token_ids for o in eager.generate(prompts, sp)])
    assert graphs.runner.timings["graph_captures"] >= 1


def test_captured_graph_sees_in_place_lora_update():
    model = eb.attach_lora(_tiny(), LoraSpec(rank=4, alpha=8), b_std=0.5)
    prompt = eb.random_prompt_ids(1, 20, model.config.vocab_size, seed=2)
    llm = LLM(model, page_size=128, num_pages=8, max_model_len=256)
    before = llm.generate(prompt, GREEDY)[0].token_ids
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-4.0)
    after = llm.generate(prompt, GREEDY)[0].token_ids
    assert after != before
    assert after == eb.hf_greedy_reference(model, prompt[0], 16)[0]


def test_float64_model_on_cuda_keeps_flex_and_eager_ops_and_matches_hf():
    """34's exact parity runs a float64 model on the GPU with the eager options of its h200
    profile: "auto" must not pick the Triton decode kernel or the Triton elementwise fusions
    there (no fp64 tiles; Triton 3.6 raised "m_i ... fp64 in loop", H200 2026-12-01)."""
    model = eb.random_qwen3(eb.TINY_QWEN3_SHAPE, dtype="float64", device="cuda")
    prompts = eb.random_prompt_ids(2, 21, model.config.vocab_size, seed=4)
    llm = LLM(model, page_size=128, num_pages=8, max_model_len=256, compile_attention=False,
              compile_layers=False, use_cuda_graphs=False)
    assert llm.runner.decode_attention == "flex" and llm.runner.paged_decode is None
    assert not llm.runner.kernels_ok
    assert eb.parity(model, llm, prompts, 8)["all_identical"]
