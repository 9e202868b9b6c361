"""Phase 2's per-backend records that outlive a killed notebook, and earlier runs reused in place
of training a backend again.

Contract: :func:`run_request` is what defines a run for reuse (model, every
:class:`~nbhelpers.config.GRPOSettings` field, the training-defining ``train`` keywords
:data:`REQUEST_KWARGS`); :func:`nbhelpers.grpo.compare.run_backends` puts it in each run and calls
:func:`write_partial` as soon as a backend finishes: ``<stem>__<backend>.json`` beside
``sidecar_path`` (the final per-backend sidecar's path and schema, with ``partial: true``,
``status`` ``ok`` | ``failed``, no gate yet), so a notebook killed later keeps it; a backend
that did not finish (the notebook interrupted, its child dead) is written there too from its
progress file (:func:`load_interrupted`: ``status`` ``interrupted``, the steps it logged); the
notebook's
final :func:`~nbhelpers.grpo.compare_sidecars.write_sidecars` writes the same paths with
``partial: false`` and so replaces them. :func:`load_reused` reads ``{backend: sidecar path}``
(a per-backend sidecar, partial or final, or the run's summary sidecar beside it), checks the
recorded request, model and device against this run's and returns ``{backend: run}``, each run
labelled ``reused_from`` (file, UTC date, run id, git sha, partial) for
:func:`~nbhelpers.grpo.compare_tables.source_word`. :func:`check_reusable` is the part of those
checks that needs no run; the runner makes it before the notebook starts.
Reached through :mod:`nbhelpers.grpo.compare`, the notebooks' face.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings

REQUEST_KWARGS = {"dataset": "gsm8k", "n_questions": 32, "skip_first": 3,
                  "format_warmup_steps": 0, "warmup_adapter": "merge"}
"""``train`` keywords that change what a run trains or reports, with the defaults a phase-2 run
uses when they are not given (``train``'s own; ``warmup_adapter``: phase 2's ``merge``). The
other keywords (``compile_mode``, ``cpu_threads``, the vLLM and flex options) act on speed or on
one backend only, so a reused run need not match them."""
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def run_request(model: str, settings: GRPOSettings, train_kwargs: dict[str, Any]
                ) -> dict[str, Any]:
    """JSON-ready ``{"model", "settings", <REQUEST_KWARGS>}`` of one phase-2 run (see module)."""
    out = {"model": model, "settings": asdict(settings)}
    out |= {k: train_kwargs.get(k, default) for k, default in REQUEST_KWARGS.items()}
    return json.loads(json.dumps(out))  # tuples -> lists, as read back from a sidecar


def write_partial(name: str, run: dict[str, Any], settings: GRPOSettings,
                  model_info: dict[str, Any], sidecar_path: str | Path) -> Path | None:
    """Write backend ``name``'s run (finished, failed, or interrupted: :func:`load_interrupted`)
    to ``<stem>__<name>.json`` beside ``sidecar_path`` (module doc). Returns the path; ``None``
    with a warning when it cannot be written (the run itself stays in memory for the notebook's
    final write)."""
    from nbhelpers.grpo.compare_sidecars import backend_sidecar
    from nbhelpers.stats import run_stamp, write_sidecar
    path = Path(sidecar_path)
    side = backend_sidecar(name, run, settings, model_info, run_id=f"{run_stamp()}_{name}",
                           partial=True)
    try:
        return write_sidecar(side, path.with_name(f"{path.stem}__{name}.json"))
    except OSError as err:
        warnings.warn(f"{name}: partial sidecar not written beside {path} ({err}); the run is "
                      "kept in memory for the final write.", stacklevel=2)
        return None


def load_interrupted(progress_file: str | Path, cause: str, settings: GRPOSettings,
                     request: dict[str, Any]) -> dict[str, Any] | None:
    """The run dict of a backend that did not finish, from its progress file
    (:func:`nbhelpers.grpo.progress.interrupted_run`: the rows it logged, ``error`` ``"<cause
    type>: interrupted after N logged steps (of max_steps M); <cause text>; ..."``,
    ``interrupted``); ``None`` when there is no progress file (the child never reached its
    first step). ``cause``: ``"<type>: <text>"``; ``request``: :func:`run_request`'s (its
    ``skip_first`` sets the summary's warm-up)."""
    from nbhelpers.grpo.progress import interrupted_run, read_progress
    progress = read_progress(progress_file)
    if progress is None:
        return None
    return interrupted_run(progress, cause, settings.max_steps, request,
                           int(request.get("skip_first", REQUEST_KWARGS["skip_first"])))


def check_writable(sidecar_path: str | Path) -> None:
    """Create ``sidecar_path``'s folder, before any backend trains.

    Raises:
        ValueError: the folder cannot be created (names it and the fix).
    """
    folder = Path(sidecar_path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"sidecar_path={str(sidecar_path)!r}: cannot create {folder} "
                         f"({err.strerror or err}); pass a path in a folder you can write to, "
                         "or '' for no sidecars.") from err


def load_reused(reuse_runs: dict[str, str | Path], model: str, settings: GRPOSettings,
                train_kwargs: dict[str, Any], model_info: dict[str, Any], device: str
                ) -> dict[str, dict[str, Any]]:
    """``{backend: run}`` read from earlier sidecars instead of training (module doc).

    ``device``: this host's :func:`nbhelpers.stats.gpu_name`; relative paths are tried from the
    working directory, then from the repo root.

    Raises:
        ValueError: a file that is missing or not that backend's phase-2 run, a failed run, or a
            recorded request / model / device that differs from this run's (names the field).
    """
    want = run_request(model, settings, train_kwargs)
    out = {}
    for backend, given in reuse_runs.items():
        path, side = _find_sidecar(backend, given)
        _check_side(backend, path, side, want, model_info, device)
        out[backend] = _run_of(path, side)
    return out


