"""LoRA B inside the consumer kernels (``lora_expand="consumer"``, ``engine/lora_pending.py``,
``engine/kernels/lora_prologue.py``): each consumer against torch (the group's own B step, then the
torch twin of the consumer), the fallbacks, and the engine against ``lora_expand="triton"``.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); the ``gpu`` test
runs them compiled at Qwen3-4B shapes; skipped when triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="lora_expand='consumer' needs the triton package")

from _kernels import DEV, inplace_lora_step, peft_tiny, skip_unless_runnable
from _tiny import random_prompts

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM, fused
from nbhelpers.engine.kernels import fused_norm as fn
from nbhelpers.engine.kernels import lora_expand as le
from nbhelpers.engine.kernels import lora_prologue as lp
from nbhelpers.engine.lora import LiveGroup, check_lora_expand
from nbhelpers.engine.lora_pending import CONSUMER_MAX_ROWS, PendingLora, add_lora_b
from nbhelpers.engine.runner_options import RunnerOptions, resolve_kernels

skip_unless_runnable(fn)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32)]
DTYPE_IDS = ["fp32", "bf16", "bf16_base_fp32_lora"]


def _tol(dtype):
    """fp32: summation order only. bf16: the consumer's roundings (norm, weight product) may
    each differ by one ulp from torch's (``test_fused_kernels._tol``), plus one on the LoRA add."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2,
                                                                       "rtol": 4 * 2 ** -7}


def _pending(sizes, ranks, n_rows, y_dtype, b_dtype, seed=0, s=2.0):
    """A :class:`PendingLora` in LiveGroup's ``ext`` layout when B has ``y``'s dtype (``y`` and
    ``xa`` views of one ``[N, sum(out) + sum(r)]`` GEMM output), else an fp32 ``xa`` of its own
    (fp32 adapters on a 16-bit base); values ~N(0, 1), B ~N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    n, r = sum(sizes), sum(ranks)
    full = torch.randn(n_rows, n + r, generator=g).to(y_dtype).to(DEV)
    xa = full[:, n:] if b_dtype == y_dtype else torch.randn(n_rows, r, generator=g).to(DEV)
    bs = [(0.3 * torch.randn(o, k, generator=g)).to(b_dtype).to(DEV)
          for o, k in zip(sizes, ranks)]
    return PendingLora(full[:, :n], xa, bs, list(sizes), list(ranks), s, le)


def _with_lora(p: PendingLora):
    """``y`` with LoRA B added by the group's own step (``add_lora_b``, torch ``addmm_``), a copy."""
    return add_lora_b(p.y.clone(), p.xa, p.bs, p.sizes, p.ranks, p.scaling)


# ----------------------------------------------------------------- stage 1: o_proj, down_proj


@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n,r", [(1, 64, 4), (5, 64, 8), (3, 2560, 32), (4, 96, 64)],
                         ids=["tiny_o_r4", "tiny_r8", "qwen3_4b_hidden_r32", "r64"])
def test_add_rms_norm_with_lora_matches_torch(y_dtype, b_dtype, rows, n, r):
    p = _pending([n], [r], rows, y_dtype, b_dtype)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(5)).to(y_dtype).to(DEV)
    w = (1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(6))).to(y_dtype).to(DEV)
    delta = p.y.view(1, rows, n)  # how layers.py hands o_proj's output over
    ref_x, ref_h = fused.add_rms_norm(x.view(1, rows, n), _with_lora(p).view(1, rows, n), w, 1e-6)
    y_before = p.y.clone()
    assert fn.lora_supported(p, 1, delta)
    got_x, got_h = fused.triton_add_rms_norm(x.view(1, rows, n), delta, w, 1e-6, lora=p)
    assert torch.equal(p.y, y_before)  # the base output is read, not written
    torch.testing.assert_close(got_x, ref_x, **_tol(y_dtype))
    torch.testing.assert_close(got_h, ref_h, **_tol(y_dtype))


def test_add_norm_unsupported_lora_falls_back_or_raises():
    """Rank above MAX_RANK, or a delta that is not the record's ``y``: ``fused`` adds B first
    (``apply()``, same result as the group's own step), the raw kernel raises."""
    p = _pending([64], [lp.MAX_RANK + 16], 3, torch.float32, torch.float32)
    x, w = torch.randn(1, 3, 64, device=DEV), torch.ones(64, device=DEV)
    want = fused.add_rms_norm(x, _with_lora(p).view(1, 3, 64), w, 1e-6)
    assert not fn.lora_supported(p, 1, p.y)
    with pytest.raises(ValueError, match="lora.apply"):
        fn.add_norm(p.y, x.view(3, 64), out_norm=(w, 1e-6, "llama"), lora=p)
    got = fused.triton_add_rms_norm(x, p.y.view(1, 3, 64), w, 1e-6, lora=p)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    q = _pending([64], [4], 3, torch.float32, torch.float32)
    assert not fn.lora_supported(q, 1, q.y.clone())  # another tensor than y: not read as y_base
    assert not fn.lora_supported(q, 2, q.y)  # a two-part consumer is not this one


