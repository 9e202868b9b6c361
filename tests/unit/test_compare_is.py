"""Issue 13 parts 2 and 4 (CPU side): phase 2's IS table and compile table from a run's own
rows / compile report, carried through the sidecars to 29_compare, and compile_dynamic's words."""

import json
import math

import pytest

from nbhelpers.grpo import compare as grpo_compare


def _run(ratios, outside, gaps, mode="none", dynamic=None, recompiles=0):
    rows = [{"step": i + 1, "loss": 0.1, "grad_norm": 0.2, "reward": -1.0,
             "is_token_ratio_mean": r, "is_token_outside_0.9_1.1": o,
             "same_support_logp_diff_mean": g, "is_ratio_applied_mean": r}
            for i, (r, o, g) in enumerate(zip(ratios, outside, gaps))]
    report = {"compile_mode": mode, "compile_dynamic": dynamic, "compiled": [] if mode == "none"
              else ["policy"], "recompiles": recompiles, "graph_breaks": 0, "unique_graphs": 1}
    return {"rows": rows, "summary": {"skip_first": 0}, "config": {"compile_report": report, "generation_batch_size": 4},
            "wall_s": 1.0, "completions": [], "error": None}


def test_is_frame_means_over_the_steps_that_logged_it():
    runs = {"flex": _run([1.0, 0.99, math.nan], [0.0, 0.02, 0.5], [0.01, 0.03, 0.02]),
            "vllm": _run([0.9, 0.8, None], [0.3, 0.5, None], [None, None, None]),
            "hf_generate": {"rows": [{"step": 1, "loss": 0.1}], "config": None}}
    table = grpo_compare.is_frame(runs)
    assert table.loc["flex", "is_ratio_mean"] == pytest.approx(0.995)  # NaN step left out
    assert table.loc["flex", "is_outside_0.9_1.1"] == pytest.approx(0.52 / 3)  # each key over its own steps
    assert table.loc["flex", "same_support_logp_diff"] == pytest.approx(0.02)
    assert table.loc["vllm", "is_ratio_mean"] == pytest.approx(0.85)
    assert math.isnan(table.loc["vllm", "same_support_logp_diff"])  # vLLM: no kept mass
    assert table.loc["vllm", "is_steps"] == 2 and table.loc["flex", "is_steps"] == 3
    assert table.loc["hf_generate"].drop("is_steps").isna().all()


def test_is_block_in_sidecars_and_back_for_29(tmp_path):
    from nbhelpers.config import GRPOSettings
    from nbhelpers.stats import read_sidecars
    runs = {"flex": _run([1.0, 1.002], [0.01, 0.03], [0.01, 0.01], "default", True, 0),
            "hf_generate": _run([None, None], [None, None], [None, None], "default", False, 5)}
    paths = grpo_compare.write_sidecars(runs, {}, GRPOSettings(), {"name": "m"},
                                        tmp_path / "run.json")
    main = json.loads(paths[0].read_text())
    by_backend = {r["backend"]: r for r in main["importance_sampling"]}
    assert by_backend["flex"]["is_ratio_mean"] == pytest.approx(1.001)
    flex_side = json.loads(paths[1].read_text())  # run__flex.json
    assert flex_side["importance_sampling"]["is_outside_0.9_1.1"] == pytest.approx(0.02)
    back, _ = grpo_compare.runs_from_sidecars(read_sidecars(tmp_path, phase="phase2"))
    table = grpo_compare.is_frame(back)
    assert table.filter(like="flex@", axis=0)["is_ratio_mean"].iloc[0] == pytest.approx(1.001)
    compiled = grpo_compare.compile_frame(back, compiled_only=True)
    assert dict(zip(compiled["compile_dynamic"], compiled["recompiles"])) == {True: 0, False: 5}


def test_compile_frame_keeps_compiled_runs_only_when_asked():
    runs = {"a": _run([1.0], [0.0], [0.0]), "b": _run([1.0], [0.0], [0.0], "default", None, 2)}
    assert list(grpo_compare.compile_frame(runs).index) == ["a", "b"]
    only = grpo_compare.compile_frame(runs, compiled_only=True)
    assert list(only.index) == ["b"] and only.loc["b", "recompiles"] == 2


def test_compile_dynamic_words():
    flag = grpo_compare.compile_dynamic_flag
    assert (flag("auto"), flag("on"), flag("off"), flag(True), flag(None)) == \
        (None, True, False, True, None)
    with pytest.raises(ValueError, match=r"use one of \('auto', 'on', 'off'\)"):
        flag("dynamic")
