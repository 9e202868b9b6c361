"""Run the same GRPO setup on several backends (one process each) and compare them.

Contract: :func:`run_backends` runs :func:`nbhelpers.grpo_backends.train` once per backend, each in
a fresh spawned process (DESIGN.md rule 6: one backend per process; vLLM and CUDA graphs leave
memory behind), and returns ``{backend: run}`` where ``run`` is a plain dict: ``rows`` (per-step
rows, :func:`~nbhelpers.grpo_backends.step_rows`), ``summary``, ``config``, ``wall_s``,
``completions`` (a sample), ``error`` (``"<ExceptionType>: message"`` or None). A failed backend
keeps its row with the error. :func:`backend_sidecar` makes one schema-v1 sidecar per backend
(phase ``phase2``) with the gate result beside it; :func:`summary_frame` and :func:`steps_long`
are the notebook's tables. ``29_compare`` reads the sidecars back with :func:`runs_from_sidecars`.

Run: ``python -c "from nbhelpers.grpo_compare import run_backends; from nbhelpers.config import
GRPOSettings; print(run_backends(['flex'], 'tiny-llama', GRPOSettings(max_steps=1,
max_completion_length=8), n_questions=4)['flex']['summary'])"``.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import traceback
from dataclasses import asdict
from typing import Any

from nbhelpers.config import GRPOSettings

PHASE = "phase2"
RUN_KEYS = ("rows", "summary", "config", "wall_s", "completions", "error")


def _child(queue: Any, backend: str, model: str, settings: GRPOSettings,
           kwargs: dict[str, Any], cpu_threads: int) -> None:
    try:
        import torch
        if cpu_threads and not torch.cuda.is_available():
            torch.set_num_threads(cpu_threads)
        from nbhelpers.grpo_backends import step_rows, train
        kwargs.setdefault("output_dir", tempfile.mkdtemp(prefix=f"grpo_{backend}_"))
        res = train(model, settings, backend=backend, **kwargs)
        queue.put({"rows": step_rows(res), "summary": res.summary, "config": res.config,
                   "wall_s": res.wall_s, "completions": res.completions[:8], "error": None})
    except Exception as err:  # noqa: BLE001 - the parent keeps the row with this error
        queue.put({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def run_isolated(backend: str, model: str, settings: GRPOSettings, *, cpu_threads: int = 0,
                 **train_kwargs: Any) -> dict[str, Any]:
    """One :func:`~nbhelpers.grpo_backends.train` run in a spawned process (see module doc).

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


def run_backends(backends: list[str], model: str, settings: GRPOSettings,
                 **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_isolated` for each backend in order; ``kwargs`` go to every run.

    Raises:
        ValueError: empty or repeated backends, or an unknown backend name.
    """
    from nbhelpers.grpo_backends import check_backend
    if not backends or len(set(backends)) != len(backends):
        raise ValueError(f"backends={backends}: give each backend once, at least one.")
    for b in backends:
        check_backend(b)
    return {b: run_isolated(b, model, settings, **kwargs) for b in backends}


def summary_frame(runs: dict[str, dict[str, Any]], gates: dict[str, Any] | None = None):
    """One row per backend: wall, median step / generation time, peak memory, gate, error."""
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
            "reward_median": s.get("reward_median"), "kl_median": s.get("kl_median"),
            "logprob_mismatch_max": _max([r.get("sampling/sampling_logp_difference/mean")
                                          for r in steps]),
            "gate": _gate_word(gates, name), "error": run.get("error")})
    return pd.DataFrame(rows).set_index("backend")


def _max(vals: list[Any]) -> float | None:
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _gate_word(gates: dict[str, Any] | None, name: str) -> str | None:
    if not gates or name not in gates:
        return None
    g = gates[name]
    g = g if isinstance(g, dict) else g.as_dict()
    if g.get("error"):
        return "not staged" if all(c["status"] == "skip" for c in g["checks"]) else "FAIL"
    return "pass" if g["passed"] else "FAIL"


def steps_long(runs: dict[str, dict[str, Any]]):
    """Tidy per-step frame (``backend``, ``step``, metrics) over every run that produced rows."""
    import pandas as pd
    frames = [pd.DataFrame(run["rows"]).assign(backend=name) for name, run in runs.items()
              if run.get("rows")]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["backend", "step"])


def backend_sidecar(name: str, run: dict[str, Any], settings: GRPOSettings,
                    model_info: dict[str, Any], gate: Any = None,
                    run_id: str | None = None) -> dict[str, Any]:
    """Schema-v1 sidecar of one backend's GRPO run; ``rounds`` = post-warm-up steps."""
    from types import SimpleNamespace

    from nbhelpers.notebook import grpo_rounds
    from nbhelpers.stats import make_sidecar
    s, steps = run.get("summary") or {}, run.get("rows") or []
    rounds = grpo_rounds(SimpleNamespace(config=run["config"], records=steps),
                         s.get("skip_first", 0)) if steps else []
    workload = {"n_prompts": settings.per_device_train_batch_size // settings.num_generations,
                "prompt_tokens_mean": None, "max_new_tokens": settings.max_completion_length,
                "ignore_eos": False, "sampling": settings.sampling_params().to_dict()}
    gate_d = gate if gate is None or isinstance(gate, dict) else gate.as_dict()
    return make_sidecar(
        phase=PHASE, backend=name, model=model_info, lora=asdict(settings.lora),
        workload=workload, rounds=rounds, error=run.get("error"), run_id=run_id,
        peak_mem={"allocated": s.get("peak_mem_allocated_gib"),
                  "device": s.get("peak_mem_device_gib")},
        extra={"grpo_summary": s, "grpo_steps": steps, "grpo_config": _jsonable(run.get("config")),
               "grpo_wall_s": run.get("wall_s"), "grpo_completions_sample": run.get("completions"),
               "gate": gate_d, "headline": {"step_time_s_median": s.get("step_time_s_median"),
                                            "peak_mem_gib": s.get("peak_mem_device_gib"),
                                            "gate": _gate_word({name: gate_d}, name)
                                            if gate_d else None}})


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else str(obj)


def runs_from_sidecars(sidecars: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """``(runs, gates)`` keyed ``"<backend>@<run_id>"`` from phase-2 per-backend sidecars."""
    runs, gates = {}, {}
    for side in sidecars:
        if side.get("phase") != PHASE or side.get("backend") == "all":
            continue
        key = f"{side['backend']}@{side['run_id']}"
        runs[key] = {"rows": side.get("grpo_steps") or [], "summary": side.get("grpo_summary"),
                     "wall_s": side.get("grpo_wall_s"), "error": side.get("error"),
                     "config": side.get("grpo_config")}
        if side.get("gate"):
            gates[key] = side["gate"]
    return runs, gates
