"""Phase 2's comparison tables over GRPO runs (``{backend: run}`` as from
:func:`nbhelpers.grpo.compare.run_backends` or
:func:`nbhelpers.grpo.compare_sidecars.runs_from_sidecars`).

Contract: :func:`summary_frame` (one row per backend: wall / step / generation seconds, peak GiB,
reward, KL, gate word, error; the source of a reused run, :func:`source_word`; a run stopped
before it finished, :func:`interrupted_label`, keeps the medians of the steps it logged and
is labelled ``interrupted after N steps`` in ``status``), :func:`steps_long` (tidy per-step
frame; :func:`not_logged_reason`: why a metric has no curve), :func:`gate_frame` (one row per
gate check; :func:`failed_checks` / :func:`failed_checks_text` / :func:`gate_headline`: the
failed ones in full), :func:`headline` (INDEX.md keys), :func:`perf_goal` (flex vs vLLM step and
memory ratios), :func:`step_split_frame` (where each step's seconds go), :func:`result_line` (the notebook's "Result:" sentence), :func:`is_summary` /
:func:`is_frame` (importance-sampling ratio per backend, from the run's own step rows) and
:func:`compile_frame` (the compile report per run). pandas is imported inside.
Reached through :mod:`nbhelpers.grpo.compare`, the notebooks' face.
"""

from __future__ import annotations

from typing import Any


def source_word(run: dict[str, Any]) -> str:
    """``this run`` | ``reused: <file> (<UTC date>[, partial record])`` for a run that
    :func:`nbhelpers.grpo.compare_records.load_reused` read from an earlier sidecar."""
    src = run.get("reused_from")
    if not src:
        return "this run"
    note = ", partial record" if src.get("partial") else ""
    return f"reused: {src['path'].rsplit('/', 1)[-1]} ({src.get('utc')}{note})"


def interrupted_label(run: dict[str, Any] | None) -> str | None:
    """``interrupted after N steps (of M)`` for a run stopped before it finished (its
    ``interrupted`` block, :func:`nbhelpers.grpo.progress.interrupted_run`); ``None`` for any
    other run."""
    stopped = (run or {}).get("interrupted")
    if not stopped:
        return None
    return (f"interrupted after {stopped.get('n_steps')} steps (of "
            f"{stopped.get('max_steps')})")


def status_word(run: dict[str, Any] | None) -> str:
    """``ok`` | ``failed`` | :func:`interrupted_label`'s label."""
    return interrupted_label(run) or ("failed" if (run or {}).get("error") else "ok")


def reused_caption(runs: dict[str, dict[str, Any]]) -> str | None:
    """A figure caption naming where each backend's curve comes from (``backend: this run`` /
    ``backend: reused: <file> (<UTC>)``, :func:`source_word`) when any run was reused from an
    earlier sidecar; ``None`` when every curve is this run's."""
    if not any(run.get("reused_from") for run in runs.values()):
        return None
    return "From: " + "; ".join(f"{name}: {source_word(run)}" for name, run in runs.items())


def summary_frame(runs: dict[str, dict[str, Any]], gates: dict[str, Any] | None = None):
    """One row per backend: wall, median step / generation time, peak memory, gate, error; and
    ``source`` (:func:`source_word`) when a run was reused from an earlier sidecar, ``status``
    (:func:`status_word`) when a run was interrupted: its numbers are over the steps it logged
    (its summary), its ``gate`` ``interrupted`` (never ``pass``)."""
    import pandas as pd

    from nbhelpers.stats import median
    rows = []
    for name, run in runs.items():
        s, steps = run.get("summary") or {}, run.get("rows") or []
        skip = s.get("skip_first", 0)
        rows.append({
            "backend": name, "wall_s": run.get("wall_s"),
            "step_time_s_median": s.get("step_time_s_median"),
            "generate_s_median": median([r.get("generate_s") for r in steps[skip:]]),
            "peak_mem_device_gib": s.get("peak_mem_device_gib"),
            "peak_mem_device_max_gib": s.get("peak_mem_device_max_gib"),
            "reward_median": s.get("reward_median"), "kl_median": s.get("kl_median"),
            "logprob_mismatch_max": _max([r.get("sampling/sampling_logp_difference/mean")
                                          for r in steps]),
            "gate": gate_word(gates, name), "error": run.get("error")})
    if any(run.get("reused_from") for run in runs.values()):
        for row, run in zip(rows, runs.values()):
            row["source"] = source_word(run)
    if any(interrupted_label(run) for run in runs.values()):
        for row, run in zip(rows, runs.values()):
            row["status"] = status_word(run)
            if interrupted_label(run) and row["gate"] in (None, "not staged"):
                row["gate"] = "interrupted"
    return pd.DataFrame(rows).set_index("backend")


