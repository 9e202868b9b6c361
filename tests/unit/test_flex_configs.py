"""Notebook 33's configurations (nbhelpers.bench.flex_configs, flex_ab's checks): LoRA modes and
their old booleans, variants over engine_options, bad values refused naming the fix before any
point runs, and the parent's record of a child that wrote nothing. CPU, no model runs here (the
child path runs in tests/notebooks/test_phase3_33_smoke.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbhelpers.bench import flex_ab as ab
from nbhelpers.bench import flex_configs as fc
from nbhelpers.run.params import plan_parameters

REPO = Path(__file__).resolve().parents[2]
NB33 = REPO / "notebooks/phase3_flex/33_flex_vs_baselines.ipynb"
SETTINGS = {"shape": "tiny", "device": "cpu", "batches": [2, 4], "prompt_tokens": 6,
            "max_new_tokens": 4, "rounds": 1, "lora_rank": 4, "profile": False}


@pytest.mark.parametrize("given, mode", [(True, "bf16"), (False, "none"), ("none", "none"),
                                         ("bf16", "bf16"), ("fp32", "fp32")])
def test_lora_mode_takes_names_and_the_old_booleans(given, mode):
    assert ab.lora_mode(given) == mode


@pytest.mark.parametrize("bad", ["fp16", "FP32", 1, None, ["bf16"]])
def test_a_bad_lora_mode_names_the_allowed_values(bad):
    with pytest.raises(ValueError, match=r"\['none', 'bf16', 'fp32'\]"):
        fc.plan_configs([bad])


def test_plan_configs_orders_variants_outer_and_lays_options_over_engine_options():
    got = fc.plan_configs([False, "fp32", "none"],
                          [{"name": "new"}, {"name": "old", "options": {"lora_expand": "addmm"}}],
                          {"fuse_lora_a": False})
    assert [(c.variant, c.lora_mode) for c in got] == [("new", "none"), ("new", "fp32"),
                                                       ("old", "none"), ("old", "fp32")]
    assert got[0].options == {"fuse_lora_a": False}
    assert got[2].options == {"fuse_lora_a": False, "lora_expand": "addmm"}
    [only] = fc.plan_configs(["bf16"], [], {"lora_expand": "addmm"})
    assert (only.variant, only.options, only.tag) == ("default", {"lora_expand": "addmm"},
                                                      "default_bf16")


@pytest.mark.parametrize("variants, fix", [
    ({"name": "a"}, "non-empty list"),
    ([{"options": {}}], "each variant is a dict with a 'name'"),
    ([{"name": "a b"}], "letters, digits"),
    ([{"name": "a", "opts": {}}], "optional 'options'"),
    ([{"name": "a", "options": ["kernel"]}], "optional 'options'"),
    ([{"name": "a"}, {"name": "a"}], "must be unique"),
    ([{"name": "a", "options": {"lora_expnd": "addmm"}}], "did you mean 'lora_expand'"),
    ([{"name": "a", "options": {"decode_attention": "fast"}}], "must be one of"),
    ([{"name": "a", "options": {"decode_kernel_options": {"kernel": "v9"}}}], "v9"),
    ([{"name": "a", "options": {"sync_every": 4}}], "set per point by the sweep"),
])
def test_bad_variants_fail_before_any_point_naming_the_fix(variants, fix):
    with pytest.raises(ValueError, match=fix):
        fc.plan_configs(["bf16"], variants)


def test_bad_engine_options_and_lora_modes_lists_are_refused():
    with pytest.raises(ValueError, match="engine_options.*unknown RunnerOptions"):
        fc.plan_configs(["bf16"], None, {"nope": 1})
    with pytest.raises(TypeError, match="must be a dict"):
        fc.plan_configs(["bf16"], None, [1])  # type: ignore[arg-type]
    for bad in ([], "bf16", None):
        with pytest.raises(ValueError, match="non-empty list"):
            fc.plan_configs(bad)


def test_bench_flex_variants_string_gets_the_same_checks():
    got = ab.parse_variants('{"name": "old", "options": {"lora_expand": "addmm"}};{"name": "new"}')
    assert got == [{"name": "old", "options": {"lora_expand": "addmm"}},
                   {"name": "new", "options": {}}]
    assert ab.parse_variants("") == [{"name": "default", "options": {}}]
    with pytest.raises(ValueError, match="--variants.*did you mean"):
        ab.parse_variants('{"name": "x", "options": {"lora_expnd": "addmm"}}')


@pytest.mark.parametrize("change, fix", [({"batches": []}, "non-empty list"),
                                         ({"batches": [0]}, r"\[1, 512\]"),
                                         ({"rounds": 0}, "rounds=0"),
                                         ({"shape": "qwen3-8b"}, "shape one of")])
def test_sweep_settings_refuse_bad_workloads(change, fix):
    with pytest.raises(ValueError, match=fix):
        fc.sweep_settings(**{**SETTINGS, **change})


def test_a_child_that_wrote_nothing_leaves_an_error_sidecar_per_batch(monkeypatch):
    monkeypatch.setattr(fc, "_run_child", lambda job, timeout_s: "child exit 1: boom")
    cfgs = fc.plan_configs(["none", "fp32"])
    sides = fc.run_configs(cfgs, fc.sweep_settings(**SETTINGS), "run-x", log=lambda _: None)
    assert [(s["variant"]["name"], s["lora_mode"], s["workload"]["n_prompts"]) for s in sides] == [
        ("default", "none", 2), ("default", "none", 4), ("default", "fp32", 2),
        ("default", "fp32", 4)]
    assert all(s["error"] == "child exit 1: boom" and s["run_id"] == "run-x" for s in sides)


@pytest.mark.parametrize("profile", ["h200", "h200_fp32", "cpu"])
def test_33_configs_pass_the_runner_and_the_sweep_checks(profile):
    """The H200 split (h200: none + bf16, h200_fp32: fp32, both variants) and the CPU config
    load, pass the runner's parameter checks and give valid configurations."""
    [(_, params)] = plan_parameters([NB33], profile, {}, repo=REPO)
    cfgs = fc.plan_configs(params["lora_modes"], params.get("variants"),
                           params.get("engine_options"))
    fc.sweep_settings(**{k: params[k] for k in SETTINGS})
    if profile.startswith("h200"):
        assert params["batches"] == [4, 8, 32, 64, 128, 256] and params["profile"] is True
        assert {c.variant for c in cfgs} == {"default", "skinny_off"}
        prev = next(c for c in cfgs if c.variant == "skinny_off")
        assert prev.options == {"skinny_gemm": "off"}
    modes = {profile: {c.lora_mode for c in cfgs}}
    assert modes == {"h200": {"h200": {"none", "bf16"}}, "h200_fp32": {"h200_fp32": {"fp32"}},
                     "cpu": {"cpu": {"none", "bf16"}}}[profile]
