"""One notebook execution: the ``nbhelpers`` kernelspec, the papermill child process, the failure
record, and stopping running children on Ctrl-C / SIGTERM.

Contract: :func:`execute` runs a :class:`Job` in ``python -m nbhelpers.run.child SPEC`` (its
own session, so a terminal's Ctrl-C reaches only the runner, which stops the child through
:func:`stop_jobs`: papermill shuts the kernel down and keeps the partial notebook); the child runs
papermill with a kernelspec for this interpreter (:func:`kernel_env`) and writes a failure's cause
to a file for :func:`mark_failed`, which writes (or marks) the job's sidecar failed. While
:data:`STOPPING` is set, :func:`execute` leaves the record to :func:`stop_jobs`, and the partial
notebook itself says it was interrupted (:mod:`nbhelpers.run.interrupted`: papermill's record,
a banner); the kernel's shutdown noise after the stop signal goes to ``<run>.interrupt.log``
beside it (:mod:`nbhelpers.run.capture`), not to the terminal. A supervisor that
stops the runner (``scripts/device/run_step.py`` at its time cap) names its reason in the file
``$NBHELPERS_STOP_REASON_FILE`` before its SIGTERM; :func:`stop_jobs` puts it in the error. Used by
:mod:`nbhelpers.run.runner`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbhelpers.run.interrupted import finish_notebook
from nbhelpers.run.phases import phase_of
from nbhelpers.stats import RUN_ID_ENV, make_sidecar, write_sidecar

log = logging.getLogger("nbhelpers.run.runner")

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The repo root, where ``nbhelpers/`` lives; on the child's ``PYTHONPATH`` so an uninstalled
checkout works."""
KERNEL_NAME = "nbhelpers"
STOP_REASON_ENV = "NBHELPERS_STOP_REASON_FILE"
"""Env var naming a file whose first line says why the run is stopped (:func:`stop_reason`)."""
GENERIC_STOP = "Ctrl-C / SIGINT / SIGTERM"


@dataclass
class Job:
    """One notebook execution: input, claimed output paths, parameters, GPU (or ``None``)."""

    notebook: Path
    output: Path
    sidecar: Path
    parameters: dict[str, Any]
    gpu: str | None = None
    returncode: int | None = None
    proc: Any = None
    """The running papermill child (``subprocess.Popen``) while it runs."""
    sha: str = ""
    """Git sha recorded once at the start of the run; the kernel gets it as NBHELPERS_GIT_SHA."""
    skipped: str = ""
    """Why the job was not started (a notebook it reads failed), or ``""``; such a job leaves no
    file behind (:func:`nbhelpers.run.runner.skip_job` removes its claimed, empty notebook)."""

    @property
    def status(self) -> str:
        """``ok``, ``failed`` or ``skipped``."""
        if self.skipped:
            return "skipped"
        return "ok" if self.returncode == 0 else "failed"


STOPPING = threading.Event()
"""Set by :func:`nbhelpers.run.runner.run` on Ctrl-C / SIGTERM: workers leave the record to
:func:`stop_jobs`."""


def kernel_env(env: dict[str, str]) -> dict[str, str]:
    """Env whose ``JUPYTER_PATH`` holds a ``nbhelpers`` kernelspec running this interpreter.

    The folder is keyed by the interpreter's path, so runners of different venvs never rewrite
    each other's kernelspec between writing it and starting the kernel.
    """
    key = hashlib.sha1(sys.executable.encode()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / f"nbhelpers-jupyter-{os.getuid()}-{key}"
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"nbhelpers ({sys.executable})", "language": "python"}
    tmp = spec_dir / f"kernel.json.{os.getpid()}.{threading.get_ident()}"  # workers are threads
    tmp.write_text(json.dumps(spec))
    tmp.replace(spec_dir / "kernel.json")
    env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), env.get("JUPYTER_PATH")]))
    return env