def step_split_frame(runs: dict[str, dict[str, Any]]):
    """Where each backend's step goes: one row per run, for ``wall_s``, ``generate_s``,
    :data:`~nbhelpers.grpo.step_timing.TIME_KEYS`, ``time/gc_s`` (Python garbage collection
    inside the step, from 2026-12-07) and (flex)
    :data:`~nbhelpers.grpo.step_timing.FLEX_KEYS` the median over the run's own step rows after
    its summary's ``skip_first`` (the steps in the summary's medians; seconds, ``decode_steps``
    a count, ``decode_ms_per_step`` ms). ``None`` where a run never logged the key (``flex/*``
    for other backends, ``time/*`` for records from before 2026-12-02)."""
    import pandas as pd

    from nbhelpers.grpo.step_timing import FLEX_KEYS, GC_KEYS, TIME_KEYS
    from nbhelpers.stats import median
    cols = ("wall_s", "generate_s", *TIME_KEYS, GC_KEYS[0], *FLEX_KEYS)
    rows = []
    for name, run in runs.items():
        steps = (run.get("rows") or [])[(run.get("summary") or {}).get("skip_first", 0):]
        rows.append({"backend": name, "n_steps": len(steps)}
                    | {c: median([r.get(c) for r in steps]) for c in cols})
    return pd.DataFrame(rows, columns=["backend", "n_steps", *cols]).set_index("backend")


def _mean(vals: list[Any]) -> float | None:
    from nbhelpers.stats import finite_or_none
    vals = [v for v in (finite_or_none(v) for v in vals) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _max(vals: list[Any]) -> float | None:
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def gate_word(gates: dict[str, Any] | None, name: str) -> str | None:
    """``pass`` | ``pass (untrained)`` | ``FAIL`` | ``not staged`` (every check skipped) |
    ``interrupted`` (skipped: the run was stopped before it finished,
    :func:`nbhelpers.grpo.gate.is_interrupted`) for ``gates[name]``; ``None`` when the backend
    was not gated. ``pass (untrained)``: the gate passed but its ``learning_signal`` check saw
    ``grad_norm`` 0 at every step (every reward tied), so the backends were compared untrained
    (a 2-step CPU run with padding read "gate pass" with no gradient at all: helper-16's trial,
    2026-12-07)."""
    if not gates or name not in gates:
        return None
    from nbhelpers.grpo.gate import is_interrupted, untrained
    g = gates[name]
    g = g if isinstance(g, dict) else g.as_dict()
    if g.get("error"):
        if not all(c["status"] == "skip" for c in g["checks"]):
            return "FAIL"
        return "interrupted" if is_interrupted(g["error"]) else "not staged"
    if not g["passed"]:
        return "FAIL"
    return "pass (untrained)" if untrained(g) else "pass"


def steps_long(runs: dict[str, dict[str, Any]]):
    """Tidy per-step frame (``backend``, ``step``, metrics) over every run that produced rows."""
    import pandas as pd
    frames = [pd.DataFrame(run["rows"]).assign(backend=name) for name, run in runs.items()
              if run.get("rows")]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["backend", "step"])


