"""An interrupted run's partial notebook says so in papermill's own record (notebook and cell
``exception``, never-run cells ``pending``) and in a banner cell on top, and the kernel's
shutdown noise after the stop signal lands in ``<run>.interrupt.log``, not on the terminal
(fresh-user trial, 2026-12-01: the record read as a clean run, and an early Ctrl-C printed
ipykernel's ``ZMQError: Socket operation on non-socket`` traceback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the runner needs the notebooks extra: "
                               "pip install -e '.[notebooks]'")
pytest.importorskip("papermill", reason="the runner needs the notebooks extra: "
                    "pip install -e '.[notebooks]'")

from runner_proc import child_env, pid_notebook, start_phase0

from nbhelpers.run import interrupted
from nbhelpers.run.execute import Job, stop_jobs

CAP_S = 600.0
"""A cap on a hung run, not a timing: the test proceeds on events (pid file, runner exit)."""


def _papermill_nb(statuses: list[str | None]) -> object:
    """A notebook as papermill leaves it: cell ``i`` has status ``statuses[i]`` (``None``: the
    cell never started, no ``start_time``)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["papermill"] = {"exception": None, "start_time": "2026-12-01T00:00:00+00:00"}
    for i, status in enumerate(statuses):
        cell = nbformat.v4.new_code_cell(f"x = {i}", execution_count=i + 1 if status else None)
        started = "2026-12-01T00:00:01+00:00" if status else None
        cell.metadata["papermill"] = {"status": status or "completed", "start_time": started,
                                      "exception": False if status else None}
        nb.cells.append(cell)
    return nb


def test_mark_cells_records_the_cell_in_flight_as_papermill_records_a_failure():
    nb = _papermill_nb(["completed", "completed", None, None])  # cell 1 was in flight
    interrupted.mark_cells(nb, 1)
    assert nb.metadata.papermill["exception"] is True
    recs = [c.metadata.papermill for c in nb.cells]
    assert recs[0]["status"] == "completed" and recs[0]["exception"] is False
    assert recs[1]["status"] == "failed" and recs[1]["exception"] is True
    assert [r["status"] for r in recs[2:]] == ["pending", "pending"]


def test_mark_cells_leaves_a_record_papermill_already_wrote():
    nb = _papermill_nb(["completed", "failed", None])
    nb.metadata.papermill["exception"] = True  # papermill's cell_exception ran (race case)
    nb.cells[2].metadata.papermill["status"] = "pending"
    before = json.dumps(nb)
    interrupted.mark_cells(nb, 0)
    assert json.dumps(nb) == before


def test_cell_tracker_keeps_the_cell_until_an_ok_reply():
    tracker = interrupted.CellTracker()
    tracker.on_cell_execute(cell=None, cell_index=3)
    assert tracker.in_flight == 3
    tracker.on_cell_executed(cell=None, cell_index=3,
                             execute_reply={"content": {"status": "error"}})
    assert tracker.in_flight == 3  # the kernel's KeyboardInterrupt reply: still that cell
    tracker.on_cell_executed(cell=None, cell_index=3, execute_reply={"content": {"status": "ok"}})
    assert tracker.in_flight is None


@pytest.mark.parametrize("statuses, where", [
    (["completed", "running", None], ("It stopped in cell 1 (papermill's index from 0, "
                                      "execution count 2")),
    ([None, None], "It stopped before its first cell ran (while the kernel started)"),
    (["completed", None], "It stopped between cells, after cell 0 had finished"),
], ids=["killed_in_a_cell", "kernel_start", "between_cells"])
def test_finish_notebook_marks_a_killed_child_and_adds_one_banner(tmp_path, statuses, where):
    path = tmp_path / "run.ipynb"
    nbformat.write(_papermill_nb(statuses), path)
    kw = {"notebook": "00_x.ipynb", "reason": "time cap 515 s", "sidecar": "executed/x/run.json",
          "when": "2026-12-01T22:00:00+00:00", "error": "interrupted (time cap 515 s)"}
    assert interrupted.finish_notebook(path, **kw)
    first = path.read_text()
    assert interrupted.finish_notebook(path, **kw) and path.read_text() == first  # idempotent
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    banner = nb.cells[0]
    assert banner.id == interrupted.BANNER_ID and banner.cell_type == "markdown"
    for text in ("# 00_x.ipynb: interrupted", "time cap 515 s", "2026-12-01T22:00:00+00:00",
                 where, "`executed/x/run.json`"):
        assert text in banner.source
    assert nb.metadata.papermill["exception"] is True
    assert nb.metadata.nbhelpers == {"status": "failed", "error": "interrupted (time cap 515 s)"}
    anchors = [i for i, c in enumerate(nb.cells) if c.get("id") == interrupted.ANCHOR_ID]
    if "running" in statuses:  # the anchor sits right before the failed cell
        assert len(anchors) == 1
        assert nb.cells[anchors[0] + 1].metadata.papermill["status"] == "failed"
    else:
        assert not anchors
    statuses_after = [c.metadata.papermill["status"] for c in nb.cells if "papermill" in
                      c.metadata]
    assert statuses_after.count("pending") == statuses.count(None)


