"""Prefill's host-side op counts: the shadow refresh (``lora_dtype="model"``) and the group fork
each issue one ``_foreach_copy_`` however many groups / layers / followers there are
(``lora_shadow.refresh_all``, ``KVCache.copy_pages``; ``scripts/count_prefill_ops.py`` counted
144 and 216 copy dispatches per Qwen3-4B GRPO prefill before). Counts, not times; CPU and GPU.
"""

from __future__ import annotations

import pytest
import torch
from _kernels import DEV, inplace_lora_step, peft_tiny
from _tiny import random_prompts
from torch.utils._python_dispatch import TorchDispatchMode

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kv_cache import KVCache
from nbhelpers.engine.lora import LiveGroup

# the compiled CUDA flex prefill takes pages of a multiple of its 64-token tile (the H200 suite
# of 2026-12-02 refused 16); the CPU keeps its small pages
KW = ({"page_size": 64, "num_pages": 12, "max_model_len": 64} if DEV == "cuda"
      else {"page_size": 16, "num_pages": 16, "max_model_len": 64})


class OpCounter(TorchDispatchMode):
    """Aten op names -> calls (:func:`_prefill_counts` runs flex_attention outside it)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _count(fn) -> dict[str, int]:
    with OpCounter() as c:
        fn()
    return c.counts


def _shadow_pairs(llm):
    return [g._fused["shadow"] for g in llm.runner.model.live_groups()
            if g._fused is not None and "shadow" in g._fused]


def test_refresh_weights_copies_every_stale_shadow_in_one_call_and_none_when_current():
    model = peft_tiny(torch.bfloat16)  # fp32 adapters on a bf16 base: shadows
    llm = LLM(model, lora_dtype="model", **KW)
    pairs = _shadow_pairs(llm)
    assert len(pairs) == 4 * 2  # qkv, o, gate_up, down in each of the 2 layers
    inplace_lora_step(model)
    counts = _count(llm.runner.refresh_weights)
    assert counts.get("_foreach_copy_") == 1 and "copy_" not in counts
    for src, dst in pairs:  # every shadow holds the updated trainer tensor, cast
        for s, d in zip(src, dst):
            assert torch.equal(d, s.detach().to(d.dtype))
    assert "_foreach_copy_" not in _count(llm.runner.refresh_weights)  # nothing changed


def test_generate_checks_the_live_weights_once_and_still_sees_updates(monkeypatch):
    """One weights check per ``LLM.generate`` call (``ModelRunner.begin_generate``), not one per
    prefill and decode window; an in-place optimizer step between calls is still seen."""
    model = peft_tiny(torch.bfloat16)
    llm = LLM(model, lora_dtype="model", sync_every=2, **KW)  # 6 tokens: 1 prefill + 3 windows
    runner, calls, events = llm.runner, [], []
    plain = runner.refresh_weights
    monkeypatch.setattr(runner, "refresh_weights", lambda: calls.append(1) or plain())
    monkeypatch.setattr(llm, "_record", lambda kind, *a, **k: events.append(kind))
    prompt = random_prompts(1, 9, 9, seed=3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True)
    group_refreshes = []
    plain_group = LiveGroup.refresh
    monkeypatch.setattr(LiveGroup, "refresh",
                        lambda self: group_refreshes.append(1) or plain_group(self))
    before = llm.generate(prompt, sp)
    assert events.count("prefill") == 1 and events.count("decode") == 3
    assert len(calls) == 1 and not runner.weights_checked  # reset after the call
    # the groups' eager forwards (CPU; CUDA warm-up/capture) skip their own per-call check
    assert not group_refreshes and not any(g.checked for g in runner.model.live_groups())
    inplace_lora_step(model)  # what the trainer's optimizer does between rollouts
    after = llm.generate(prompt, sp)
    assert len(calls) == 2
    for src, dst in _shadow_pairs(llm):  # the one check copied the update into the shadows
        for s, d in zip(src, dst):
            assert torch.equal(d, s.detach().to(d.dtype))
    assert after[0].logprobs != before[0].logprobs
    fresh = LLM(model, lora_dtype="model", sync_every=2, **KW).generate(prompt, sp)
    assert after[0].token_ids == fresh[0].token_ids  # same as an engine built after the step
    torch.testing.assert_close(after[0].logprobs, fresh[0].logprobs, atol=1e-5, rtol=0)

    def boom():
        raise RuntimeError("stop mid-call")
    monkeypatch.setattr(llm, "_step", lambda *a: boom())
    with pytest.raises(RuntimeError, match="stop mid-call"):
        llm.generate(prompt, sp)
    assert not runner.weights_checked  # a failed call does not leave the check switched off


def test_copy_pages_is_copy_page_per_pair_in_one_call():
    kv = KVCache.allocate(3, 2, 4, num_pages=6, page_size=2, dtype=torch.float32, device=DEV)
    for t in kv.k + kv.v:
        t.copy_(torch.randn_like(t))
    ref = KVCache.allocate(3, 2, 4, num_pages=6, page_size=2, dtype=torch.float32, device=DEV)
    for a, b in zip(ref.k + ref.v, kv.k + kv.v):
        a.copy_(b)
    pairs = [(1, 3), (1, 4), (2, 5)]
    for src, dst in pairs:
        ref.copy_page(src, dst)
    counts = _count(lambda: kv.copy_pages(pairs))
    assert counts.get("_foreach_copy_") == 1 and "copy_" not in counts
    for a, b in zip(ref.k + ref.v, kv.k + kv.v):
        assert torch.equal(a, b)
    assert "_foreach_copy_" not in _count(lambda: kv.copy_pages([]))


def test_shared_prefix_fork_and_batched_refresh_keep_tokens_and_follow_the_trainer():
    """GRPO's shape: one prompt (not a page multiple) x 4 samples, fp32 adapters as shadows.
    Prefilled once and forked, the samples match unshared prefills (same seeds), before and after
    an in-place update, which the next generate sees; the fork is one ``_foreach_copy_``."""
    model = peft_tiny(torch.bfloat16)
    prompt = random_prompts(1, 21, 21, seed=5)
    sp = SamplingParams(temperature=1.0, min_p=0.1, n=4, max_new_tokens=6, ignore_eos=True,
                        seed=11)
    shared = LLM(model, lora_dtype="model", share_prefix=True, **KW)
    plain = LLM(model, lora_dtype="model", share_prefix=False, **KW)
    calls = []
    copy_pages = shared.runner.kv.copy_pages
    shared.runner.kv.copy_pages = lambda pairs: (calls.append(len(pairs)), copy_pages(pairs))

    def run():
        got, want = shared.generate(prompt, sp), plain.generate(prompt, sp)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
        return [g.token_ids for g in got]

    before = run()
    assert calls == [3]  # one call copies the leader's last page into 3 followers
    inplace_lora_step(model)
    assert run() != before


def _prefill_counts(llm, prompts, sp) -> tuple[dict[str, int], list]:
    """Aten op counts of the engine's prefill calls during one ``generate``, and its outputs;
    flex_attention counts as one op (one kernel compiled; its eager CPU form is not what the GPU
    runs, and torch.compile refuses to run under a user dispatch mode)."""
    from torch.utils._python_dispatch import _disable_current_modes
    runner, counts = llm.runner, {}
    prefill, flex = runner.prefill, runner.model.flex

    def one_op(*a, **k):
        counts["flex_attention"] = counts.get("flex_attention", 0) + 1
        with _disable_current_modes():
            return flex(*a, **k)
    runner.model.flex = one_op

    def counted(*a, **k):
        with OpCounter() as c:
            prefill(*a, **k)
        for name, n in c.counts.items():
            counts[name] = counts.get(name, 0) + n
    runner.prefill = counted
    try:
        return counts, llm.generate(prompts, sp)
    finally:
        runner.prefill, runner.model.flex = prefill, flex


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_prefill_elementwise_triton_matches_eager_with_fewer_ops(attention):
    """``prefill_elementwise="triton"``: same greedy tokens and logprobs (fp32 tiny Qwen3 with
    PEFT adapters, 2 prompts packed), and the eager norm/RoPE/SwiGLU ops and KV writes leave the
    prefill (each piece is one kernel launch instead of 2-26 aten ops)."""
    from nbhelpers.engine.kernels import fused_norm
    if not (fused_norm.INTERPRETED or torch.cuda.is_available()):
        pytest.skip("triton imported without TRITON_INTERPRET=1 and no CUDA device")
    model = peft_tiny(torch.float32)
    prompts = random_prompts(2, 9, 23, seed=7)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    # eager prefill: under the CUDA default prefill_graphs="auto" a flex prefill is captured,
    # and the counter sees its 3 warm-up calls + the capture (4 forwards: rsqrt 36, H200
    # 2026-12-03) and a replay dispatches no aten op
    kw = {**KW, "fused_elementwise": "off", "lora_expand": "addmm",
          "prefill_attention": attention, "prefill_graphs": "off"}
    eager_ops, want = _prefill_counts(LLM(model, **kw), prompts, sp)
    fused_ops, got = _prefill_counts(LLM(model, prefill_elementwise="triton", **kw), prompts, sp)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
    assert eager_ops["rsqrt"] == 2 * (2 + 2) + 1  # per layer: 2 block norms + q/k norms; final
    # the norms' pow/mean/rsqrt, SiLU and the KV index_copy_ now run inside the kernels (the
    # interpreter adds its own empty/set_/copy_ calls, so totals are not compared here)
    for name in ("rsqrt", "pow", "mean", "silu", "index_copy_"):
        assert name in eager_ops and name not in fused_ops, name


def test_prefill_elementwise_values_are_checked():
    from nbhelpers.engine.runner_options import RunnerOptions
    with pytest.raises(ValueError, match=r"prefill_elementwise='compile'.*\('off', 'triton'\)"):
        RunnerOptions(prefill_elementwise="compile")
    assert RunnerOptions().prefill_elementwise == "off"
