"""``lora_expand="consumer"`` in the engine (``engine/lora_pending.py``): option values, the
group's deferral range, and greedy tokens/logprobs against ``lora_expand="triton"`` before and
after an in-place update of the adapters, with the expand launches a decode step makes counted.
The consumer kernels themselves: ``test_lora_consumer.py``.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); skipped when
triton is not importable.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("triton", reason="lora_expand='consumer' needs the triton package")

from _kernels import (
    DEV,
    decode_step_launches,
    inplace_lora_step,
    peft_tiny,
    skip_unless_runnable,
)
from _tiny import random_prompts

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import lora_expand as le
from nbhelpers.engine.lora import LiveGroup, check_lora_expand
from nbhelpers.engine.lora_pending import CONSUMER_MAX_ROWS, defers_rows
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_kernels

skip_unless_runnable(le)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
COUNTS_PER_STEP = DEV == "cpu"
"""Python launch calls equal launches per step only without CUDA graphs (the CPU engine); on
CUDA the decode step is captured once and replayed, so the tests compare outputs there (under
capture: the live-LoRA contract with graphs) and count on the CPU."""


def test_option_values_and_auto_picks_consumer_on_cuda(monkeypatch):
    assert check_lora_expand("consumer") == "consumer"
    assert RunnerOptions(lora_expand="consumer").lora_expand == "consumer"
    with pytest.raises(ValueError, match="consumer"):  # the message lists the new value
        check_lora_expand("prologue")
    # "auto": the consumer mode on CUDA with triton (H200 A/B, step n17a, 2026-12-02), else addmm
    assert resolve_kernels(RunnerOptions(), False)[1] == "addmm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert resolve_kernels(RunnerOptions(), True)[1] == "consumer"
    assert resolve_kernels(RunnerOptions(lora_expand="triton"), True)[1] == "triton"
    defaults = RunnerOptions()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_kernels(defaults, True)[1] == "addmm"  # CUDA without triton


def test_group_defers_only_in_range():
    """``deferred`` gives base outputs + the record in consumer mode up to CONSUMER_MAX_ROWS rows;
    ``apply()`` then equals the group's own call; other modes and more rows: no record."""
    layer = peft_tiny(torch.float32).get_base_model().model.layers[0]
    mods = [layer.mlp.gate_proj, layer.mlp.up_proj]
    x = torch.randn(1, 5, 64, device=DEV)
    with torch.no_grad():
        want = LiveGroup(mods, lora_expand="triton")(x)
        outs, p = LiveGroup(mods, lora_expand="consumer").deferred(x)
        assert p is not None and p.sizes == [128, 128] and p.ranks == [4, 4]
        assert not torch.allclose(outs[0], want[0])  # base only so far
        p.apply()
        for o, w in zip(outs, want):
            torch.testing.assert_close(o, w, rtol=1e-6, atol=1e-6)
        assert LiveGroup(mods, lora_expand="triton").deferred(x)[1] is None
        big = torch.randn(1, CONSUMER_MAX_ROWS + 1, 64, device=DEV)
        assert LiveGroup(mods, lora_expand="consumer").deferred(big)[1] is None


def test_one_part_group_defers_only_from_its_rows():
    """o_proj alone (one part, below ``DEFER_MIN_PARTS``) in consumer mode: no record by default
    (``one_part_rows=0``); with ``one_part_rows`` set, a record from that many rows up to
    CONSUMER_MAX_ROWS, whose ``apply()`` equals the group's own call; none below or above that
    range, nor in ``"triton"`` mode. Two-part groups keep deferring at any count in range."""
    o_proj = peft_tiny(torch.float32).get_base_model().model.layers[0].self_attn.o_proj
    group = LiveGroup([o_proj], lora_expand="consumer")
    x = torch.randn(1, 5, o_proj.in_features, device=DEV)
    with torch.no_grad():
        want = LiveGroup([o_proj], lora_expand="triton")(x)[0]
        assert group.one_part_rows == 0 and group.deferred(x)[1] is None  # today's behaviour
        group.set_lora_expand("consumer", one_part_rows=1)
        (out,), p = group.deferred(x)
        assert p is not None and p.sizes == [o_proj.out_features] and p.ranks == [4]
        assert not torch.allclose(out, want)  # base only so far
        p.apply()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        edge = torch.randn(CONSUMER_MAX_ROWS, o_proj.in_features, device=DEV)
        assert group.deferred(edge)[1] is not None  # the bound itself is in range
        big = torch.randn(1, CONSUMER_MAX_ROWS + 1, o_proj.in_features, device=DEV)
        assert group.deferred(big)[1] is None
        group.set_lora_expand("consumer", one_part_rows=6)
        assert group.deferred(x)[1] is None  # 5 rows < 6
        group.set_lora_expand("triton", one_part_rows=1)
        assert group.deferred(x)[1] is None
    assert [defers_rows(1, n, 16) for n in (15, 16, 64, 65)] == [False, True, True, False]
    assert [defers_rows(2, n, 0) for n in (1, 64, 65)] == [True, True, False]
    assert not defers_rows(1, 32, 0)


