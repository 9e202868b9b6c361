"""Phase 2's run shapes: which GRPO runs may be gated and timed against each other.

Two runs are comparable only on the same device, model and *shape* (the GRPO workload and the
training setup their sidecars record). ``29_compare`` groups by :func:`group_key` ``(device,
model, shape)`` and takes the newest run of each backend per group (:func:`latest_per_group`),
so a realistic-preset vLLM run is never gated or timed against a reference-shape flex run.

Contract: :func:`run_shape` -> ``{field: value}`` over :data:`SHAPE_FIELDS` of one run dict (as
from :func:`nbhelpers.grpo.compare_sidecars.runs_from_sidecars` or
:func:`nbhelpers.grpo.compare.run_backends`); :func:`shape_label` names it (``g4 b4x1 256tok``:
num_generations, per_device_train_batch_size x gradient_accumulation_steps,
max_completion_length; then only the fields that differ from :data:`REFERENCE`, e.g.
``warmup60``); :func:`latest_per_backend` (one group) / :func:`latest_per_group`;
:func:`vllm_ratio`, :func:`ratio_text` (the ratio, or why there is none) and
:func:`speed_frame` (the per-shape speed table, failed and interrupted runs marked);
:func:`sources` (a
group's sidecar files and dates, for captions); :func:`runs_frame` (one row per run with its
group); :func:`flex_vs_vllm`, :func:`result_by_shape`, :func:`headline_by_shape` (the ratio per
group, stated, not judged). pandas is imported inside.

Run: ``python -c "from nbhelpers.grpo.compare_shapes import shape_label, REFERENCE;
print(shape_label(REFERENCE | {'num_generations': 8, 'per_device_train_batch_size': 16,
'gradient_accumulation_steps': 4, 'max_completion_length': 512}))"``.
"""

from __future__ import annotations

from typing import Any

from nbhelpers.grpo.compare_tables import interrupted_label, status_word

UNKNOWN = "?"

SHAPE_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "num_generations": (("config", "num_generations"), ("settings", "num_generations"),
                        ("sampling", "n")),
    "per_device_train_batch_size": (("config", "per_device_train_batch_size"),
                                    ("settings", "per_device_train_batch_size"),
                                    ("workload", "completions")),
    "gradient_accumulation_steps": (("config", "gradient_accumulation_steps"),
                                    ("settings", "gradient_accumulation_steps")),
    "max_completion_length": (("config", "max_completion_length"),
                              ("settings", "max_completion_length"),
                              ("workload", "max_new_tokens")),
    "max_prompt_length": (("settings", "max_prompt_length"),),
    "dataset": (("request", "dataset"),),
    "format_warmup_steps": (("request", "format_warmup_steps"), ("warmup", "steps")),
    "gradient_checkpointing": (("settings", "gradient_checkpointing"),),
    "pad_to_multiple_of": (("config", "pad_to_multiple_of"), ("settings", "pad_to_multiple_of")),
    "beta": (("config", "beta"), ("settings", "beta")),
    "learning_rate": (("config", "learning_rate"), ("settings", "learning_rate")),
    "lora_rank": (("lora", "rank"), ("settings_lora", "rank")),
    "lora_alpha": (("lora", "alpha"), ("settings_lora", "alpha")),
    "temperature": (("config", "temperature"), ("sampling", "temperature")),
    "top_p": (("config", "top_p"), ("sampling", "top_p")),
    "top_k": (("config", "top_k"), ("sampling", "top_k")),
    "min_p": (("config", "min_p"), ("sampling", "min_p")),
}
"""Field -> ``(source, key)`` lookups tried in order: ``config`` (TRL's GRPO config as run,
sidecar ``grpo_config``), ``settings`` / ``request`` (``grpo_request``, recorded since
2026-12-01), ``workload`` / ``sampling`` (the schema's ``workload`` block, in every sidecar;
``completions`` = ``n_prompts`` x ``sampling.n``), ``lora`` (the schema's ``lora`` block),
``warmup`` (``grpo_config.format_warmup``). A field no source holds takes :data:`FALLBACK`."""

REFERENCE: dict[str, Any] = {
    "max_prompt_length": 256, "dataset": "gsm8k", "format_warmup_steps": 0,
    "gradient_checkpointing": False, "pad_to_multiple_of": 0, "beta": 0.04,
    "learning_rate": 5e-6, "lora_rank": 32, "lora_alpha": 64, "temperature": 1.0, "top_p": 1.0,
    "top_k": 0, "min_p": 0.1}
"""The reference setup (DESIGN.md "Reference workloads"; every ``configs/20_*.yaml`` so far);
:func:`shape_label` names only the fields that differ from it. ``top_k`` 0 = disabled."""