def test_stop_jobs_finishes_a_started_jobs_partial_notebook(tmp_path):
    """The runner's side: a started child (here ``sleep``) is stopped, the sidecar says
    interrupted, and its notebook, left by a child killed in cell 1, gets the record."""
    out = tmp_path / "executed/phase0_reference/00_x/20261201T000000Z_cpu_abc.ipynb"
    out.parent.mkdir(parents=True)
    nbformat.write(_papermill_nb(["completed", "running", None]), out)
    job = Job(notebook=tmp_path / "notebooks/phase0_reference/00_x.ipynb", output=out,
              sidecar=out.with_suffix(".json"), parameters={})
    job.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stop_jobs([job], repo=tmp_path, grace_s=30.0, reason="test stop")
    assert job.returncode == 130 and job.proc.poll() is not None
    side = json.loads(job.sidecar.read_text())
    assert side["status"] == "failed" and side["error"].startswith("interrupted (test stop)")
    nb = nbformat.read(out, as_version=4)
    assert "It stopped in cell 1" in nb.cells[0].source
    assert "executed/phase0_reference/00_x/20261201T000000Z_cpu_abc.json" in nb.cells[0].source


def test_a_started_job_whose_notebook_papermill_never_wrote_gets_a_readable_one(tmp_path):
    out = tmp_path / "executed/phase0_reference/00_x/run.ipynb"
    out.parent.mkdir(parents=True)
    out.write_bytes(b"")  # the claim file: papermill never started
    job = Job(notebook=tmp_path / "00_x.ipynb", output=out, sidecar=out.with_suffix(".json"),
              parameters={})
    job.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stop_jobs([job], repo=tmp_path, grace_s=30.0, reason="test stop")
    nb = nbformat.read(out, as_version=4)
    assert "interrupted (test stop) while running" in nb.cells[0].source


CAPTURE_SCRIPT = """
import os, subprocess, sys
from pathlib import Path
from nbhelpers.run.capture import StderrCapture
cap = StderrCapture(Path(sys.argv[1]))
print("genuine error before the stop", file=sys.stderr, flush=True)
kernel = "import os; os.write(2, b'Traceback (most recent call last):\\\\n  kernel noise\\\\n')"
# a process started after the capture, as the kernel is, inherits fd 2
subprocess.run([sys.executable, "-c", "import sys; print('kernel says hello', file=sys.stderr)"])
cap.divert()
subprocess.run([sys.executable, "-c", kernel])
print("child's own shutdown noise", file=sys.stderr, flush=True)
cap.close()
print("one line after close", file=sys.stderr)
"""


SHUTDOWN_SCRIPT = """
import subprocess, sys
from pathlib import Path
from nbhelpers.run.capture import StderrCapture
cap = StderrCapture(Path(sys.argv[1]))
line = "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel."
subprocess.run([sys.executable, "-c", f"import sys; print('cell error', file=sys.stderr); "
                f"print({line!r}, file=sys.stderr)"])
# the line in two writes, apart in time: two reads of the pipe (seen once on a busy host)
split = ("import os, sys, time; b = sys.argv[1].encode() + bytes([10]); os.write(2, b[:20]); "
         "time.sleep(0.3); os.write(2, b[20:])")
subprocess.run([sys.executable, "-c", split, line])
cap.divert()
subprocess.run([sys.executable, "-c", f"import sys; print({line!r}, file=sys.stderr)"])
cap.close()
"""


