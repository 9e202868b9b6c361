"""Run the same GRPO setup on several backends (one process each) and compare them.

Contract: :func:`run_backends` runs :func:`nbhelpers.grpo.train` once per backend, each in
a fresh spawned process (DESIGN.md rule 6: one backend per process; vLLM and CUDA graphs leave
memory behind), and returns ``{backend: run}`` where ``run`` is a plain dict: ``rows`` (per-step
rows, :func:`~nbhelpers.grpo.result.step_rows`), ``summary``, ``config``, ``wall_s``,
``completions`` (a sample), ``error`` (``"<ExceptionType>: message"`` or None). A failed backend
keeps its row with the error. Each finished backend is written to disk at once and earlier
runs can be reused instead of trained (:mod:`~nbhelpers.grpo.compare_records`: ``sidecar_path``,
``reuse_runs``). :func:`backend_sidecar` makes one schema-v1 sidecar per backend
(phase ``phase2``) with the gate result and the IS report (:func:`is_summary`) beside it; :func:`summary_frame` and :func:`steps_long`
are the notebook's tables. ``29_compare`` reads the sidecars back with :func:`runs_from_sidecars`.
The tables live in :mod:`~nbhelpers.grpo.compare_tables`, the sidecars and the cross-run gate in
:mod:`~nbhelpers.grpo.compare_sidecars`, the (device, model, shape) groups runs are compared
within and the per-shape speed table in :mod:`~nbhelpers.grpo.compare_shapes`; this module is
the notebooks' face for all of them.

Run: ``python -c "from nbhelpers.grpo.compare import run_backends; from nbhelpers.config import
GRPOSettings; print(run_backends(['flex'], 'tiny-llama', GRPOSettings(max_steps=1,
max_completion_length=8), n_questions=4)['flex']['summary'])"``.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import traceback
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import compare_records as records
from nbhelpers.grpo.compare_shapes import (
    flex_vs_vllm,
    group_key,
    group_runs,
    headline_by_shape,
    latest_per_backend,
    latest_per_group,
    ratio_text,
    result_by_shape,
    run_shape,
    runs_frame,
    shape_label,
    sources,
    speed_frame,
    vllm_ratio,
)
from nbhelpers.grpo.compare_sidecars import (
    PHASE,
    backend_sidecar,
    filter_device,
    gate_conclusion,
    gate_latest,
    load_runs,
    runs_from_sidecars,
    write_sidecars,
)
from nbhelpers.grpo.compare_tables import (
    compile_frame,
    failed_checks,
    failed_checks_text,
    gate_frame,
    gate_headline,
    headline,
    is_frame,
    is_summary,
    not_logged_reason,
    perf_goal,
    result_line,
    reused_caption,
    source_word,
    step_split_frame,
    steps_long,
    summary_frame,
)
from nbhelpers.grpo.compile_report import compile_dynamic_flag
from nbhelpers.stats import gpu_name

__all__ = ["PHASE", "RUN_KEYS", "WARMUP_ADAPTER", "backend_sidecar",
           "compile_dynamic_flag", "compile_frame", "failed_checks", "failed_checks_text",
           "filter_device", "flex_options", "flex_vs_vllm", "gate_conclusion", "gate_frame",
           "gate_headline", "gate_latest", "group_key", "group_runs",
           "headline", "headline_by_shape", "is_frame", "is_summary",
           "latest_per_backend", "latest_per_group", "load_runs", "not_logged_reason",
           "perf_goal", "ratio_text", "result_by_shape", "result_line", "reused_caption",
           "run_backends",
           "run_isolated", "run_shape", "runs_frame", "runs_from_sidecars",
           "shape_label", "source_word", "sources", "speed_frame", "step_split_frame",
           "steps_long", "summary_frame", "vllm_ratio", "write_sidecars"]

WARMUP_ADAPTER = "merge"
"""Phase 2 merges a format warm-up into the base (``train(warmup_adapter=...)``): every backend of
one comparison then starts from the same base policy with a fresh adapter."""
RUN_KEYS = ("rows", "summary", "config", "wall_s", "completions", "error")


def _child(queue: Any, backend: str, model: str, settings: GRPOSettings,
           kwargs: dict[str, Any], cpu_threads: int) -> None:
    try:
        import torch
        if cpu_threads and not torch.cuda.is_available():
            torch.set_num_threads(cpu_threads)
        from nbhelpers.grpo import step_rows, train
        kwargs.setdefault("output_dir", tempfile.mkdtemp(prefix=f"grpo_{backend}_"))
        kwargs.setdefault("warmup_adapter", WARMUP_ADAPTER)
        res = train(model, settings, backend=backend, **kwargs)
        queue.put({"rows": step_rows(res), "summary": res.summary, "config": res.config,
                   "wall_s": res.wall_s, "completions": res.completions[:8], "error": None})
    except Exception as err:  # noqa: BLE001 - the parent keeps the row with this error
        queue.put({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def run_isolated(backend: str, model: str, settings: GRPOSettings, *, cpu_threads: int = 0,
                 **train_kwargs: Any) -> dict[str, Any]:
    """One :func:`~nbhelpers.grpo.train` run in a spawned process (see module doc).

    ``cpu_threads`` > 0 sets ``torch.set_num_threads`` in the child on CPU hosts (tiny GEMMs on
    few shared cores run faster on one thread). Never raises for a failed run: ``error`` says why.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, backend, model, settings, train_kwargs,
                                            cpu_threads))
    proc.start()
    try:
        out = queue.get()
    except (EOFError, OSError) as err:
        out = {"error": f"{type(err).__name__}: child died ({err})"}
    proc.join()
    if proc.exitcode not in (0, None) and out.get("error") is None:
        out["error"] = f"ChildExit: exit code {proc.exitcode}"
    return {k: out.get(k) for k in RUN_KEYS} | {"traceback": out.get("traceback")}