def test_option_values_and_auto_unchanged():
    assert check_lora_expand("consumer") == "consumer"
    assert RunnerOptions(lora_expand="consumer").lora_expand == "consumer"
    with pytest.raises(ValueError, match="consumer"):  # the message lists the new value
        check_lora_expand("prologue")
    for on_cuda in (False, True):  # "auto" never picks the consumer mode (no H200 A/B yet)
        assert resolve_kernels(RunnerOptions(), on_cuda)[1] in ("addmm", "triton")


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


# ----------------------------------------------------------------- stage 2: gate_up


@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inter,ranks", [(1, 128, [4, 4]), (5, 96, [8, 16]),
                                              (3, 2048, [32, 32])],
                         ids=["tiny_gate_up_r4", "ranks_differ", "wide_r32"])
def test_silu_mul_with_lora_matches_torch(y_dtype, b_dtype, rows, inter, ranks):
    p = _pending([inter, inter], ranks, rows, y_dtype, b_dtype, seed=1)
    gate, up = p.y.view(1, rows, 2 * inter).split(inter, -1)  # LiveGroup's split views
    ref_g, ref_u = _with_lora(p).view(1, rows, 2 * inter).split(inter, -1)
    assert fn.lora_supported(p, 2, gate, up)
    got = fused.triton_silu_mul(gate, up, lora=p)
    torch.testing.assert_close(got, fused.silu_mul(ref_g, ref_u), **_tol(y_dtype))


def test_act_mul_unsupported_lora_falls_back_or_raises():
    p = _pending([64, 64], [4, lp.MAX_RANK + 1], 2, torch.float32, torch.float32)
    gate, up = p.y.split(64, -1)
    want = fused.silu_mul(*_with_lora(p).split(64, -1))
    assert not fn.lora_supported(p, 2, gate, up)
    with pytest.raises(ValueError, match="lora.apply"):
        fn.act_mul(gate, up, lora=p)
    torch.testing.assert_close(fused.triton_silu_mul(gate, up, lora=p), want, rtol=1e-5,
                               atol=1e-5)
    q = _pending([64, 64], [4, 4], 2, torch.float32, torch.float32)
    g2, u2 = q.y.split(64, -1)
    assert not fn.lora_supported(q, 2, u2, g2)  # parts swapped: not read as their y_base


# ----------------------------------------------------------------- the engine


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


def test_engine_consumer_matches_triton_before_and_after_update(monkeypatch):
    """Tiny fp32 Qwen3, LoRA r=4 on every projection: the same greedy tokens and logprobs
    (|dlogprob| < 1e-4, the lora_expand tests' bound) as ``lora_expand="triton"``, before and
    after an in-place optimizer step on the adapters (live LoRA); the decode steps launch
    fewer expand kernels (prefill keeps them)."""
    model = peft_tiny(torch.float32)
    prompts = random_prompts(3, 5, 12, seed=2)
    calls = _count_expand(monkeypatch)
    kw = {"fused_elementwise": "triton"}
    llm_t = LLM(model, page_size=64, num_pages=8, max_model_len=64, lora_expand="triton", **kw)
    llm_c = LLM(model, page_size=64, num_pages=8, max_model_len=64, lora_expand="consumer", **kw)
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
    assert counts[0] == counts[2] == 4 * layers * steps  # qkv, o, gate_up, down per layer
    assert counts[1] == counts[3] == EXPAND_PER_LAYER * layers * steps


EXPAND_PER_LAYER = 1
"""Expand launches per decode layer left in consumer mode (qkv, stage 2)."""


def test_engine_consumer_falls_back_without_triton_elementwise(monkeypatch):
    """``fused_elementwise="off"`` (no consumer kernel): consumer mode runs as ``"triton"``."""
    model = peft_tiny(torch.float32)
    prompts = random_prompts(2, 5, 9, seed=4)
    want = _run(model, prompts, lora_expand="triton", fused_elementwise="off")
    calls = _count_expand(monkeypatch)
    _assert_same(_run(model, prompts, lora_expand="consumer", fused_elementwise="off"), want,
                 tol=1e-6)
    assert len(calls) == 8 * (1 + GREEDY.max_new_tokens - 1)  # 4 groups x 2 layers, each pass


# ----------------------------------------------------------------- GPU, compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES[1:], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_gpu_qwen3_4b_shapes_match_torch(y_dtype, b_dtype, rows):
    """Compiled consumers at Qwen3-4B shapes (hidden 2560, intermediate 9728, r 32) against
    torch on the device."""
    test_add_rms_norm_with_lora_matches_torch(y_dtype, b_dtype, rows, 2560, 32)
    test_silu_mul_with_lora_matches_torch(y_dtype, b_dtype, rows, 9728, [32, 32])