def test_one_part_rows_option_values():
    """``lora_consumer_one_part_rows``: 0 by default, any int >= 0 accepted (RunnerOptions and
    the A/B scripts' option check, which lists the fields); -1, "16" and True refused with the
    field's name and the fix."""
    from nbhelpers.bench import flex_ab
    assert RunnerOptions().lora_consumer_one_part_rows == 0
    assert RunnerOptions(lora_consumer_one_part_rows=16).lora_consumer_one_part_rows == 16
    assert flex_ab.check_engine_options({"lora_consumer_one_part_rows": 16}, "x") == {
        "lora_consumer_one_part_rows": 16}
    for bad in (-1, "16", True):
        with pytest.raises(ValueError, match=r"RunnerOptions\.lora_consumer_one_part_rows="
                           r".*must be an int >= 0.*e\.g\. 16; 0 \(the default\)"):
            RunnerOptions(lora_consumer_one_part_rows=bad)
    # values that could never apply (helper-19's trial: an A/B variant would measure nothing)
    assert RunnerOptions(lora_consumer_one_part_rows=16, lora_expand="consumer")
    for mode in ("addmm", "triton", "epilogue"):
        with pytest.raises(ValueError, match=rf"=16 with lora_expand='{mode}': only the consumer "
                           r"mode defers LoRA B; use lora_expand='consumer'"):
            RunnerOptions(lora_consumer_one_part_rows=16, lora_expand=mode)
    assert RunnerOptions(lora_consumer_one_part_rows=CONSUMER_MAX_ROWS)
    with pytest.raises(ValueError, match=rf"above lora_pending.CONSUMER_MAX_ROWS="
                       rf"{CONSUMER_MAX_ROWS}.*use 1-{CONSUMER_MAX_ROWS}"):
        RunnerOptions(lora_consumer_one_part_rows=CONSUMER_MAX_ROWS + 1)


# ----------------------------------------------------------------- the engine

EXPAND_PER_LAYER = 2
"""Expand launches per decode layer left in consumer mode: o_proj's and down_proj's (one-part
groups keep theirs, ``lora_pending.DEFER_MIN_PARTS``); q/k/v and gate_up go to their consumers.
With ``lora_consumer_one_part_rows`` at most the decode rows: none (all four groups defer)."""


def _count_expand(monkeypatch):
    calls = []
    real = le.lora_expand
    monkeypatch.setattr(le, "lora_expand", lambda *a: (calls.append(a[0].shape[0]), real(*a))[1])
    return calls


def _run(model, prompts, **options):
    llm = LLM(model, page_size=64, num_pages=8, max_model_len=64, **options)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)]


def _assert_same(got, want, tol=1e-4):
    for (gt, glp), (wt, wlp) in zip(got, want):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(glp, wlp)) < tol


@pytest.mark.parametrize("one_part_rows,expand_per_layer", [(0, EXPAND_PER_LAYER), (1, 0)],
                         ids=["default", "one_part_rows_1"])
