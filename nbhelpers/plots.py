"""Figure builders over tidy pandas DataFrames; one fixed colour per backend everywhere.

Contract: every builder takes a DataFrame, returns a ``matplotlib.figure.Figure`` built without
pyplot (no global state, never ``plt.show()``); the notebook displays it. Frames are long ("tidy"):
one row per (backend, step) or (backend, step, reward function). :func:`steps_frame` and
:func:`rewards_frame` turn :class:`~nbhelpers.grpo.callbacks.StatisticsCallback` records into them.
:func:`caption` writes where a figure's numbers come from under it.

Run: ``python -c "from nbhelpers.plots import BACKEND_COLORS; print(BACKEND_COLORS)"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

BACKEND_COLORS: dict[str, str] = {
    "hf_generate": "#7f7f7f",     # grey: the naive TRL path, the baseline
    "hf_cb": "#1f77b4",           # blue
    "hf_cb_nograph": "#aec7e8",   # light blue: same engine, CUDA graphs off
    "cb_sync": "#17becf",         # cyan
    "unsloth": "#2ca02c",         # green
    "vllm": "#d62728",            # red
    "flex": "#9467bd",            # purple: this project's engine
    "reference": "#000000",       # black: published numbers (research/anchors.md)
}
"""One colour per backend (matplotlib tab10 shades), used by every figure of the lab."""
FALLBACK_COLOR = "#bcbd22"


def color(backend: str) -> str:
    """The backend's fixed colour (olive for names not in :data:`BACKEND_COLORS`)."""
    return BACKEND_COLORS.get(backend, FALLBACK_COLOR)


def steps_frame(records: Sequence[dict[str, Any]], backend: str) -> pd.DataFrame:
    """One row per step from ``StatisticsCallback.records`` with a ``backend`` column."""
    import pandas as pd
    frame = pd.DataFrame(list(records))
    frame["backend"] = backend
    return frame


def rewards_frame(records: Sequence[dict[str, Any]], backend: str) -> pd.DataFrame:
    """Long frame ``step, backend, reward_func, reward_mean`` from ``rewards/<func>/mean`` keys."""
    import pandas as pd
    rows = [{"step": r["step"], "backend": backend, "reward_func": k.split("/")[1],
             "reward_mean": v} for r in records for k, v in r.items()
            if k.startswith("rewards/") and k.endswith("/mean")]
    return pd.DataFrame(rows, columns=["step", "backend", "reward_func", "reward_mean"])


def _require_columns(frame: pd.DataFrame, columns: Sequence[str], builder: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{builder}: frame lacks columns {missing} (has {list(frame.columns)}); "
                         "build it with nbhelpers.plots.steps_frame / rewards_frame.")


def _new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.2):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _line_per_backend(ax, frame: pd.DataFrame, y: str, label_suffix: str = "", **style) -> None:
    for backend, sub in frame.groupby("backend", sort=False):
        sub = sub.dropna(subset=[y]).sort_values("step")
        ax.plot(sub["step"], sub[y], marker="o", ms=3, color=color(str(backend)),
                label=f"{backend}{label_suffix}", **style)


def metric_by_step(frame: pd.DataFrame, y: str, ylabel: str, title: str) -> Figure:
    """Line of column ``y`` against ``step``, one line per backend.

    Raises:
        ValueError: ``frame`` lacks ``step``, ``backend`` or ``y``.
    """
    _require_columns(frame, ("step", "backend", y), "metric_by_step")
    fig, (ax,) = _new_figure()
    _line_per_backend(ax, frame, y)
    ax.set(xlabel="optimiser step", ylabel=ylabel, title=title)
    ax.legend(fontsize="small")
    return fig


def step_time(frame: pd.DataFrame) -> Figure:
    """Wall seconds per GRPO step (``wall_s``), one line per backend."""
    return metric_by_step(frame, "wall_s", "step wall time (s)", "Step time")


def kl(frame: pd.DataFrame) -> Figure:
    """KL to the reference model per step (``kl``; TRL logs it only when ``beta > 0``)."""
    return metric_by_step(frame, "kl", "KL (nats/token)", "KL")


def loss(frame: pd.DataFrame) -> Figure:
    """GRPO loss per step (``loss``)."""
    return metric_by_step(frame, "loss", "loss", "Loss")


def rewards(frame: pd.DataFrame) -> Figure:
    """Mean reward of each reward function per step; colour = backend, line style = function.

    Raises:
        ValueError: ``frame`` lacks ``step, backend, reward_func, reward_mean``.
    """
    _require_columns(frame, ("step", "backend", "reward_func", "reward_mean"), "rewards")
    fig, (ax,) = _new_figure(width=6.0)
    styles = ["-", "--", ":", "-."]
    for i, (func, sub) in enumerate(frame.groupby("reward_func", sort=False)):
        _line_per_backend(ax, sub, "reward_mean", f" {func}", linestyle=styles[i % len(styles)])
    ax.set(xlabel="optimiser step", ylabel="mean reward", title="Rewards per function")
    ax.legend(fontsize="x-small")
    return fig


