"""Programmatic Dependent Launch (runner option ``pdl``, ``engine/kernels/pdl.py``): option values
and resolution, the launch switch, the CPU no-op, and the ``USE_GDC=True`` branches of every
decode kernel run in Triton's interpreter with the PDL instructions stubbed (same tokens and
logprobs as ``pdl="off"``). The sm_90 PTX and the GPU runs: ``test_pdl_builds.py``.

On the CPU the kernels run in Triton's interpreter (``tests/conftest.py``), where PDL stays off.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the PDL kernels need the triton package")

from _kernels import DEV, peft_tiny
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_pdl

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
CUDA = torch.device("cuda")


def test_option_values_and_auto_is_the_default():
    assert RunnerOptions().pdl == "auto"
    for mode in ("auto", "off", "on", "early", "prefetch"):
        assert RunnerOptions(pdl=mode).pdl == mode
    with pytest.raises(ValueError,
                       match=r"pdl='yes'.*\('auto', 'off', 'on', 'early', 'prefetch'\)"):
        RunnerOptions(pdl="yes")
    with pytest.raises(ValueError, match=r"\('off', 'on', 'early', 'prefetch'\)"):
        pdl.check_pdl("auto")  # the launch side takes resolved values only
    with pytest.raises(ValueError, match="pdl"):
        LLM(tiny_model("qwen3").to(DEV), page_size=64, num_pages=4, max_model_len=32, pdl=True)


def test_resolution_needs_hopper_cuda(monkeypatch):
    """``"on"`` -> on only for compute capability >= 9 without the interpreter and without
    ``compile_decode``; ``"auto"`` (the default, after the H200 A/B) the same as ``"on"``;
    ``"off"`` off; the CPU -> off."""
    assert not resolve_pdl(RunnerOptions(pdl="on"), torch.device("cpu"))
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    for major, want in ((9, True), (10, True), (8, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, m=major: (m, 0))
        assert resolve_pdl(RunnerOptions(pdl="on"), CUDA) is want, major
        assert resolve_pdl(RunnerOptions(pdl="auto"), CUDA) is want, major
        assert resolve_pdl(RunnerOptions(), CUDA) is want, major
        assert not resolve_pdl(RunnerOptions(pdl="off"), CUDA)
    assert not resolve_pdl(RunnerOptions(pdl="on", compile_decode=True), CUDA)
    assert not resolve_pdl(RunnerOptions(compile_decode=True), CUDA)
    monkeypatch.setattr(pdl, "interpreted", lambda: True)
    assert not resolve_pdl(RunnerOptions(pdl="on"), CUDA)


def test_scope_sets_the_launch_kwargs(monkeypatch):
    off = {"USE_GDC": False}  # no launch_pdl key: Triton's default launch, as before the option
    assert pdl.launch_kwargs() == off
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    with pdl.scope(True):
        assert pdl.launch_kwargs() == {"USE_GDC": True, "launch_pdl": True}
        with pdl.scope(False):
            assert pdl.launch_kwargs() == off and not pdl.active()
        assert pdl.active()
    assert pdl.launch_kwargs() == off
    monkeypatch.setattr(pdl, "interpreted", lambda: True)
    with pdl.scope(True):  # the interpreter has no griddepcontrol: stays off
        assert pdl.launch_kwargs() == off


def _spy(monkeypatch) -> list[bool]:
    """Record, per kernel launch, whether it was a PDL launch."""
    seen: list[bool] = []
    real = pdl.launch_kwargs

    def spy(**prewait: bool) -> dict[str, bool]:
        kw = real(**prewait)
        seen.append(kw["USE_GDC"])
        assert kw.get("launch_pdl", False) == kw["USE_GDC"]  # never one without the other
        return kw
    monkeypatch.setattr(pdl, "launch_kwargs", spy)
    return seen


def _force_skinny(monkeypatch) -> None:
    """Every decode GEMM runs the skinny kernel (default config): on CUDA the tuner may keep
    cuBLAS for the tiny shapes, and then no skinny launch would be checked."""
    from nbhelpers.engine.kernels import skinny_gemm as sg
    from nbhelpers.engine.skinny_linear import SkinnyLinear
    monkeypatch.setattr(SkinnyLinear, "config",
                        lambda self, x2, w, bias: sg.default_config(w.shape[0], x2.shape[1]))


KERNEL_OPTS = {"page_size": 64, "num_pages": 8, "max_model_len": 64, "skinny_gemm": "triton",
               "fused_elementwise": "triton", "decode_attention": "triton",
               "lora_expand": "triton"}


def greedy_per_mode(model, modes, options, before=None) -> dict:
    """``{mode: [(token_ids, logprobs), ...]}``: :data:`GREEDY` over three random prompts by a
    fresh ``LLM(model, pdl=mode, **options)`` per mode (the GPU parity tests: each asserts the
    runner resolved ``mode`` and captured a decode graph); ``before(mode)`` runs first (spies)."""
    prompts, outs = random_prompts(3, 5, 12, seed=2), {}
    for mode in modes:
        if before is not None:
            before(mode)
        llm = LLM(model, pdl=mode, **options)
        assert llm.runner.pdl_mode == mode
        outs[mode] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)]
        assert llm.runner.timings["graph_captures"] > 0
    return outs


def assert_same_greedy(got, want) -> None:
    """Same greedy tokens, logprobs within 1e-6 (``greedy_per_mode`` rows)."""
    for (t_got, lp_got), (t_want, lp_want) in zip(got, want):
        assert t_got == t_want
        torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), rtol=0,
                                   atol=1e-6)


@pytest.mark.skipif(DEV != "cpu", reason="the CPU no-op; CUDA: test_pdl_builds.py "
                    "test_gpu_pdl_on_matches_off")
def test_on_is_a_no_op_on_the_cpu(monkeypatch):
    """``LLM(model, pdl="on")`` on the CPU resolves off: every kernel launch of its decode steps
    (interpreter) gets ``USE_GDC=False`` and no ``launch_pdl``; tokens as ``pdl="off"``."""
    model = peft_tiny(torch.float32)
    prompts = random_prompts(2, 5, 9, seed=3)
    seen = _spy(monkeypatch)
    llm = LLM(model, pdl="on", **KERNEL_OPTS)
    assert llm.runner.pdl is False
    got = llm.generate(prompts, GREEDY)
    assert seen and not any(seen)
    want = LLM(model, pdl="off", **KERNEL_OPTS).generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.fixture
def gdc_stubs(monkeypatch):
    """:func:`stub_gdc` as a fixture."""
    return stub_gdc(monkeypatch)


def stub_gdc(monkeypatch) -> dict[str, int]:
    """The ``USE_GDC=True`` branches in the interpreter: ``gdc_wait`` / ``gdc_launch_dependents``
    (which the interpreter lacks) as counting no-ops and the interpreter check off, so
    :func:`pdl.scope` turns on (the interpreter drops ``launch_pdl``). Returns the counts."""
    import triton.language as tl
    calls = {"wait": 0, "launch": 0}
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait",
                        lambda: calls.__setitem__("wait", calls["wait"] + 1))
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents",
                        lambda: calls.__setitem__("launch", calls["launch"] + 1))
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    return calls


@pytest.mark.skipif(DEV != "cpu", reason="runs the USE_GDC branch in the interpreter; CUDA: "
                    "test_pdl_builds.py test_gpu_skinny_gemm_pdl_matches_off")
def test_skinny_gemm_peeled_first_tile_is_exact(gdc_stubs):
    """The ``USE_GDC`` skinny GEMM (first K tile peeled, its W load before the wait) gives the
    plain kernel's result bit for bit: several K tiles per split, one split, one tile a split;
    one wait and one launch_dependents per program."""
    from nbhelpers.engine.kernels import skinny_gemm as sg
    torch.manual_seed(0)
    x, w, bias = torch.randn(3, 640), torch.randn(96, 640), torch.randn(96)
    programs = 0
    for cfg in (sg.Config(64, 128, 2), sg.Config(32, 128, 1), sg.Config(64, 128, 8)):
        want = sg.skinny_gemm(x, w, bias, cfg)
        with pdl.scope(True):
            got = sg.skinny_gemm(x, w, bias, cfg)
        assert torch.equal(got, want), cfg
        torch.testing.assert_close(got, torch.addmm(bias, x, w.t()), rtol=1e-5, atol=1e-4)
        programs += -(-96 // cfg.block_n) * sg.launch_split(640, cfg)[0]
    assert gdc_stubs == {"wait": programs, "launch": programs}


@pytest.mark.skipif(DEV != "cpu", reason="runs the USE_GDC branches in the interpreter; CUDA: "
                    "test_pdl_builds.py test_gpu_pdl_on_matches_off")
def test_engine_gdc_branches_match_off_in_the_interpreter(monkeypatch, gdc_stubs):
    """Every decode kernel's ``USE_GDC=True`` build (the runner's switch forced on, the PDL
    instructions stubbed): the greedy tokens and logprobs of ``pdl="off"``, exactly; decode
    launches on, prefill's off."""
    model = peft_tiny(torch.float32)
    prompts = random_prompts(2, 5, 9, seed=3)
    want = LLM(model, pdl="off", **KERNEL_OPTS).generate(prompts, GREEDY)
    assert gdc_stubs == {"wait": 0, "launch": 0}
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    seen = _spy(monkeypatch)
    llm = LLM(model, pdl="on", **KERNEL_OPTS)
    assert llm.runner.pdl is True
    got = llm.generate(prompts, GREEDY)
    assert any(seen) and not all(seen)
    assert gdc_stubs["wait"] > 0 and gdc_stubs["launch"] > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