def test_engine_consumer_matches_triton_before_and_after_update(monkeypatch, one_part_rows,
                                                                 expand_per_layer):
    """Tiny fp32 Qwen3, LoRA r=4 on every projection: the same greedy tokens and logprobs
    (|dlogprob| < 1e-4, the lora_expand tests' bound) as ``lora_expand="triton"``, before and
    after an in-place optimizer step on the adapters (live LoRA); the decode steps launch
    fewer expand kernels (prefill keeps them): o_proj's and down_proj's by default, none with
    ``lora_consumer_one_part_rows=1`` (their add+RMSNorm adds B, the last layer's through the
    final norm)."""
    model = peft_tiny(torch.float32)
    prompts = random_prompts(3, 5, 12, seed=2)
    calls = _count_expand(monkeypatch)
    kw = {"fused_elementwise": "triton"}
    llm_t = LLM(model, page_size=64, num_pages=8, max_model_len=64, lora_expand="triton", **kw)
    llm_c = LLM(model, page_size=64, num_pages=8, max_model_len=64, lora_expand="consumer",
                lora_consumer_one_part_rows=one_part_rows, **kw)
    counts = []
    for step in range(2):
        outs = []
        for llm in (llm_t, llm_c):
            calls.clear()
            outs.append([(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)])
            counts.append(sum(1 for n in calls if n <= 4))  # decode rows (bucket of 4)
        _assert_same(outs[1], outs[0])
        if step == 0:
            before = outs[0]
            inplace_lora_step(model)
    assert [t for t, _ in outs[0]] != [t for t, _ in before]  # the update changed the output
    layers, steps = 2, GREEDY.max_new_tokens - 1  # the first token comes from prefill
    if COUNTS_PER_STEP:
        assert counts[0] == counts[2] == 4 * layers * steps  # qkv, o, gate_up, down per layer
        assert counts[1] == counts[3] == expand_per_layer * layers * steps


@pytest.mark.parametrize("one_part_rows", [0, 1])
@pytest.mark.parametrize("lora_dtype", ["model", "adapter"])
def test_engine_consumer_bf16_model_fp32_adapters(monkeypatch, lora_dtype, one_part_rows):
    """TRL's case, a bf16 model with fp32 adapters: through the bf16 shadows
    (``lora_dtype="model"``, B read from ``lora_shadow``'s copies) or the fp32 tensors themselves
    (``"adapter"``: fp32 B, the add in fp32): the tokens of ``lora_expand="triton"`` and its
    logprobs to fp32 summation order, before and after an in-place update of the trainer's
    tensors (the shadows re-copy on the version counters, no user call); with
    ``lora_consumer_one_part_rows=1`` o_proj's and down_proj's B too in add+RMSNorm (no decode
    expand launch left)."""
    model = peft_tiny(torch.bfloat16)
    prompts = random_prompts(2, 6, 10, seed=5)
    kw = {"fused_elementwise": "triton", "lora_dtype": lora_dtype}
    llm_t = LLM(model, page_size=64, num_pages=8, max_model_len=64, lora_expand="triton", **kw)
    llm_c = LLM(model, page_size=64, num_pages=8, max_model_len=64, lora_expand="consumer",
                lora_consumer_one_part_rows=one_part_rows, **kw)
    calls = _count_expand(monkeypatch)
    per_layer = 0 if one_part_rows else EXPAND_PER_LAYER
    seen = []
    for _ in range(2):
        want = llm_t.generate(prompts, GREEDY)
        calls.clear()
        got = llm_c.generate(prompts, GREEDY)
        if COUNTS_PER_STEP:  # decode rows: the bucket of 2; 2 layers, the first token prefilled
            assert sum(1 for n in calls if n <= 2) == per_layer * 2 * (GREEDY.max_new_tokens - 1)
        # CPU: bit-equal (seen here); GPU: tl.dot and the prologue sum r in their own order,
        # so a bf16 output may sit one ulp apart (2e-2 in logprob covers that)
        _assert_same([(o.token_ids, o.logprobs) for o in got],
                     [(o.token_ids, o.logprobs) for o in want], tol=1e-6 if DEV == "cpu" else 2e-2)
        seen.append([o.token_ids for o in want])
        inplace_lora_step(model)
    assert seen[0] != seen[1]


