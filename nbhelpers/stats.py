"""Timers, peak memory, robust summaries and the result sidecar (schema v1, DESIGN.md).

Contract: one JSON sidecar per measurement. ``make_sidecar`` fills the schema's keys, ``write_sidecar``
writes it atomically next to the executed notebook, ``read_sidecars`` loads every sidecar under a
folder for the comparison notebooks (``sidecar_root``: their folder parameter as they read it;
``no_runs_why``: why one holds no runs). Values that are not finite are stored as ``None``
(never inf/NaN). A sidecar's ``run_id`` defaults to :func:`run_stamp`: the runner's start stamp
(the one in the executed notebook's file name) when the runner launched the kernel.

Run: ``python -c "from nbhelpers.stats import env_info; print(env_info())"``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SIDECAR_KEYS = (
    "schema", "run_id", "phase", "backend", "model", "lora", "workload", "rounds",
    "decode_tok_per_s_median", "prompt_tok_per_s_median", "wall_s_median",
    "peak_mem_allocated_gib", "peak_mem_device_gib", "env", "error",
)
_VERSIONED = ("torch", "transformers", "trl", "vllm", "peft", "accelerate", "unsloth", "triton")
GIB = 1024**3


def utc_stamp() -> str:
    """UTC time as ``YYYYmmddTHHMMSSZ`` (sortable, filename-safe)."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


RUN_ID_ENV = "NBHELPERS_RUN_ID"
"""Environment variable the runner sets for the kernel: the UTC stamp of the run's file names."""


def run_stamp() -> str:
    """The run's id: ``$NBHELPERS_RUN_ID`` (``nbhelpers.run.execute`` sets it to the stamp that
    starts the executed notebook's and sidecar's file names, taken when the run started), else
    :func:`utc_stamp` now (a notebook run by hand)."""
    return os.environ.get(RUN_ID_ENV) or utc_stamp()


