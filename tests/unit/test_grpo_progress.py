"""Phase 2 keeps what a backend produced before it was stopped: each backend's child streams one
progress line per logged step beside the sidecar (nbhelpers.grpo.progress), and a backend
stopped mid-run (the notebook interrupted at a time cap, or its process killed) keeps those steps
in an ``interrupted`` sidecar that 29_compare shows but never gates or ranks as a finished run.
Real tiny GRPO runs (tiny Llama, hf_generate, ~10 s each in a spawned process); the stops are
signals sent by a callback at a given step (tests/unit/progress_stop.py), not timers."""

import json
import multiprocessing
import shutil
import signal
from datetime import datetime
from pathlib import Path

import pytest
import torch
from progress_stop import InterruptParentAfter, KillSelfAfter

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import compare as grpo_compare
from nbhelpers.grpo.compile_report import CompileWatch
from nbhelpers.grpo.gate import check_runs, thresholds_for
from nbhelpers.grpo.progress import read_progress
from nbhelpers.stats import median

MODEL = "tiny-llama"
SETTINGS = GRPOSettings(max_steps=3, max_completion_length=8)
KW = {"n_questions": 4, "cpu_threads": 1, "progress": False}
COMPILE_KEYS = {"compile_mode", "compile_dynamic", "compile_scope", "graph_breaks",
                "graph_break_reasons", "recompiles", "recompile_reasons", "unique_graphs", "frames_total", "frames_ok",
                "compile_s"}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A whole 3-step hf_generate run with a sidecar path: its folder."""
    folder = tmp_path_factory.mktemp("finished")
    grpo_compare.run_backends(["hf_generate"], MODEL, SETTINGS, sidecar_path=folder / "run.json",
                              **KW)
    return folder


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """hf_generate stopped by a KeyboardInterrupt in this process after its 2nd step: its
    folder and the interrupt that came back up."""
    folder = tmp_path_factory.mktemp("interrupted")
    # SIGINT must raise KeyboardInterrupt here, as in a notebook kernel: a suite started as a
    # background job of a non-interactive shell inherits SIGINT ignored, and this worker then
    # waited forever for a child that waited for it (seen 2026-12-07 on a clean clone; it passed
    # only when an earlier test in the same worker had installed a SIGINT handler)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as stop:
            grpo_compare.run_backends(["hf_generate", "flex"], MODEL, SETTINGS,
                                      sidecar_path=folder / "run.json",
                                      callbacks=[InterruptParentAfter(2)], **KW)
    finally:
        signal.signal(signal.SIGINT, previous)
    return folder, stop


def test_the_child_streams_one_progress_line_per_step(finished):
    lines = _lines(finished / "run__hf_generate.progress.jsonl")
    side = json.loads((finished / "run__hf_generate.json").read_text())
    start, steps = lines[0], lines[1:]
    assert start["event"] == "start" and start["backend"] == "hf_generate"
    assert start["max_steps"] == 3 and start["request"] == side["grpo_request"]
    assert start["config"]["generation_batch_size"] == 4
    assert start["config"]["lora"]["rank"] == SETTINGS.lora.rank
    assert [s["event"] for s in steps] == ["step"] * 3 and [s["step"] for s in steps] == [1, 2, 3]
    # each line's row is the step's row of the finished sidecar (step_rows), bit for bit
    assert [s["row"] for s in steps] == side["grpo_steps"]
    assert all(s["row"]["wall_s"] > 0 and s["row"]["generate_s"] > 0 for s in steps)
    assert all("step_time" in s["row"] and "time/loss_fwd_bwd_s" in s["row"] for s in steps)
    on_cuda = torch.cuda.is_available()
    assert all((s["max_memory_allocated_gib"] is None) is not on_cuda for s in steps)
    times = [datetime.fromisoformat(s["utc"]) for s in lines]
    assert times == sorted(times)
    for s in steps:
        assert set(s["compile"]) == COMPILE_KEYS
        assert s["compile"]["compile_mode"] == "none" and s["compile"]["recompiles"] == 0
        assert s["compile"]["compile_s"] == 0.0  # nothing compiled (torch here records it)


def test_compile_watch_snapshot_reads_the_counts_inside_the_block():
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="enter the `with` block"):
        CompileWatch("default").snapshot()
    with CompileWatch("default", dynamic=False) as watch:
        f = torch.compile(torch.nn.Linear(4, 4), dynamic=False)
        f(torch.randn(2, 4))
        first = watch.snapshot()
        f(torch.randn(3, 4))
        second = watch.snapshot()
    assert (first["recompiles"], first["unique_graphs"], first["frames_total"]) == (0, 1, 1)
    assert (second["recompiles"], second["unique_graphs"]) == (1, 2)
    assert "size mismatch at index 0" in next(iter(second["recompile_reasons"]))
    assert 0.0 < first["compile_s"] < second["compile_s"]
    assert watch.report() == second


def test_an_interrupted_backend_keeps_its_logged_steps(interrupted):
    folder, stop = interrupted
    assert stop.type is KeyboardInterrupt  # went on up after the record was written
    assert multiprocessing.active_children() == []  # the child was stopped, not left behind
    # flex never started: no progress file, no record
    assert sorted(p.name for p in folder.iterdir()) == [
        "run__hf_generate.json", "run__hf_generate.progress.jsonl"]
    side = json.loads((folder / "run__hf_generate.json").read_text())
    progress = read_progress(folder / "run__hf_generate.progress.jsonl")
    assert side["status"] == "interrupted" and side["partial"] is True
    assert side["error"].startswith(
        "KeyboardInterrupt: interrupted after 2 logged steps (of max_steps 3); the notebook was "
        "stopped while hf_generate trained")
    assert side["interrupted"]["n_steps"] == 2 and side["interrupted"]["max_steps"] == 3
    assert side["interrupted"]["last_step_utc"] == progress["steps"][-1]["utc"]
    assert [r["step"] for r in side["grpo_steps"]] == [1, 2]
    assert side["grpo_steps"] == [s["row"] for s in progress["steps"]]
    summary = side["grpo_summary"]
    assert summary["n_steps"] == 2 and summary["skip_first"] == 0  # fewer steps than 3: all
    assert summary["step_time_s_median"] == median([r["wall_s"] for r in side["grpo_steps"]])
    assert side["grpo_config"]["generation_batch_size"] == 4
    assert side["grpo_config"]["compile_report"] == progress["steps"][-1]["compile"]
    assert side["headline"]["record"] == "interrupted" and side["gate"] is None
    assert "not a finished run" in side["partial_note"]
    assert side["grpo_request"]["settings"]["max_steps"] == 3
    assert len(side["rounds"]) == 2 and side["rounds"][0]["wall_s"] == side["grpo_steps"][0][
        "wall_s"]
    with pytest.raises(ValueError, match="that run failed"):  # never reused as a finished run
        grpo_compare.run_backends(["flex"], MODEL, SETTINGS, reuse_runs={
            "hf_generate": folder / "run__hf_generate.json"}, **KW)


def test_a_child_that_dies_keeps_its_steps_and_the_next_backend_runs(tmp_path, monkeypatch):
    real, calls = grpo_compare.run_isolated, []

    def kill_hf_then_fake_flex(backend, *args, **kwargs):
        calls.append(backend)
        if backend == "flex":
            return {"rows": [], "summary": None, "config": None, "wall_s": None,
                    "completions": None, "error": "RuntimeError: stand-in", "traceback": None}
        return real(backend, *args, **kwargs)

    monkeypatch.setattr(grpo_compare, "run_isolated", kill_hf_then_fake_flex)
    runs = grpo_compare.run_backends(["hf_generate", "flex"], MODEL, SETTINGS,
                                     sidecar_path=tmp_path / "run.json",
                                     callbacks=[KillSelfAfter(1, str(tmp_path / "out.txt"))],
                                     **KW)
    assert calls == ["hf_generate", "flex"]
    # the killed child cleaned nothing up; the parent removed TRL's output folder after it died
    out_dir = Path((tmp_path / "out.txt").read_text())
    assert out_dir.name.startswith("grpo_hf_generate_") and not out_dir.exists()
    run = runs["hf_generate"]
    assert run["error"].startswith("ChildExit: interrupted after 1 logged step (of max_steps 3); "
                                   "the training process died (exit code -9)")
    assert [r["step"] for r in run["rows"]] == [1] and run["interrupted"]["n_steps"] == 1
    side = json.loads((tmp_path / "run__hf_generate.json").read_text())
    assert side["status"] == "interrupted" and side["grpo_steps"] == run["rows"]
    # a process that died on its own still fails the gate (only a stop from outside is skipped)
    gate = check_runs(runs, "hf_generate", thresholds_for("random", SETTINGS.sampling_params()))
    assert [(c.name, c.status) for c in gate["hf_generate"].checks] == [("ran", "fail")]


def test_29_shows_an_interrupted_run_labelled_and_never_gates_or_ranks_it(
        finished, interrupted, tmp_path):
    """The finished hf_generate run, the interrupted one (newer) and the interrupted one
    relabelled as vLLM (a stand-in: the numbers are hf_generate's) in one folder."""
    src = interrupted[0] / "run__hf_generate.json"
    shutil.copy(finished / "run__hf_generate.json", tmp_path / "a__hf_generate.json")
    shutil.copy(src, tmp_path / "b__hf_generate.json")
    side = json.loads(src.read_text())
    side["backend"], side["run_id"] = "vllm", side["run_id"].replace("_hf_generate", "_vllm")
    (tmp_path / "b__vllm.json").write_text(json.dumps(side))
    _, _, runs, _ = grpo_compare.load_runs(tmp_path)
    assert len(runs) == 3
    (group, latest), = grpo_compare.latest_per_group(runs).items()
    assert latest["hf_generate"]["interrupted"] is None  # the newer interrupted run ranks below
    label = "interrupted after 2 steps (of 3)"
    step = median([r["wall_s"] for r in side["grpo_steps"]])

    cross = grpo_compare.gate_latest(runs, "hf_generate")
    assert [(c.name, c.status) for c in cross["vllm"].checks] == [("ran", "skip")]
    assert "interrupted after 2 logged steps (of max_steps 3)" in cross["vllm"].checks[0].detail
    assert grpo_compare.failed_checks(cross) == []
    assert grpo_compare.gate_conclusion(runs, cross, "hf_generate") == "cross-run gate: pass."

    table = grpo_compare.summary_frame(latest, cross)
    assert table.loc["vllm", "status"] == label and table.loc["hf_generate", "status"] == "ok"
    assert table.loc["vllm", "gate"] == "interrupted"
    assert table.loc["vllm", "step_time_s_median"] == pytest.approx(step)
    assert (f"vllm: {label}, median step {step:.2f} s over its steps, gate interrupted"
            in grpo_compare.result_line(latest, cross, "cpu"))
    assert grpo_compare.headline(latest, cross)["vllm_status"] == label

    speed = grpo_compare.speed_frame(runs).set_index("backend")
    assert speed.loc["vllm", "status"] == label and speed.loc["hf_generate", "status"] == "ok"
    assert speed.loc["vllm", "step_time_s_median"] == pytest.approx(step)
    assert speed["step_vs_vllm"].isna().all()  # a part of a run is never a ratio's reference
    assert "interrupted after 2 steps (of 3): not a finished run" in grpo_compare.ratio_text(
        latest)
    assert f"vllm {step:.3f} s ({label})" in grpo_compare.result_by_shape({group: latest})