def not_logged_reason(runs: dict[str, dict[str, Any]], column: str, beta: float) -> str:
    """Why :func:`steps_long` holds no value of ``column`` (so there is no curve to plot): ``no
    backend ran`` (no run produced a step row), ``beta is 0`` for ``kl`` (TRL logs KL only when
    ``beta`` > 0), else ``no step of <the backends that ran> logged it``."""
    ran = [name for name, run in runs.items() if run.get("rows")]
    if not ran:
        return (f"no backend ran ({', '.join(runs)}: see each error above)" if runs
                else "no backend ran")
    if column == "kl" and not beta:
        return "beta is 0 (TRL logs KL only when beta > 0)"
    return f"no step of {', '.join(ran)} logged it"


def gate_frame(gates: dict[str, Any]):
    """Long table ``backend, check, status, detail`` of :func:`nbhelpers.grpo.gate.check_runs`."""
    import pandas as pd
    rows = []
    for name, g in gates.items():
        g = g if isinstance(g, dict) else g.as_dict()
        rows += [{"backend": name, **c} for c in g["checks"]]
    return pd.DataFrame(rows, columns=["backend", "name", "status", "detail"])


def failed_checks(gates: dict[str, Any]) -> list[dict[str, str]]:
    """Every failed check of ``gates`` (``{key: GateResult or its dict}``) as ``{backend, check,
    detail}``, the detail in full."""
    out = []
    for name, g in gates.items():
        g = g if isinstance(g, dict) else g.as_dict()
        out += [{"backend": name, "check": c["name"], "detail": c["detail"]}
                for c in g["checks"] if c["status"] == "fail"]
    return out


def failed_checks_text(gates: dict[str, Any]) -> str:
    """``cross-run gate: pass``, or ``cross-run gate: FAILED, <n> checks:`` and one line per
    failed check (:func:`failed_checks`): ``- <backend>: <check>: <full detail>``; for printing
    under :func:`gate_frame`, whose display pandas cuts (rows past ``max_rows``, long details)."""
    failed = failed_checks(gates)
    if not failed:
        return "cross-run gate: pass"
    head = f"cross-run gate: FAILED, {len(failed)} check{'s' if len(failed) > 1 else ''}:"
    return "\n".join([head, *(f"- {f['backend']}: {f['check']}: {f['detail']}" for f in failed)])


def gate_headline(gates: dict[str, Any]) -> dict[str, str]:
    """``{"cross_gate": "pass"}`` or ``{"cross_gate": "FAIL <backend>.<check>; ..."}`` for
    ``executed/INDEX.md``."""
    failed = failed_checks(gates)
    return {"cross_gate": "pass" if not failed else
            "FAIL " + "; ".join(f"{f['backend']}.{f['check']}" for f in failed)}


def headline(runs: dict[str, dict[str, Any]], gates: dict[str, Any]) -> dict[str, Any]:
    """``{<backend>_step_s, <backend>_peak_gib, <backend>_gate}`` for ``executed/INDEX.md``,
    ``<backend>_source`` (:func:`source_word`) for a run reused from an earlier sidecar, and
    ``<backend>_status`` (:func:`interrupted_label`) for an interrupted run (its step time is
    over the steps it logged)."""
    out: dict[str, Any] = {}
    for name, row in summary_frame(runs, gates).iterrows():
        out |= {f"{name}_step_s": row["step_time_s_median"],
                f"{name}_peak_gib": peak_gib(row), f"{name}_gate": row["gate"]}
        if runs[name].get("reused_from"):
            out[f"{name}_source"] = source_word(runs[name])
        if interrupted_label(runs[name]):
            out[f"{name}_status"] = interrupted_label(runs[name])
    return out


STEP_GOALS = {("qwen3-4b", "g4 b4x1 256tok"): 0.8, ("qwen3-4b", "g8 b16x4 512tok"): 0.7}
"""Issue 13's speed goals, flex median step / vLLM colocate's, per ``(model, shape label)``
(:func:`nbhelpers.grpo.compare_shapes.shape_label`): <= 0.8x at the reference shape, <= 0.7x
at the realistic preset (8 prompts x 8 generations, 512 new tokens); other groups have none."""

