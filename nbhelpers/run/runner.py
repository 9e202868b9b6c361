"""Papermill runner: parameterised notebook copies into the append-only ``executed/`` archive.

Contract: :func:`run` resolves a phase (``phase0``...) or a notebook path to notebooks, reads
``configs/<stem>.<profile>.yaml`` (literals) overridden by ``-p NAME VALUE``, and executes each
notebook in its own subprocess, one at a time per GPU (``CUDA_VISIBLE_DEVICES`` set per worker;
on a CPU profile one worker). Each run writes ``executed/<phase dir>/<stem>/<UTC>_<device>_<sha>
.ipynb`` (papermill keeps the partial output when a cell fails) and the JSON sidecar beside it (the
notebook writes it to the ``sidecar_path`` parameter; the runner writes one with ``error`` when the
notebook did not, or marks the notebook's sidecar failed). Names are claimed with exclusive file
creation, so no earlier run is overwritten and two runs at once never share a file. Before any name
is claimed, every notebook of the run is planned (``run_params.plan_parameters``): its config
exists and every config / ``-p`` value matches the notebook's ``parameters`` cell; in a phase run
a notebook without a config for a non-CPU profile (the CPU-only ``19_compare``) is skipped with a
logged note, while a single-notebook target without one is an error. The git sha is read once per
run: it names the files and reaches the kernel as ``NBHELPERS_GIT_SHA`` (the notebook's sidecar
records the same one). A failed notebook's sidecar ``error`` is its exception (``ename: evalue``,
cell index) and the repo-relative path of the partial notebook. Bad input raises
:class:`~nbhelpers.run.params.UserInputError` (the CLI prints ``error: ...``, exit 2).
:func:`write_index` regenerates ``executed/INDEX.md`` from the sidecars.

Run: ``python -m nbhelpers run phase0 --profile cpu`` (see ``nbhelpers/__main__.py``).
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
from queue import Empty, Queue
from typing import Any

from nbhelpers.run.index import write_index
from nbhelpers.run.params import (
    MissingInputError,
    UserInputError,
    load_parameters,
    parse_overrides,
    plan_parameters,
    profiles,
)
from nbhelpers.stats import device_tag, git_sha, make_sidecar, utc_stamp, write_sidecar

__all__ = ["Job", "UserInputError", "load_parameters", "parse_overrides", "plan_jobs",
           "plan_parameters", "profiles", "run", "write_index"]

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""Where ``nbhelpers`` lives; on the child's ``PYTHONPATH`` so an uninstalled checkout works."""
REPO = PACKAGE_ROOT
PHASE_DIRS = {"phase0": "phase0_reference", "phase1": "phase1_rollout",
              "phase2": "phase2_grpo", "phase3": "phase3_flex"}
"""``run <phase>`` runs every ``notebooks/<dir>/*.ipynb`` in name order (``19_compare`` last)."""
KERNEL_NAME = "nbhelpers"


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

    @property
    def status(self) -> str:
        return "ok" if self.returncode == 0 else "failed"


def resolve_notebooks(target: str, repo: Path = REPO) -> list[Path]:
    """Notebooks for a phase name (``phase0``), a phase folder (``phase0_reference`` or
    ``notebooks/phase0_reference``), or one ``.ipynb`` path.

    Raises:
        UserInputError: unknown phase, or a phase folder without notebooks.
        MissingInputError: the notebook path does not exist (also a ``FileNotFoundError``).
    """
    if target.endswith(".ipynb"):
        path = Path(target) if Path(target).is_absolute() else repo / target
        if not path.is_file():
            raise MissingInputError(f"notebook {target!r} not found (paths are relative to "
                                    f"{repo}).")
        return [path]
    folder = PHASE_DIRS.get(target, target.rstrip("/").removeprefix("notebooks/"))
    if folder not in PHASE_DIRS.values():
        raise UserInputError(f"unknown phase {target!r}: use one of {sorted(PHASE_DIRS)} or a path "
                         "to an .ipynb file.")
    found = sorted((repo / "notebooks" / folder).glob("*.ipynb"))
    if not found:
        raise UserInputError(f"phase {target!r} has no notebooks yet under notebooks/{folder}/.")
    return found


