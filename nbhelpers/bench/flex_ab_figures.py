"""The A/B table and figures of a flex sweep over variants (notebook 33), held to one run.

Contract: each function takes a :func:`nbhelpers.bench.flex_figures.flex_frame` of one run's
sidecars and that ``run_id`` (``ValueError`` for rows of another run). :func:`ab_frame`: one row
per (LoRA mode, batch), the variants side by side for tok/s, ms/step, % of the floor, kernel
classes, kernels and aten ops per step, plus each variant's tok/s over the first variant's.
:func:`ab_figure`: tok/s and that ratio against batch, one panel per LoRA mode.
:func:`kernels_figure`: every profiled point's kernel-class ms per step (stacked) beside its
measured graph step, with kernels/step written on each bar. Re-exported by
:mod:`nbhelpers.bench.flex_sweep`. Tests: ``tests/unit/test_flex_ab_figures.py``.
"""

from __future__ import annotations

from typing import Any

from nbhelpers.bench.flex_figures import (
    MODE_COLOURS,
    STYLES,
    _check_frame,
    batch_ticks,
    mode_label,
)

METRICS = {"decode_tok_per_s": "tok/s", "decode_step_ms": "ms/step", "pct_of_floor": "% floor",
           "gemm_ms": "GEMM ms", "attention_ms": "attn ms", "elementwise_ms": "elem ms",
           "sampling_ms": "sample ms", "kernels_per_step": "kernels/step",
           "aten_ops_per_step": "aten ops/step"}
"""Frame column -> A/B table column stem (``"<stem> [<variant>]"``)."""
KERNEL_CLASSES = {"gemm_ms": "GEMM", "attention_ms": "attention", "elementwise_ms": "elementwise",
                  "sampling_ms": "sort/sample"}


