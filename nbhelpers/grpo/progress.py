"""Phase 2's per-step progress file: what a backend's run logged so far, on disk as it trains,
so a run stopped at a device call's time cap keeps its steps.

Contract: :class:`ProgressWriter` is a trainer callback that
:func:`nbhelpers.grpo.compare.run_backends` puts into each backend's spawned child when it has a
``sidecar_path``; it writes ``<stem>__<backend>.progress.jsonl`` (:func:`progress_path`) beside the
sidecar, one JSON object a line, each line flushed as written:

* a ``start`` line before step 1: ``event: "start"``, ``backend``, ``utc``, ``max_steps``,
  ``request`` (:func:`~nbhelpers.grpo.compare_records.run_request`), ``config`` (the GRPOConfig
  values a sidecar's ``grpo_config`` records, the LoRA block, the policy's attention and the
  plan's notes);
* one ``step`` line per logged training step: ``step``, ``row`` (the step's row as
  :func:`nbhelpers.grpo.result.step_rows` builds it: the
  :class:`~nbhelpers.grpo.callbacks.StatisticsCallback` record joined with TRL's log keys),
  ``max_memory_allocated_gib`` (the run's ``torch.cuda.max_memory_allocated`` so far, GiB; null
  on the CPU), ``utc`` and ``compile`` (:meth:`nbhelpers.grpo.compile_report.CompileWatch.snapshot`:
  graph breaks, recompiles and their reasons, ``compile_s`` so far).

:func:`read_progress` reads it back (a line torn by a kill is skipped) and :func:`interrupted_run`
turns it into the run dict of :func:`~nbhelpers.grpo.compare.run_isolated` with ``error``
``"<cause type>: interrupted after N logged steps (of max_steps M) ..."`` and ``interrupted``
``{n_steps, max_steps, cause}``; :func:`nbhelpers.grpo.compare_records.load_interrupted` builds
it and :func:`~nbhelpers.grpo.compare_records.write_partial` writes it as the backend's partial
sidecar. The trainer hands the writer its statistics callback,
compile watch and config through :meth:`ProgressWriter.bind_run` (:func:`nbhelpers.grpo.train`:
any callback with a ``bind_run``).

Run: ``pytest tests/unit/test_grpo_progress.py``.
"""

from __future__ import annotations

import json
import warnings
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

from transformers import TrainerCallback

from nbhelpers.grpo.gate import INTERRUPTED

PROGRESS_SUFFIX = ".progress.jsonl"


def progress_path(sidecar_path: str | Path, backend: str) -> Path:
    """``<stem>__<backend>.progress.jsonl`` beside ``sidecar_path``."""
    path = Path(sidecar_path)
    return path.with_name(f"{path.stem}__{backend}{PROGRESS_SUFFIX}")


def _utc() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _line(obj: dict[str, Any]) -> str:
    from nbhelpers.stats import _sanitise  # NaN / inf -> null: the file stays strict JSON
    return json.dumps(_sanitise(obj), allow_nan=False, default=str) + "\n"


