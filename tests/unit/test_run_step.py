"""scripts/device/run_step.py's time cap on CPU: a capped notebook job is stopped through the
runner's Ctrl-C path (failed sidecar naming the cap, partial per-backend sidecars kept, INDEX.md,
everything packed after the runner ended); a job that ignores SIGTERM is killed, its strays too.

Waits are event-based (a pid file appears, a process exits); every cap only bounds a hung run.
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import nbformat
import pytest
from runner_proc import pid_notebook

REAL_REPO = Path(__file__).resolve().parents[2]
EVENT_CAP_S = 600.0
"""Bound on every wait for an event (a busy 2-core host once took > 60 s to start a kernel)."""

SLEEP_SOURCE = """import os, pathlib, time
from nbhelpers.stats import make_sidecar, write_sidecar
side = pathlib.Path(sidecar_path)
# what phase 2 writes when a backend finishes (nbhelpers.grpo.compare_records.write_partial)
write_sidecar(make_sidecar(phase="phase0", backend="flex", extra={"partial": True}),
              side.with_name(side.stem + "__flex.json"))
ready = pathlib.Path(pid_file)
ready.with_suffix(".tmp").write_text(str(os.getpid()))
ready.with_suffix(".tmp").replace(ready)  # atomic: the test never reads a half-written pid
time.sleep(900)"""


@pytest.fixture
def run_step(monkeypatch):
    """scripts/device/run_step.py as a module (it imports step_table from its own folder)."""
    monkeypatch.syspath_prepend(str(REAL_REPO / "scripts/device"))
    return importlib.import_module("run_step")


def _sleep_repo(root: Path, pid_file: Path) -> None:
    pid_notebook(root / "notebooks/phase0_reference/00_sleep.ipynb",
                 [nbformat.v4.new_code_cell(SLEEP_SOURCE)])
    (root / "configs").mkdir()
    (root / "configs/00_sleep.cpu.yaml").write_text(f"pid_file: {pid_file}\n")


def _wait_for(event, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll ``event()``; fail after :data:`EVENT_CAP_S` or when ``proc`` exits first."""
    deadline = time.monotonic() + EVENT_CAP_S
    while not event():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the job exited ({proc.returncode}) before {what} (its output is in "
                        "the captured stderr)")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {EVENT_CAP_S:.0f} s")
        time.sleep(0.2)


def _pid_gone(pid: int) -> bool:
    """No such process, or a zombie (killed, waiting for whoever reaps orphans here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def _env() -> dict[str, str]:
    # prepend, not replace: the GPU host's papermill/ipykernel come from PYTHONPATH (/tmp/site)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REAL_REPO), os.environ.get("PYTHONPATH")]))}


def test_capped_notebook_job_is_recorded_failed_naming_the_cap_and_packed(
        run_step, tmp_path, monkeypatch):
    """The runner gets SIGTERM at the cap (here: once its kernel runs the notebook, so the cap
    is already past), writes the failed sidecar and INDEX.md and exits 130 before any SIGKILL;
    the partial ``<run>__flex.json`` is untouched; the kernel is gone; the pack holds it all."""
    pid_file = tmp_path / "kernel.pid"
    _sleep_repo(tmp_path, pid_file)
    code = ("import sys; from pathlib import Path; from nbhelpers.__main__ import main; "
            f"from nbhelpers.run import runner as run; run.REPO = Path({str(tmp_path)!r}); "
            "sys.exit(main(['run', 'phase0']))")
    t0 = time.time()
    job = run_step.launch_job([sys.executable, "-c", code], _env(), cwd=tmp_path)
    try:
        _wait_for(pid_file.exists, "kernel pid file (kernel start)", job.proc)
        kernel = int(pid_file.read_text())
        (partial,) = (tmp_path / "executed/phase0_reference/00_sleep").glob("*__flex.json")
        before = partial.read_bytes()
        rc = run_step.wait_capped(job, cap_s=1.0, grace_s=EVENT_CAP_S)
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        run_step.kill_strays(job.token)  # a failed check leaves no kernel behind
    assert str(rc).startswith("stopped at time cap 1 s (exit 130)"), rc
    run_dir = partial.parent
    (side,) = [p for p in run_dir.glob("*.json") if "__" not in p.name]
    doc = json.loads(side.read_text())
    assert doc["status"] == "failed"
    assert doc["error"].startswith("interrupted (time cap 1 s of run_step.py) while running")
    assert f"partial sidecars: {partial.relative_to(tmp_path)}" in doc["error"]
    assert partial.read_bytes() == before and json.loads(before)["partial"] is True
    index = (tmp_path / "executed/INDEX.md").read_text()
    assert "| error: interrupted (time cap 1 s of run_step.py) while running | failed |" in index
    _wait_for(lambda: _pid_gone(kernel), "exit of the notebook's kernel")
    assert not job.reason_file.parent.exists()
    monkeypatch.setattr(run_step, "REPO", tmp_path)
    with tarfile.open(run_step.pack("t", t0, tmp_path)) as tar:
        names = set(tar.getnames())
    assert {str(p.relative_to(tmp_path)) for p in (side, partial, side.with_suffix(".ipynb"))} \
        <= names


STUBBORN = """import os, pathlib, signal, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
def on_term(signum, frame):  # read the reason the supervisor wrote, then keep running
    out.with_name("reason.txt").write_text(
        pathlib.Path(os.environ["NBHELPERS_STOP_REASON_FILE"]).read_text())
