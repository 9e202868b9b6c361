"""Tables and figures of flex sweep sidecars, held to one run (notebook 33, ``bench_flex.py``).

Contract (issue 12, "the executed notebooks show their own run"): every figure takes the run's
``run_id`` and raises ``ValueError`` when handed a row of another run; other runs are shown only as
tables with their source file and date (:func:`earlier_frame`), and the phase-1 engines only as
reference points labelled with their file (:func:`reference_frame`'s ``source``). Re-exported by
:mod:`nbhelpers.bench.flex_sweep`. Rows carry each point's variant, LoRA mode and adapter
dtype (notebook 33's A/B: :mod:`nbhelpers.bench.flex_ab_figures`). Tests:
``tests/unit/test_floor.py``, ``tests/unit/test_flex_ab_figures.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def own_sidecars(sidecars: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """``sidecars`` unchanged when all carry ``run_id``. Raises ``ValueError`` naming the other
    runs otherwise (show those with :func:`earlier_frame`, a labelled table)."""
    other = sorted({str(s.get("run_id")) for s in sidecars if s.get("run_id") != run_id})
    if other:
        raise ValueError(f"sidecars of other runs {other} handed to a figure of run {run_id!r}: "
                         "figures show only this run; use earlier_frame(...) for a table.")
    return sidecars


def flex_frame(sidecars: list[dict[str, Any]], run_id: str | None = None) -> Any:
    """Tidy rows of flex sidecars: tag, variant, lora_mode, adapter_dtype, batch, lora, tok/s,
    step/replay/prefill ms, peak GiB, % of floor, floor ms, kernel-class ms and kernels per step
    (CUDA profile), aten ops per step (``profile=True``, any device), config_pid, run_id, source;
    sorted by variant and LoRA mode (each in the order they first appear) and batch. With ``run_id``: only that run's sidecars are
    accepted (:func:`own_sidecars`)."""
    import pandas as pd
    if run_id is not None:
        own_sidecars(sidecars, run_id)
    frame = pd.DataFrame([_row(s) for s in sidecars])
    keys = {c: frame[c].map({v: i for i, v in enumerate(dict.fromkeys(frame[c]))})
            for c in ("variant", "lora_mode")}  # first appearance: the run's own order
    return (frame.assign(_v=keys["variant"], _m=keys["lora_mode"])
            .sort_values(["_v", "_m", "batch", "utc"], kind="stable")
            .drop(columns=["_v", "_m"]).reset_index(drop=True))


def lora_mode_of(s: dict[str, Any]) -> str:
    """A sidecar's LoRA mode: ``lora_mode`` (notebook 33), ``point.lora`` (``bench_flex.py
    --points``), else ``"none"`` without a LoRA block and ``"lora"`` (dtype unrecorded) with."""
    return (s.get("lora_mode") or (s.get("point") or {}).get("lora")
            or ("none" if s.get("lora") is None else "lora"))


def _row(s: dict[str, Any]) -> dict[str, Any]:
    b, fl = s.get("breakdown") or {}, s.get("floor") or {}
    kb = b.get("kernel_breakdown") or {}
    return {"tag": s.get("tag"), "variant": (s.get("variant") or {}).get("name") or "default",
            "lora_mode": lora_mode_of(s), "adapter_dtype": s.get("adapter_dtype"),
            "batch": s["workload"]["n_prompts"], "lora": s.get("lora") is not None,
            "decode_tok_per_s": s.get("decode_tok_per_s_median"),
            "decode_step_ms": b.get("decode_step_ms"), "replay_ms": b.get("replay_ms"),
            "prefill_s": b.get("prefill_s"), "host_s": b.get("host_s"),
            "peak_gib": s.get("peak_mem_allocated_gib"), "pct_of_floor": s.get("pct_of_floor"),
            "floor_ms": fl.get("floor_ms_per_step"),
            **{k: kb.get(k) for k in ("gemm_ms", "attention_ms", "elementwise_ms",
                                      "sampling_ms", "kernels_per_step")},
            "aten_ops_per_step": (b.get("aten_ops") or {}).get("ops_per_step"),
            "error": s.get("error") or "", "config_pid": s.get("config_pid"),
            "utc": (s.get("env") or {}).get("utc"), "run_id": s.get("run_id"),
            "source": Path(s.get("_path") or "this run").name}


def earlier_frame(sidecars: list[dict[str, Any]], run_id: str) -> Any:
    """A table (never a figure) of flex sidecars of runs other than ``run_id``, each row with its
    ``source`` file and ``utc`` date; ``None`` when there are none."""
    other = [s for s in sidecars if s.get("tag") and s.get("run_id") != run_id]
    return flex_frame(other) if other else None


def reference_frame(gold_paths: list[str]) -> Any:
    """Phase-1 H200 measurements (``gold_*.json``) as tidy rows, ``source`` = file name (its
    date) and ``run_id`` = the file's ``meta.run_id``."""
    import json

    import pandas as pd
    rows = []
    for path in gold_paths:
        with open(path) as fh:
            doc = json.load(fh)
        meta = doc.get("meta") or {}
        for r in doc["results"]:
            rows.append({"engine": r["engine"].replace("_lora", ""), "lora": bool(r["lora"]),
                         "batch": r["n_prompts"], "decode_tok_per_s": r["decode_tok_per_s"],
                         "peak_gib": r.get("peak_gpu_mem_gib"), "error": r.get("error") or "",
                         "source": Path(path).name, "run_id": meta.get("run_id")})
    return pd.DataFrame(rows, columns=["engine", "lora", "batch", "decode_tok_per_s", "peak_gib",
                                       "error", "source", "run_id"])


