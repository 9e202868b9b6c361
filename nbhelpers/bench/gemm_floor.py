"""Decode GEMMs against the read-bandwidth floor, from a flex run's own sidecars (issue 12).

Contract: :func:`gemm_floor_frame` turns the skinny-GEMM tuner times a run recorded
(``breakdown["skinny_tuner"]`` of each point sidecar, :func:`nbhelpers.bench.flex_sweep.
run_flex_point`: every candidate's cold-weight time in ms, the chosen one and cuBLAS's, per
``(rows M, N, K, dtype)`` shape) into one row per shape: launches per decode step (``num_layers``
for a layer GEMM, 1 for the LM head, whose ``N`` is ``vocab_size``), MB of weights, the chosen
kernel's microseconds and TB/s, ``floor_us`` (those bytes at the bandwidth measured in the same
process, ``floor["bandwidth_bytes_per_s"]``), ``fixed_us`` (chosen minus floor: what a launch
costs beyond streaming its weights: ramp-up, the last wave's tail, the split-K fix-up) and
cuBLAS's microseconds. :func:`step_overhead` sums ``launches x fixed_us`` per row count: the
decode step's milliseconds that are neither bytes nor arithmetic. Every sidecar must be of
``run_id`` (:func:`nbhelpers.bench.flex_figures.own_sidecars` raises ``ValueError`` otherwise:
a report shows its own run); a run without tuner times (the CPU, or ``skinny_gemm="off"``)
gives an empty frame.

Why: the H200 run of 2026-12-07 (33, git 2052410) took 3.34 ms a decode step at batch 4 with PEFT
fp32 adapters against a 2.05 ms floor; by its tuner times qkv, o_proj, down_proj and gate_up each
cost 2.8-4.3 us beyond their bytes at 4.17 TB/s, 14.8 us a layer, 0.53 ms a step: the share of the
step a kernel that streams a whole layer without launch boundaries could remove.

Run: ``pytest tests/unit/test_gemm_floor.py``.
"""

from __future__ import annotations

from typing import Any

ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
COLUMNS = ("M", "N", "K", "dtype", "launches_per_step", "weight_mb", "choice", "us", "tb_s",
           "floor_us", "fixed_us", "cublas_us", "bandwidth_tb_s")


def parse_key(key: str) -> dict[str, Any] | None:
    """``{"M", "N", "K", "dtype"}`` of a skinny tuner key
    (``"<gpu>|triton <v>|skinny|M4|N151936|K2560|bfloat16|bias0"``); ``None`` for another kind."""
    parts = key.split("|")
    if "skinny" not in parts:
        return None
    got: dict[str, Any] = {}
    for part in parts:
        if part[:1] in "MNK" and part[1:].isdigit():
            got[part[0]] = int(part[1:])
        elif part in ELEM_BYTES:
            got["dtype"] = part
    return got if {"M", "N", "K", "dtype"} <= got.keys() else None


def gemm_floor_frame(sidecars: list[dict[str, Any]], run_id: str, num_layers: int,
                     vocab_size: int) -> Any:
    """One row per decode GEMM shape timed by ``run_id``'s tuner (module docstring), ordered by
    rows then N. Raises ``ValueError`` for ``num_layers`` or ``vocab_size`` below 1."""
    import pandas as pd

    from nbhelpers.bench.flex_figures import own_sidecars
    if num_layers < 1 or vocab_size < 1:
        raise ValueError(f"gemm_floor_frame: num_layers={num_layers}, vocab_size={vocab_size}: "
                         "both must be >= 1 (the model's config).")
    rows: dict[tuple[int, int, int, str], dict[str, Any]] = {}
    for side in own_sidecars(sidecars, run_id):
        bw = (side.get("floor") or {}).get("bandwidth_bytes_per_s")
        tuner = (side.get("breakdown") or {}).get("skinny_tuner") or {}
        for key, entry in tuner.items():
            shape = parse_key(key)
            times = (entry or {}).get("ms") or {}
            choice = (entry or {}).get("choice")
            if shape is None or choice not in times or not bw:
                continue
            ident = (shape["M"], shape["N"], shape["K"], shape["dtype"])
            if ident in rows:
                continue
            nbytes = shape["N"] * shape["K"] * ELEM_BYTES[shape["dtype"]]
            us, floor_us = 1e3 * times[choice], 1e6 * nbytes / bw
            rows[ident] = {**shape, "weight_mb": nbytes / 1e6, "choice": choice, "us": us,
                           "launches_per_step": 1 if shape["N"] == vocab_size else num_layers,
                           "tb_s": nbytes / (us * 1e-6) / 1e12, "floor_us": floor_us,
                           "fixed_us": us - floor_us,
                           "cublas_us": 1e3 * times["cublas"] if "cublas" in times else None,
                           "bandwidth_tb_s": bw / 1e12}
    frame = pd.DataFrame([rows[k] for k in sorted(rows)], columns=list(COLUMNS))
    return frame


def step_overhead(frame: Any) -> Any:
    """Per row count ``M``: ``gemm_ms`` (the tuned GEMMs' time a decode step, launches x us),
    ``floor_ms`` (their bytes at the measured bandwidth) and ``fixed_ms`` (the difference), in
    ms; empty for an empty frame."""
    import pandas as pd
    if frame.empty:
        return pd.DataFrame(columns=["gemm_ms", "floor_ms", "fixed_ms"])
    per = frame.assign(gemm_ms=frame["us"] * frame["launches_per_step"] / 1e3,
                       floor_ms=frame["floor_us"] * frame["launches_per_step"] / 1e3)
    out = per.groupby("M")[["gemm_ms", "floor_ms"]].sum()
    out["fixed_ms"] = out["gemm_ms"] - out["floor_ms"]
    return out


def model_dims(shape: str) -> dict[str, int]:
    """``{"num_layers", "vocab_size"}`` of notebook 33's ``shape`` (``"qwen3-4b"`` | ``"tiny"``,
    :data:`nbhelpers.bench.flex_sweep.QWEN3_4B_SHAPE` / ``TINY_QWEN3_SHAPE``). Raises
    ``ValueError`` for another name."""
    from nbhelpers.bench import flex_sweep as eb
    shapes = {"qwen3-4b": eb.QWEN3_4B_SHAPE, "tiny": eb.TINY_QWEN3_SHAPE}
    if shape not in shapes:
        raise ValueError(f"model_dims: shape={shape!r}: use one of {sorted(shapes)}.")
    cfg = shapes[shape]
    return {"num_layers": cfg["num_hidden_layers"], "vocab_size": cfg["vocab_size"]}