MEMORY_MARGIN_GIB = 2.0
"""Issue 13's memory goal: flex's peak <= the trainer-alone peak (the ``hf_generate`` row of the
same group) + this many GiB."""


def peak_gib(row: Any) -> float | None:
    """A run's peak card memory in GiB from a summary row (a dict or a pandas row):
    ``peak_mem_device_max_gib`` (the card's estimated peak during the steps,
    :func:`nbhelpers.stats.peak_memory_gib`) where the run recorded it (since 2026-12-04), else
    ``peak_mem_device_gib`` (in use at each step's end: the older records' only measure, which
    reads low for an engine that frees its cache before the step ends, as transformers' CB
    does); ``None`` when neither is a finite number."""
    from nbhelpers.stats import finite_or_none
    for key in ("peak_mem_device_max_gib", "peak_mem_device_gib"):
        value = finite_or_none(row.get(key))
        if value is not None:
            return value
    return None


def perf_goal(summary, group: tuple[str, str, str] | None = None) -> dict[str, Any]:
    """Flex against vLLM from a :func:`summary_frame`: ``step_ratio`` and ``memory_ratio``
    (flex / vLLM median step and peak device memory, :func:`peak_gib`) with issue 6's ``met``
    (step <= vLLM's at <= 1/5 of its peak memory), and issue 13's goal for ``group``
    (``(device, model, shape label)``, :func:`nbhelpers.grpo.compare_shapes.group_key`):
    ``step_goal`` (from :data:`STEP_GOALS`, ``None`` for a group without one), ``memory_limit_gib`` (the group's
    ``hf_generate`` peak + :data:`MEMORY_MARGIN_GIB`, ``None`` without that row) and
    ``met_issue13`` (step ratio <= the goal and, where the limit is known, flex's peak <= it;
    ``None`` without a goal). Values ``None`` when either backend has no numbers (missing,
    NaN, or a failed or interrupted run's row: its numbers cover part of a run)."""
    from nbhelpers.stats import finite_or_none
    goal = STEP_GOALS.get(tuple(group[1:])) if group is not None else None
    summary = summary[summary["error"].isna()] if "error" in summary else summary
    ref = peak_gib(summary.loc["hf_generate"]) if "hf_generate" in summary.index else None
    limit = None if ref is None else ref + MEMORY_MARGIN_GIB
    none = {"step_ratio": None, "memory_ratio": None, "met": None, "step_goal": goal,
            "memory_limit_gib": limit, "met_issue13": None}
    if not {"flex", "vllm"} <= set(summary.index):
        return none
    f, v = ([finite_or_none(summary.loc[b, "step_time_s_median"]), peak_gib(summary.loc[b])]
            for b in ("flex", "vllm"))
    if None in f or None in v or 0.0 in v:
        return none
    step, mem = f[0] / v[0], f[1] / v[1]
    met13 = None if goal is None else bool(step <= goal and (limit is None or f[1] <= limit))
    return {"step_ratio": step, "memory_ratio": mem, "met": bool(step <= 1.0 and mem <= 0.2),
            "step_goal": goal, "memory_limit_gib": limit, "met_issue13": met13}


def result_line(runs: dict[str, dict[str, Any]], gates: dict[str, Any], device: str) -> str:
    """The notebook's "Result:" sentence, computed from the runs (an interrupted run:
    ``<backend>: interrupted after N steps (of M), median step X s over its steps, gate
    <word>``)."""
    from nbhelpers.stats import finite_or_none
    parts = []
    for name, row in summary_frame(runs, gates).iterrows():
        label, step = interrupted_label(runs[name]), finite_or_none(row["step_time_s_median"])
        if label:
            shown = "no step time" if step is None else f"median step {step:.2f} s over its steps"
            parts.append(f"{name}: {label}, {shown}, gate {row['gate']}")
        elif row["error"]:
            parts.append(f"{name}: {row['gate']} ({str(row['error'])[:80]})")
        else:
            peak = peak_gib(row)
            shown = "no peak" if peak is None else f"{peak:.2f} GiB"
            parts.append(f"{name}: median step {row['step_time_s_median']:.2f} s, peak "
                         f"{shown}, gate {row['gate']}")
        if runs[name].get("reused_from"):
            parts[-1] += f" [{source_word(runs[name])}]"
    return f"**Result** ({device}): " + "; ".join(parts) + "."


