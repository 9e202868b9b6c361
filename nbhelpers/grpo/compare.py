"""Run the same GRPO setup on several backends (one process each) and compare them.

Contract: :func:`run_backends` runs :func:`nbhelpers.grpo.train` once per backend, each in
a fresh spawned process (DESIGN.md rule 6: one backend per process; vLLM and CUDA graphs leave
memory behind), and returns ``{backend: run}`` where ``run`` is a plain dict: ``rows`` (per-step
rows, :func:`~nbhelpers.grpo.result.step_rows`), ``summary``, ``config``, ``wall_s``,
``completions`` (a sample), ``error`` (``"<ExceptionType>: message"`` or None). A failed backend
keeps its row with the error. Each finished backend is written to disk at once and earlier
runs can be reused instead of trained (:mod:`~nbhelpers.grpo.compare_records`: ``sidecar_path``,
``reuse_runs``).

Partial sidecars. With a ``sidecar_path`` each backend's child also streams one JSON line per
logged step to ``<stem>__<backend>.progress.jsonl`` beside it (:mod:`~nbhelpers.grpo.progress`:
the step's row, peak allocated GiB so far, UTC, the compile counts so far). A backend that
finishes is written as ``<stem>__<backend>.json`` (``partial: true``, ``status`` ``ok`` |
``failed``). A backend that does not finish keeps the steps it logged: when the notebook is
stopped while it trains (a ``KeyboardInterrupt`` / ``SystemExit`` in this process: a device
call's time cap, a user's stop) the child is stopped, its progress file is read and the same
sidecar is written with ``status: "interrupted"``, ``interrupted`` ``{n_steps, max_steps,
cause}`` and ``error`` ``"KeyboardInterrupt: interrupted after N logged steps (of max_steps
M); ..."`` (the rows are those steps, the summary their medians), then the interrupt goes on up;
a child that dies on its own (killed, crashed) gets the same record (cause ``ChildExit`` with
its exit code, or ``SIGTERM`` / ``SIGINT``) and the next backend runs. ``29_compare`` shows
such a run's numbers labelled ``interrupted after N steps`` and never counts it as a finished
run (:func:`nbhelpers.grpo.gate.check_runs`: not gated when stopped from outside; ranked below
every finished run). A backend stopped before its first log line has no progress file and no
record (nothing was produced). :func:`backend_sidecar` makes one schema-v1 sidecar per backend
(phase ``phase2``) with the gate result and the IS report (:func:`is_summary`) beside it; :func:`summary_frame` and :func:`steps_long`
are the notebook's tables. ``29_compare`` reads the sidecars back with :func:`runs_from_sidecars`.
The tables live in :mod:`~nbhelpers.grpo.compare_tables`, the sidecars and the cross-run gate in
:mod:`~nbhelpers.grpo.compare_sidecars`, the (device, model, shape) groups runs are compared
within and the per-shape speed table in :mod:`~nbhelpers.grpo.compare_shapes`; this module is
the notebooks' face for all of them.

Run: ``python -c "from nbhelpers.grpo.compare import run_backends; from nbhelpers.config import
GRPOSettings; print(run_backends(['flex'], 'tiny-llama', GRPOSettings(max_steps=1,
max_completion_length=8), n_questions=4)['flex']['summary'])"``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import signal
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import compare_records as records
from nbhelpers.grpo.compare_shapes import (
    flex_vs_vllm,
    group_key,
    group_runs,
    headline_by_shape,
    latest_per_backend,
    latest_per_group,
    ratio_text,
    result_by_shape,
    run_shape,
    runs_frame,
    shape_label,
    sources,
    speed_frame,
    vllm_ratio,
)
from nbhelpers.grpo.compare_sidecars import (
    PHASE,
    backend_sidecar,
    filter_device,
    gate_conclusion,
    gate_latest,
    load_runs,
    runs_from_sidecars,
    write_sidecars,
)
from nbhelpers.grpo.compare_tables import (
    compile_frame,
    failed_checks,
    failed_checks_text,
    gate_frame,
    gate_headline,
    headline,
    is_frame,
    is_summary,
    not_logged_reason,
    perf_goal,
    result_line,
    reused_caption,
    source_word,
    step_split_frame,
    steps_long,
    summary_frame,
)
from nbhelpers.grpo.compile_report import compile_dynamic_flag
from nbhelpers.stats import gpu_name

__all__ = ["PHASE", "RUN_KEYS", "WARMUP_ADAPTER", "backend_sidecar",
           "compile_dynamic_flag", "compile_frame", "failed_checks", "failed_checks_text",
           "filter_device", "flex_options", "flex_vs_vllm", "gate_conclusion", "gate_frame",
           "gate_headline", "gate_latest", "group_key", "group_runs",
           "headline", "headline_by_shape", "is_frame", "is_summary",
           "latest_per_backend", "latest_per_group", "load_runs", "not_logged_reason",
           "perf_goal", "ratio_text", "result_by_shape", "result_line", "reused_caption",
           "run_backends",
           "run_isolated", "run_shape", "runs_frame", "runs_from_sidecars",
           "shape_label", "source_word", "sources", "speed_frame", "step_split_frame",
           "steps_long", "summary_frame", "vllm_ratio", "write_sidecars"]

WARMUP_ADAPTER = "merge"
"""Phase 2 merges a format warm-up into the base (``train(warmup_adapter=...)``): every backend of
one comparison then starts from the same base policy with a fresh adapter."""
RUN_KEYS = ("rows", "summary", "config", "wall_s", "completions", "error")


POLL_S = 2.0
"""Seconds between the parent's checks that the child is alive while it waits for its result."""
STOP_GRACE_S = 5.0
"""Seconds a child gets to exit after SIGTERM (the parent was interrupted) before SIGKILL; short:
the runner that stopped the notebook SIGKILLs it all 20 s after its stop signal
(:func:`nbhelpers.run.execute.stop_jobs`), and the interrupted record is written after this."""