def grpo_panel(steps: pd.DataFrame, reward_frame: pd.DataFrame) -> Figure:
    """Phase 0 overview, 4 panels: step time, rewards per function, KL (if logged), loss."""
    fig, axes = _new_figure(ncols=4, width=4.2)
    for ax, (y, label) in zip(axes[[0, 2, 3]], [("wall_s", "step wall time (s)"),
                                                  ("kl", "KL"), ("loss", "loss")]):
        if y in steps.columns and steps[y].notna().any():
            _line_per_backend(ax, steps, y)
        else:
            ax.text(0.5, 0.5, f"{y} not logged", ha="center", transform=ax.transAxes)
        ax.set(xlabel="optimiser step", ylabel=label, title=label)
    for func, sub in reward_frame.groupby("reward_func", sort=False):
        axes[1].plot(sub["step"], sub["reward_mean"], marker="o", ms=3, label=func)
    axes[1].set(xlabel="optimiser step", ylabel="mean reward", title="rewards per function")
    axes[1].legend(fontsize="x-small")
    return fig


def metrics_by_step(frame: pd.DataFrame, metrics: Sequence[tuple[str, ...]], title: str
                    ) -> Figure:
    """One panel per ``(column, ylabel)`` or ``(column, ylabel, "log")`` of ``metrics`` present
    in ``frame`` (a column with no value gets a "not logged" note), lines per backend, ``title``
    over the row. ``"log"``: a log y axis when every value is > 0 (grad norms that differ 100x
    between backends), else linear with "(linear: values <= 0)" in the label.

    Raises:
        ValueError: ``frame`` lacks ``step`` or ``backend``, or a scale other than ``"log"``.
    """
    import pandas as pd
    _require_columns(frame, ("step", "backend"), "metrics_by_step")
    fig, axes = _new_figure(ncols=len(metrics), width=3.6)
    for ax, spec in zip(axes, metrics):
        y, label = spec[0], spec[1]
        scale = spec[2] if len(spec) > 2 else None
        if scale not in (None, "log"):
            raise ValueError(f"metrics_by_step: scale {scale!r} for {y!r}: use 'log' or leave "
                             "it out.")
        if y in frame.columns and frame[y].notna().any():
            _line_per_backend(ax, frame, y)
            values = pd.to_numeric(frame[y], errors="coerce").dropna()
            if scale == "log" and (values > 0).all():
                ax.set_yscale("log")
            elif scale == "log":
                label += " (linear: values <= 0)"
        else:
            ax.text(0.5, 0.5, f"{y} not logged", ha="center", transform=ax.transAxes)
        ax.set(xlabel="optimiser step", ylabel=label)
    axes[0].legend(fontsize="x-small")
    fig.suptitle(title, fontsize="medium")
    return fig


def grouped_bars(frame: pd.DataFrame, columns: Sequence[str], ylabel: str, title: str
                 ) -> Figure:
    """Bars of ``columns`` (x groups) for each backend (``frame``'s index; backend colours).
    A missing value (None or NaN, also a whole-``None`` column) draws no bar; a column no
    backend has is labelled ``(not logged)`` under its tick.

    Raises:
        ValueError: ``frame`` lacks one of ``columns``.
    """
    import pandas as pd
    _require_columns(frame, columns, "grouped_bars")
    values = frame[list(columns)].apply(pd.to_numeric, errors="coerce").astype(float)
    fig, (ax,) = _new_figure(width=7.0, height=3.4)
    width = 0.8 / max(1, len(frame))
    for i, (backend, row) in enumerate(values.iterrows()):
        bars = [(j + (i - (len(frame) - 1) / 2) * width, row[c])
                for j, c in enumerate(columns) if pd.notna(row[c])]
        ax.bar([x for x, _ in bars], [h for _, h in bars], width, color=color(str(backend)),
               label=str(backend))
    ax.set_xticks(range(len(columns)),
                  [c.split("/")[-1] + ("" if values[c].notna().any() else "\n(not logged)")
                   for c in columns], fontsize="small")
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize="x-small")
    return fig


def caption(fig: Figure, text: str, width: int = 120) -> Figure:
    """``fig`` with ``text`` (wrapped at ``width`` characters) in small type under the axes
    (the figure's ``supxlabel``, inside its layout): where the figure's numbers come from."""
    import textwrap
    fig.supxlabel(textwrap.fill(text, width), x=0.01, ha="left", fontsize=6)
    return fig
