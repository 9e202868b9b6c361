"""The decode MLP as one launch in the engine (runner option ``mlp_block``,
``engine/mlp_block.py``): the option's values and errors, the two kernel pieces it leans on
(``lora_expand(round_to=...)``, ``add_norm`` rounding an fp32 delta), and greedy tokens and
logprobs against ``mlp_block="off"`` on tiny Qwen3 / Llama models: no LoRA; fp32 adapters on an
fp32 base before and after an in-place update of the adapters (live LoRA); a bf16 base with fp32
adapters read directly, through the bf16 shadows (the CUDA default) and with bf16 adapters;
partial LoRA targets and batches above 16 rows (the unfused path); the kernel's calls counted.
On CUDA the decode step runs through CUDA graphs (the engine's default there). The kernel
itself: ``test_mlp_block.py``.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); skipped when
triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="mlp_block='triton' needs the triton package")

from _kernels import (
    DEV,
    decode_step_launches,
    inplace_lora_step,
    peft_tiny,
    skip_unless_runnable,
)
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import fused_norm as fn
from nbhelpers.engine.kernels import lora_expand as le
from nbhelpers.engine.kernels import mlp_block as mb
from nbhelpers.engine.mlp_block import MLP_BLOCK_MODES, MlpBlock, check_mlp_block
from nbhelpers.engine.runner_options import RunnerOptions

skip_unless_runnable(mb)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
LAYERS = 2  # the tiny models' layers
DECODE_STEPS = GREEDY.max_new_tokens - 1  # the first token comes from prefill


def test_option_values_and_errors():
    assert MLP_BLOCK_MODES == ("off", "triton") and RunnerOptions().mlp_block == "off"
    assert check_mlp_block("triton") == "triton"
    with pytest.raises(ValueError, match=r"RunnerOptions\.mlp_block='on': use one of "
                       r"\('off', 'triton'\)"):
        RunnerOptions(mlp_block="on")
    for mode in ("compile", "off"):
        with pytest.raises(ValueError, match=rf"fused_elementwise='{mode}'.*use "
                           r"fused_elementwise='triton'"):
            RunnerOptions(mlp_block="triton", fused_elementwise=mode)
    from nbhelpers.bench import flex_ab
    assert flex_ab.check_engine_options({"mlp_block": "triton"}, "x") == {"mlp_block": "triton"}
    assert not MlpBlock().enabled and not MlpBlock("triton", 2, 64, "meta").enabled


@pytest.mark.parametrize("round_to", [torch.bfloat16, torch.float16])
def test_expand_round_to_is_peft_order_on_an_fp32_sum(round_to):
    """``lora_expand(y fp32, ..., round_to=dt)`` = ``rnd(rnd(y) + s * xa @ B^T)`` (PEFT's order
    for fp32 adapters on a ``dt`` base), stored in fp32; a 16-bit ``y`` or another dtype is
    refused."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4, 64, generator=g).to(DEV) * 3
    xa, b = torch.randn(4, 8, generator=g).to(DEV), torch.randn(64, 8, generator=g).to(DEV)
    want = (y.to(round_to).float() + 0.5 * (xa @ b.t())).to(round_to).float()
    got = y.clone()
    le.lora_expand(got, xa, [b], [64], [8], 0.5, round_to=round_to)
    assert got.dtype == torch.float32
    tol = 0 if DEV == "cpu" else float(torch.finfo(round_to).eps)  # GPU: r summed in tl.dot
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got, got.to(round_to).float())  # exactly representable
    with pytest.raises(ValueError, match="round_to is torch.bfloat16 / torch.float16 and needs "
                       "an fp32 y"):
        le.lora_expand(y.to(round_to), xa.to(round_to), [b.to(round_to)], [64], [8], 0.5,
                       round_to=round_to)
    with pytest.raises(ValueError, match="round_to"):
        le.lora_expand(y.clone(), xa, [b], [64], [8], 0.5, round_to=torch.float64)


def test_expand_rounds_an_fp32_xa_sum_to_16bit_b():
    """16-bit adapters (or shadows): an fp32 ``xa`` (mlp_block's unrounded ``h @ A_d^T``) with
    bf16 B and ``round_to`` is rounded to bf16 first, PEFT's ``lora_A`` output dtype; without
    ``round_to`` the mixed dtypes are refused."""
    g = torch.Generator().manual_seed(2)
    y = torch.randn(4, 64, generator=g).to(DEV) * 3
    xa = torch.randn(4, 8, generator=g).to(DEV)
    b = torch.randn(64, 8, generator=g).to(torch.bfloat16).to(DEV)
    xa16 = xa.to(torch.bfloat16).float()
    want = (y.to(torch.bfloat16).float() + 0.5 * (xa16 @ b.float().t())).to(torch.bfloat16)
    got = y.clone()
    le.lora_expand(got, xa, [b], [64], [8], 0.5, round_to=torch.bfloat16)
    tol = 0 if DEV == "cpu" else 1e-2
    torch.testing.assert_close(got, want.float(), rtol=tol, atol=tol)
    assert not le.supported(y, xa, [b], [64], [8]) and le.supported(y, xa, [b], [64], [8],
                                                                    xa_sum=True)