def _child(queue: Any, backend: str, model: str, settings: GRPOSettings,
           kwargs: dict[str, Any], cpu_threads: int, progress_path: str = "",
           progress_request: dict[str, Any] | None = None) -> None:
    try:
        import torch
        if cpu_threads and not torch.cuda.is_available():
            torch.set_num_threads(cpu_threads)
        from nbhelpers.grpo import step_rows, train
        kwargs.setdefault("warmup_adapter", WARMUP_ADAPTER)
        single = kwargs.get("num_processes", 1) == 1 and kwargs.get("vllm_mode",
                                                                     "colocate") == "colocate"
        if progress_path and single:  # ranks' processes take no callbacks (distributed.launch)
            from nbhelpers.grpo.progress import ProgressWriter
            kwargs["callbacks"] = [*kwargs.get("callbacks", ()),
                                   ProgressWriter(progress_path, backend, progress_request)]
        res = train(model, settings, backend=backend, **kwargs)
        queue.put({"rows": step_rows(res), "summary": res.summary, "config": res.config,
                   "wall_s": res.wall_s, "completions": res.completions[:8], "error": None})
    except Exception as err:  # noqa: BLE001 - the parent keeps the row with this error
        queue.put({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def run_isolated(backend: str, model: str, settings: GRPOSettings, *, cpu_threads: int = 0,
                 progress_path: str | Path = "", progress_request: dict[str, Any] | None = None,
                 **train_kwargs: Any) -> dict[str, Any]:
    """One :func:`~nbhelpers.grpo.train` run in a spawned process (see module doc).

    ``cpu_threads`` > 0 sets ``torch.set_num_threads`` in the child on CPU hosts (tiny GEMMs on
    few shared cores run faster on one thread). ``progress_path`` (non-empty): the child streams
    its per-step progress file there (:class:`~nbhelpers.grpo.progress.ProgressWriter`, with
    ``progress_request`` in its start line; single-process runs only). Returns the run dict
    (module doc) with ``traceback`` and ``child_died`` (``None``, or ``{"exit_code": int}`` when
    the child died without reporting, ``error`` then ``"ChildExit: ..."``).

    Raises:
        ValueError: ``cpu_threads`` < 0 (before any child starts; 0 = torch's default).

    Never raises for a failed run: ``error`` says why. An interrupt in this process
    (``KeyboardInterrupt`` / ``SystemExit`` while it waits) stops the child (SIGTERM, then
    SIGKILL after :data:`STOP_GRACE_S`) and is raised on.
    """
    if not isinstance(cpu_threads, int) or isinstance(cpu_threads, bool) or cpu_threads < 0:
        raise ValueError(f"cpu_threads={cpu_threads!r}: give an int >= 0 (0 = torch's default "
                         "thread count, n > 0 = n threads in the run's process on a CPU host).")
    # TRL's output_dir unless the caller gave one: a temporary folder this process removes when
    # the child has ended, however it ended (it holds the format warm-up's merged weights, 8 GB
    # at Qwen3-4B; a child stopped by SIGTERM runs no cleanup of its own)
    own = None if train_kwargs.get("output_dir") else tempfile.TemporaryDirectory(
        prefix=f"grpo_{backend}_")
    if own is not None:
        train_kwargs = {**train_kwargs, "output_dir": own.name}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, backend, model, settings, train_kwargs,
                                            cpu_threads, str(progress_path or ""),
                                            progress_request))
    proc.start()
    try:
        out = _wait(queue, proc)
        proc.join()
    except BaseException:
        _stop(proc)
        raise
    finally:
        if own is not None and not proc.is_alive():
            own.cleanup()
    if proc.exitcode not in (0, None) and out.get("error") is None:
        out["error"] = f"ChildExit: exit code {proc.exitcode}"
    return {k: out.get(k) for k in RUN_KEYS} | {"traceback": out.get("traceback"),
                                                "child_died": out.get("child_died")}