def flex_options(sleep_between_rollouts: bool = False,
                 compile_attention: str = "auto") -> dict[str, Any] | None:
    """``train(flex_options=...)`` from notebook parameters; None when all are defaults.

    ``compile_attention``: ``auto`` (engine default: on iff CUDA) | ``on`` | ``off``. On the CPU
    ``on`` pays a ~20 s compile once and then decodes ~6x faster than the eager flex_attention
    math path (SmolLM2-135M, 4 x 16 tokens: 3.3 s vs 21 s per rollout, measured here).

    Raises:
        ValueError: ``compile_attention`` not one of the three words.
    """
    choices = {"auto": None, "on": True, "off": False}
    if compile_attention not in choices:
        raise ValueError(f"compile_attention={compile_attention!r}: use auto | on | off.")
    out: dict[str, Any] = {}
    if sleep_between_rollouts:
        out["sleep_between_rollouts"] = True
    if choices[compile_attention] is not None:
        out["compile_attention"] = choices[compile_attention]
    return out or None


def run_backends(backends: list[str], model: str, settings: GRPOSettings, *,
                 sidecar_path: str | Path = "", model_info: dict[str, Any] | None = None,
                 reuse_runs: dict[str, str | Path] | None = None,
                 **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_isolated` for each backend in order; ``kwargs`` go to every run. Each run
    carries ``request`` (:func:`~nbhelpers.grpo.compare_records.run_request`).

    ``sidecar_path`` (non-empty): each backend's run is written as it finishes
    (:func:`~nbhelpers.grpo.compare_records.write_partial`, ``<stem>__<backend>.json``), so a
    notebook killed later keeps it. ``reuse_runs`` ``{backend: sidecar path}``: those backends
    are read from earlier sidecars (:func:`~nbhelpers.grpo.compare_records.load_reused`: same
    request, model and device) instead of trained, in ``backends``' order, the ones not in
    ``backends`` first; each is labelled ``reused_from``. ``model_info``: the sidecars' model
    block (default :func:`nbhelpers.models.describe` of ``model``). Reused runs are read and
    checked before anything trains.

    Raises:
        ValueError: empty or repeated backends, an unknown backend name, an unwritable
            ``sidecar_path`` folder, or a reused sidecar that is missing, failed or does not
            match this run (the message names the field).
    """
    from nbhelpers.grpo.setup import check_backend
    if not backends or len(set(backends)) != len(backends):
        raise ValueError(f"backends={backends}: give each backend once, at least one.")
    reuse_runs = dict(reuse_runs or {})
    for b in [*backends, *reuse_runs]:
        check_backend(b)
    if model_info is None and (sidecar_path or reuse_runs):
        from nbhelpers.models import describe
        model_info = describe(model)
    reused = records.load_reused(reuse_runs, model, settings, kwargs, model_info or {},
                                 gpu_name()) if reuse_runs else {}
    if sidecar_path:
        records.check_writable(sidecar_path)
    order = [b for b in reuse_runs if b not in backends] + list(backends)
    runs = {}
    for b in order:
        if b in reused:
            runs[b] = reused[b]
            continue
        runs[b] = run_isolated(b, model, settings, **kwargs) | {
            "request": records.run_request(model, settings, kwargs)}
        if sidecar_path:
            records.write_partial(b, runs[b], settings, model_info, sidecar_path)
    return runs
