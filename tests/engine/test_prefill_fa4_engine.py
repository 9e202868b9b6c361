"""``prefill_attention="fa4"`` against the engine's own prefill.

CPU: a fake ``flash_attn.cute`` (``_fa4_fake.py``: FlashAttention's varlen forward in torch) with
compute capability 9.0 patched in; the engine's tokens and logprobs with ``"fa4"`` equal
``"flex"`` on tiny Qwen3 / Llama-3 / Gemma-4 (sliding windows, KV sharing), under prefix sharing
and preemption, and the arguments FA4 received (cu_seqlens, causal, softmax_scale, head counts,
window) are checked. The plan alone (cached context ``start > 0``, padding rows, GQA, a window)
is checked against the SDPA plan on a shared pool. GPU: the real FA4 (bf16) against flex
prefill logits and an fp32 reference, on an H200 with the fa4 bundle staged.
"""

from __future__ import annotations

import pytest
import torch
from _fa4_fake import as_hopper, install
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM, prefill_fa4
from nbhelpers.engine.attention import prefill_sdpa_mask, sliding_window
from nbhelpers.engine.kv_cache import PagePool
from nbhelpers.engine.runner_batches import pack_prefill, prefill_attention_batch
from nbhelpers.engine.scheduler import Sequence

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
OPTS = {"page_size": 16, "num_pages": 24, "max_model_len": 96, "decode_attention": "flex"}


def _model(arch: str):
    if arch == "gemma4":
        from test_gemma4 import tiny_gemma4
        return tiny_gemma4()
    return tiny_model(arch)


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """fp32 last-token logits ``[R, vocab]`` of one packed prefill of ``prompts`` through the
    runner's own prefill path (pages from a fresh pool, the runner's resolved attention)."""
    r = llm.runner
    pool = PagePool(r.opt.num_pages, r.opt.page_size)
    seqs = [Sequence(i, list(p), 0, 1) for i, p in enumerate(prompts)]
    for s in seqs:
        s.block_table = pool.allocate(pool.pages_for(s.num_tokens))
    ids, pos, rows, slots = pack_prefill(seqs, r.opt, r.pad_prefill)
    attn = prefill_attention_batch(r.model, r.opt, seqs, rows, pos, r.prefill_attention,
                                   r.max_pages, r.kv)
    return r._prefill_run(ids, pos, slots, seqs, attn)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma4"])
def test_fa4_tokens_equal_flex_and_fa4_gets_the_packed_batch(arch, monkeypatch):
    cute = install(monkeypatch)
    as_hopper(monkeypatch)
    model = _model(arch)
    prompts = random_prompts(3, 5, 40, vocab=model.config.vocab_size)  # past pages and windows
    fa4 = LLM(model, prefill_attention="fa4", **OPTS)
    flex = LLM(model, prefill_attention="flex", **OPTS)
    got, ref = fa4.generate(prompts, GREEDY), flex.generate(prompts, GREEDY)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    em = fa4.runner.model
    assert len(cute.calls) == len(em.layers)  # one prefill step, every layer through FA4
    lens = [len(p) for p in prompts]
    cu = [sum(lens[:i]) for i in range(len(lens) + 1)]
    scales = getattr(em, "scales", None) or [em.scale] * len(em.layers)
    dims = getattr(em, "head_dims", None) or [em.head_dim] * len(em.layers)
    for i, call in enumerate(cute.calls):
        extra = em.spec.mask_for_layer(i)
        assert call["cu_q"] == call["cu_k"] == cu
        assert call["max_q"] == call["max_k"] == max(lens)
        assert call["causal"] is True and call["softcap"] == 0.0 and call["extra"] == {}
        assert call["scale"] == pytest.approx(scales[i])
        assert (call["heads"], call["head_dim"]) == (em.num_heads, dims[i])
        assert call["kv_heads"] == (em.kv_heads[i] if arch == "gemma4" else em.num_kv_heads)
        assert call["window"] == ((extra.window - 1, 0) if extra is not None else (None, None))
    if arch == "gemma4":
        assert {c["window"] for c in cute.calls} == {(None, None), (15, 0)}
    logits_fa4 = prefill_logits(fa4, prompts)
    logits_flex = prefill_logits(flex, prompts)
    assert (logits_fa4 - logits_flex).abs().max() < 1e-4