def _wait(queue: Any, proc: Any) -> dict[str, Any]:
    """The child's result; a child that died without one gives ``child_died`` (a plain
    ``queue.get()`` would wait forever: this process holds the queue's write end too)."""
    while True:
        try:
            return queue.get(timeout=POLL_S)
        except queue_mod.Empty:
            if proc.is_alive():
                continue
        try:  # a child that put its result just before exiting
            return queue.get(timeout=POLL_S)
        except queue_mod.Empty:
            proc.join()
            return {"error": f"ChildExit: the child died (exit code {proc.exitcode}) before it "
                             "reported", "child_died": {"exit_code": proc.exitcode}}


def _stop(proc: Any) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(STOP_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _death_cause(exit_code: int | None) -> str:
    """``"<type>: <text>"`` for a child that died: ``SIGTERM`` / ``SIGINT`` (stopped from
    outside), else ``ChildExit`` with the exit code."""
    stops = {-signal.SIGTERM: "SIGTERM", -signal.SIGINT: "SIGINT"}
    kind = stops.get(exit_code, "ChildExit")
    return f"{kind}: the training process died (exit code {exit_code}) before it reported"


def flex_options(sleep_between_rollouts: bool = False,
                 compile_attention: str = "auto",
                 freeze_gc: bool = False) -> dict[str, Any] | None:
    """``train(flex_options=...)`` from notebook parameters; None when all are defaults.

    ``freeze_gc``: the engine's ``RunnerOptions.freeze_gc`` (vLLM's heap freeze after the first
    rollout; :mod:`nbhelpers.engine.gc_watch`).

    ``compile_attention``: ``auto`` (engine default: on iff CUDA) | ``on`` | ``off``. On the CPU
    ``on`` pays a ~20 s compile once and then decodes ~6x faster than the eager flex_attention
    math path (SmolLM2-135M, 4 x 16 tokens: 3.3 s vs 21 s per rollout, measured here).

    Raises:
        ValueError: ``compile_attention`` not one of the three words.
    """
    choices = {"auto": None, "on": True, "off": False}
    if compile_attention not in choices:
        raise ValueError(f"compile_attention={compile_attention!r}: use auto | on | off.")
    out: dict[str, Any] = {}
    if sleep_between_rollouts:
        out["sleep_between_rollouts"] = True
    if choices[compile_attention] is not None:
        out["compile_attention"] = choices[compile_attention]
    if freeze_gc:
        out["freeze_gc"] = True
    return out or None


def run_backends(backends: list[str], model: str, settings: GRPOSettings, *,
                 sidecar_path: str | Path = "", model_info: dict[str, Any] | None = None,
                 reuse_runs: dict[str, str | Path] | None = None,
                 **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_isolated` for each backend in order; ``kwargs`` go to every run. Each run
    carries ``request`` (:func:`~nbhelpers.grpo.compare_records.run_request`).

    ``sidecar_path`` (non-empty): each backend's run is written as it finishes
    (:func:`~nbhelpers.grpo.compare_records.write_partial`, ``<stem>__<backend>.json``), so a
    notebook killed later keeps it; while it trains its child streams
    ``<stem>__<backend>.progress.jsonl``, and a backend that is interrupted or whose child dies
    keeps the steps it logged in that sidecar (``status: "interrupted"``, module doc).
    ``reuse_runs`` ``{backend: sidecar path}``: those backends are read from earlier sidecars
    (:func:`~nbhelpers.grpo.compare_records.load_reused`: same request, model and device)
    instead of trained, in ``backends``' order, the ones not in
    ``backends`` first; each is labelled ``reused_from``. ``model_info``: the sidecars' model
    block (default :func:`nbhelpers.models.describe` of ``model``). Reused runs are read and
    checked before anything trains.

    Raises:
        ValueError: empty or repeated backends, an unknown backend name, an unwritable
            ``sidecar_path`` folder, or a reused sidecar that is missing, failed or does not
            match this run (the message names the field).
        KeyboardInterrupt, SystemExit: this process was interrupted while a backend trained;
            raised on after that backend's interrupted sidecar is written (module doc).
    """
    from nbhelpers.grpo.setup import check_backend
    if not backends or len(set(backends)) != len(backends):
        raise ValueError(f"backends={backends}: give each backend once, at least one.")
    reuse_runs = dict(reuse_runs or {})
    for b in [*backends, *reuse_runs]:
        check_backend(b)
    if model_info is None and (sidecar_path or reuse_runs):
        from nbhelpers.models import describe
        model_info = describe(model)
    reused = records.load_reused(reuse_runs, model, settings, kwargs, model_info or {},
                                 gpu_name()) if reuse_runs else {}
    if sidecar_path:
        records.check_writable(sidecar_path)
    order = [b for b in reuse_runs if b not in backends] + list(backends)
    runs = {}
    for b in order:
        if b in reused:
            runs[b] = reused[b]
            continue
        runs[b] = _run_one(b, model, settings, kwargs, sidecar_path, model_info)
    return runs


def _run_one(backend: str, model: str, settings: GRPOSettings, kwargs: dict[str, Any],
             sidecar_path: str | Path, model_info: dict[str, Any] | None) -> dict[str, Any]:
    """One backend of :func:`run_backends`: trained, its partial (or interrupted) sidecar
    written when there is a ``sidecar_path``."""
    from nbhelpers.grpo.progress import progress_path
    request = records.run_request(model, settings, kwargs)
    progress = progress_path(sidecar_path, backend) if sidecar_path else None
    if progress is not None:
        progress.unlink(missing_ok=True)  # an older run's lines are not this run's
        # what the interrupted record needs, imported now: after a stop signal the runner
        # leaves seconds, not a cold transformers import (progress.py imports it)
        import nbhelpers.grpo.callbacks
        import nbhelpers.grpo.phase0_report  # noqa: F401
    try:
        run = run_isolated(backend, model, settings, progress_path=progress or "",
                           progress_request=request, **kwargs) | {"request": request}
    except (KeyboardInterrupt, SystemExit) as stop:
        if progress is not None:
            _keep_interrupted(backend, progress, f"{type(stop).__name__}: the notebook was "
                              f"stopped while {backend} trained (a time cap or a user's "
                              "interrupt)", settings, request, model_info, sidecar_path)
        raise
    if progress is not None and run.get("child_died"):
        cause = _death_cause(run["child_died"].get("exit_code"))
        run = records.load_interrupted(progress, cause, settings, request) or run
    if sidecar_path:
        records.write_partial(backend, run, settings, model_info, sidecar_path)
    return run


def _keep_interrupted(backend: str, progress: Path, cause: str, settings: GRPOSettings,
                      request: dict[str, Any], model_info: dict[str, Any] | None,
                      sidecar_path: str | Path) -> None:
    """Write the interrupted backend's sidecar from its progress file; never raises (the
    interrupt that led here must go on up)."""
    try:
        run = records.load_interrupted(progress, cause, settings, request)
        if run is not None:
            records.write_partial(backend, run, settings, model_info, sidecar_path)
    except Exception as err:  # noqa: BLE001 - warn, and let the interrupt propagate
        warnings.warn(f"{backend}: interrupted record not written from {progress} "
                      f"({type(err).__name__}: {err}).", stacklevel=2)