def _check_frame(flex: Any, run_id: str) -> None:
    runs = sorted(set(map(str, flex["run_id"])))
    if runs != [run_id]:
        raise ValueError(f"figure of run {run_id!r} got rows of runs {runs}: build the frame "
                         "from this run's sidecars only (flex_frame(sides, run_id)).")


MODE_COLOURS = {"none": "tab:grey", "bf16": "tab:blue", "fp32": "tab:red", "lora": "tab:purple"}
"""One colour per LoRA mode in every flex figure; line style per variant (:func:`_style`)."""
STYLES = ("-", "--", ":", "-.")


def mode_label(mode: str) -> str:
    """``"no LoRA"`` / ``"LoRA bf16"`` / ``"LoRA fp32"`` (``bf16``: the model's dtype)."""
    return "no LoRA" if mode == "none" else ("LoRA" if mode == "lora" else f"LoRA {mode}")


def _lines(flex: Any) -> Any:
    """``((variant, lora_mode), rows)`` in the frame's order."""
    return flex.groupby(["variant", "lora_mode"], sort=False)


def _style(flex: Any, variant: str, mode: str) -> dict[str, Any]:
    variants = list(dict.fromkeys(flex["variant"]))
    return {"marker": "o", "color": MODE_COLOURS.get(mode),
            "linestyle": STYLES[variants.index(variant) % len(STYLES)]}


def batch_ticks(ax: Any, batches: Any) -> None:
    """Log-scale batch axis labelled with the measured batches themselves."""
    ticks = sorted({int(b) for b in batches})
    ax.set_xscale("log")
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.minorticks_off()


def sweep_figure(flex: Any, run_id: str, reference: Any | None = None) -> Any:
    """Decode tok/s against batch, one line per (variant, LoRA mode), of run ``run_id`` only; phase-1 engines as
    points labelled with their source file. Raises ``ValueError`` for rows of another run or
    reference rows without a ``source``."""
    import matplotlib.pyplot as plt
    _check_frame(flex, run_id)
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for (variant, mode), part in _lines(flex):
        part = part.groupby("batch", as_index=False)["decode_tok_per_s"].last()
        ax.plot(part["batch"], part["decode_tok_per_s"], **_style(flex, variant, mode),
                label=f"flex {variant} {mode_label(mode)} (run {run_id})")
    if reference is not None and len(reference):
        if "source" not in reference or not reference["source"].astype(bool).all():
            raise ValueError("reference rows need a 'source' (file and date): use "
                             "reference_frame(...).")
        for _, r in reference[reference["error"] == ""].iterrows():
            ax.scatter(r["batch"], r["decode_tok_per_s"], marker="x" if r["lora"] else "+",
                       label=f"{r['engine']} {'LoRA ' if r['lora'] else ''}({r['source']})")
    batch_ticks(ax, flex["batch"])
    ax.set(xlabel="batch (sequences)", ylabel="decode tok/s",
           title="flex engine batch sweep (random weights)")
    ax.legend(fontsize=6)
    plt.close(fig)  # the notebook shows the returned figure once
    return fig


def pct_figure(flex: Any, run_id: str) -> Any:
    """% of the bandwidth floor against batch, one line per (variant, LoRA mode), of run
    ``run_id``."""
    import matplotlib.pyplot as plt
    _check_frame(flex, run_id)
    fig, ax = plt.subplots(figsize=(7, 3.5), constrained_layout=True)
    for (variant, mode), part in _lines(flex.dropna(subset=["pct_of_floor"])):
        part = part.groupby("batch", as_index=False)["pct_of_floor"].last()
        ax.plot(part["batch"], part["pct_of_floor"], **_style(flex, variant, mode),
                label=f"{variant} {mode_label(mode)}")
    ax.axhline(100, color="grey", lw=0.8)
    batch_ticks(ax, flex["batch"])
    ax.set(xlabel="batch (sequences)", ylabel="% of read-bandwidth floor",
           title=f"decode step vs its bytes / measured bandwidth (run {run_id})")
    ax.legend(fontsize=7)
    plt.close(fig)
    return fig


def breakdown_figure(side: dict[str, Any], run_id: str) -> Any:
    """Stacked bar: GPU kernel ms per decode step by class of sidecar ``side`` (of run
    ``run_id``), beside its measured step time. Raises ``ValueError`` for another run's sidecar
    or one without a profile."""
    import matplotlib.pyplot as plt
    own_sidecars([side], run_id)
    b = side.get("breakdown") or {}
    if not b.get("profile"):
        raise ValueError(f"sidecar {side.get('tag')!r} has no kernel profile: run with "
                         "profile=True on CUDA.")
    fig, ax = plt.subplots(figsize=(6, 3.5), constrained_layout=True)
    bottom = 0.0
    for cls, ms in sorted(b["profile"]["kernel_ms_per_step"].items(), key=lambda kv: -kv[1]):
        ax.bar(["kernels (eager step)"], [ms], bottom=bottom, label=f"{cls} {ms:.2f} ms")
        bottom += ms
    ax.bar(["measured step (graph)"], [b["decode_step_ms"]], color="grey")
    ax.set(ylabel="ms per decode step",
           title=f"where a decode step goes ({side.get('tag')}, run {run_id})")
    ax.legend(fontsize=7)
    plt.close(fig)  # the notebook shows the returned figure once
    return fig