@pytest.mark.parametrize("with_lora", [False, True])
def test_add_norm_rounds_an_fp32_delta_first(with_lora):
    """``add_norm(fp32 delta, bf16 x)`` equals ``add_norm(delta.to(bf16), x)`` (the GEMM
    epilogue's rounding first), with a one-part pending LoRA too; results in ``x``'s dtype."""
    from nbhelpers.engine.lora_pending import PendingLora
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(DEV)
    delta = torch.randn(3, 64, generator=g).to(DEV)
    w = (1 + torch.randn(64, generator=g) * 0.1).to(torch.bfloat16).to(DEV)
    rounded = delta.to(torch.bfloat16)
    lora = lora16 = None
    if with_lora:
        xa, b = torch.randn(3, 4, generator=g).to(DEV), torch.randn(64, 4, generator=g).to(DEV)
        lora = PendingLora(delta, xa, [b], [64], [4], 0.5)
        lora16 = PendingLora(rounded, xa, [b], [64], [4], 0.5)
    res, out = fn.add_norm(delta, x, out_norm=(w, 1e-6, "llama"), lora=lora)
    res16, out16 = fn.add_norm(rounded, x, out_norm=(w, 1e-6, "llama"), lora=lora16)
    assert res.dtype == out.dtype == torch.bfloat16
    assert torch.equal(res, res16) and torch.equal(out, out16)
    with pytest.raises(ValueError, match="or delta fp32 with a bf16/fp16 x"):
        fn.add_norm(delta.double(), x)


# ----------------------------------------------------------------- the engine


def _count_block(monkeypatch):
    calls = []
    real = mb.mlp_block
    monkeypatch.setattr(mb, "mlp_block",
                        lambda x, *a, **k: (calls.append(x.shape[0]), real(x, *a, **k))[1])
    return calls


def _llm(model, mode, **kw):
    return LLM(model, page_size=64, num_pages=12, max_model_len=64, fused_elementwise="triton",
               mlp_block=mode, **kw)


def _assert_same(got, want, tol):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < tol


def _served(calls):
    """Block calls the decode steps made: one a layer a step on the CPU (eager); on CUDA the
    step is captured once per bucket (at least one call a layer) and replayed."""
    return len(calls) >= LAYERS and (DEV != "cpu" or len(calls) == LAYERS * DECODE_STEPS)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_no_lora_matches_unfused(monkeypatch, arch):
    """Tiny fp32 models, no LoRA: the greedy tokens of ``mlp_block="off"``, |dlogprob| < 1e-5
    (the atomics sum the down GEMM in their own order), the block serving every decode layer."""
    model = tiny_model(arch).to(DEV).eval()
    prompts = random_prompts(3, 5, 12, seed=2)
    want = _llm(model, "off").generate(prompts, GREEDY)
    calls = _count_block(monkeypatch)
    got = _llm(model, "triton").generate(prompts, GREEDY)
    _assert_same(got, want, 1e-5)
    assert _served(calls) and set(calls) <= {3, 4}  # the decode bucket's rows


def test_engine_fp32_adapters_live_updates(monkeypatch):
    """Tiny fp32 Qwen3 with PEFT LoRA r=4 on every projection: the tokens and logprobs of the
    unfused path (|dlogprob| < 1e-5) before and after an in-place optimizer step on the
    adapters (the block reads the trainer's own tensors when it runs: on CUDA the graphs
    captured in the first call replay the update), block serving."""
    model = peft_tiny(torch.float32)
    prompts = random_prompts(4, 5, 12, seed=3)
    off, on = _llm(model, "off"), _llm(model, "triton")
    calls = _count_block(monkeypatch)
    seen = []
    for _ in range(2):
        want = off.generate(prompts, GREEDY)
        _assert_same(on.generate(prompts, GREEDY), want, 1e-5)
        seen.append([o.token_ids for o in want])
        inplace_lora_step(model)
    assert seen[0] != seen[1]  # the update changed the output
    assert len(calls) == (2 * LAYERS * DECODE_STEPS if DEV == "cpu" else LAYERS)


@pytest.mark.parametrize("adapters", ["fp32", "fp32_shadow", "bf16"])
def test_engine_bf16_model(monkeypatch, adapters):
    """A bf16 base with PEFT's fp32 adapters read as they are (``lora_dtype="adapter"``),
    through the bf16 shadows (``"model"``, the CUDA default: TRL's case as the engine runs it),
    or with bf16 adapters: the unfused path's tokens, logprobs within bf16 rounding (a flipped
    rounding moves an output by an ulp), the block serving."""
    model = peft_tiny(torch.bfloat16, autocast_adapter_dtype=adapters != "bf16")
    kw = {"lora_dtype": "model" if adapters == "fp32_shadow" else "adapter"}
    prompts = random_prompts(2, 6, 10, seed=5)
    want = _llm(model, "off", **kw).generate(prompts, GREEDY)
    calls = _count_block(monkeypatch)
    got = _llm(model, "triton", **kw).generate(prompts, GREEDY)
    _assert_same(got, want, 5e-2)
    assert _served(calls)


