"""``pdl="early"`` (``engine/kernels/pdl.py``: weights loaded before ``griddepcontrol.wait``,
the ``PREWAIT`` constexpr): the option and its resolution, the launch kwargs, and every
``PREWAIT`` kernel (``lora_expand``, add+RMSNorm, q/k norm + RoPE + cache, the gate_up
consumer) giving exactly (``torch.equal``) the outputs of ``pdl="on"`` in Triton's interpreter
with the PDL instructions stubbed (``test_pdl.stub_gdc``), over the shapes of each kernel's own
tests; then the engine's greedy tokens and logprobs against ``pdl="off"``. The sm_90 PTX
(a weight load before the wait, no store) and the GPU parity: ``test_pdl_builds.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the PDL kernels need the triton package")

from _kernels import DEV, peft_tiny
from _tiny import random_prompts
from test_pdl import CUDA, GREEDY, KERNEL_OPTS, _spy, stub_gdc

from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_pdl_mode

INTERP = pytest.mark.skipif(DEV != "cpu", reason="runs the PREWAIT branches in the interpreter; "
                            "CUDA: test_pdl_builds.py test_gpu_pdl_early_matches_on (H200 suite)")
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32)]
DTYPE_IDS = ["fp32", "bf16", "bf16_base_fp32_lora"]


@pytest.fixture
def gdc_calls(monkeypatch):
    """The PDL instructions stubbed (``test_pdl.stub_gdc``): their call counts."""
    return stub_gdc(monkeypatch)


def test_option_accepts_early_and_bad_values_list_it():
    assert RunnerOptions(pdl="early").pdl == "early"
    assert RunnerOptions().pdl == "auto"  # "auto" resolves to "early" (test below)
    with pytest.raises(ValueError, match=r"pdl='yes'.*\('auto', 'off', 'on', 'early', "):
        RunnerOptions(pdl="yes")
    assert pdl.check_pdl("early") == "early"
    with pytest.raises(ValueError, match=r"\('off', 'on', 'early', 'prefetch'\)"), \
            pdl.scope("fast"):
        pass


def test_resolution_of_early(monkeypatch):
    """``"early"`` (and the opt-in ``"prefetch"``, ``test_pdl_prefetch.py``) resolve to
    themselves where ``"on"`` is on (Hopper, no interpreter, no ``compile_decode``), else
    ``"off"``; ``"auto"`` is ``"early"`` there (the default since the H200 A/B and GPU suite of
    2026-12-02, step ``n17a``)."""
    for mode in ("early", "prefetch"):
        assert resolve_pdl_mode(RunnerOptions(pdl=mode), torch.device("cpu")) == "off"
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    want = {"early": "early", "on": "on", "auto": "early", "off": "off", "prefetch": "prefetch"}
    for mode, got in want.items():
        assert resolve_pdl_mode(RunnerOptions(pdl=mode), CUDA) == got, mode
    for mode in ("early", "prefetch"):
        assert resolve_pdl_mode(RunnerOptions(pdl=mode, compile_decode=True), CUDA) == "off"
    assert resolve_pdl_mode(RunnerOptions(compile_decode=True), CUDA) == "off"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (8, 0))
    for mode in ("early", "prefetch"):
        assert resolve_pdl_mode(RunnerOptions(pdl=mode), CUDA) == "off"


def test_scope_early_adds_prewait_only_where_asked(monkeypatch):
    assert pdl.launch_kwargs(prewait=True) == {"USE_GDC": False, "PREWAIT": False}
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    on = {"USE_GDC": True, "launch_pdl": True}
    for mode, early in ((True, False), ("on", False), ("early", True)):
        with pdl.scope(mode):
            assert pdl.launch_kwargs() == on  # launchers without PREWAIT: unchanged
            assert pdl.launch_kwargs(prewait=True) == {**on, "PREWAIT": early}
            assert pdl.active() and pdl.early() is early
            with pdl.scope("off"):
                assert pdl.launch_kwargs(prewait=True) == {"USE_GDC": False, "PREWAIT": False}
            assert pdl.early() is early
    assert not pdl.early() and not pdl.active()
    monkeypatch.setattr(pdl, "interpreted", lambda: True)
    with pdl.scope("early"):  # the interpreter: off
        assert pdl.launch_kwargs(prewait=True) == {"USE_GDC": False, "PREWAIT": False}


def _prewait_spy(monkeypatch) -> list[bool]:
    """Record ``PREWAIT`` of every launch that asks for it (over :func:`test_pdl._spy`)."""
    seen: list[bool] = []
    real = pdl.launch_kwargs

    def spy(**prewait: bool) -> dict[str, bool]:
        kw = real(**prewait)
        if "PREWAIT" in kw:
            seen.append(kw["PREWAIT"])
            assert kw["USE_GDC"] or not kw["PREWAIT"]  # never early without the wait
        return kw
    monkeypatch.setattr(pdl, "launch_kwargs", spy)
    return seen


def _same_on_and_early(run, calls) -> None:
    """``run()`` (a fresh call returning a tuple of tensors) under ``scope("on")`` and
    ``scope("early")``: bit-identical outputs and the same number of waits (one a program)."""
    outs, waits = {}, {}
    for mode in ("on", "early"):
        before = calls["wait"]
        with pdl.scope(mode):
            assert pdl.early() is (mode == "early")
            outs[mode] = [t.clone() for t in run()]
        waits[mode] = calls["wait"] - before
    assert waits["on"] == waits["early"] > 0
    for a, b in zip(outs["on"], outs["early"]):
        assert a.dtype == b.dtype and torch.equal(a, b)


@INTERP
@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sizes,ranks", [([64, 16, 16], [4, 4, 4]), ([128, 128], [8, 8]),
                                         ([64, 32, 32], [8, 4, 2]), ([32], [80]),
                                         ([64], [16]), ([64, 64], [32, 16]),
                                         ([128, 64, 64], [64, 32, 8])],
                         ids=["qkv_unequal", "gate_up_equal", "ranks_differ", "one_part_r80",
                              "one_part_r16", "two_parts_r32", "three_parts_r64"])
@pytest.mark.parametrize("n_rows", [1, 70])
def test_lora_expand_early_equals_on(gdc_calls, y_dtype, b_dtype, sizes, ranks, n_rows):
    """``lora_expand``'s peeled first rank chunk (B before the wait): 1-3 parts, ranks 2-80
    (one and two ``BLOCK_R`` chunks), the shapes of ``test_lora_expand.py``."""
    from test_lora_expand import _operands

    from nbhelpers.engine.kernels import lora_expand as le

    def run():
        full, y, xa, bs = _operands(sizes, ranks, n_rows, y_dtype, b_dtype)
        le.lora_expand(y, xa, bs, sizes, ranks, 2.0)
        return (full,)
    _same_on_and_early(run, gdc_calls)


@INTERP
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["llama_first", "llama_add", "gemma_sandwich",
                                  "gemma_no_weight", "delta_only"])
def test_add_norm_early_equals_on(gdc_calls, dtype, case):
    """add+RMSNorm's weights before the wait (``wd``, ``wo``, ``layer_scalar``): every norm
    layout ``fused.py`` launches, with dummy weight slots where a weight is missing."""
    from test_fused_kernels import _randn

    from nbhelpers.engine.kernels import fused_norm as fn
    rows, n = 5, 96
    x, h = _randn(rows, n, dtype=dtype), _randn(rows, n, dtype=dtype, seed=1, scale=3.0)
    w1, w2 = _randn(n, dtype=dtype, seed=2), _randn(n, dtype=dtype, seed=3)
    s = torch.tensor([0.7], dtype=dtype, device=DEV)
    kwargs = {"llama_first": {"x": None, "out_norm": (w2, 1e-6, "llama")},
              "llama_add": {"x": x, "out_norm": (w2, 1e-6, "llama")},
              "gemma_sandwich": {"x": x, "out_norm": (w2, 1e-6, "gemma"),
                                 "delta_norm": (w1, 1e-6, "gemma"), "scale": s},
              "gemma_no_weight": {"x": x, "out_norm": (None, 1e-6, "gemma"),
                                  "delta_norm": (None, 1e-6, "gemma"), "scale": s},
              "delta_only": {"x": x}}[case]
    _same_on_and_early(lambda: [t for t in fn.add_norm(h, **kwargs) if t is not None],
                       gdc_calls)


@INTERP
@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n,r", [(1, 64, 4), (5, 64, 8), (3, 2560, 32), (4, 96, 64),
                                      (2, 96, 16)],
                         ids=["tiny_o_r4", "tiny_r8", "qwen3_4b_hidden_r32", "r64", "r16"])
def test_add_norm_lora_early_equals_on(gdc_calls, y_dtype, b_dtype, rows, n, r):
    """The LoRA prologue's first ``LORA_K`` ranks of B before the wait (o_proj/down_proj
    consumer), the shapes of ``test_lora_consumer.py``."""
    from test_lora_consumer import _pending

    from nbhelpers.engine import fused

    def run():
        p = _pending([n], [r], rows, y_dtype, b_dtype)
        x = torch.randn(rows, n, generator=torch.Generator().manual_seed(5)).to(y_dtype)
        w = (1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(6))).to(y_dtype)
        return fused.triton_add_rms_norm(x.view(1, rows, n).to(DEV), p.y.view(1, rows, n),
                                         w.to(DEV), 1e-6, lora=p)
    _same_on_and_early(run, gdc_calls)


@INTERP
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,hkv,d", [(1, 4, 2, 16), (3, 7, 1, 32), (6, 6, 2, 128)],
                         ids=["gqa2", "odd_heads_mqa", "gqa3_d128"])
@pytest.mark.parametrize("style", ["llama", "gemma", None], ids=["qwen3", "gemma", "no_norm"])
def test_qk_rope_cache_early_equals_on(gdc_calls, dtype, t, h, hkv, d, style):
    """q/k norm weights before the wait (q_norm in q programs, k_norm in k/v programs); Gemma's
    weightless v_norm; no norm at all (nothing early: the weight slots are dummies)."""
    from test_fused_kernels import _randn, _rope_case

    from nbhelpers.engine.kernels import qk_rope_cache as qrc

    def run():
        q, k, v, cos, sin, slots, (kc, vc) = _rope_case(t, h, hkv, d, dtype)
        wq, wk = _randn(d, dtype=dtype, seed=5), _randn(d, dtype=dtype, seed=6)
        out = qrc.qk_norm_rope_cache(q, k, v, h, hkv, d, cos, sin, kc, vc, slots,
                                     qk_norm=(wq, wk, 1e-6, style) if style else None,
                                     v_norm=(1e-6, "gemma") if style == "gemma" else None)
        return out, kc, vc
    _same_on_and_early(run, gdc_calls)


@INTERP
@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("t,h,hkv,d,ranks", [(1, 4, 2, 16, [4, 4, 4]), (3, 4, 2, 16, [8, 4, 16]),
                                             (2, 6, 2, 128, [32, 32, 32]),
                                             (2, 4, 2, 32, [64, 16, 8])],
                         ids=["tiny_qwen3_r4", "ranks_differ", "d128_r32", "r64"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_rope_cache_lora_early_equals_on(gdc_calls, y_dtype, b_dtype, t, h, hkv, d, ranks,
                                            qk_norm):
    """The q/k/v consumer's B tiles before the wait (q's or k's and v's, selected by the
    program id), the shapes of ``test_lora_consumer.py``."""
    from test_lora_consumer import _qkv_case

    from nbhelpers.engine import fused

    def run():
        p, cos, sin, slots, (kc, vc) = _qkv_case(t, h, hkv, d, ranks, y_dtype, b_dtype)
        g = torch.Generator().manual_seed(7)
        wq, wk = ((1 + 0.3 * torch.randn(d, generator=g)).to(y_dtype).to(DEV) for _ in range(2))
        wq, wk = (wq, wk) if qk_norm else (None, None)
        q, k, v = p.y.view(1, t, -1).split(p.sizes, -1)
        out = fused.triton_qk_rope_cache(q.view(1, t, h, d), k.view(1, t, hkv, d), v, wq, wk,
                                         1e-6, cos, sin, (kc, vc, slots), (h, hkv, d), lora=p)
        return out, kc, vc
    _same_on_and_early(run, gdc_calls)


@INTERP
@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inter,ranks", [(1, 128, [4, 4]), (5, 96, [8, 16]),
                                              (3, 2048, [32, 32]), (2, 64, [64, 32])],
                         ids=["tiny_gate_up_r4", "ranks_differ", "wide_r32", "r64"])
def test_act_mul_lora_early_equals_on(gdc_calls, y_dtype, b_dtype, rows, inter, ranks):
    """The gate_up consumer's two B tiles before the wait, ``test_lora_consumer.py``'s shapes."""
    from test_lora_consumer import _pending

    from nbhelpers.engine import fused

    def run():
        p = _pending([inter, inter], ranks, rows, y_dtype, b_dtype, seed=1)
        gate, up = p.y.view(1, rows, 2 * inter).split(inter, -1)
        return (fused.triton_silu_mul(gate, up, lora=p),)
    _same_on_and_early(run, gdc_calls)


@INTERP
@pytest.mark.parametrize("expand", ["triton", "consumer"])
def test_engine_early_matches_off_in_the_interpreter(monkeypatch, gdc_calls, expand):
    """The engine with ``pdl="early"`` (the runner's switch forced on, PDL stubbed): the greedy
    tokens and logprobs of ``pdl="off"``, exactly, with the separate expand and with LoRA B in
    the consumers; the runner resolves and records ``"early"``."""
    from nbhelpers.engine.tuner_tables import resolved_kernels
    model = peft_tiny(torch.float32)
    prompts = random_prompts(2, 5, 9, seed=3)
    opts = {**KERNEL_OPTS, "lora_expand": expand}
    want = LLM(model, pdl="off", **opts).generate(prompts, GREEDY)
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    seen = _spy(monkeypatch)
    prewait = _prewait_spy(monkeypatch)
    llm = LLM(model, pdl="early", **opts)
    assert (llm.runner.pdl, llm.runner.pdl_mode) == (True, "early")
    assert resolved_kernels(llm.runner)["pdl_mode"] == "early"
    got = llm.generate(prompts, GREEDY)
    assert any(seen) and not all(seen)  # decode on, prefill off
    assert any(prewait) and not all(prewait)  # PREWAIT kernels early in decode, not prefill
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