def claim_output(folder: Path, stem: str) -> tuple[Path, Path]:
    """Exclusively create ``folder/<stem>[_N].ipynb`` and return it with its ``.json`` sibling.

    ``O_CREAT | O_EXCL`` makes the claim atomic: concurrent runners never get the same name and
    an existing run (notebook or sidecar) is never overwritten.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        name = stem if n == 0 else f"{stem}_{n}"
        nb, side = folder / f"{name}.ipynb", folder / f"{name}.json"
        if side.exists():
            continue
        try:
            os.close(os.open(nb, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        return nb, side
    raise RuntimeError(f"could not claim a free name for {stem} in {folder} after 1000 tries.")


def gpu_device_tag(gpu: str | None) -> str:
    """Device label for the run's file name: the tag of GPU ``gpu`` per nvidia-smi (without
    ``--gpus``: the first visible GPU), or ``cpu`` when nvidia-smi is absent or finds none."""
    if gpu is None:
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        if not gpu or gpu == "-1":
            return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i",
                              gpu], capture_output=True, text=True, timeout=20, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return device_tag(out.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def plan_jobs(target: str, profile: str, overrides: dict[str, Any], gpus: list[str] | None,
              executed: Path, repo: Path = REPO) -> list[Job]:
    """Plan every notebook of ``target`` (:func:`plan_parameters`), then claim output names;
    a failed plan claims nothing. The git sha is read once, here. One job per notebook."""
    planned = plan_parameters(resolve_notebooks(target, repo), profile, overrides, repo)
    jobs: list[Job] = []
    _check_writable(executed)
    sha = git_sha(repo)
    for nb, params in planned:
        gpu = gpus[len(jobs) % len(gpus)] if gpus else None
        stem = f"{utc_stamp()}_{gpu_device_tag(gpu)}_{sha}"
        out, side = claim_output(executed / nb.parent.name / nb.stem, stem)
        params["sidecar_path"] = os.path.relpath(side, repo)
        jobs.append(Job(nb, out, side, params, gpu, sha=sha))
    return jobs


_STOPPING = threading.Event()
"""Set by :func:`run` on Ctrl-C / SIGTERM: workers leave the record to :func:`stop_jobs`."""


def _check_writable(folder: Path) -> None:
    """Raises ``UserInputError`` naming the fix when ``folder`` cannot be created or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise UserInputError(f"--executed {folder}: cannot create or write there "
                             f"({err.strerror or err}); pass a folder you can write to.") from err


def _kernel_env(env: dict[str, str]) -> dict[str, str]:
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


def repo_path(path: Path, repo: Path = REPO) -> str:
    """``path`` relative to ``repo`` (never a machine-specific absolute path in a sidecar)."""
    return os.path.relpath(path, repo)