def not_applied(side: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{option: (asked, ran)}`` for a variant's options (``side["variant"]["options"]``,
    ``"auto"`` aside) that the engine resolved to something else on the host (the sidecar's
    ``breakdown.resolved``, :func:`nbhelpers.engine.tuner_tables.resolved_kernels`; ``pdl`` is
    its ``pdl_mode``, ``None`` reads ``"off"``). E.g. ``pdl="early"`` and
    ``sample_kernel="triton"`` run as off / torch on the CPU: that variant measured the default
    kernels there (fresh-user trial, 2026-12-02: its tok/s was 15 % off the default's, noise).
    ``pdl_prefetch_mib`` recorded as ``None`` reads ``"ignored (pdl is not 'prefetch')"`` (the
    budget only applies to that mode). ``{}`` for sidecars from before ``resolved`` was
    recorded."""
    ran = (side.get("breakdown") or {}).get("resolved") or {}
    out = {}
    for name, value in ((side.get("variant") or {}).get("options") or {}).items():
        key = "pdl_mode" if name == "pdl" else name
        got = ran.get(key, value)
        if got is None:
            got = ("ignored (pdl is not 'prefetch')" if name == "pdl_prefetch_mib" else "off")
        if value != "auto" and got != value:
            out[name] = (value, got)
    return out


def _variants(flex: Any) -> list[str]:
    return list(dict.fromkeys(flex["variant"]))


def ab_frame(flex: Any, run_id: str) -> Any:
    """One row per (lora_mode, batch) with ``adapter_dtype`` and ``"<metric> [<variant>]"``
    columns (:data:`METRICS`, metric-major so the variants sit side by side; NaN where a point
    has no value) and, with several variants, ``"tok/s <v> / <first>"`` ratios."""
    import pandas as pd
    _check_frame(flex, run_id)
    variants, rows = _variants(flex), []
    for (mode, batch), part in flex.groupby(["lora_mode", "batch"], sort=False):
        by = part.drop_duplicates("variant", keep="last").set_index("variant")
        row = {"lora_mode": mode, "adapter_dtype": part["adapter_dtype"].iloc[0], "batch": batch}
        for col, stem in METRICS.items():
            row.update({f"{stem} [{v}]": by[col].get(v) for v in variants})
        for v in variants[1:]:
            base, got = by["decode_tok_per_s"].get(variants[0]), by["decode_tok_per_s"].get(v)
            row[f"tok/s {v} / {variants[0]}"] = got / base if base and got else None
        rows.append(row)
    return pd.DataFrame(rows)


def ab_figure(flex: Any, run_id: str) -> Any:
    """Decode tok/s (top) and tok/s over the first variant's (bottom) against batch, one
    line per variant, one column of panels per LoRA mode, of run ``run_id`` only."""
    import matplotlib.pyplot as plt
    _check_frame(flex, run_id)
    variants, modes = _variants(flex), list(dict.fromkeys(flex["lora_mode"]))
    fig, axes = plt.subplots(2, len(modes), figsize=(4 * len(modes) + 1, 6), sharex=True,
                             squeeze=False, constrained_layout=True)
    for j, mode in enumerate(modes):
        part = flex[flex["lora_mode"] == mode]
        base = part[part["variant"] == variants[0]].groupby("batch")["decode_tok_per_s"].last()
        for i, v in enumerate(variants):
            line = part[part["variant"] == v].groupby("batch")["decode_tok_per_s"].last()
            style = {"marker": "o", "linestyle": STYLES[i % len(STYLES)], "label": v,
                     "color": MODE_COLOURS.get(mode)}
            axes[0, j].plot(line.index, line.values, **style)
            axes[1, j].plot(line.index, (line / base.reindex(line.index)).values, **style)
        axes[0, j].set(title=f"{mode_label(mode)}", ylabel="decode tok/s")
        batch_ticks(axes[1, j], part["batch"])
        axes[1, j].set(xlabel="batch (sequences)", ylabel=f"tok/s over {variants[0]}")
        axes[1, j].axhline(1.0, color="grey", lw=0.8)
        axes[0, j].legend(fontsize=7)
    fig.suptitle(f"flex variants A/B, one process per (variant, LoRA mode) (run {run_id})")
    plt.close(fig)  # the notebook shows the returned figure once
    return fig


def kernels_figure(flex: Any, run_id: str) -> Any:
    """Per profiled point: kernel-class ms of one eager step (stacked bars) and the measured
    graph step (black dash), kernels/step above each bar; one panel per LoRA mode, bars grouped
    by batch with one per variant. Raises ``ValueError`` for another run's rows or a frame
    without any kernel profile (run with ``profile=True`` on CUDA)."""
    import matplotlib.pyplot as plt
    _check_frame(flex, run_id)
    prof = flex.dropna(subset=["gemm_ms"])
    if prof.empty:
        raise ValueError(f"run {run_id!r} has no kernel profile: run with profile=True on CUDA.")
    modes = list(dict.fromkeys(prof["lora_mode"]))
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(6, 0.6 * len(prof) / len(modes) + 2),
                             3.2 * len(modes)), squeeze=False, constrained_layout=True)
    colours = dict(zip(KERNEL_CLASSES, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    for ax, mode in zip(axes[:, 0], modes):
        part = (prof[prof["lora_mode"] == mode].sort_values("batch", kind="stable")
                .reset_index(drop=True))  # batch-major, the variants side by side
        x = list(range(len(part)))
        bottom = [0.0] * len(part)
        for col, label in KERNEL_CLASSES.items():
            ax.bar(x, part[col], bottom=bottom, color=colours[col], label=label)
            bottom = [b + h for b, h in zip(bottom, part[col])]
        ax.scatter(x, part["decode_step_ms"], marker="_", s=400, color="black",
                   label="measured step (graph)")
        for xi, top, n in zip(x, bottom, part["kernels_per_step"]):
            ax.annotate(f"{n:.0f}", (xi, top), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(x, [f"b{r.batch}\n{r.variant}" for r in part.itertuples()], fontsize=6)
        ax.set(ylabel="ms per decode step", title=f"{mode_label(mode)}: kernel classes of one "
               "eager step (number: kernels/step)")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"where a decode step goes, every profiled point (run {run_id})")
    plt.close(fig)
    return fig
