"""Phase 2 keeps every finished backend: a per-backend record is on disk as soon as the backend
finishes (a notebook killed later keeps it), and a later call can reuse it as its reference
instead of training it again (nbhelpers.grpo.compare_records). One real GRPO step of the tiny
Llama (hf_generate, ~16 s in a spawned process); the other backends are stand-ins, so each
test checks the records, not the training."""

import json
import shutil
from dataclasses import replace

import pytest

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import compare as grpo_compare
from nbhelpers.grpo.gate import check_runs, thresholds_for
from nbhelpers.stats import gpu_name, read_sidecars

MODEL = "tiny-llama"
SETTINGS = GRPOSettings(max_steps=1, max_completion_length=8)
KW = {"n_questions": 4, "cpu_threads": 1, "progress": False}


class Aborted(KeyboardInterrupt):
    """What a time cap's kill looks like to the notebook: training stops, nothing returns."""


@pytest.fixture(scope="module")
def first_call(tmp_path_factory):
    """hf_generate trains for real; flex then aborts the run (as a kill at a time cap would)."""
    real = grpo_compare.run_isolated
    folder = tmp_path_factory.mktemp("first")

    def hf_then_abort(backend, *args, **kwargs):
        if backend == "flex":
            raise Aborted
        return real(backend, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(Aborted):
        mp.setattr(grpo_compare, "run_isolated", hf_then_abort)
        grpo_compare.run_backends(["hf_generate", "flex"], MODEL, SETTINGS,
                                  sidecar_path=folder / "run.json", **KW)
    return folder


def _never_trains(*args, **kwargs):
    raise AssertionError("a backend was trained although the reuse check should have failed")


def _shifted(reference, shift):
    """A stand-in flex run: the reference's rows with every reward moved by ``shift``."""
    rows = [r | {"reward": r["reward"] + shift} for r in reference["grpo_steps"]]
    return {"rows": rows, "summary": reference["grpo_summary"], "config": reference["grpo_config"],
            "wall_s": 1.0, "completions": [], "error": None, "traceback": None}


def test_finished_backend_is_on_disk_when_the_next_one_aborts(first_call):
    # the progress file (one line per step, test_grpo_progress.py) stays beside the record;
    # flex was stopped before its child started: nothing of it
    assert sorted(p.name for p in first_call.iterdir()) == [
        "run__hf_generate.json", "run__hf_generate.progress.jsonl"]
    side = json.loads((first_call / "run__hf_generate.json").read_text())
    assert side["partial"] is True and side["status"] == "ok" and side["error"] is None
    assert side["backend"] == "hf_generate" and len(side["grpo_steps"]) == SETTINGS.max_steps
    assert side["grpo_request"]["settings"]["seed"] == SETTINGS.seed
    assert side["grpo_request"]["n_questions"] == 4 and side["grpo_request"]["model"] == MODEL
    assert side["headline"]["record"] == "partial" and side["gate"] is None
    runs, _ = grpo_compare.runs_from_sidecars(read_sidecars(first_call, phase="phase2"))
    assert [k.split("@")[0] for k in runs] == ["hf_generate"]  # 29_compare sees it


def test_a_failed_backend_gets_a_failed_partial_record(tmp_path, monkeypatch):
    def boom(backend, *args, **kwargs):
        return {"rows": [], "summary": None, "config": None, "wall_s": None, "completions": None,
                "error": "RuntimeError: boom", "traceback": "Traceback ...\nRuntimeError: boom"}

    monkeypatch.setattr(grpo_compare, "run_isolated", boom)
    runs = grpo_compare.run_backends(["flex"], MODEL, SETTINGS, sidecar_path=tmp_path / "r.json",
                                     model_info={"name": MODEL, "weights": "random"}, **KW)
    side = json.loads((tmp_path / "r__flex.json").read_text())
    assert side["status"] == "failed" and side["partial"] and side["error"] == runs["flex"]["error"]


def test_reuse_gates_against_the_earlier_run_and_the_final_write_replaces_partials(
        first_call, tmp_path, monkeypatch):
    source = first_call / "run__hf_generate.json"
    ref = json.loads(source.read_text())
    monkeypatch.setattr(grpo_compare, "run_isolated", lambda b, *a, **k: _shifted(ref, -0.5))
    out = tmp_path / "run.json"
    runs = grpo_compare.run_backends(["flex"], MODEL, SETTINGS, sidecar_path=out,
                                     reuse_runs={"hf_generate": str(first_call / "run.json")},
                                     **KW)
    assert list(runs) == ["hf_generate", "flex"]
    assert runs["hf_generate"]["rows"] == ref["grpo_steps"]
    assert runs["hf_generate"]["reused_from"]["utc"] == ref["env"]["utc"]
    assert json.loads((tmp_path / "run__flex.json").read_text())["partial"] is True
    gates = check_runs(runs, "hf_generate", thresholds_for("random", SETTINGS.sampling_params()))
    reward = next(c for c in gates["flex"].checks if c.name == "reward_vs_reference")
    assert reward.status == "pass" and "= 0.5 " in reward.detail  # against the reused rows
    label = f"reused: run__hf_generate.json ({ref['env']['utc']}, partial record)"
    assert grpo_compare.summary_frame(runs, gates).loc["hf_generate", "source"] == label
    assert label in grpo_compare.result_line(runs, gates, "cpu")
    paths = grpo_compare.write_sidecars(runs, gates, SETTINGS, {"name": MODEL}, out)
    assert [p.name for p in paths] == ["run.json", "run__flex.json"]  # the source holds hf's
    flex = json.loads(paths[1].read_text())
    assert flex["partial"] is False and flex["gate"]["passed"] and "partial_note" not in flex
    main = json.loads(paths[0].read_text())
    assert main["reused"]["hf_generate"]["utc"] == ref["env"]["utc"]
    assert main["reused"]["hf_generate"]["path"].endswith("run__hf_generate.json")
    assert main["headline"]["hf_generate_source"] == label


@pytest.mark.parametrize("change,field", [
    ({"settings": replace(SETTINGS, max_steps=2)}, "settings.max_steps: sidecar 1, this run 2"),
    ({"settings": replace(SETTINGS, seed=1)}, "settings.seed: sidecar 3407, this run 1"),
    ({"settings": replace(SETTINGS, lora=replace(SETTINGS.lora, rank=8))}, "settings.lora.rank"),
    ({"n_questions": 5}, "n_questions: sidecar 4, this run 5"),
    ({"model": "tiny-qwen3"}, "model: sidecar 'tiny-llama', this run 'tiny-qwen3'")])
def test_a_mismatched_reuse_is_a_value_error_naming_the_field(first_call, monkeypatch, change,
                                                              field):
    monkeypatch.setattr(grpo_compare, "run_isolated", _never_trains)
    args = {"settings": SETTINGS, "model": MODEL, **KW} | change
    with pytest.raises(ValueError, match="does not match this run") as err:
        grpo_compare.run_backends(["flex"], args.pop("model"), args.pop("settings"),
                                  reuse_runs={"hf_generate": first_call / "run__hf_generate.json"},
                                  **args)
    assert field in str(err.value)


@pytest.mark.parametrize("pad,reused", [(0, True), (64, False)])
def test_a_sidecar_older_than_a_settings_field_matches_that_fields_default(
        first_call, tmp_path, monkeypatch, pad, reused):
    """The H200 reference row of 2026-12-01 predates ``pad_to_multiple_of`` (2026-12-05): its
    request has no such key. A run that keeps the default (0, no padding: what that run did)
    reuses it (session 22's unsloth row was refused with "sidecar None, this run 0"); a run
    that pads is refused, naming the field."""
    ref = json.loads((first_call / "run__hf_generate.json").read_text())
    monkeypatch.setattr(grpo_compare, "run_isolated", lambda b, *a, **k: _shifted(ref, 0.0))
    old = tmp_path / "old__hf_generate.json"
    side = json.loads((first_call / "run__hf_generate.json").read_text())
    del side["grpo_request"]["settings"]["pad_to_multiple_of"]
    old.write_text(json.dumps(side))
    settings = replace(SETTINGS, pad_to_multiple_of=pad)
    call = lambda: grpo_compare.run_backends(  # noqa: E731
        ["flex"], MODEL, settings, sidecar_path=tmp_path / "run.json",
        reuse_runs={"hf_generate": old}, **KW)
    if reused:
        assert call()["hf_generate"]["reused_from"]["path"].endswith("old__hf_generate.json")
    else:
        with pytest.raises(ValueError, match="settings.pad_to_multiple_of: sidecar 0, this run 64"):
            call()


@pytest.mark.parametrize("edit,backend,message", [
    # a device this host is not (on the H200 a sidecar from "NVIDIA H200" would match)
    (lambda s: s["env"].update(gpu="NVIDIA A100-SXM4-80GB"), "hf_generate",
     f"device: sidecar 'NVIDIA A100-SXM4-80GB', this run {gpu_name()!r}"),
    (lambda s: s.pop("grpo_request"), "hf_generate", "no grpo_request"),
    (lambda s: s.update(error="RuntimeError: x", status="failed"), "hf_generate",
     "that run failed"),
    (lambda s: None, "flex", "holds backend 'hf_generate'")])
def test_a_sidecar_that_cannot_be_reused_says_why(first_call, tmp_path, monkeypatch, edit,
                                                  backend, message):
    monkeypatch.setattr(grpo_compare, "run_isolated", _never_trains)
    copy = tmp_path / "old__hf_generate.json"
    shutil.copy(first_call / "run__hf_generate.json", copy)
    side = json.loads(copy.read_text())
    edit(side)
    copy.write_text(json.dumps(side))
    with pytest.raises(ValueError, match=f"reuse_runs\\['{backend}'\\]") as err:
        grpo_compare.run_backends(["flex"], MODEL, SETTINGS, reuse_runs={backend: copy}, **KW)
    assert message in str(err.value)


def test_the_runner_takes_reuse_runs_from_the_command_line(first_call):
    from pathlib import Path

    from nbhelpers.run.params import UserInputError, parse_overrides, plan_parameters
    repo = Path(__file__).resolve().parents[2]
    nb = repo / "notebooks" / "phase2_grpo" / "20_grpo_equivalence.ipynb"
    side = first_call / "run__hf_generate.json"
    given = parse_overrides([("backends", "[flex]"), ("reuse_runs", f"{{hf_generate: {side}}}")])
    [(_, params)] = plan_parameters([nb], "cpu", given, repo=repo)
    assert params["reuse_runs"] == {"hf_generate": str(side)}
    # a path that is not there fails here, before the notebook starts (tests/unit/
    # test_bad_input_runs.py has the other cases)
    gone = parse_overrides([("reuse_runs", "{hf_generate: executed/x/run__hf_generate.json}")])
    with pytest.raises(UserInputError, match=r"-p reuse_runs .*no such file"):
        plan_parameters([nb], "cpu", gone, repo=repo)


def test_hf_generate_step_rows_carry_the_step_split(first_call):
    """Issue 13: the trainer split (time/*) is in every hf_generate step row of the sidecar,
    non-negative, its parts within the step wall; no flex/* keys for a non-flex backend; the
    step's GC seconds and collections (``step_timing.GC_KEYS``) are there too."""
    from nbhelpers.grpo.step_timing import TIME_KEYS
    side = json.loads((first_call / "run__hf_generate.json").read_text())
    for row in side["grpo_steps"]:
        assert all(row[k] is not None and row[k] >= 0 for k in TIME_KEYS), row
        assert sum(row[k] for k in TIME_KEYS[:3]) <= row["wall_s"] + 1e-3
        assert row["generate_s"] <= row["time/generate_and_score_s"] + 1e-3
        assert not [k for k in row if k.startswith("flex/")]
        # the step's Python garbage collection (GC_KEYS), inside the split: never above the wall
        assert 0.0 <= row["time/gc_s"] <= row["wall_s"] and row["gc/collections"] >= row["gc/gen2"] >= 0
    table = grpo_compare.step_split_frame({"hf_generate": {"rows": side["grpo_steps"],
                                                          "summary": side["grpo_summary"]}})
    assert table.loc["hf_generate", "n_steps"] == len(side["grpo_steps"])
    assert table.loc["hf_generate", "time/optimizer_s"] == side["grpo_steps"][0]["time/optimizer_s"]
    assert table.loc["hf_generate", "flex/decode_s"] is None