def test_the_kernels_normal_shutdown_line_stays_off_the_terminal_but_not_out_of_the_log(
        tmp_path):
    """jupyter_client 8.x interrupts every kernel it shuts down, and ipykernel logs that as an
    ERROR line; a successful run ended with it (2026-12-07). The terminal copy drops that one
    line; other stderr stays, and after a stop the log keeps it."""
    log = tmp_path / "run.interrupt.log"
    done = subprocess.run([sys.executable, "-c", SHUTDOWN_SCRIPT, str(log)], env=child_env(),
                          capture_output=True, text=True, timeout=CAP_S, check=True)
    assert done.stderr.splitlines() == ["cell error"]
    assert log.read_text() == "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel.\n"


def test_stderr_capture_diverts_what_comes_after_the_signal_into_the_log(tmp_path):
    log = tmp_path / "run.interrupt.log"
    done = subprocess.run([sys.executable, "-c", CAPTURE_SCRIPT, str(log)], env=child_env(),
                          capture_output=True, text=True, timeout=CAP_S, check=True)
    assert done.stderr.splitlines() == ["genuine error before the stop", "kernel says hello",
                                        "one line after close"]
    assert log.read_text() == ("Traceback (most recent call last):\n  kernel noise\n"
                               "child's own shutdown noise\n")


NOISY_SOURCE = """import os, pathlib, signal, time
kernel = get_ipython().kernel
kernel.log.error("genuine kernel error before the stop")
def on_int(signum, frame):  # jupyter_client interrupts the kernel at shutdown: noise then
    kernel.log.error("Exception in message handler:\\nTraceback (most recent call last):\\n"
                     "zmq.error.ZMQError: Socket operation on non-socket (test noise)")
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_int)
ready = pathlib.Path(pid_file)
ready.with_suffix(".tmp").write_text(str(os.getpid()))
ready.with_suffix(".tmp").replace(ready)
time.sleep(900)"""


def _notebook(path: Path) -> None:
    pid_notebook(path, [nbformat.v4.new_code_cell(NOISY_SOURCE),
                        nbformat.v4.new_markdown_cell("## after"),
                        nbformat.v4.new_code_cell("print('never runs')")],
                 head=(nbformat.v4.new_markdown_cell("# t"),))