def test_engine_consumer_falls_back_without_triton_elementwise(monkeypatch):
    """``fused_elementwise="off"`` (no consumer kernel): consumer mode runs as ``"triton"``."""
    model = peft_tiny(torch.float32)
    prompts = random_prompts(2, 5, 9, seed=4)
    want = _run(model, prompts, lora_expand="triton", fused_elementwise="off")
    calls = _count_expand(monkeypatch)
    _assert_same(_run(model, prompts, lora_expand="consumer", fused_elementwise="off"), want,
                 tol=1e-6)
    if COUNTS_PER_STEP:  # 4 groups x 2 layers, each pass
        assert len(calls) == 8 * (1 + GREEDY.max_new_tokens - 1)


def _lora_model(model, targets):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model.to(DEV), cfg).eval()


def test_engine_consumer_partial_targets_match_triton(monkeypatch):
    """LoRA on q, v and down only: q/k/v has LoRA on some parts (each part computes its own,
    nothing deferred), o_proj and gate_up none, down_proj one part (not deferred,
    ``DEFER_MIN_PARTS``): the tokens and logprobs of ``"triton"`` and its expand launches."""
    from _tiny import tiny_model
    model = _lora_model(tiny_model("qwen3"), ["q_proj", "v_proj", "down_proj"])
    prompts = random_prompts(2, 5, 9, seed=6)
    calls = _count_expand(monkeypatch)
    want = _run(model, prompts, lora_expand="triton", fused_elementwise="triton")
    n_triton, calls[:] = len(calls), []
    _assert_same(_run(model, prompts, lora_expand="consumer", fused_elementwise="triton"), want)
    if COUNTS_PER_STEP:  # down_proj's expand in both modes
        assert n_triton == len(calls) > 0


@pytest.mark.skipif(DEV != "cpu", reason="tiny-gemma4 engine tests run on the CPU (16-token "
                    "pages); Gemma-4 on CUDA: test_gemma4.test_gpu_compiled_graphs_match_hf")
def test_engine_consumer_gemma4_runs_as_triton():
    """Gemma-4's own block calls its groups directly (no consumer kernels take LoRA there):
    ``"consumer"`` gives exactly the tokens and logprobs of ``"triton"``."""
    from test_gemma4 import SMALL, VOCAB, tiny_gemma4
    model = _lora_model(tiny_gemma4(), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    prompt = random_prompts(1, 12, 12, seed=5, vocab=VOCAB)
    outs = [LLM(model, **SMALL, lora_expand=mode, fused_elementwise="triton").generate(
        prompt, GREEDY)[0] for mode in ("triton", "consumer")]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs


@pytest.mark.skipif(not le.INTERPRETED, reason="counts the Triton interpreter's launches; with "
                    "CUDA, test_engine_consumer_matches_triton_before_and_after_update counts "
                    "the expand launches")
def test_decode_step_triton_launch_count():
    """Triton launches of one decode step (batch 4, tiny 2-layer Qwen3, LoRA on every
    projection; ``bench.profile``'s eager step): ``lora_expand="consumer"`` makes 2 fewer a
    layer than ``"triton"`` (q/k/v's and gate_up's expand launches), gate_up's SiLU x up
    through ``lora_act_mul``'s kernel instead of the plain one, the other launches the same."""
    from collections import Counter

    model = peft_tiny(torch.float32)
    prompts = random_prompts(4, 5, 12, seed=2)
    launches: dict[str, Counter] = {}
    for mode in ("triton", "consumer"):
        llm = LLM(model, page_size=64, num_pages=8, max_model_len=64, lora_expand=mode,
                  fused_elementwise="triton")
        llm.generate(prompts, GREEDY)
        launches[mode] = decode_step_launches(llm)
    layers = len(model.get_base_model().model.layers)
    tri, con = launches["triton"], launches["consumer"]
    assert tri["_lora_expand_gemm"] == 4 * layers
    assert con["_lora_expand_gemm"] == EXPAND_PER_LAYER * layers  # o_proj, down_proj
    assert sum(tri.values()) - sum(con.values()) == (4 - EXPAND_PER_LAYER) * layers
    assert con["_act_mul_lora_kernel"] == tri["_act_mul_kernel"] == layers
    assert "_act_mul_kernel" not in con
    same = ("_lora_expand_gemm", "_act_mul_kernel", "_act_mul_lora_kernel")
    assert Counter({k: v for k, v in con.items() if k not in same}) == \
        Counter({k: v for k, v in tri.items() if k not in same})