def check_reusable(backend: str, given: str | Path, cwd: Path) -> Path:
    """The checks of :func:`load_reused` that need no run (the runner's preflight, before the
    notebook starts): ``given`` (relative paths from ``cwd``, the notebook's working directory,
    then the repo root) is a readable JSON sidecar of ``backend``'s phase-2 run that did not fail
    and records its request. Returns the file found.

    Raises:
        ValueError: missing, unreadable or not JSON, another backend's, not phase 2, failed, or
            without ``grpo_request`` (the message names the file and the fix).
    """
    path, side = _find_sidecar(backend, given, cwd)
    _check_usable(f"reuse_runs[{backend!r}] ({path.name})", backend, side)
    return path


def _find_sidecar(backend: str, given: str | Path,
                  cwd: Path | None = None) -> tuple[Path, dict[str, Any]]:
    path = Path(given)
    if not path.is_absolute():
        here = path if cwd is None else cwd / path
        path = here if here.is_file() else PACKAGE_ROOT / path
    tries, held = [path, path.with_name(f"{path.stem}__{backend}.json")], []
    for cand in tries:
        side = _read(cand)
        if side is not None and side.get("backend") == backend and "grpo_steps" in side:
            return cand, side
        if side is not None:
            held.append(f"{cand.name} holds backend {side.get('backend')!r}")
        elif cand.is_file():
            held.append(f"{cand.name} is not a readable JSON object")
    found = f" ({'; '.join(held)})" if held else " (no such file)"
    raise ValueError(f"reuse_runs[{backend!r}]={str(given)!r}: no phase-2 {backend} run at "
                     f"{' or '.join(str(t) for t in tries)}{found}; give the "
                     f"<run>__{backend}.json sidecar of an executed 20_grpo_equivalence run "
                     "(or its <run>.json).")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        side = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return side if isinstance(side, dict) else None


def _check_side(backend: str, path: Path, side: dict[str, Any], want: dict[str, Any],
                model_info: dict[str, Any], device: str) -> None:
    where = f"reuse_runs[{backend!r}] ({path.name})"
    _check_usable(where, backend, side)
    gpu = (side.get("env") or {}).get("gpu") or "cpu"
    mismatches = _diff(_predated_defaults(side["grpo_request"]), want, "") + _diff(
        {k: (side.get("model") or {}).get(k) for k in ("name", "weights")},
        {k: model_info.get(k) for k in ("name", "weights")}, "model_info.")
    if gpu != device:
        mismatches.append(f"device: sidecar {gpu!r}, this run {device!r}")
    if mismatches:
        raise ValueError(f"{where} does not match this run: {'; '.join(mismatches)}. Pass the "
                         f"same values (-p ...) or train {backend} again (leave it out of "
                         "reuse_runs).")


def _check_usable(where: str, backend: str, side: dict[str, Any]) -> None:
    """A phase-2 sidecar that did not fail and records its request (else ``ValueError``)."""
    if side.get("phase") != "phase2":
        raise ValueError(f"{where}: phase {side.get('phase')!r}, not phase2: give a sidecar of "
                         "20_grpo_equivalence.")
    if side.get("error") or side.get("status") == "failed":
        raise ValueError(f"{where}: that run failed ({str(side.get('error'))[:200]}); train "
                         f"{backend} again (leave it out of reuse_runs).")
    got = side.get("grpo_request")
    if not got:
        raise ValueError(f"{where}: no grpo_request (written before runs could be reused), so "
                         f"its settings cannot be checked; train {backend} again (leave it out "
                         "of reuse_runs).")


def _predated_defaults(request: Any) -> Any:
    """``request`` with every :class:`~nbhelpers.config.GRPOSettings` field its ``settings``
    lack set to the field's default: a field added after the sidecar was written (e.g.
    ``pad_to_multiple_of``, 2026-12-05) did not exist for that run, which ran with what the
    default keeps (``pad_to_multiple_of=0``: no padding, TRL's ``None``). A value the sidecar
    records, ``None`` included, is compared as written."""
    if not isinstance(request, dict) or not isinstance(request.get("settings"), dict):
        return request
    return request | {"settings": asdict(GRPOSettings()) | request["settings"]}


def _diff(got: Any, want: Any, prefix: str) -> list[str]:
    """``"<field>: sidecar X, this run Y"`` for every leaf that differs (dicts walked)."""
    if isinstance(got, dict) and isinstance(want, dict):
        keys = list(want) + [k for k in got if k not in want]
        return [m for k in keys for m in _diff(got.get(k), want.get(k), f"{prefix}{k}.")]
    return [] if got == want else [f"{prefix.rstrip('.')}: sidecar {got!r}, this run {want!r}"]


def _run_of(path: Path, side: dict[str, Any]) -> dict[str, Any]:
    """The run dict of :func:`~nbhelpers.grpo.compare.run_isolated`, labelled ``reused_from``."""
    try:
        shown = str(path.resolve().relative_to(PACKAGE_ROOT))
    except ValueError:
        shown = str(path)
    env = side.get("env") or {}
    return {"rows": side.get("grpo_steps") or [], "summary": side.get("grpo_summary"),
            "config": side.get("grpo_config"), "wall_s": side.get("grpo_wall_s"),
            "completions": side.get("grpo_completions_sample") or [], "error": None,
            "traceback": None, "request": side.get("grpo_request"),
            "reused_from": {"path": shown, "utc": env.get("utc"), "run_id": side.get("run_id"),
                            "git_sha": env.get("git_sha"), "partial": bool(side.get("partial"))}}