def repo_path(path: Path, repo: Path = PACKAGE_ROOT) -> str:
    """``path`` relative to ``repo`` (never a machine-specific absolute path in a sidecar)."""
    return os.path.relpath(path, repo)


def execute(job: Job, repo: Path = PACKAGE_ROOT) -> int:
    """Run ``job`` in a subprocess (its own ``CUDA_VISIBLE_DEVICES``, ``NBHELPERS_GIT_SHA`` =
    the run's sha, ``NBHELPERS_RUN_ID`` = its file names' stamp, :func:`run_stamp_of`); on
    failure put the notebook's exception in the sidecar's ``error``."""
    env = kernel_env(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    if job.sha:
        env["NBHELPERS_GIT_SHA"] = job.sha
    env[RUN_ID_ENV] = run_stamp_of(job)
    if job.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = job.gpu
    with tempfile.TemporaryDirectory(prefix="nbhelpers-run-") as tmp:
        error_file = Path(tmp) / "error.txt"
        if STOPPING.is_set():  # stopped while this worker took the job: start no child
            return 130
        spec = json.dumps({"input": str(job.notebook), "output": str(job.output),
                           "parameters": job.parameters, "cwd": str(repo),
                           "error_file": str(error_file), "log_file": str(interrupt_log(job))})
        log.info("running %s -> %s (gpu %s)", job.notebook.name, job.output, job.gpu)
        # own session: a terminal's Ctrl-C reaches only the runner, which stops the child
        # itself (stop_jobs) so the kernel is shut down and the run is recorded
        proc = subprocess.Popen([sys.executable, "-m", "nbhelpers.run.child", spec], env=env,
                                cwd=repo, start_new_session=True)
        job.proc = proc
        proc.wait()
        cause = error_file.read_text().strip() if error_file.is_file() else ""
    job.proc = None
    if STOPPING.is_set():  # interrupted: stop_jobs records the run
        return 130
    job.returncode = proc.returncode
    if proc.returncode != 0:
        cause = cause or f"notebook execution failed (exit {proc.returncode})"
        mark_failed(job, f"{cause}\npartial notebook: {repo_path(job.output, repo)}")
    return proc.returncode


def run_stamp_of(job: Job) -> str:
    """The UTC stamp that starts ``job``'s file names (``<UTC>_<device>_<sha>[_N]``, taken when
    the run was planned): every sidecar of the run records it as its ``run_id``
    (:func:`nbhelpers.stats.run_stamp`), so the id and the file name agree."""
    return job.sidecar.stem.split("_", 1)[0]


def interrupt_log(job: Job) -> Path:
    """``<run>.interrupt.log`` beside the job's notebook: what reached the papermill child's
    stderr after the stop signal (the kernel's shutdown); written only when something did."""
    return job.output.with_suffix(".interrupt.log")


def mark_failed(job: Job, error: str) -> None:
    """Write an ``error`` sidecar when the notebook wrote none; set ``error`` on one it wrote."""
    if job.sidecar.is_file():
        side = json.loads(job.sidecar.read_text())
        side["error"] = side.get("error") or error
    else:
        phase = phase_of(job.notebook) or job.notebook.parent.name  # its folder names it
        side = make_sidecar(phase=phase, backend=str(job.parameters.get("backend", "unknown")),
                            error=error, run_id=run_stamp_of(job),
                            extra={"notebook": job.notebook.name})
    side["status"] = "failed"
    write_sidecar(side, job.sidecar)


def stop_reason() -> str:
    """Why the run is stopped: the first line of the file named by ``$NBHELPERS_STOP_REASON_FILE``
    (a supervisor writes it before signalling, e.g. ``time cap 515 s of run_step.py``), else
    :data:`GENERIC_STOP`. Never raises: an unreadable or empty file gives the generic reason."""
    path = os.environ.get(STOP_REASON_ENV)
    try:
        lines = Path(path).read_text().strip().splitlines() if path else []
    except (OSError, UnicodeDecodeError):
        lines = []
    return lines[0].strip() if lines and lines[0].strip() else GENERIC_STOP


def stop_jobs(jobs: list[Job], repo: Path = PACKAGE_ROOT, grace_s: float = 20.0,
              reason: str | None = None) -> None:
    """After Ctrl-C / SIGTERM: SIGINT to each running papermill child (it shuts its kernel down
    and keeps the partial notebook), SIGKILL after ``grace_s``; every job that had not finished
    gets a failed sidecar (``interrupted (<reason>)``, default :func:`stop_reason`) naming its
    partial notebook and the partial ``<run>__<backend>.json`` sidecars beside it (kept as they
    are), so INDEX.md lists it. A started job's partial notebook gets
    :func:`~nbhelpers.run.interrupted.finish_notebook` (papermill record, banner: why, when, which
    cell, the sidecar); one that never started, or whose notebook papermill never wrote, gets
    :func:`write_not_started` in place of its empty claimed notebook."""
    import signal
    import time
    from datetime import UTC, datetime
    why = reason or stop_reason()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    running = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
    for job in running:
        job.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for job in running:
        try:
            job.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(job.proc.pid, signal.SIGKILL)
    for job in jobs:  # a job that finished before the interrupt keeps its own result
        if job in running or job.returncode is None:
            started = job in running
            job.returncode = 130
            what = (f"interrupted ({why}) while running\npartial notebook: "
                    f"{repo_path(job.output, repo)}{_partials(job, repo)}" if started
                    else f"interrupted ({why}) before it started")
            mark_failed(job, what)
            if not started or not _finish(job, why, when, what, repo):
                write_not_started(job.output, job.notebook.name, what)


def _finish(job: Job, why: str, when: str, what: str, repo: Path) -> bool:
    """:func:`~nbhelpers.run.interrupted.finish_notebook` for ``job``; a notebook it cannot
    mark (a malformed partial file) is logged and left as it is, so the rest of the record (the
    other jobs, INDEX.md) is still written; ``False`` only when papermill never wrote one."""
    try:
        return finish_notebook(job.output, notebook=job.notebook.name, reason=why, when=when,
                               sidecar=repo_path(job.sidecar, repo), error=what)
    except Exception as exc:  # noqa: BLE001 -- the sidecar already says interrupted
        log.warning("could not mark %s as interrupted (%r); its sidecar says so",
                    repo_path(job.output, repo), exc)
        return True


def write_not_started(output: Path, notebook: str, what: str) -> None:
    """Replace the claimed, still empty ``output`` (0 bytes) with a one-cell nbformat-4 notebook
    saying that the run never started and why, so INDEX.md's link opens in Jupyter (an empty
    file does not). A file papermill already wrote is left alone."""
    try:
        if output.stat().st_size:
            return
    except OSError:
        return
    cell = {"cell_type": "markdown", "metadata": {}, "id": "not-started",
            "source": f"# {notebook}: not run\n\n{what}; no cell ran. Its sidecar (the JSON "
                      "file of the same name) records the failure."}
    doc = {"nbformat": 4, "nbformat_minor": 5, "cells": [cell],
           "metadata": {"nbhelpers": {"status": "failed", "error": what}}}
    output.write_text(json.dumps(doc, indent=1) + "\n")


def _partials(job: Job, repo: Path) -> str:
    """New lines ``partial sidecars: a, b`` (repo-relative) for the ``<run>__<backend>.json``
    files beside the job's sidecar (phase 2 writes one per finished backend) and
    ``shutdown output: <log>`` when :func:`interrupt_log` was written, else ``""``."""
    found = sorted(job.sidecar.parent.glob(f"{job.sidecar.stem}__*.json"))
    text = "\npartial sidecars: " + ", ".join(repo_path(p, repo) for p in found) if found else ""
    log_file = interrupt_log(job)
    return text + (f"\nshutdown output: {repo_path(log_file, repo)}" if log_file.is_file() else "")