def git_sha(repo: str | os.PathLike | None = None, short: bool = True) -> str:
    """The checkout's HEAD sha (``nogit`` outside a repo); ``+dirty`` is not appended.

    ``NBHELPERS_GIT_SHA`` overrides it: a copy of the working tree without ``.git`` (a remote GPU
    host) still records which commit it ran.
    """
    if os.environ.get("NBHELPERS_GIT_SHA"):
        return os.environ["NBHELPERS_GIT_SHA"]
    cmd = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
    try:
        out = subprocess.run(cmd, cwd=repo or Path(__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip() or "nogit"
    except (OSError, subprocess.SubprocessError):
        return "nogit"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gpu_name() -> str:
    """``torch.cuda.get_device_name(0)`` or ``cpu``; never imports torch when it is absent."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def device_tag(name: str | None = None) -> str:
    """Short filename-safe device label: ``h200``, ``b200``, ``a100``... or ``cpu``."""
    name = (name or gpu_name()).lower()
    for tag in ("h200", "h100", "b200", "gb200", "a100", "l40s", "l4", "a10g", "rtx"):
        if tag in name:
            return tag
    return "cpu" if name == "cpu" else "".join(c for c in name if c.isalnum())[:16] or "gpu"


def env_info() -> dict[str, Any]:
    """The run's environment: gpu name, driver, library versions, git sha, UTC time, host."""
    info: dict[str, Any] = {"gpu": gpu_name(), "driver": None, "python": platform.python_version(),
                            "platform": platform.platform(), "git_sha": git_sha(),
                            "utc": datetime.now(UTC).isoformat(timespec="seconds"),
                            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    info.update({name: _version(name) for name in _VERSIONED})
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return info


def finite_or_none(x: Any) -> Any:
    """``x`` as a float, or ``None`` when it is missing, NaN or infinite (JSON has no inf)."""
    if x is None:
        return None
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def median(values: Sequence[float]) -> float | None:
    """Median of the finite values, ``None`` when there are none."""
    vals = sorted(v for v in (finite_or_none(v) for v in values) if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else 0.5 * (vals[mid - 1] + vals[mid])


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100) of the finite values (numpy's default)."""
    vals = sorted(v for v in (finite_or_none(v) for v in values) if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _cuda_sync() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def timer() -> Iterator[dict[str, float]]:
    """Synchronised wall timer: ``with timer() as t: ...; t["s"]`` (seconds, CUDA synced)."""
    out: dict[str, float] = {}
    _cuda_sync()
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        _cuda_sync()
        out["s"] = time.perf_counter() - t0


def reset_peak_memory() -> None:
    """Reset torch's peak-allocation counter (no-op on the CPU)."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> dict[str, float | None]:
    """Peak memory in GiB.

    ``allocated``: ``torch.cuda.max_memory_allocated`` (tensors only). ``device``: what the card has
    in use now per ``torch.cuda.mem_get_info`` (total - free; includes other allocators such as
    vLLM's reservation and the CUDA context). ``device_max``: an estimate of the card's peak use
    since the last :func:`reset_peak_memory`: ``torch.cuda.max_memory_reserved`` (the caching
    allocator's peak, KV caches and CUDA-graph pools included) plus what the card has in use now
    outside that allocator (``device`` - ``torch.cuda.memory_reserved``: CUDA context, cuBLAS and
    NCCL workspaces), never below ``device``. It differs from ``device`` for an engine that frees
    its memory before the measurement (transformers' continuous batching frees its paged cache at
    the end of ``generate_batch``: its ``device`` reads the trainer's footprint, not the peak).
    On the CPU: the process's peak RSS for all three.
    """
    try:
        import torch
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            in_use = total - free
            outside = max(0, in_use - torch.cuda.memory_reserved())
            device_max = max(in_use, torch.cuda.max_memory_reserved() + outside)
            return {"allocated": torch.cuda.max_memory_allocated() / GIB,
                    "device": in_use / GIB, "device_max": device_max / GIB}
    except ImportError:
        pass
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux
    return {"allocated": rss, "device": rss, "device_max": rss}


def rounds_summary(rounds: Sequence[dict[str, float]]) -> dict[str, float | None]:
    """Medians over timed rounds, each ``{"wall_s", "new_tokens", "prompt_tokens"}``.

    ``decode_tok_per_s`` = new tokens / generation seconds of the round (prefill included, as in
    vLLM's ``benchmark_throughput`` output tok/s); ``prompt_tok_per_s`` = prompt tokens / the
    same seconds. A round's generation seconds are its ``wall_s``, or its ``generate_s`` when it
    has that key: a GRPO step round, whose wall also holds rewards and the loss forward/backward
    (:func:`nbhelpers.grpo.phase0_report.grpo_rounds`); a ``generate_s`` of ``None`` (rollout not
    timed) leaves the round out of both rates, never rated over the whole step.
    """
    timed = [(r, _generation_s(r)) for r in rounds]
    dec = [r["new_tokens"] / s for r, s in timed if s]
    pro = [r.get("prompt_tokens", 0) / s for r, s in timed if s]
    return {"decode_tok_per_s_median": median(dec), "prompt_tok_per_s_median": median(pro),
            "wall_s_median": median([r["wall_s"] for r in rounds])}


def _generation_s(round_: dict[str, float]) -> float | None:
    """The seconds a round's token rates divide by (:func:`rounds_summary`)."""
    return round_["generate_s"] if "generate_s" in round_ else round_.get("wall_s")


def make_sidecar(*, phase: str, backend: str, model: dict[str, Any] | None = None,
                 lora: dict[str, Any] | None = None, workload: dict[str, Any] | None = None,
                 rounds: Sequence[dict[str, float]] = (), peak_mem: dict[str, Any] | None = None,
                 error: str | None = None, run_id: str | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A schema-v1 sidecar dict. ``extra`` keys are added beside the schema's keys.

    Raises:
        ValueError: when ``extra`` would overwrite a schema key.
    """
    peak_mem = peak_mem or {}
    side: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "run_id": run_id or run_stamp(), "phase": phase,
        "backend": backend, "model": model, "lora": lora, "workload": workload,
        "rounds": [dict(r) for r in rounds], **rounds_summary(rounds),
        "peak_mem_allocated_gib": finite_or_none(peak_mem.get("allocated")),
        "peak_mem_device_gib": finite_or_none(peak_mem.get("device")),
        "env": env_info(), "error": error,
    }
    clash = set(extra or {}) & set(SIDECAR_KEYS)
    if clash:
        raise ValueError(f"make_sidecar(extra=...) would overwrite schema keys {sorted(clash)}: "
                         "rename them.")
    side.update(extra or {})
    return _sanitise(side)


def _sanitise(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _sanitise(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitise(v) for v in obj]
    return obj


def validate_sidecar(side: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the missing keys when ``side`` is not a schema-v1 sidecar."""
    if not isinstance(side, dict):  # ValueError like every other "not a sidecar" case
        raise ValueError(  # noqa: TRY004
            f"not a schema-v{SCHEMA_VERSION} sidecar: a JSON {type(side).__name__}, "
            "not an object. Build it with nbhelpers.stats.make_sidecar().")
    missing = [k for k in SIDECAR_KEYS if k not in side]
    if missing or side.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"not a schema-v{SCHEMA_VERSION} sidecar: missing {missing}, schema="
                         f"{side.get('schema')!r}. Build it with nbhelpers.stats.make_sidecar().")


def write_sidecar(side: dict[str, Any], path: str | os.PathLike) -> Path:
    """Validate and write ``side`` as JSON to ``path`` atomically (tmp file + rename)."""
    validate_sidecar(side)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(_sanitise(side), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def read_sidecars(root: str | os.PathLike, phase: str | None = None) -> list[dict[str, Any]]:
    """Every valid sidecar ``*.json`` under ``root`` (optionally of one phase), with ``_path``."""
    out = []
    for p in sorted(Path(root).rglob("*.json")):
        try:
            side = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
            logging.getLogger(__name__).warning("skipped %s: not readable JSON (%s)", p, exc)
            continue
        try:
            validate_sidecar(side)
        except (ValueError, TypeError, AttributeError):
            continue  # other JSON (bench choices, worker specs): not a sidecar
        if phase is None or side.get("phase") == phase:
            side["_path"] = str(p)
            out.append(side)
    return out


def sidecar_root(sidecar_dir: str | os.PathLike, cwd: Path | None = None) -> Path:
    """A compare notebook's sidecar folder (``19_compare``'s ``executed_dir``, ``29_compare``'s
    ``sidecar_dir``) as it reads it: an absolute path as given; a relative one from ``cwd``
    (default: this process's; the runner starts the kernel in the checkout), or, when it is not
    there, from two folders above ``cwd`` (Jupyter starts a kernel in the notebook's folder,
    ``notebooks/phaseN_*/``)."""
    path, cwd = Path(sidecar_dir), Path.cwd() if cwd is None else Path(cwd)
    if path.is_absolute():
        return path
    tries = [cwd / path] + ([cwd.parents[1] / path] if len(cwd.parents) > 1 else [])
    return next((p for p in tries if p.exists()), tries[0])


def no_runs_why(root: Path, every: list[dict[str, Any]], phase: str, otherwise: str) -> str:
    """Why a compare notebook found no runs of ``phase`` under ``root`` (``every``: all the
    sidecars :func:`read_sidecars` found there): no such folder, not a folder, no sidecar files,
    only other phases' sidecars, else ``otherwise`` (e.g. only notebook summaries)."""
    other = sorted({str(s.get("phase")) for s in every} - {phase})
    return ("no such folder" if not root.exists() else "not a folder" if not root.is_dir()
            else "no sidecar files in it" if not every
            else f"only sidecars of {other}" if all(s.get("phase") != phase for s in every)
            else otherwise)