class ProgressWriter(TrainerCallback):
    """Streams one JSON line per logged step to ``path`` (module docstring). Never stops a run:
    a file it cannot write is warned about once and left alone."""

    def __init__(self, path: str | Path, backend: str, request: dict[str, Any] | None = None):
        self.path, self.backend, self.request = Path(path), backend, request
        self._file: IO[str] | None = None
        self._stats: Any = None
        self._watch: Any = None
        self._written = 0  # the last step written
        self._max_alloc_gib: float | None = None

    def bind_run(self, *, stats: Any, watch: Any, config: dict[str, Any],
                 max_steps: int | None = None) -> None:
        """Called by the trainer before step 1: the run's
        :class:`~nbhelpers.grpo.callbacks.StatisticsCallback`, its
        :class:`~nbhelpers.grpo.compile_report.CompileWatch` and config; writes the ``start``
        line (truncating an older file)."""
        self._stats, self._watch = stats, watch
        try:
            self._file = self.path.open("w", encoding="utf-8")
        except OSError as err:
            warnings.warn(f"progress file {self.path} not written ({err}); the run goes on.",
                          stacklevel=2)
            return
        self._write({"event": "start", "backend": self.backend, "utc": _utc(),
                     "max_steps": max_steps, "request": self.request, "config": config})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._file is None or self._stats is None or not logs or "train_runtime" in logs:
            return
        from nbhelpers.grpo.result import step_rows
        new = [r for r in self._stats.records if self._written < r["step"] <= state.global_step]
        if not new:
            return
        rows = step_rows(SimpleNamespace(records=new, log_history=state.log_history))
        mem, comp = self._memory_gib(), self._compile()
        for row in rows:
            self._write({"event": "step", "step": row["step"], "row": row,
                         "max_memory_allocated_gib": mem, "utc": _utc(), "compile": comp})
        self._written = rows[-1]["step"]

    def on_train_end(self, args, state, control, **kwargs):
        if self._file is not None:
            self._file.close()
            self._file = None

    def _memory_gib(self) -> float | None:
        """Running max of ``torch.cuda.max_memory_allocated`` (GiB; the statistics callback
        resets the peak at each step); ``None`` without CUDA."""
        import torch
        if not torch.cuda.is_available():
            return None
        now = torch.cuda.max_memory_allocated() / 2**30
        self._max_alloc_gib = max(now, self._max_alloc_gib or 0.0)
        return self._max_alloc_gib

    def _compile(self) -> dict[str, Any] | None:
        try:
            return self._watch.snapshot() if self._watch is not None else None
        except RuntimeError:  # the watch's block has not begun (not on a step's log)
            return None

    def _write(self, obj: dict[str, Any]) -> None:
        try:
            self._file.write(_line(obj))
            self._file.flush()
        except (OSError, ValueError) as err:
            warnings.warn(f"progress file {self.path}: stopped writing ({err}).", stacklevel=2)
            self._file = None


def read_progress(path: str | Path) -> dict[str, Any] | None:
    """``{"start": <start line or None>, "steps": [<step lines>, step order]}`` of a progress
    file; ``None`` when there is none. Lines that are not JSON objects (a line torn by a kill)
    are skipped; a step seen twice keeps its last line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return None
    start, steps = None, {}
    for raw in text.splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("event") == "start":
            start = obj
        elif obj.get("event") == "step" and isinstance(obj.get("row"), dict):
            steps[obj["step"]] = obj
    return {"start": start, "steps": [steps[k] for k in sorted(steps)]}


def interrupted_run(progress: dict[str, Any], cause: str, max_steps: int,
                    request: dict[str, Any] | None = None, skip_first: int = 3) -> dict[str, Any]:
    """The run dict of :func:`~nbhelpers.grpo.compare.run_isolated` (``rows``, ``summary``,
    ``config``, ``wall_s``, ``completions``, ``error``, ``traceback``, ``request``) for a run
    stopped after the steps ``progress`` (:func:`read_progress`) holds, plus ``interrupted``
    ``{n_steps, max_steps, cause, last_step_utc}``.

    ``cause``: ``"<type>: <text>"``, e.g. ``"KeyboardInterrupt: in the parent"``; its type starts
    ``error``. ``summary``: :meth:`~nbhelpers.grpo.callbacks.StatisticsCallback.summary` over the
    rows it has (``skip_first`` warm-up steps left out when more steps exist, else all, with its
    note); ``config``: the start line's, with the last step's compile snapshot as
    ``compile_report`` (``compile_s`` etc. so far); ``wall_s``: ``None`` (the run did not end).
    """
    from nbhelpers.grpo.callbacks import StatisticsCallback
    steps, start = progress["steps"], progress.get("start") or {}
    rows = [s["row"] for s in steps]
    stats = StatisticsCallback()
    stats.records = rows
    kind, _, text = cause.partition(": ")
    n = len(rows)
    config = dict(start.get("config") or {})
    if steps and steps[-1].get("compile") is not None:
        config["compile_report"] = steps[-1]["compile"]
    if steps:
        config["max_memory_allocated_gib"] = steps[-1].get("max_memory_allocated_gib")
    error = (f"{kind}: {INTERRUPTED} {n} logged step{'s' if n != 1 else ''} (of max_steps "
             f"{max_steps}); {text or 'stopped'}; the rows are the steps logged before it")
    return {"rows": rows, "summary": stats.summary(skip_first) if rows else None,
            "config": config or None, "wall_s": None, "completions": [], "error": error,
            "traceback": None, "request": request if request is not None else start.get(
                "request"),
            "interrupted": {"n_steps": n, "max_steps": max_steps, "cause": cause,
                            "last_step_utc": steps[-1].get("utc") if steps else None}}