def test_engine_keeps_the_unfused_path_where_the_block_does_not_serve(monkeypatch):
    """LoRA on some of gate/up/down only (here down's alone): no block call, exactly the
    unfused outputs, one warning saying why; a 20-row decode batch (above
    ``engine/mlp_block.ROUTE_MAX_ROWS``): no block call either, silently (a batch size, not a
    setup the user can change)."""
    from peft import LoraConfig, get_peft_model
    calls = _count_block(monkeypatch)
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                     init_lora_weights=False)
    model = get_peft_model(tiny_model("qwen3").to(DEV), cfg).eval()
    prompts = random_prompts(2, 5, 9, seed=4)
    llm = _llm(model, "triton")
    with pytest.warns(UserWarning, match=r"does not serve layer 0's MLP \(LoRA on gate/up but "
                      r"not down, or the reverse\); the unfused path runs there"):
        got = llm.generate(prompts, GREEDY)
    _assert_same(got, _llm(model, "off").generate(prompts, GREEDY), 1e-9)
    assert llm.runner.model.mlp_block.skipped == {"LoRA on gate/up but not down, or the reverse"}
    many = random_prompts(20, 4, 6, seed=7)
    model = tiny_model("qwen3").to(DEV).eval()
    big = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    kw = {"page_size": 64, "num_pages": 24, "max_model_len": 64, "fused_elementwise": "triton"}
    want = LLM(model, mlp_block="off", **kw).generate(many, big)
    got = LLM(model, mlp_block="triton", **kw).generate(many, big)
    _assert_same(got, want, 1e-9)
    assert calls == []


@pytest.mark.skipif(DEV != "cpu", reason="'auto' elementwise kernels resolve to triton on CUDA")
def test_warns_when_it_would_serve_nothing():
    """``mlp_block="triton"`` where the elementwise kernels resolve away from Triton (the CPU
    with ``fused_elementwise="auto"``): a warning naming the fix, the unfused outputs."""
    model = tiny_model("qwen3").to(DEV).eval()
    prompts = random_prompts(1, 5, 5, seed=1)
    with pytest.warns(UserWarning, match=r"mlp_block='triton' serves nothing here.*fused_"
                      r"elementwise resolved to"):
        llm = LLM(model, page_size=64, num_pages=4, max_model_len=64, mlp_block="triton")
    want = LLM(model, page_size=64, num_pages=4, max_model_len=64).generate(prompts, GREEDY)
    _assert_same(llm.generate(prompts, GREEDY), want, 1e-9)


@pytest.mark.skipif(not mb.INTERPRETED, reason="counts the Triton interpreter's launches; on "
                    "CUDA bench_flex.py's kernels/step column counts them (H200 host)")
@pytest.mark.parametrize("lora", [False, True])
def test_decode_step_triton_launches(lora):
    """Triton launches of one decode step (batch 4, tiny 2-layer Qwen3, fp32; with LoRA r=4 on
    every projection, ``lora_expand="consumer"``; ``bench.profile``'s eager step): the block
    replaces, per layer, the SiLU x up kernel (``_act_mul_kernel``, or ``_act_mul_lora_kernel``
    with LoRA) with one ``_mlp_block_kernel`` (the GEMMs run in torch on the CPU, so only the
    Triton ones are counted here); with LoRA o_proj's and down's expand stay one launch each a
    layer; the other Triton launches are unchanged."""
    from collections import Counter

    model = peft_tiny(torch.float32) if lora else tiny_model("qwen3").to(DEV).eval()
    prompts = random_prompts(4, 5, 12, seed=2)
    launches: dict[str, Counter] = {}
    for mode in ("off", "triton"):
        llm = _llm(model, mode, lora_expand="consumer")
        llm.generate(prompts, GREEDY)
        launches[mode] = decode_step_launches(llm)
    off, on = launches["off"], launches["triton"]
    act = "_act_mul_lora_kernel" if lora else "_act_mul_kernel"
    assert off[act] == on["_mlp_block_kernel"] == LAYERS and act not in on
    # o_proj's and down_proj's B: one expand each a layer either way (lora_pending.py)
    assert on["_lora_expand_gemm"] == off["_lora_expand_gemm"] == (2 * LAYERS if lora else 0)
    same = (act, "_mlp_block_kernel")
    assert Counter({k: v for k, v in on.items() if k not in same}) == \
        Counter({k: v for k, v in off.items() if k not in same})


@pytest.mark.parametrize("variant", ["use_dora", "lora_bias"])
def test_engine_refuses_lora_variants_it_does_not_compute(variant):
    """DoRA and a LoRA B bias (PEFT options the engine's ``y + s * B(A(x))`` does not compute):
    building an engine is a ``ValueError`` naming the fix, not other tokens than PEFT's
    (helper-26's trial: |dlogprob| up to 0.24 with either option, mlp_block on or off)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                     init_lora_weights=False, **{variant: True})
    model = get_peft_model(tiny_model("qwen3").to(DEV), cfg).eval()
    with pytest.raises(ValueError, match="(DoRA|LoRA B bias).*merge_and_unload"):
        _llm(model, "off")
