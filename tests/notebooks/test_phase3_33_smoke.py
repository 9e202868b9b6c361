"""Papermill smoke run of notebook 33 on the tiny shape (CPU): two variants x no LoRA and fp32
LoRA (the old boolean ``false`` for none) x two batches, each (variant, mode) in its own process;
the sidecar, the A/B table and the sweep hold every point with its own numbers. A bad
``lora_modes`` / ``variants`` value fails in the derived-values cell, before any point runs."""

from __future__ import annotations

import itertools
import json

import nbformat
import pytest

from nbhelpers.run import runner
from nbhelpers.stats import validate_sidecar

NOTEBOOK = "notebooks/phase3_flex/33_flex_vs_baselines.ipynb"
VARIANTS = [{"name": "fused", "options": {}}, {"name": "unfused", "options": {"fuse_lora_a": False}}]
SMOKE = {"batches": [2, 4], "prompt_tokens": 6, "max_new_tokens": 4, "rounds": 1, "lora_rank": 4,
         "lora_modes": [False, "fp32"], "variants": VARIANTS, "profile": True}
POINTS = list(itertools.product(["fused", "unfused"], ["none", "fp32"], [2, 4]))


def _outputs(nb, mime):
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if mime in o.get("data", {})]


@pytest.mark.notebooks
def test_33_measures_every_variant_mode_batch_in_its_own_process(tmp_path):
    jobs = runner.run(NOTEBOOK, profile="cpu", overrides=SMOKE, executed=tmp_path)
    assert [j.status for j in jobs] == ["ok"], f"see {jobs[0].output}"
    side = json.loads(jobs[0].sidecar.read_text())
    validate_sidecar(side)
    assert jobs[0].output.name.startswith(side["run_id"])  # run_id is the file's stamp
    points = {(p["variant"]["name"], p["lora_mode"], p["workload"]["n_prompts"]): p
              for p in side["points"]}
    assert sorted(points) == sorted(POINTS) and len(side["points"]) == len(POINTS)
    for (variant, mode, _), p in points.items():
        validate_sidecar(p)
        assert p["error"] is None and p["run_id"] == side["run_id"]
        assert p["decode_tok_per_s_median"] > 0 and p["rounds"][0]["new_tokens"] > 0
        assert p["adapter_dtype"] == (None if mode == "none" else "float32")
        assert (p["lora"] is None) == (mode == "none")
        assert p["variant"] == next(v for v in VARIANTS if v["name"] == variant)
        assert p["breakdown"]["aten_ops"]["ops_per_step"] > 0  # profiled, every point
    _one_process_per_configuration(points)
    _sweep_and_table_hold_each_points_numbers(side, points)
    # the variants really differ: unfused LoRA A is one more GEMM per projection group
    for b in (2, 4):
        fused, unfused = (points[(v, "fp32", b)]["breakdown"]["aten_ops"]["ops_per_step"]
                          for v in ("fused", "unfused"))
        assert unfused > fused, (fused, unfused)
    nb = nbformat.read(jobs[0].output, as_version=4)
    assert len(_outputs(nb, "image/png")) >= 3  # A/B, sweep and % of floor figures
    result = _outputs(nb, "text/markdown")[-1]
    assert result.startswith("**Result:**") and "4 configurations in their own processes" in result


def _one_process_per_configuration(points):
    pids = {}
    for (variant, mode, _), p in points.items():
        pids.setdefault((variant, mode), set()).add(p["config_pid"])
    assert all(len(s) == 1 for s in pids.values()), pids  # batches share their config's process
    assert len(set().union(*pids.values())) == len(pids) == 4, pids  # configs never share one


def _sweep_and_table_hold_each_points_numbers(side, points):
    for r in side["sweep"]:
        p = points[(r["variant"], r["lora_mode"], r["batch"])]
        assert r["decode_tok_per_s"] == p["decode_tok_per_s_median"]
        assert r["decode_step_ms"] == p["breakdown"]["decode_step_ms"]
        assert r["pct_of_floor"] == p["pct_of_floor"]
        assert r["aten_ops_per_step"] == p["breakdown"]["aten_ops"]["ops_per_step"]
    assert len(side["sweep"]) == len(points)
    assert len(side["ab_table"]) == 4  # (mode, batch) rows, the variants side by side
    for row in side["ab_table"]:
        for v in ("fused", "unfused"):
            p = points[(v, row["lora_mode"], row["batch"])]
            assert row[f"tok/s [{v}]"] == p["decode_tok_per_s_median"]
            assert row[f"ms/step [{v}]"] == p["breakdown"]["decode_step_ms"]
            assert row[f"% floor [{v}]"] == p["pct_of_floor"]
            assert row[f"aten ops/step [{v}]"] == p["breakdown"]["aten_ops"]["ops_per_step"]
        assert row["tok/s unfused / fused"] == pytest.approx(
            points[("unfused", row["lora_mode"], row["batch"])]["decode_tok_per_s_median"]
            / points[("fused", row["lora_mode"], row["batch"])]["decode_tok_per_s_median"])


@pytest.mark.notebooks
@pytest.mark.parametrize("bad, fix", [
    ({"lora_modes": ["fp16"]}, "is no LoRA mode; use one of ['none', 'bf16', 'fp32']"),
    ({"variants": [{"name": "a", "options": {"lora_expnd": "addmm"}}]},
     "did you mean 'lora_expand'"),
])
def test_33_bad_modes_or_variants_fail_before_any_point(tmp_path, bad, fix):
    """Refused when the runner plans the run (session 9's fresh-user trial: the notebook's own
    check failed in cell 5 and left a failed notebook, sidecar and INDEX row): one error naming
    the fix, no kernel started, nothing written."""
    from nbhelpers.run.errors import UserInputError
    with pytest.raises(UserInputError) as err:
        runner.run(NOTEBOOK, profile="cpu", overrides={**SMOKE, **bad}, executed=tmp_path)
    assert fix in str(err.value) and f"-p {next(iter(bad))}" in str(err.value)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
