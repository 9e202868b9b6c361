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
logged note, while a single-notebook target without one is an error. A phase's compare notebook
(``19_compare``, ``29_compare``: it reads the others' sidecars) starts after the rest of the phase
and is skipped, with a logged line naming the fix and no file left behind, when one of them
failed. The git sha is read once per run: it names the files and reaches the kernel as ``NBHELPERS_GIT_SHA`` (the notebook's sidecar
records the same one); so does the UTC stamp, as ``NBHELPERS_RUN_ID``: every sidecar's
``run_id`` is the stamp of its file name (the run's start). A failed notebook's sidecar ``error`` is its exception (``ename: evalue``,
cell index) and the repo-relative path of the partial notebook. Bad input raises
:class:`~nbhelpers.run.params.UserInputError` (the CLI prints ``error: ...``, exit 2).
:func:`write_index` regenerates ``executed/INDEX.md`` from the sidecars. One job's process (papermill
child, kernelspec, failure record, stop on interrupt) is :mod:`nbhelpers.run.execute`.

Run: ``python -m nbhelpers run phase0 --profile cpu`` (see ``nbhelpers/__main__.py``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from nbhelpers.run.execute import (
    PACKAGE_ROOT,
    STOPPING,
    Job,
    execute,
    mark_failed,
    repo_path,
    stop_jobs,
)
from nbhelpers.run.index import write_index
from nbhelpers.run.params import (
    MissingInputError,
    UserInputError,
    load_parameters,
    parse_overrides,
    plan_parameters,
    profiles,
)
from nbhelpers.run.phases import PHASE_DIRS, is_compare, phase_of
from nbhelpers.stats import device_tag, git_sha, utc_stamp

__all__ = ["PHASE_DIRS", "Job", "UserInputError", "execute", "load_parameters", "mark_failed",
           "parse_overrides", "plan_jobs", "plan_parameters", "profiles", "repo_path", "run",
           "stop_jobs", "write_index"]

log = logging.getLogger(__name__)

REPO = PACKAGE_ROOT
"""The checkout whose ``notebooks/``, ``configs/`` and ``executed/`` a run uses."""


def resolve_notebooks(target: str, repo: Path = REPO) -> list[Path]:
    """Notebooks for a phase name (``phase0``), a phase folder (``phase0_reference`` or
    ``notebooks/phase0_reference``), or one ``.ipynb`` path.

    A notebook path must lie in a phase folder, ``<repo>/notebooks/<phase dir>/``: the phase
    comes from that folder (:func:`~nbhelpers.run.phases.phase_of`) and picks both the value
    checks (:mod:`nbhelpers.run.values`) and the archive folder
    ``executed/<phase dir>/<stem>/``. A notebook elsewhere (an executed copy under
    ``executed/``, a scratch ``/tmp/x.ipynb``) would skip those checks and open a new top-level
    folder in the append-only archive, and no workflow needs that (an executed copy is an
    output: re-run its source notebook), so it is refused rather than allowed with a warning.

    Raises:
        UserInputError: unknown phase, a phase folder without notebooks, or a notebook path
            outside ``notebooks/<phase dir>/`` (the message names the notebook to run instead).
        MissingInputError: the notebook path does not exist (also a ``FileNotFoundError``).
    """
    if target.endswith(".ipynb"):
        path = Path(target) if Path(target).is_absolute() else repo / target
        if not path.is_file():
            raise MissingInputError(f"notebook {target!r} not found (paths are relative to "
                                    f"{repo}).")
        _check_in_phase_folder(path, target, repo)
        return [path]
    folder = PHASE_DIRS.get(target, target.rstrip("/").removeprefix("notebooks/"))
    if folder not in PHASE_DIRS.values():
        raise UserInputError(f"unknown phase {target!r}: use one of {sorted(PHASE_DIRS)} or a path "
                         "to an .ipynb file.")
    found = sorted((repo / "notebooks" / folder).glob("*.ipynb"))
    if not found:
        raise UserInputError(f"phase {target!r} has no notebooks yet under notebooks/{folder}/.")
    return found


def _check_in_phase_folder(path: Path, target: str, repo: Path) -> None:
    """Raise :class:`UserInputError` unless ``path`` is in ``repo/notebooks/<phase dir>/``;
    the message names the source notebook of that name when there is one."""
    folders = {(repo / "notebooks" / d).resolve(): d for d in PHASE_DIRS.values()}
    if path.resolve().parent in folders:
        return
    same = sorted((repo / "notebooks").glob(f"*/{path.name}"))
    if not same and "_" in path.stem:  # an executed copy is <UTC>_<device>_<sha>.ipynb
        same = sorted((repo / "notebooks").glob(f"*/{path.parent.name}.ipynb"))
    fix = (f"run its source notebook, python -m nbhelpers run "
           f"{os.path.relpath(same[0], repo)}" if same
           else "move it into notebooks/<phase dir>/ first")
    raise UserInputError(f"notebook {target!r} is not in a phase folder (notebooks/"
                         f"{{{','.join(PHASE_DIRS.values())}}}/): its parameters would skip the "
                         f"phase's value checks and its output would open a new folder in "
                         f"executed/. {fix[0].upper() + fix[1:]}, or run a whole phase "
                         f"(python -m nbhelpers run phase0 ... phase3).")


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
    """Plan every notebook of ``target`` (:func:`plan_parameters`) and check it against this
    host (:func:`~nbhelpers.run.host_checks.check_host`; a compare notebook's sidecars only
    when no notebook of its phase runs before it here), then claim output names; a failed plan
    claims nothing. The git sha is read once, here. One job per notebook.

    Raises:
        UserInputError: a bad value, a request this host cannot run, or ``executed`` not
            writable (nothing is claimed)."""
    planned = plan_parameters(resolve_notebooks(target, repo), profile, overrides, repo)
    if len(planned) > 1:  # a phase run: its compare notebook reads what this run writes
        planned = [(nb, reroot_archive_paths(params, overrides, executed, repo))
                   for nb, params in planned]
    from nbhelpers.run.host_checks import check_host  # this host runs them: GPU-sized requests
    writers = {phase_of(nb) for nb, _ in planned if not is_compare(nb)}
    for nb, params in planned:
        check_host(params, phase_of(nb), lambda n, nb=nb: (
            f"{'-p ' + n if n in overrides else f'configs/{nb.stem}.{profile}.yaml'} "
            f"({nb.name})"), notebook=nb, repo=repo, sidecars_pending=phase_of(nb) in writers)
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


ARCHIVE_PREFIX = "executed/"
"""How a config names a folder of the default archive (``sidecar_dir``, ``bench_dir``)."""


def reroot_archive_paths(params: dict[str, Any], overrides: dict[str, Any], executed: Path,
                         repo: Path) -> dict[str, Any]:
    """``params`` with each config value that names a folder of the default archive
    (``executed/...``, not given with ``-p``) moved under ``executed`` when a phase run writes
    elsewhere (``--executed DIR``): ``run phase2 --executed DIR`` then compares the runs it just
    wrote to ``DIR`` (29's ``sidecar_dir``), not the checkout's archive. A single notebook keeps
    its config (``run .../29_compare.ipynb --executed DIR`` reads the archive, writes to DIR).
    Values are repo-relative when ``executed`` is inside the checkout, else absolute."""
    if executed.resolve() == (repo / "executed").resolve():
        return params
    out = dict(params)
    for name, value in params.items():
        if name in overrides or not isinstance(value, str) or \
                not value.startswith(ARCHIVE_PREFIX):
            continue
        moved = executed.resolve() / value[len(ARCHIVE_PREFIX):]
        try:
            out[name] = str(moved.relative_to(repo.resolve()))
        except ValueError:
            out[name] = str(moved)
    return out


def _check_writable(folder: Path) -> None:
    """Raises ``UserInputError`` naming the fix when ``folder`` cannot be created or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise UserInputError(f"--executed {folder}: cannot create or write there "
                             f"({err.strerror or err}); pass a folder you can write to.") from err


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


def skip_job(job: Job, failed: list[Job], repo: Path) -> None:
    """Leave ``job`` (a phase's compare notebook) unstarted because ``failed`` (notebooks it reads)
    failed in this run: its claimed, still empty notebook file is removed (no sidecar was
    written), ``job.skipped`` says why, and a warning line names the fix."""
    names = ", ".join(j.notebook.stem for j in failed)
    job.skipped = (f"{job.notebook.stem} not run: {names} failed in this run (partial output "
                   f"kept: {', '.join(repo_path(j.output, repo) for j in failed)}), so it would "
                   "compare stale or missing sidecars; fix that notebook, then run python -m "
                   f"nbhelpers run {repo_path(job.notebook, repo)}")
    if job.output.is_file() and job.output.stat().st_size == 0:
        job.output.unlink()
    log.warning("skipped %s", job.skipped)


def _run_batch(jobs: list[Job], gpus: list[str] | None, repo: Path, queue: Queue,
               workers: list[threading.Thread]) -> None:
    """Run ``jobs`` through ``queue``: one worker thread per GPU (one without ``gpus``),
    appended to ``workers`` (so an interrupt can wait for them), until all are done."""
    for job in jobs:
        queue.put(job)
    batch = [threading.Thread(target=_worker, args=(queue, g, repo), daemon=True)
             for g in (gpus or [None])]
    workers += batch
    for w in batch:
        w.start()
    for w in batch:
        while w.is_alive():  # join with a timeout: the main thread stays interruptible
            w.join(0.5)


def _compare_batch(later: list[Job], first: list[Job], repo: Path) -> list[Job]:
    """The compare jobs to start: each is skipped (:func:`skip_job`) when a notebook of its
    phase failed in ``first``."""
    out = []
    for job in later:
        failed = [j for j in first if j.status == "failed"
                  and phase_of(j.notebook) == phase_of(job.notebook)]
        if failed:
            skip_job(job, failed, repo)
        else:
            out.append(job)
    return out


def run(target: str, *, profile: str = "cpu", gpus: list[str] | None = None,
        overrides: dict[str, Any] | None = None, repo: Path | None = None,
        executed: Path | None = None) -> list[Job]:
    """Execute ``target``'s notebooks (one worker per GPU, each a queue consumer) and rewrite
    ``executed/INDEX.md``. A phase's compare notebook (:func:`~nbhelpers.run.phases.is_compare`)
    starts after the others and is skipped with a logged line naming the fix when one of them
    failed (the failed notebook's partial output is kept). Returns the jobs with their return
    codes (0 = ok) and ``skipped`` reasons."""
    repo = repo or REPO
    executed = executed or repo / "executed"
    STOPPING.clear()
    jobs = plan_jobs(target, profile, overrides or {}, gpus, executed, repo)
    first = [j for j in jobs if not is_compare(j.notebook)]
    later = [j for j in jobs if is_compare(j.notebook)]
    queue: Queue = Queue()
    workers: list[threading.Thread] = []
    try:
        _run_batch(first, gpus, repo, queue, workers)
        _run_batch(_compare_batch(later, first, repo), gpus, repo, queue, workers)
    except KeyboardInterrupt:
        STOPPING.set()
        while not queue.empty():  # nothing new starts
            queue.get_nowait()
        stop_jobs([j for j in jobs if not j.skipped], repo)
        for w in workers:  # let a worker finish writing what its child left
            w.join(2.0)
        write_index(executed, repo)
        raise
    write_index(executed, repo)
    return jobs
