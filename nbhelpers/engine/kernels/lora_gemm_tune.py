"""Per-shape choice between cuBLAS (+ LoRA shrink/expand) and :mod:`.lora_gemm` configs, on disk.

Contract: :func:`shape_key` names one decode GEMM shape (M bucket, parts, ranks, K, dtypes, bias)
on one device (GPU name, Triton version); :class:`Tuner` times every candidate once per key
(:func:`cold_ms`: ``triton.testing.do_bench``, which zeroes a 256 MB buffer before each run so
the weights are not in L2, as in a decode step where the other layers evicted them) and records
the winner and every time in a JSON file (:func:`cache_path`); later keys are served from it, also
in later processes. The engine (``LiveGroup``) tunes at a shape's first eager call (the CUDA-graph
warm-up steps before capture) and never while capturing or on the CPU. A file that does not parse
is ignored and rewritten.

Source of the method: Triton's own ``triton.autotune`` (benchmark each config once per key, keep
the best), with the key extended by the device and cached on disk as vLLM's tuned fused-MoE
configs are (``vllm/model_executor/layers/fused_moe/configs/*.json``, keyed by device name).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

CUBLAS = "cublas"
"""The choice name of the caller's cuBLAS path (base GEMM + LoRA shrink/expand)."""


def cache_path() -> Path:
    """``$NBHELPERS_CACHE_DIR/lora_gemm.json``, else ``$XDG_CACHE_HOME`` (default ``~/.cache``)
    ``/nbhelpers/lora_gemm.json``."""
    root = os.environ.get("NBHELPERS_CACHE_DIR")
    if root:
        return Path(root) / "lora_gemm.json"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nbhelpers" / "lora_gemm.json"


def device_name(device: Any) -> str:
    """``"<GPU name>|triton <version>"`` (``"cpu|..."`` off CUDA)."""
    import torch
    import triton
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    return f"{gpu}|triton {triton.__version__}"


def m_bucket(m: int) -> int:
    """The row tile a launch with ``m`` rows uses (16, 32 or 64): one key per bucket."""
    return max(16, 1 << (m - 1).bit_length())


def shape_key(device: Any, m: int, sizes: list[int], k: int, w_dtype: Any, a_dtype: Any = None,
              ranks: list[int] | None = None, bias: bool = False) -> str:
    """One string per (device, M bucket, N parts, K, ranks, dtypes, bias)."""
    lora = f"r{'+'.join(map(str, ranks))}:{str(a_dtype).removeprefix('torch.')}" if ranks else "nolora"
    return (f"{device_name(device)}|M{m_bucket(m)}|N{'+'.join(map(str, sizes))}|K{k}|"
            f"{str(w_dtype).removeprefix('torch.')}|{lora}|bias{int(bias)}")


def cold_ms(fn: Callable[[], Any]) -> float:
    """Median ms of ``fn()`` with L2 flushed before each run (``triton.testing.do_bench``)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))


class Tuner:
    """Timed choices per :func:`shape_key`, persisted at ``path`` (default :func:`cache_path`).

    ``timer(fn) -> ms`` (default :func:`cold_ms`). :meth:`choose` returns the stored or newly
    timed winner's name.
    """

    def __init__(self, path: Path | None = None, timer: Callable[[Callable], float] | None = None):
        self.path = Path(path) if path is not None else cache_path()
        self.timer = timer or cold_ms
        self.table: dict[str, dict] = self._load()

    def _load(self) -> dict[str, dict]:
        """The stored table; a file that does not parse as a JSON object is re-tuned and
        replaced at the next save, with a warning (a missing file is just empty)."""
        if not self.path.exists():
            return {}
        try:
            table = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            table = err
        if not isinstance(table, dict):
            warnings.warn(f"{self.path.stem} tuner: cache {self.path} is not a JSON object "
                          f"({table!r:.80}); re-tuning and replacing it.", stacklevel=3)
            return {}
        return table

    def choose(self, key: str, candidates: dict[str, Callable[[], Any]],
               per_call: int = 1) -> str:
        """Name of the fastest of ``candidates`` (name -> zero-argument launch of ``per_call``
        GEMMs) for ``key``; timed once, then read from the table (a stored name no longer offered
        is re-timed). Stores ``ms`` per GEMM."""
        entry = self.table.get(key)
        if entry and entry.get("choice") in candidates:
            return entry["choice"]
        times = {name: self._time(fn) / per_call for name, fn in candidates.items()}
        best = min(times, key=times.get)
        self.table[key] = {"choice": best, "ms": times}
        self._save()
        return best

    def entries(self, choices: dict[str, str]) -> dict[str, dict]:
        """``{key: {"choice": name, "ms": {candidate: ms per GEMM}}}`` for ``choices`` (key ->
        the candidate name the caller runs), ``ms`` copied from the table (``{}`` for a key it
        does not hold: a choice made without timing)."""
        return {key: {"choice": name, "ms": dict((self.table.get(key) or {}).get("ms") or {})}
                for key, name in sorted(choices.items())}

    def _time(self, fn: Callable[[], Any]) -> float:
        """``timer(fn)``; a candidate that fails to launch (e.g. Triton's ``OutOfResources``:
        shared memory on a smaller GPU) is never chosen (``inf``)."""
        try:
            return self.timer(fn)
        except Exception:  # noqa: BLE001 -- any launch failure disqualifies the config
            return float("inf")

    def _save(self) -> None:
        """Write the table atomically (tmp file + replace); an unwritable cache is skipped."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.table, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError:
            pass


_TUNER: Tuner | None = None


def tuner() -> Tuner:
    """The process's :class:`Tuner` (created at first use, reading :func:`cache_path`)."""
    global _TUNER
    if _TUNER is None:
        _TUNER = Tuner()
    return _TUNER


def config_name(cfg: Any) -> str:
    """``"n128_k128_s4_w4_st3"`` for a :class:`.lora_gemm.Config`."""
    return (f"n{cfg.block_n}_k{cfg.block_k}_s{cfg.split_k}_w{cfg.num_warps}"
            f"_st{cfg.num_stages}")