signal.signal(signal.SIGTERM, on_term)
stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"],
                         start_new_session=True)  # out of the job's group, like papermill
out.with_suffix(".tmp").write_text(str(stray.pid))
out.with_suffix(".tmp").replace(out)
while True:
    time.sleep(0.1)"""


def test_job_ignoring_sigterm_is_killed_after_the_grace_and_its_strays_too(run_step, tmp_path):
    """SIGTERM, reason file written first, SIGKILL after ``grace_s``, then the process of
    another session that still carries the job's token is killed as well."""
    ready = tmp_path / "stray.pid"
    job = run_step.launch_job([sys.executable, "-c", STUBBORN, str(ready)], dict(os.environ),
                              cwd=tmp_path)
    try:
        _wait_for(ready.exists, "the job's ready file", job.proc)
        stray = int(ready.read_text())
        rc = run_step.wait_capped(job, cap_s=1.0, grace_s=2.0)
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        run_step.kill_strays(job.token)
    assert rc.startswith("killed at time cap 1 s (no exit 2 s after SIGTERM); killed stray pids")
    assert str(stray) in rc
    assert (tmp_path / "reason.txt").read_text() == "time cap 1 s of run_step.py\n"
    _wait_for(lambda: _pid_gone(stray), "exit of the stray process")


def test_job_ending_before_its_cap_returns_its_exit_code(run_step, tmp_path):
    job = run_step.launch_job([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ),
                              cwd=tmp_path)
    assert run_step.wait_capped(job, cap_s=EVENT_CAP_S) == 3
    assert not job.reason_file.exists()


def test_pack_takes_the_files_under_out_beside_executed(run_step, tmp_path, monkeypatch):
    """A call brings back at most 8 files: the tgz holds $OUT's own files too (``OUT/...``),
    a bench A/B's sidecars in ``$OUT/bench_ab`` included, and never itself."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    (repo / "executed/phase3_flex").mkdir(parents=True)
    (repo / "executed/phase3_flex/run.json").write_text("{}")
    (out / "bench_ab").mkdir(parents=True)
    for i in range(12):
        (out / "bench_ab" / f"side_{i}.json").write_text(str(i))
    (out / "n12.log").write_text("log")
    monkeypatch.setattr(run_step, "REPO", repo)
    tgz = run_step.pack("n12", 0.0, out)
    with tarfile.open(tgz) as tar:
        names = set(tar.getnames())
        assert tar.extractfile("OUT/bench_ab/side_7.json").read() == b"7"
    assert names == ({"executed/phase3_flex/run.json", "OUT/n12.log"}
                     | {f"OUT/bench_ab/side_{i}.json" for i in range(12)})


def _cli(*args):
    return subprocess.run([sys.executable, str(REAL_REPO / "scripts/device/run_step.py"), *args],
                          capture_output=True, text=True, cwd=REAL_REPO, timeout=EVENT_CAP_S,
                          check=False)


@pytest.mark.parametrize("budget", ["-5", "0", "nan", "inf", "5000", "abc"])
def test_a_budget_outside_one_to_600_seconds_is_refused_before_anything_runs(budget, tmp_path):
    """A negative budget skipped every job and exited 0; nan turned off every cap (a fresh
    user's probe, 2026-12-03). Refused by argparse, exit 2, nothing staged or written."""
    res = subprocess.run([sys.executable, str(REAL_REPO / "scripts/device/run_step.py"), "s13f",
                          "--sha", "abc1234", f"--budget={budget}"], capture_output=True,
                         text=True, cwd=REAL_REPO, timeout=EVENT_CAP_S, check=False,
                         env={**os.environ, "OUT": str(tmp_path / "out")})
    assert res.returncode == 2 and "argument --budget" in res.stderr, res.stderr
    assert "seconds" in res.stderr.splitlines()[-1] and not (tmp_path / "out").exists()


def test_an_unknown_step_is_one_line_also_in_a_dry_run():
    """`--dry-run` with a misspelt step gave a KeyError traceback; now the same line as a real
    call, naming the steps (and 'all' for a dry run)."""
    for args in (["nosuchstep", "--dry-run"], ["nosuchstep"], ["all"]):
        res = _cli(*args)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith(f"unknown step {args[0]!r}: choose one of ['a1', ")
    assert "(or 'all' with --dry-run)" in _cli("all").stderr


def test_a_bad_override_in_a_dry_run_names_the_step_and_job(run_step, monkeypatch, capsys):
    """A step whose -p value the runner refuses: the dry run prints BAD with the job and the
    reason and returns 1 (it raised a UserInputError traceback naming neither)."""
    bad = ([], [], [(run_step.STEPS["s13r"][2][0][0], {"backends": "[flex]",
                                                        "max_steps": "'ten'"}, 10, 20, 0)])
    monkeypatch.setitem(run_step.STEPS, "badstep", bad)
    assert run_step.dry_run("badstep") == 1
    out = capsys.readouterr().out
    assert "job notebooks/phase2_grpo/20_grpo_equivalence.ipynb --profile h200" in out
    assert "BAD: " in out and "max_steps" in out