def _wait_for(event, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + CAP_S
    while not event():
        if proc.poll() is not None:
            pytest.fail(f"the runner exited ({proc.returncode}) before {what}:\n"
                        f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {CAP_S:.0f} s")
        time.sleep(0.2)


def _stop_running(root: Path, name: str, pid_file: Path, group: bool = False):
    """Start ``nbhelpers run phase0`` over ``root``, SIGINT it once the notebook's kernel is in
    its cell (``group``: the whole process group, as a terminal's Ctrl-C), wait for it to exit;
    ``(returncode, terminal text)``."""
    log = root / "runner.log"  # stdout and stderr, as a terminal shows them
    with log.open("w") as out:
        proc = start_phase0(root, name, pid_file, out, subprocess.STDOUT, new_session=group)
    try:
        _wait_for(pid_file.exists, "kernel pid file", proc, log)
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _wait_for(lambda: proc.poll() is not None, "runner exit", proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, log.read_text()


def test_interrupted_run_records_itself_and_keeps_kernel_noise_off_the_terminal(tmp_path):
    """Ctrl-C to the runner once the kernel runs a cell: the partial notebook's papermill
    record and banner say interrupted (in which cell, when, the sidecar); the kernel's error
    logged before the signal is on the runner's stderr; the traceback it logs at shutdown (as
    ipykernel's ZMQError one) is in ``<run>.interrupt.log``, which the child's line names."""
    pid_file = tmp_path / "kernel.pid"
    _notebook(tmp_path / "notebooks/phase0_reference/00_noisy.ipynb")
    returncode, text = _stop_running(tmp_path, "00_noisy", pid_file)
    assert returncode == 130, text[-3000:]
    assert "genuine kernel error before the stop" in text
    assert "Traceback" not in text and "ZMQError" not in text, text[-3000:]
    folder = tmp_path / "executed/phase0_reference/00_noisy"
    (nb_path,) = folder.glob("*.ipynb")
    shutdown_log = nb_path.with_suffix(".interrupt.log")
    assert "ZMQError: Socket operation on non-socket (test noise)" in shutdown_log.read_text()
    assert f"kernel shutdown output: {os.path.relpath(shutdown_log, tmp_path)}" in text
    nb = nbformat.read(nb_path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.papermill["exception"] is True
    cells = [c for c in nb.cells if "papermill" in c.metadata]
    noisy = next(c for c in cells if "time.sleep(900)" in c.source)
    assert noisy.metadata.papermill["status"] == "failed"
    assert noisy.metadata.papermill["exception"] is True
    assert cells[-1].metadata.papermill["status"] == "pending"  # never ran
    assert cells[-2].metadata.papermill["status"] == "pending"  # the markdown after it
    banner = nb.cells[0].source
    index = cells.index(noisy)
    assert banner.startswith("# 00_noisy.ipynb: interrupted")
    assert "Ctrl-C / SIGINT / SIGTERM" in banner and f"It stopped in cell {index} " in banner
    assert f"`{os.path.relpath(nb_path.with_suffix('.json'), tmp_path)}`" in banner
    side = json.loads(nb_path.with_suffix(".json").read_text())
    assert side["status"] == "failed" and "shutdown output: " in side["error"]


def test_a_marker_split_across_two_reads_is_held_back_not_shown():
    from nbhelpers.run.capture import MARKER, _marker_prefix_len
    assert _marker_prefix_len(b"progress 30%" + MARKER[:5]) == 5
    assert _marker_prefix_len(b"progress 30%") == 0  # plain text is never held back
    assert _marker_prefix_len(MARKER[:1]) == 1


CLEANUP_SOURCE = """import os, pathlib, time
ready = pathlib.Path(pid_file)
ready.with_suffix(".tmp").write_text(str(os.getpid()))
ready.with_suffix(".tmp").replace(ready)
try:
    time.sleep(900)
except KeyboardInterrupt:  # as phase 2's run_backends: write what it has, then go on up
    time.sleep(1.5)
    raise"""


def test_a_cell_that_cleans_up_before_reraising_leaves_no_traceback_on_the_terminal(tmp_path):
    """Phase 2's cell catches the stop, writes the interrupted backend's sidecar and raises on;
    the kernel's error reply then ends nbclient's cell task after the papermill child took the
    signal, and asyncio logged "Task exception was never retrieved" with three tracebacks
    (~150 lines) on the terminal at exit (a new user's Ctrl-C, 2026-12-04). They belong in the
    shutdown log with the rest of the kernel's shutdown output."""
    pid_file = tmp_path / "kernel.pid"
    pid_notebook(tmp_path / "notebooks/phase0_reference/00_cleanup.ipynb",
                 [nbformat.v4.new_code_cell(CLEANUP_SOURCE)])
    # a terminal's Ctrl-C: every process of the group
    returncode, text = _stop_running(tmp_path, "00_cleanup", pid_file, group=True)
    assert returncode == 130, text[-3000:]
    assert "Traceback" not in text and "Task exception" not in text, text[-3000:]
    assert "interrupted" in text


def test_after_the_stop_asyncio_reports_go_to_the_shutdown_log(tmp_path, capsys):
    import logging

    from nbhelpers.run.child import _asyncio_log_to
    logger = logging.getLogger("asyncio")
    saved = (list(logger.handlers), logger.propagate)
    try:
        log_file = tmp_path / "run.interrupt.log"
        _asyncio_log_to(log_file)
        logger.error("Task exception was never retrieved (test)")
        for h in logger.handlers:
            h.flush()
        assert "Task exception was never retrieved (test)" in log_file.read_text()
        _asyncio_log_to(None)
        logger.error("dropped (test)")
        captured = capsys.readouterr()
        assert "Task exception" not in captured.err + captured.out
        assert "dropped (test)" not in captured.err + captured.out
    finally:
        for h in logger.handlers:
            h.close()
        logger.handlers, logger.propagate = saved
