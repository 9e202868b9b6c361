"""``prefill_attention="fa4"``: option validation, resolution and the errors naming the fix.

The engine-level equality with flex (fake ``flash_attn.cute``) and the real-FA4 GPU test are in
``test_prefill_fa4_engine.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch
from _fa4_fake import as_hopper, install
from _tiny import tiny_model

from nbhelpers.engine import LLM, prefill_fa4
from nbhelpers.engine.attention import sliding_window, soft_cap
from nbhelpers.engine.runner_options import PREFILL_ATTENTION, RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_prefill

OPTS = {"page_size": 16, "num_pages": 16, "max_model_len": 64}


@pytest.fixture
def no_fa4(monkeypatch):
    """FA4 absent even where it is installed (``sys.modules[name] = None`` blocks the import)."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


def test_bad_value_names_every_choice():
    with pytest.raises(ValueError, match="prefill_attention='flash4'") as err:
        RunnerOptions(prefill_attention="flash4")
    assert all(repr(v) in str(err.value) for v in ("auto", "flex", "sdpa", "fa4"))
    assert "fa4" in PREFILL_ATTENTION


def test_missing_fa4_is_an_import_error_naming_the_bundle(no_fa4):
    for make in (lambda: RunnerOptions(prefill_attention="fa4"),
                 lambda: LLM(tiny_model("qwen3"), prefill_attention="fa4", **OPTS)):
        with pytest.raises(ImportError) as err:
            make()
        text = str(err.value)
        for part in ("python -m nbhelpers.bundles build fa4", "commands fa4", "/tmp/fa4_site",
                     "nvidia_cutlass_dsl/dsl_packages", "prefill_attention='flex'",
                     "pip install -e '.[fa4]'"):
            assert part in text, (part, text)


def test_missing_fa4_fails_the_flex_backend_before_the_weights_load(no_fa4):
    from nbhelpers.backends.flex import _preflight
    from nbhelpers.config import ModelSpec
    with pytest.raises(ImportError, match="build fa4"):
        _preflight(ModelSpec(name="smollm2-135m-instruct"), {"prefill_attention": "fa4"})


def test_staging_text_matches_the_fa4_bundle_set():
    """STAGE_FA4 is hand-written (the engine may not import nbhelpers.bundles): it must name the
    set's site dir and the PYTHONPATH its device commands export."""
    from nbhelpers.bundles.build import _pythonpath
    from nbhelpers.bundles.sets import SETS
    fa4 = SETS["fa4"]
    assert fa4.site in prefill_fa4.STAGE_FA4
    assert f"PYTHONPATH={_pythonpath(fa4)}" in prefill_fa4.STAGE_FA4
    assert "flash-attn-4==4.0.0b36" in fa4.pins and "4.0.0b36" in prefill_fa4.__doc__


def test_auto_never_picks_fa4():
    opt = RunnerOptions()
    assert resolve_prefill(opt, on_cuda=True, sdpa_ok=True) == "flex"
    assert resolve_prefill(opt, on_cuda=False, sdpa_ok=True) == "sdpa"
    assert resolve_prefill(opt, on_cuda=False, sdpa_ok=False) == "flex"


def test_resolution_checks_device_capability_and_dtype(monkeypatch):
    install(monkeypatch)
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="not on CUDA.*prefill_attention='flex'"):
        LLM(model, prefill_attention="fa4", **OPTS)
    monkeypatch.setattr(prefill_fa4, "_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.0"):
        LLM(model, prefill_attention="fa4", **OPTS)
    monkeypatch.setattr(prefill_fa4, "_capability", lambda device: (9, 0))
    with pytest.raises(ValueError, match="bfloat16/float16 models, this one is float32"):
        LLM(model, prefill_attention="fa4", **OPTS)
    as_hopper(monkeypatch)
    llm = LLM(model, prefill_attention="fa4", **OPTS)
    assert llm.runner.prefill_attention == "fa4"
    assert LLM(model, **OPTS).runner.prefill_attention == "sdpa"  # auto: unchanged on the CPU


def test_import_failure_names_the_pythonpath_fix(monkeypatch, tmp_path):
    """flash_attn.cute found but failing to import (cutlass off the path: the .pth trap)."""
    pkg = tmp_path / "flash_attn"
    (pkg / "cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cute" / "__init__.py").write_text("raise ImportError(\"No module named 'cutlass'\")")
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    as_hopper(monkeypatch)
    try:
        with pytest.raises(ImportError, match="cutlass.*dsl_packages"):
            LLM(tiny_model("qwen3"), prefill_attention="fa4", **OPTS)
    finally:  # the half-imported fake package must not outlive the test (it made a later
        # test's find_spec("flash_attn") see an FA4 install: tests/unit/test_backends.py)
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
        importlib.invalidate_caches()


@pytest.mark.parametrize("dim,major,ok", [(64, 9, True), (128, 9, True), (256, 9, True),
                                          (512, 9, False), (12, 9, False), (4, 9, False),
                                          (128, 10, True), (192, 10, False), (256, 10, True)])
def test_head_dims_follow_fa4_b36(dim, major, ok):
    assert prefill_fa4.head_dim_ok(dim, major) is ok


def _fake_engine_model(head_dims, score_mod=None, masks=()):
    from nbhelpers.engine.models import ArchSpec
    spec = ArchSpec(name="X", attn_score_mod=score_mod, layer_masks=tuple(masks))
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16,
                           head_dims=list(head_dims), head_dim=head_dims[0], spec=spec,
                           layers=[None] * len(head_dims))


def test_gemma4_e2b_head_dims_and_odd_score_mods_are_refused(monkeypatch):
    """Gemma-4 E2B (sliding 256, full 512) is refused, not run half on flex."""
    as_hopper(monkeypatch)
    e2b = _fake_engine_model([256, 512, 256], masks=[sliding_window(512), None,
                                                     sliding_window(512)])
    assert "head_dim [512]" in prefill_fa4.fa4_problem(e2b)
    assert prefill_fa4.fa4_problem(_fake_engine_model([256, 256])) is None
    assert prefill_fa4.fa4_problem(_fake_engine_model([128], score_mod=soft_cap(30.0))) is None

    def bias(score, b, h, q_idx, kv_idx):
        return score + 1.0
    assert "'bias' has no FA4 form" in prefill_fa4.fa4_problem(
        _fake_engine_model([128], score_mod=bias))
    spec_mask = _fake_engine_model([128, 128], masks=[lambda q, kv: q >= kv])
    assert "not a sliding window" in prefill_fa4.fa4_problem(spec_mask)


def test_gemma4_like_model_with_fa4_head_dims_builds(monkeypatch):
    """A Gemma-4 whose head dims FA4 has (the tiny test one: 16/32) runs (sliding windows go to
    FA4's window_size, KV-shared layers read their store layer's pages)."""
    from test_gemma4 import tiny_gemma4
    install(monkeypatch)
    as_hopper(monkeypatch)
    model = tiny_gemma4()
    llm = LLM(model, prefill_attention="fa4", **OPTS)
    assert llm.runner.prefill_attention == "fa4"
    capped = dataclasses.replace(llm.runner.model.spec, attn_score_mod=soft_cap(30.0))
    llm.runner.model.spec = capped
    assert prefill_fa4.fa4_problem(llm.runner.model) is None
