"""The CPU default attention (SDPA over the rows' own pages) against eager flex_attention and HF.

Covers every registered architecture (tiny Qwen3, Llama-3, Gemma-4 with sliding windows and KV
sharing), several prompts of different lengths across page boundaries, preemption under a small
pool, prefix sharing (n > 1), the ``"auto"`` choice on the CPU and the errors of a model SDPA cannot
express (a score_mod). Timing is ``scripts/cpu_speed.py``, not here.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import hf_greedy, random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.attention import (
    decode_block_mask,
    decode_sdpa_mask,
    paged_attention,
    sliding_window,
    soft_cap,
)
from nbhelpers.engine.kv_cache import phys_to_logical

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
FLEX = {"decode_attention": "flex", "prefill_attention": "flex"}
SDPA = {"decode_attention": "sdpa", "prefill_attention": "sdpa"}


def _gemma4():
    from test_gemma4 import tiny_gemma4
    return tiny_gemma4()


def _model(arch: str):
    return _gemma4() if arch == "gemma4" else tiny_model(arch)


def _vocab(model) -> int:
    return model.config.vocab_size


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma4"])
def test_sdpa_matches_flex_and_hf(arch):
    model = _model(arch)
    prompts = random_prompts(3, 5, 40, vocab=_vocab(model))  # past page 16 and Gemma's window 16
    opts = {"page_size": 16, "num_pages": 24, "max_model_len": 96}
    sdpa = LLM(model, **opts, **SDPA).generate(prompts, GREEDY)
    flex = LLM(model, **opts, **FLEX).generate(prompts, GREEDY)
    for prompt, a, b in zip(prompts, sdpa, flex):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        ref, ref_lp = hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert a.token_ids == ref
        assert max(abs(x - y) for x, y in zip(a.logprobs, ref_lp)) < 1e-4  # test_parity's bound


@pytest.mark.parametrize("arch", ["qwen3", "gemma4"])
def test_sdpa_under_preemption_and_prefix_sharing(arch):
    model = _model(arch)
    prompts = random_prompts(4, 6, 10, seed=3, vocab=_vocab(model))
    sp = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, n=2)
    big = LLM(model, page_size=4, num_pages=64, max_model_len=32, sync_every=4, **FLEX)
    ref = big.generate(prompts, sp)
    tiny = LLM(model, page_size=4, num_pages=13, max_model_len=32, sync_every=4)
    outs = tiny.generate(prompts, sp)
    assert tiny.runner.decode_attention == "sdpa" and tiny.last_stats["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    lp_gap = max(abs(x - y) for o, r in zip(outs, ref) for x, y in zip(o.logprobs, r.logprobs))
    assert lp_gap < 1e-5


def test_auto_picks_sdpa_on_cpu_and_flex_for_a_score_mod():
    model = tiny_model("qwen3")
    llm = LLM(model, page_size=16, num_pages=8, max_model_len=64)
    assert (llm.runner.decode_attention, llm.runner.prefill_attention) == ("sdpa", "sdpa")
    from nbhelpers.engine.models import get_arch_spec
    spec = get_arch_spec(model.config)
    import dataclasses
    capped = dataclasses.replace(spec, attn_score_mod=soft_cap(50.0))
    from unittest import mock
    with mock.patch("nbhelpers.engine.models.get_arch_spec", return_value=capped):
        auto = LLM(model, page_size=16, num_pages=8, max_model_len=64)
        assert (auto.runner.decode_attention, auto.runner.prefill_attention) == ("flex", "flex")
        assert "score_mod" in auto.runner.attention_note
        with pytest.raises(ValueError, match="use 'flex'"):
            LLM(model, page_size=16, num_pages=8, max_model_len=64, decode_attention="sdpa")


def test_sdpa_decode_with_cuda_graphs_is_a_clear_error():
    with pytest.raises(ValueError, match="use_cuda_graphs=False"):
        LLM(tiny_model("llama"), page_size=16, num_pages=8, max_model_len=64,
            use_cuda_graphs=True, decode_attention="sdpa")


def test_bad_prefill_attention_names_the_choices():
    from nbhelpers.engine.runner_options import RunnerOptions
    with pytest.raises(ValueError, match="sdpa"):
        RunnerOptions(prefill_attention="math")


@pytest.mark.parametrize("window", [None, 5])
def test_decode_plan_equals_flex_on_a_shared_pool(window):
    """One decode step, rows of different lengths on scattered pages, one padded row: SDPA plan
    vs flex's paged BlockMask on the same pool (torch reference: eager flex_attention)."""
    from torch.nn.attention.flex_attention import flex_attention
    g = torch.Generator().manual_seed(0)
    ps, num_pages, h, h_kv, d = 4, 12, 4, 2, 8
    k = torch.randn(1, h_kv, num_pages * ps, d, generator=g)
    v = torch.randn(1, h_kv, num_pages * ps, d, generator=g)
    block_table = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [0, 0, 0, 0], [2, 9, 4, 11]])
    pos = torch.tensor([9, 2, 0, 15])  # row 2 is padding (null page only)
    is_pad = torch.tensor([False, False, True, False])
    q = torch.randn(4, h, 1, d, generator=g)
    extra = sliding_window(window) if window else None
    used = pos // ps + 1
    p2l = phys_to_logical(block_table, used, num_pages)
    p2l[:, 0] = torch.where(is_pad, 0, -1)
    mask = decode_block_mask(p2l, block_table, used, pos, ps, num_pages * ps, extra)
    ref = flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True)
    fn = paged_attention(flex_attention)
    out = fn(q, k, v, block_mask=decode_sdpa_mask(block_table, pos, 4, ps, extra), scale=0.3,
             enable_gqa=True)
    live = ~is_pad
    torch.testing.assert_close(out[live], ref[live], atol=1e-6, rtol=1e-5)
    assert torch.isfinite(out).all()
