"""Per-shape choice between cuBLAS (``F.linear``) and :mod:`.skinny_gemm` configs, cached on disk.

Contract: :func:`shape_key` names one decode GEMM (device name + Triton version, M bucket, N, K,
dtype, bias). :class:`SkinnyTuner` times every candidate once per key with cold weights and
records the winner and every time (ms per GEMM; ``inf`` for a config that failed to launch or
to match ``F.linear``) in a JSON file keyed by that string
(:func:`cache_path`: ``skinny_gemm.json`` beside :mod:`.lora_gemm_tune`'s ``lora_gemm.json``,
same format ``{key: {"choice": name, "ms": {name: ms}}}``); later keys are served from it, also in
later processes, unless the stored entry lacks a time for one of today's candidates (the
candidate set grew: re-timed). A file that does not parse is replaced, with a warning. With
``cublas=False`` (runner option ``skinny_gemm_cublas="never"``) cuBLAS is no candidate and the key
ends in ``|nocublas``, so the two modes' choices never serve each other. The engine
(:mod:`nbhelpers.engine.skinny_linear`) tunes at a shape's first eager CUDA call (the CUDA-graph
warm-up steps before capture), never while capturing, tracing or on the CPU (there: the fixed
:func:`.skinny_gemm.default_config`).

Cold weights: each candidate runs over enough copies of W (>= 256 MB, :data:`ROTATE_BYTES`) that
the H200's 50 MB L2 holds none of them, as in a decode step where the other layers evicted them,
timed as :data:`REPS` passes inside one CUDA graph (launch overhead off the clock, as the engine
replays graphs): the method of ``/work/shared/tools/gemv_roofline.py``. A candidate whose result
differs from ``F.linear`` beyond bf16 rounding, or that fails to launch, is never chosen.
Source of the method: Triton's ``triton.autotune`` (time each config once per key, keep the
best) with the key extended by the device and cached on disk as vLLM's fused-MoE configs are.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbhelpers.engine.kernels import lora_gemm_tune
from nbhelpers.engine.kernels.lora_gemm_tune import CUBLAS, Tuner, device_name

ROTATE_BYTES = 256 << 20
MAX_COPIES = 64
"""At most this many copies (weights under 4 MB, tiny test models, stay partly in L2)."""
REPS = 4
__all__ = ["CUBLAS", "SkinnyTuner", "cache_path", "candidates", "config_name", "graph_ms",
           "shape_key", "tuner"]


def cache_path() -> Path:
    """``skinny_gemm.json`` in the directory of :func:`.lora_gemm_tune.cache_path`
    (``$NBHELPERS_CACHE_DIR``, else ``$XDG_CACHE_HOME/nbhelpers``, default ``~/.cache``)."""
    return lora_gemm_tune.cache_path().with_name("skinny_gemm.json")


def m_bucket(m: int) -> int:
    """The engine's decode bucket holding ``m`` rows (1, 2, 4, 8, 16, 32 or 64): one key each
    (one :func:`.skinny_gemm.block_m` per bucket: 16 up to the 16 bucket, then 32, then 64)."""
    return 1 << (m - 1).bit_length()


def shape_key(device: Any, m: int, n: int, k: int, dtype: Any, bias: bool,
              cublas: bool = True) -> str:
    """``"<GPU name>|triton <v>|skinny|M<bucket>|N<n>|K<k>|<dtype>|bias<0/1>"``, plus
    ``"|nocublas"`` when cuBLAS is no candidate (``cublas=False``)."""
    return (f"{device_name(device)}|skinny|M{m_bucket(m)}|N{n}|K{k}|"
            f"{str(dtype).removeprefix('torch.')}|bias{int(bias)}"
            + ("" if cublas else "|nocublas"))


def config_name(cfg: Any) -> str:
    """``"n64_k128_s4_w4_st3"`` for a :class:`.skinny_gemm.Config`."""
    return f"n{cfg.block_n}_k{cfg.block_k}_s{cfg.split}_w{cfg.num_warps}_st{cfg.num_stages}"


def candidates(m: int, n: int, k: int, elem_size: int, limit_bytes: int) -> dict[str, Any]:
    """``{config_name: Config}`` the tuner times for an ``[m, k] x [n, k]^T`` GEMM: the
    :func:`.skinny_gemm.default_config`, :data:`.skinny_gemm.CONFIGS` and, for small-N large-K
    shapes, :func:`.skinny_gemm.small_n_configs` (o_proj +4, down_proj +8 for Qwen3-4B: 15-23
    candidates a shape, 5 shapes per M bucket) that fit ``limit_bytes`` of shared memory at the
    row tile ``m`` launches with (:func:`.skinny_gemm.block_m`: a 32-row tile needs more)."""
    from nbhelpers.engine.kernels import skinny_gemm as sg
    bm = sg.block_m(m)
    return {config_name(c): c
            for c in (sg.default_config(n, k), *sg.CONFIGS, *sg.small_n_configs(n, k))
            if sg.fits(c, elem_size, limit_bytes, bm)}


def graph_ms(fn: Callable[[], Any], reps: int = REPS) -> float:
    """Best ms of one ``fn()`` over 5 replays of a CUDA graph of ``reps`` calls (warmed up on a
    side stream first: compiles and raises launch errors before capture)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