IS_COLUMNS = {"is_token_ratio_mean": "is_ratio_mean",
              "is_token_outside_0.9_1.1": "is_outside_0.9_1.1",
              "same_support_logp_diff_mean": "same_support_logp_diff",
              "is_ratio_applied_mean": "is_ratio_applied_mean",
              "is_filtered_ratio_mean": "filtered_ratio_mean",
              "is_filtered_outside_0.9_1.1": "filtered_outside_0.9_1.1"}
"""Step-row keys (:data:`nbhelpers.grpo.callbacks.TRL_LOG_KEYS`, from
:data:`nbhelpers.grpo.flex_rollout.IS_KEYS`) -> :func:`is_summary` names."""


def is_summary(run: dict[str, Any]) -> dict[str, Any]:
    """The IS report of one run from its step rows: for each :data:`IS_COLUMNS` key the mean over
    the steps that logged it (every step weighs the same; ``None`` when no step did), and
    ``is_steps``, the number of steps with a token ratio. ``is_ratio_mean``: per-token
    ``exp(trainer - engine)`` logprob ratio; ``is_outside_0.9_1.1``: fraction of tokens outside
    [0.9, 1.1]; ``same_support_logp_diff``: mean |engine - trainer| logprob on one support,
    nats/token (``None`` for vLLM: it returns no kept mass); ``is_ratio_applied_mean``: TRL's
    ratio as the loss applies it (after its mode and clip); ``filtered_*``: flex only, the same
    ratio against the engine's filtered logprob (vLLM-style, not on one support: carries the
    kept mass, :mod:`nbhelpers.grpo.flex_rollout`)."""
    rows = run.get("rows") or []
    out: dict[str, Any] = {name: _mean([r.get(key) for r in rows])
                           for key, name in IS_COLUMNS.items()}
    return out | {"is_steps": sum(1 for r in rows if r.get("is_token_ratio_mean") is not None)}


def is_frame(runs: dict[str, dict[str, Any]]):
    """One row per run (index: the ``runs`` key): :func:`is_summary`."""
    import pandas as pd
    return pd.DataFrame([{"backend": name, **is_summary(run)} for name, run in runs.items()],
                        columns=["backend", *IS_COLUMNS.values(), "is_steps"]).set_index("backend")


COMPILE_COLUMNS = ("compile_mode", "compile_dynamic", "compile_scope", "compiled", "recompiles",
                   "graph_breaks", "unique_graphs", "compile_s")


def compile_frame(runs: dict[str, dict[str, Any]], compiled_only: bool = False):
    """One row per run: :data:`COMPILE_COLUMNS` of ``config["compile_report"]``
    (:class:`nbhelpers.grpo.compile_report.CompileWatch`; ``compile_dynamic`` ``None`` = torch's
    default; ``compile_scope`` ``None`` in runs before 2026-12-07, which compiled the backbone;
    ``compile_s`` seconds dynamo spent compiling). ``compiled_only`` keeps the runs whose
    ``compile_mode`` is not ``none``. The counts cover the whole training block, the flex
    engine's own ``flex_attention`` compiles included."""
    import pandas as pd
    rows = []
    for name, run in runs.items():
        rep = (run.get("config") or {}).get("compile_report") or {}
        if compiled_only and rep.get("compile_mode", "none") == "none":
            continue
        rows.append({"backend": name, **{k: rep.get(k) for k in COMPILE_COLUMNS}})
    return pd.DataFrame(rows, columns=["backend", *COMPILE_COLUMNS]).set_index("backend")