FALLBACK: dict[str, Any] = {"num_generations": UNKNOWN, "per_device_train_batch_size": UNKNOWN,
                            "max_completion_length": UNKNOWN,
                            "gradient_accumulation_steps": 1} | REFERENCE
"""What an older sidecar that records a field nowhere is taken to have run: the value every
phase-2 config and the notebook's default had before the field was recorded (gradient
accumulation, gradient checkpointing: not notebook parameters before 2026-12-02, i.e. 1 and
off; ``pad_to_multiple_of``: not a parameter before 2026-12-04, i.e. 0 (TRL's None, no
padding); prompt length 256 and dataset gsm8k: recorded only since 2026-12-01 (``grpo_request``),
every config had them since 2026-11-30; format warm-up: none before it existed). The three
workload counts have no such value: ``?`` (no sidecar in the archive lacks them: ``workload``
holds them even for runs that failed before training)."""

LABEL_NAMES = {"max_prompt_length": "prompt", "pad_to_multiple_of": "pad", "dataset": "",
               "format_warmup_steps": "warmup",
               "beta": "beta", "learning_rate": "lr", "lora_rank": "r", "lora_alpha": "alpha",
               "temperature": "T", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}


def _sources(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    config, request = run.get("config") or {}, run.get("request") or {}
    settings, workload = request.get("settings") or {}, dict(run.get("workload") or {})
    sampling = workload.get("sampling") or {}
    if workload.get("n_prompts") and sampling.get("n"):
        workload["completions"] = workload["n_prompts"] * sampling["n"]
    return {"config": config, "settings": settings, "request": request, "workload": workload,
            "sampling": sampling, "lora": run.get("lora") or {},
            "settings_lora": settings.get("lora") or {},
            "warmup": config.get("format_warmup") or {}}


def run_shape(run: dict[str, Any]) -> dict[str, Any]:
    """``{field: value}`` over :data:`SHAPE_FIELDS`: the first source that records the field,
    else :data:`FALLBACK` (``?`` for the workload counts). ``top_k`` <= 0 reads as 0 (disabled:
    TRL records 0, the request -1)."""
    src = _sources(run)
    out = {}
    for field, lookups in SHAPE_FIELDS.items():
        found = [src[s][k] for s, k in lookups if src[s].get(k) is not None]
        out[field] = found[0] if found else FALLBACK[field]
    if isinstance(out["top_k"], int):
        out["top_k"] = max(0, out["top_k"])
    return out


def shape_label(shape: dict[str, Any]) -> str:
    """``g<num_generations> b<per_device_train_batch_size>x<gradient_accumulation_steps>
    <max_completion_length>tok``, then ``<name><value>`` for each field that differs from
    :data:`REFERENCE` (``gc`` for gradient checkpointing on, the dataset by its name)."""
    n, batch, accum, tokens = (shape.get(k, UNKNOWN) for k in (
        "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
        "max_completion_length"))
    parts = [f"g{n} b{batch}x{accum} {tokens}tok"]
    for field, ref in REFERENCE.items():
        value = shape.get(field, ref)
        if value != ref:
            parts.append("gc" if field == "gradient_checkpointing" and value is True
                         else f"{LABEL_NAMES.get(field, field)}{value}")
    return " ".join(parts)


def group_key(run: dict[str, Any]) -> tuple[str, str, str]:
    """``(device, model, shape label)``: runs are gated and compared only within one key."""
    return (run.get("gpu") or "cpu", (run.get("model") or {}).get("name") or UNKNOWN,
            shape_label(run_shape(run)))


def group_runs(runs: dict[str, dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """``{group_key: {"<backend>@<run_id>": run}}``, groups sorted."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for key, run in runs.items():
        groups.setdefault(group_key(run), {})[key] = run
    return dict(sorted(groups.items()))


def _newest(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per backend the newest run that did not fail (no ``error``), else the newest failed one
    (it then shows as failed): a newer failed run never hides an older good one. An interrupted
    run has an ``error`` too: it never hides a finished run."""
    out: dict[str, tuple[bool, str, dict[str, Any]]] = {}
    for key, run in runs.items():
        backend, _, run_id = key.partition("@")
        rank = (not run.get("error"), run_id)
        if backend not in out or rank > out[backend][:2]:
            out[backend] = (*rank, run)
    return {b: run for b, (_, _, run) in sorted(out.items())}


def latest_per_backend(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{backend: run}`` keeping, for runs of one (device, model, shape) group, the newest
    ``backend@<UTC run id>`` of each backend that did not fail (no ``error``); a backend whose
    runs all failed keeps its newest failed one, so it shows as failed.

    Raises:
        ValueError: the runs span several groups (the newest of each backend could then be runs
            of different workloads): use :func:`latest_per_group`.
    """
    groups = group_runs(runs)
    if len(groups) > 1:
        raise ValueError(f"latest_per_backend: the runs span {len(groups)} (device, model, "
                         f"shape) groups {list(groups)}; take latest_per_group(runs) and "
                         "compare within one group.")
    return _newest(runs)


def latest_per_group(runs: dict[str, dict[str, Any]]
                     ) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """``{(device, model, shape): {backend: newest run}}`` (:func:`group_runs`; newest ok run,
    else newest failed one, as :func:`latest_per_backend`)."""
    return {group: _newest(members) for group, members in group_runs(runs).items()}


def _step_s(run: dict[str, Any] | None) -> float | None:
    from nbhelpers.stats import finite_or_none
    return finite_or_none(((run or {}).get("summary") or {}).get("step_time_s_median"))


def _done_step_s(run: dict[str, Any] | None) -> float | None:
    """A finished run's median step; ``None`` for a failed or interrupted one (an interrupted
    run's median covers part of a run: shown, never compared)."""
    return None if error_line(run) else _step_s(run)


def vllm_ratio(latest: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """``{backend: median step / vLLM's median step}`` over one group's ``{backend: run}``;
    ``None`` for every backend when the group has no ``vllm`` run or it has no step time (or
    failed, or was interrupted), and for a backend without one."""
    ref = _done_step_s(latest.get("vllm"))
    return {b: (s / ref if ref and s is not None else None)
            for b, s in ((b, _done_step_s(r)) for b, r in latest.items())}


def error_line(run: dict[str, Any] | None) -> str | None:
    """The first line of a run's ``error`` (``None`` for a run that did not fail)."""
    error = str((run or {}).get("error") or "").strip()
    return error.splitlines()[0] if error else None


def ratio_text(latest: dict[str, dict[str, Any]]) -> str:
    """flex's median step over vLLM's in one group's ``{backend: run}`` (:func:`vllm_ratio`) as
    ``0.750``, or ``n/a (<why>)``: a backend with no run in the group, a run that failed (``vLLM
    run <id> failed: <error first line>``) or one without a step time."""
    ratio = vllm_ratio(latest).get("flex")
    return f"{ratio:.3f}" if ratio is not None else f"n/a ({_no_ratio_reason(latest)})"


def _no_ratio_reason(latest: dict[str, dict[str, Any]]) -> str:
    why = []
    for backend, label in (("flex", "flex"), ("vllm", "vLLM")):
        run = latest.get(backend)
        if run is None:
            why.append(f"no {label} run in this group")
            continue
        name = " ".join([f"{label} run", *[str(run[k]) for k in ("run_id",) if run.get(k)]])
        if interrupted_label(run):
            why.append(f"{name} {interrupted_label(run)}: not a finished run")
        elif error_line(run):
            why.append(f"{name} failed: {error_line(run)}")
        elif _step_s(run) is None:
            why.append(f"{name} has no step time")
    return "; ".join(why)


def source_of(run: dict[str, Any]) -> str:
    """``<sidecar file> (<UTC time>)`` of a run read from a sidecar; ``this run`` otherwise."""
    if not run.get("sidecar"):
        return "this run"
    return f"{run['sidecar']} ({str(run.get('utc') or '?')[:16].replace('T', ' ')} UTC)"


def sources(latest: dict[str, dict[str, Any]]) -> str:
    """``backend: <sidecar> (<UTC>); ...`` of one group, for a table or figure caption."""
    return "; ".join(f"{b}: {source_of(r)}" for b, r in latest.items())


SPEED_SPLIT = ("generate_s", "time/generate_and_score_s", "time/loss_fwd_bwd_s",
               "time/optimizer_s", "flex/prefill_s", "flex/decode_ms_per_step")
""":func:`~nbhelpers.grpo.compare_tables.step_split_frame` columns in :func:`speed_frame`."""


def speed_frame(runs: dict[str, dict[str, Any]]):
    """The per-shape speed table: one row per (device, model, shape, backend), the newest run
    of each backend in each group (:func:`latest_per_group`). Columns: the group, ``backend``,
    ``sidecar`` / ``utc`` (where the row's numbers come from), ``step_time_s_median`` (the
    run's summary), :data:`SPEED_SPLIT` (medians over the summary's steps, ``None`` where the
    run never logged the key), ``peak_mem_device_gib`` and ``peak_mem_device_max_gib`` (NaN
    before 2026-12-04; :func:`nbhelpers.grpo.compare_tables.peak_gib`), the IS columns of
    :func:`~nbhelpers.grpo.compare_tables.is_frame`, ``step_vs_vllm`` (:func:`vllm_ratio`,
    from the vLLM row of the same group; NaN when it has none), ``status`` (``ok`` | ``failed``:
    a failed run's numbers are missing, not zero | ``interrupted after N steps (of M)``: the
    numbers are over the steps it logged, and ``step_vs_vllm`` is NaN: a part of a run is never
    compared) and ``error`` (its first line, else None).
    Every number column is float: a value no run logged is NaN (a whole-``None`` column, such as
    ``time/*`` on records from before 2026-12-02, would otherwise be ``object`` and break
    arithmetic and bar plots)."""
    import pandas as pd

    from nbhelpers.grpo.compare_tables import is_frame, step_split_frame
    rows = []
    for (gpu, model, shape), latest in latest_per_group(runs).items():
        split, is_table, ratio = step_split_frame(latest), is_frame(latest), vllm_ratio(latest)
        for backend, run in latest.items():
            rows.append({"device": gpu, "model": model, "shape": shape, "backend": backend,
                         "sidecar": run.get("sidecar"), "utc": run.get("utc"),
                         "step_time_s_median": _step_s(run),
                         **{c: split.loc[backend, c] for c in SPEED_SPLIT},
                         "peak_mem_device_gib": (run.get("summary") or {}).get(
                             "peak_mem_device_gib"),
                         "peak_mem_device_max_gib": (run.get("summary") or {}).get(
                             "peak_mem_device_max_gib"),
                         **is_table.loc[backend].to_dict(), "step_vs_vllm": ratio[backend],
                         "status": status_word(run),
                         "error": error_line(run)})
    frame = pd.DataFrame(rows)
    numbers = [c for c in frame.columns if c not in _SPEED_TEXT]
    frame[numbers] = frame[numbers].apply(pd.to_numeric, errors="coerce").astype(float)
    return frame


_SPEED_TEXT = ("device", "model", "shape", "backend", "sidecar", "utc", "status", "error")


def runs_frame(runs: dict[str, dict[str, Any]]):
    """One row per run (index: the ``runs`` key): ``device``, ``model``, ``shape``,
    ``sidecar``, ``utc``."""
    import pandas as pd
    rows = [{"run": key, **dict(zip(("device", "model", "shape"), group_key(run))),
             "sidecar": run.get("sidecar"), "utc": run.get("utc")} for key, run in runs.items()]
    return pd.DataFrame(rows, columns=["run", "device", "model", "shape", "sidecar", "utc"]
                        ).set_index("run")


def flex_vs_vllm(groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]]
                 ) -> dict[tuple[str, str, str], float | None]:
    """``{group: flex median step / vLLM's}`` (:func:`vllm_ratio`) over
    :func:`latest_per_group`'s groups; ``None`` where a group lacks either number."""
    return {group: vllm_ratio(latest).get("flex") for group, latest in groups.items()}


def result_by_shape(groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]]) -> str:
    """``<device>, <model>, <shape>: flex/vLLM median step <ratio> (<flex s> / <vLLM s>)``
    per group, ``; ``-joined (the ratio stated, not judged); without a ratio ``no flex/vLLM
    pair``, or :func:`ratio_text`'s reason when the group's flex or vLLM run failed."""
    parts = []
    for (gpu, model, shape), ratio in flex_vs_vllm(groups).items():
        latest = groups[(gpu, model, shape)]
        failed = any(error_line(latest.get(b)) for b in ("flex", "vllm"))
        what = (f"flex/vLLM median step {ratio:.3f}" if ratio is not None
                else f"no flex/vLLM ratio: {_no_ratio_reason(latest)}" if failed
                else "no flex/vLLM pair")
        steps = ", ".join(f"{b} {_step_s(r):.3f} s" + (f" ({interrupted_label(r)})"
                                                         if interrupted_label(r) else "")
                          for b, r in latest.items() if _step_s(r) is not None)
        parts.append(f"{gpu}, {model}, {shape}: {what} ({steps or 'no step times'})")
    return "; ".join(parts)


def headline_by_shape(groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]]
                      ) -> dict[str, float]:
    """``{"<model> <shape> flex/vllm": ratio}`` for ``executed/INDEX.md`` (groups with a
    ratio; the device is prefixed when the groups span several)."""
    devices = {gpu for gpu, _, _ in groups}
    return {f"{gpu + ' ' if len(devices) > 1 else ''}{model} {shape} flex/vllm": round(r, 3)
            for (gpu, model, shape), r in flex_vs_vllm(groups).items() if r is not None}