class SkinnyTuner(Tuner):
    """:class:`.lora_gemm_tune.Tuner` (same file format, atomic save, a warning for a cache file
    that does not parse) with :meth:`choose_gemm` for cold-weight timing of one GEMM.
    ``timer(fn) -> ms`` (default :func:`graph_ms`)."""

    def __init__(self, path: Path | None = None, timer: Callable[[Callable], float] | None = None):
        super().__init__(path if path is not None else cache_path(), timer or graph_ms)

    def choose_gemm(self, key: str, x: Any, w: Any, bias: Any, configs: dict[str, Any],
                    launch: Callable[..., Any], cublas: bool = True) -> str:
        """:meth:`choose` between ``F.linear`` (:data:`CUBLAS`, unless ``cublas=False``) and
        ``launch(x, w_i, bias, cfg)`` for every ``configs`` entry (name -> config), each over
        rotated copies ``w_i`` of ``w`` (:data:`ROTATE_BYTES`, at most :data:`MAX_COPIES`); a
        config whose output differs from ``F.linear``'s is never chosen (``inf``). A stored
        entry is served when it timed every candidate offered now. With ``cublas=False`` and no
        config that runs correctly: :data:`CUBLAS` anyway, with a warning (not stored)."""
        names = (CUBLAS, *configs) if cublas else tuple(configs)
        entry = self.table.get(key) or {}
        ms = entry.get("ms") or {}
        if entry.get("choice") in names and set(names) <= set(ms) and math.isfinite(
                ms[entry["choice"]]):
            return entry["choice"]
        self.table.pop(key, None)  # stale (fewer candidates) or new: time them all
        ok = self._correct(key, x, w, bias, configs, launch)
        if not ok and not cublas:
            return self._no_triton(key)
        import torch.nn.functional as F
        n_copies = min(MAX_COPIES, -(-ROTATE_BYTES // (w.numel() * w.element_size())))
        copies = [w] + [w.clone() for _ in range(n_copies - 1)]
        cands = {name: (lambda c=cfg: [launch(x, wi, bias, c) for wi in copies])
                 for name, cfg in ok.items()}
        if cublas:
            cands[CUBLAS] = lambda: [F.linear(x, wi, bias) for wi in copies]
        choice = self.choose(key, cands, per_call=len(copies))
        if failed := set(configs) - set(ok):
            self.table[key]["ms"].update(dict.fromkeys(sorted(failed), math.inf))
            self._save()
        if not math.isfinite(self.table[key]["ms"][choice]):
            return self._no_triton(key)
        return choice

    def _correct(self, key: str, x: Any, w: Any, bias: Any, configs: dict[str, Any],
                 launch: Callable[..., Any]) -> dict[str, Any]:
        """The ``configs`` whose ``launch`` matches ``F.linear`` to ~2 bf16 ulps of the output's
        largest value (1e-3 relative for fp32); one that raises is left out with a warning."""
        import torch
        import torch.nn.functional as F
        want = F.linear(x, w, bias).float()
        tol = 1e-3 if w.dtype == torch.float32 else 2 ** -6  # ~2 ulps of bf16 at the output
        scale = want.abs().max().item() + 1e-6
        ok = {}
        for name, cfg in configs.items():
            try:
                got = launch(x, w, bias, cfg).float()
            except Exception as err:  # noqa: BLE001 -- a config that cannot launch is skipped
                warnings.warn(f"skinny_gemm tuner: {name} failed for {key}: {err}", stacklevel=3)
                continue
            if (got - want).abs().max().item() <= tol * scale:
                ok[name] = cfg
        return ok

    @staticmethod
    def _no_triton(key: str) -> str:
        warnings.warn(f"skinny_gemm tuner: no candidate ran correctly for {key}; it keeps "
                      "F.linear for this shape (also with skinny_gemm_cublas='never').",
                      stacklevel=3)
        return CUBLAS


_TUNER: SkinnyTuner | None = None


def tuner() -> SkinnyTuner:
    """The process's :class:`SkinnyTuner` (created at first use, reading :func:`cache_path`)."""
    global _TUNER
    if _TUNER is None:
        _TUNER = SkinnyTuner()
    return _TUNER