def test_fa4_under_prefix_sharing_and_preemption(monkeypatch):
    """n=2 (one prefill per group, copy-on-write forks) and a pool small enough to preempt:
    resumed sequences re-prefill prompt + generated tokens through FA4."""
    cute = install(monkeypatch)
    as_hopper(monkeypatch)
    model = tiny_model("qwen3")
    prompts = random_prompts(4, 6, 10, seed=3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, n=2)
    small = {"page_size": 4, "num_pages": 13, "max_model_len": 32, "sync_every": 4,
             "decode_attention": "flex"}
    ref = LLM(model, **{**small, "num_pages": 64}, prefill_attention="flex").generate(prompts, sp)
    llm = LLM(model, **small, prefill_attention="fa4")
    outs = llm.generate(prompts, sp)
    assert llm.last_stats["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert max(abs(x - y) for o, r in zip(outs, ref) for x, y in zip(o.logprobs, r.logprobs)) \
        < 1e-5
    assert any(c["max_q"] > 10 for c in cute.calls)  # a re-prefill longer than any prompt


@pytest.mark.parametrize("window", [None, 6])
def test_plan_with_cached_context_and_padding_equals_the_sdpa_plan(window, monkeypatch):
    """Requests whose queries start past 0 (keys = cached context + new tokens, FA's causal
    bottom-right alignment), three padding query rows, GQA 4:2, scattered pages: FA4 plan
    (fake kernel) vs the SDPA plan over the same pool."""
    cute = install(monkeypatch)
    g = torch.Generator().manual_seed(0)
    ps, num_pages, h, h_kv, d = 4, 16, 4, 2, 8
    k = torch.randn(1, h_kv, num_pages * ps, d, generator=g)
    v = torch.randn(1, h_kv, num_pages * ps, d, generator=g)
    tables = [[3, 7, 1, 9], [5, 2], [11, 4, 6]]
    starts, q_lens = [5, 0, 8], [7, 6, 2]
    ends = torch.tensor(q_lens).cumsum(0).tolist()
    spans = list(zip([0] + ends[:-1], ends))
    q = torch.randn(1, h, ends[-1] + 3, d, generator=g)
    extra = sliding_window(window) if window else None
    plan = prefill_fa4.fa4_prefill_plan(tables, spans, starts, ps, "cpu", extra)
    sdpa = prefill_sdpa_mask(tables, spans, starts, ps, "cpu", extra)
    out = plan.attend(q, k, v, 0.3)
    ref = sdpa.attend(q, k, v, 0.3)
    assert out.shape == q.shape and out[:, :, ends[-1]:].abs().max() == 0
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    call = cute.calls[-1]
    assert call["cu_q"] == [0, 7, 13, 15] and call["cu_k"] == [0, 12, 18, 28]
    assert (call["max_q"], call["max_k"]) == (7, 12)
    with pytest.raises(ValueError, match="tile the packed tokens"):
        prefill_fa4.fa4_prefill_plan(tables, [(0, 7), (8, 14)], [0, 0], ps, "cpu")
    with pytest.raises(ValueError, match="not a sliding window"):
        prefill_fa4.fa4_prefill_plan(tables, spans, starts, ps, "cpu", lambda a, b: a >= b)


def test_plan_soft_cap_reaches_fa4_and_other_score_mods_are_refused(monkeypatch):
    from nbhelpers.engine.attention import soft_cap
    cute = install(monkeypatch)
    k = v = torch.randn(1, 2, 32, 8)
    q = torch.randn(1, 4, 5, 8)
    plan = prefill_fa4.fa4_prefill_plan([[1, 2]], [(0, 5)], [0], 4, "cpu")
    plan.attend(q, k, v, 0.5, soft_cap(20.0))
    assert cute.calls[-1]["softcap"] == 20.0
    with pytest.raises(ValueError, match="soft_cap"):
        plan.attend(q, k, v, 0.5, lambda s, b, h, qi, ki: s)


def _gpu_fa4_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    major = torch.cuda.get_device_capability()[0]
    if major not in prefill_fa4.FA4_CAPABILITIES:
        return f"compute capability {major}.x (FA4 here: sm_90 / sm_100)"
    if not prefill_fa4.fa4_importable():
        return "flash_attn.cute not importable"
    return None


_WHY = _gpu_fa4_reason()


@pytest.mark.skipif(_WHY is not None, reason=f"real FA4 prefill: {_WHY}; run on the H200 host "
                    f"(nvidia-h200) with the fa4 bundle staged: {prefill_fa4.STAGE_FA4}")
def test_gpu_real_fa4_prefill_logits_match_flex():
    """Tiny bf16 Qwen3 (head_dim 128 as Qwen3-4B, GQA 4:2) on the GPU: last-token prefill
    logits with the real FA4 vs compiled flex prefill, both against the fp32 model's own HF
    forward; FA4 must be as close to fp32 as flex is (bf16 noise), and greedy tokens agree."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, max_position_embeddings=1024, tie_word_embeddings=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    fp32 = Qwen3ForCausalLM(cfg).eval().cuda()
    model = Qwen3ForCausalLM(cfg).eval().cuda().to(torch.bfloat16)
    model.load_state_dict({k: t.to(torch.bfloat16) for k, t in fp32.state_dict().items()})
    prompts = random_prompts(3, 5, 300, seed=1)  # across pages of 128
    opts = {"page_size": 128, "num_pages": 16, "max_model_len": 512}
    fa4 = LLM(model, prefill_attention="fa4", **opts)
    flex = LLM(model, prefill_attention="flex", **opts)
    assert fa4.runner.prefill_attention == "fa4"
    with torch.no_grad():
        ref = torch.stack([fp32(torch.tensor([p], device="cuda")).logits[0, -1] for p in prompts])
    a, b = prefill_logits(fa4, prompts), prefill_logits(flex, prompts)
    err_fa4, err_flex = (a - ref).abs().max().item(), (b - ref).abs().max().item()
    assert err_fa4 <= 1.5 * err_flex + 1e-2, (err_fa4, err_flex)
    assert (a - b).abs().max().item() < 0.1
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    assert [o.token_ids[:1] for o in fa4.generate(prompts, sp)] == \
        [o.token_ids[:1] for o in flex.generate(prompts, sp)]