def execute(job: Job, repo: Path = REPO) -> int:
    """Run ``job`` in a subprocess (its own ``CUDA_VISIBLE_DEVICES``, ``NBHELPERS_GIT_SHA`` =
    the run's sha); on failure put the notebook's exception in the sidecar's ``error``."""
    env = _kernel_env(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    if job.sha:
        env["NBHELPERS_GIT_SHA"] = job.sha
    if job.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = job.gpu
    with tempfile.TemporaryDirectory(prefix="nbhelpers-run-") as tmp:
        error_file = Path(tmp) / "error.txt"
        spec = json.dumps({"input": str(job.notebook), "output": str(job.output),
                           "parameters": job.parameters, "cwd": str(repo),
                           "error_file": str(error_file)})
        log.info("running %s -> %s (gpu %s)", job.notebook.name, job.output, job.gpu)
        # own session: a terminal's Ctrl-C reaches only the runner, which stops the child
        # itself (stop_jobs) so the kernel is shut down and the run is recorded
        proc = subprocess.Popen([sys.executable, "-m", "nbhelpers.run.runner", spec], env=env,
                                cwd=repo, start_new_session=True)
        job.proc = proc
        proc.wait()
        cause = error_file.read_text().strip() if error_file.is_file() else ""
    job.proc = None
    if _STOPPING.is_set():  # interrupted: stop_jobs records the run
        return 130
    job.returncode = proc.returncode
    if proc.returncode != 0:
        cause = cause or f"notebook execution failed (exit {proc.returncode})"
        mark_failed(job, f"{cause}\npartial notebook: {repo_path(job.output, repo)}")
    return proc.returncode


def mark_failed(job: Job, error: str) -> None:
    """Write an ``error`` sidecar when the notebook wrote none; set ``error`` on one it wrote."""
    if job.sidecar.is_file():
        side = json.loads(job.sidecar.read_text())
        side["error"] = side.get("error") or error
    else:
        phase = job.notebook.parent.name.split("_")[0]
        side = make_sidecar(phase=phase, backend=str(job.parameters.get("backend", "unknown")),
                            error=error, extra={"notebook": job.notebook.name})
    side["status"] = "failed"
    write_sidecar(side, job.sidecar)


def stop_jobs(jobs: list[Job], repo: Path = REPO, grace_s: float = 20.0) -> None:
    """After Ctrl-C / SIGTERM: SIGINT to each running papermill child (it shuts its kernel down
    and keeps the partial notebook), SIGKILL after ``grace_s``; every job that had not finished
    gets a failed sidecar (``interrupted``), so INDEX.md lists it."""
    import signal
    import time
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
            what = (f"interrupted (Ctrl-C / SIGINT / SIGTERM) while running\npartial notebook: "
                    f"{repo_path(job.output, repo)}" if started
                    else "interrupted before it started (Ctrl-C / SIGINT / SIGTERM)")
            mark_failed(job, what)


def _worker(queue: Queue, gpu: str | None, repo: Path) -> None:
    while True:
        try:
            job = queue.get_nowait()
        except Empty:
            return
        job.gpu = gpu if gpu is not None else job.gpu
        try:
            execute(job, repo)
        except Exception as exc:  # a runner bug must fail the job visibly, not kill the worker
            log.exception("runner error on %s", job.notebook.name)
            job.returncode = -1
            mark_failed(job, f"runner error: {exc!r}")


def run(target: str, *, profile: str = "cpu", gpus: list[str] | None = None,
        overrides: dict[str, Any] | None = None, repo: Path | None = None,
        executed: Path | None = None) -> list[Job]:
    """Execute ``target``'s notebooks (one worker per GPU, each a queue consumer) and rewrite
    ``executed/INDEX.md``. Returns the jobs with their return codes (0 = ok)."""
    repo = repo or REPO
    executed = executed or repo / "executed"
    _STOPPING.clear()
    jobs = plan_jobs(target, profile, overrides or {}, gpus, executed, repo)
    queue: Queue = Queue()
    for job in jobs:
        queue.put(job)
    workers = [threading.Thread(target=_worker, args=(queue, g, repo), daemon=True)
               for g in (gpus or [None])]
    for w in workers:
        w.start()
    try:
        for w in workers:
            while w.is_alive():  # join with a timeout: the main thread stays interruptible
                w.join(0.5)
    except KeyboardInterrupt:
        _STOPPING.set()
        while not queue.empty():  # nothing new starts
            queue.get_nowait()
        stop_jobs(jobs, repo)
        for w in workers:  # let a worker finish writing what its child left
            w.join(2.0)
        write_index(executed, repo)
        raise
    write_index(executed, repo)
    return jobs


def _execute_in_child(spec: dict[str, Any]) -> int:
    """Child-process side of :func:`execute`: papermill with the ``nbhelpers`` kernel; the cells'
    text output is also streamed to this terminal as it comes (``stdout_file``/``stderr_file``),
    so a long run shows its training logs, not only papermill's cell bar. A failure is written to
    ``spec["error_file"]`` as ``<ename>: <evalue> (cell <index>, execution count <n>)`` for the
    parent's sidecar."""
    import papermill as pm
    error_file = Path(spec["error_file"]) if spec.get("error_file") else None
    try:
        pm.execute_notebook(spec["input"], spec["output"], parameters=spec["parameters"],
                            kernel_name=KERNEL_NAME, cwd=spec["cwd"], progress_bar=True,
                            stdout_file=sys.stdout, stderr_file=sys.stderr)
    except pm.PapermillExecutionError as exc:
        msg = (f"{exc.ename}: {exc.evalue} (cell {exc.cell_index}, execution count "
               f"{exc.exec_count})")
        print(f"notebook failed: {msg}", file=sys.stderr)
        if error_file:
            error_file.write_text(msg)
        return 1
    except Exception as exc:  # kernel death, papermill bug: record it, keep the traceback
        if error_file:
            error_file.write_text(f"{type(exc).__name__}: {exc}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(_execute_in_child(json.loads(sys.argv[1])))
