"""Run the same GRPO setup on several backends (one process each) and compare them.

Contract: :func:`run_backends` runs :func:`nbhelpers.grpo.train` once per backend, each in
a fresh spawned process (DESIGN.md rule 6: one backend per process; vLLM and CUDA graphs leave
memory behind), and returns ``{backend: run}`` where ``run`` is a plain dict: ``rows`` (per-step
rows, :func:`~nbhelpers.grpo.result.step_rows`), ``summary``, ``config``, ``wall_s``,
``completions`` (a sample), ``error`` (``"<ExceptionType>: message"`` or None). A failed backend
keeps its row with the error. :func:`backend_sidecar` makes one schema-v1 sidecar per backend
(phase ``phase2``) with the gate result beside it; :func:`summary_frame` and :func:`steps_long`
are the notebook's tables. ``29_compare`` reads the sidecars back with :func:`runs_from_sidecars`.

Run: ``python -c "from nbhelpers.grpo.compare import run_backends; from nbhelpers.config import
GRPOSettings; print(run_backends(['flex'], 'tiny-llama', GRPOSettings(max_steps=1,
max_completion_length=8), n_questions=4)['flex']['summary'])"``.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings

PHASE = "phase2"
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


def run_backends(backends: list[str], model: str, settings: GRPOSettings,
                 **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_isolated` for each backend in order; ``kwargs`` go to every run.

    Raises:
        ValueError: empty or repeated backends, or an unknown backend name.
    """
    from nbhelpers.grpo.setup import check_backend
    if not backends or len(set(backends)) != len(backends):
        raise ValueError(f"backends={backends}: give each backend once, at least one.")
    for b in backends:
        check_backend(b)
    return {b: run_isolated(b, model, settings, **kwargs) for b in backends}


def filter_device(runs: dict[str, dict[str, Any]], gates: dict[str, Any], device: str
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``(runs, gates)`` of the runs whose device name contains ``device`` (case-insensitive:
    ``"h200"`` matches ``"NVIDIA H200"``; ``""`` keeps all).

    Raises:
        ValueError: no run matches; the message lists the devices the sidecars hold.
    """
    if not device:
        return runs, gates
    keep = {k: r for k, r in runs.items() if device.lower() in str(r.get("gpu", "")).lower()}
    if not keep:
        seen = sorted({str(r.get("gpu")) for r in runs.values()})
        raise ValueError(f"device={device!r} matches no phase-2 run; the sidecars hold runs on "
                         f"{seen}: pass one of those (a part of the name is enough) or ''.")
    return keep, {k: g for k, g in gates.items() if k in keep}


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

    from nbhelpers.grpo.phase0_report import grpo_rounds
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
               "traceback_tail": (run.get("traceback") or "")[-4000:] or None,
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
        if side.get("phase") != PHASE or side.get("backend") == "all" or "grpo_steps" not in side:
            continue  # notebook summaries and the runner's failure sidecars are not backend runs
        run_id = str(side["run_id"]).removesuffix(f"_{side['backend']}")
        key = f"{side['backend']}@{run_id}"
        runs[key] = {"rows": side.get("grpo_steps") or [], "summary": side.get("grpo_summary"),
                     "wall_s": side.get("grpo_wall_s"), "error": side.get("error"),
                     "config": side.get("grpo_config"), "model": side.get("model"),
                     "gpu": (side.get("env") or {}).get("gpu") or "cpu"}
        if side.get("gate"):
            gates[key] = side["gate"]
    return runs, gates


def gate_frame(gates: dict[str, Any]):
    """Long table ``backend, check, status, detail`` of :func:`nbhelpers.grpo.gate.check_runs`."""
    import pandas as pd
    rows = []
    for name, g in gates.items():
        g = g if isinstance(g, dict) else g.as_dict()
        rows += [{"backend": name, **c} for c in g["checks"]]
    return pd.DataFrame(rows, columns=["backend", "name", "status", "detail"])


def write_sidecars(runs: dict[str, dict[str, Any]], gates: dict[str, Any],
                   settings: GRPOSettings, model_info: dict[str, Any],
                   sidecar_path: str | Path) -> list[Path]:
    """One sidecar per backend (``<stem>__<backend>.json`` beside ``sidecar_path``) and, at
    ``sidecar_path``, the run's summary (backend ``all``: per-backend table, gate, failures)."""
    from nbhelpers.grpo.gate import GateFailed, assert_gate
    from nbhelpers.stats import make_sidecar, utc_stamp, write_sidecar
    path, run_id = Path(sidecar_path), utc_stamp()
    written = []
    for name, run in runs.items():
        side = backend_sidecar(name, run, settings, model_info, gates.get(name),
                               run_id=f"{run_id}_{name}")
        written.append(write_sidecar(side, path.with_name(f"{path.stem}__{name}.json")))
    try:
        assert_gate(gates)
        failure = None
    except GateFailed as err:
        failure = str(err)
    table = summary_frame(runs, gates).reset_index().to_dict(orient="records")
    main = make_sidecar(phase=PHASE, backend="all", model=model_info, lora=asdict(settings.lora),
                        run_id=run_id, error=failure,
                        extra={"backends": table, "headline": headline(runs, gates),
                               "sidecars": [p.name for p in written]})
    return [write_sidecar(main, path), *written]


def headline(runs: dict[str, dict[str, Any]], gates: dict[str, Any]) -> dict[str, Any]:
    """``{<backend>_step_s, <backend>_peak_gib, <backend>_gate}`` for ``executed/INDEX.md``."""
    out: dict[str, Any] = {}
    for name, row in summary_frame(runs, gates).iterrows():
        out |= {f"{name}_step_s": row["step_time_s_median"],
                f"{name}_peak_gib": row["peak_mem_device_gib"], f"{name}_gate": row["gate"]}
    return out


def perf_goal(summary) -> dict[str, Any]:
    """Issue 6's goal from a :func:`summary_frame`: flex median step <= vLLM's, at <= 1/5 of
    vLLM's peak memory. Values ``None`` when either backend has no numbers."""
    if not {"flex", "vllm"} <= set(summary.index):
        return {"step_ratio": None, "memory_ratio": None, "met": None}
    f, v = summary.loc["flex"], summary.loc["vllm"]
    try:
        step = f["step_time_s_median"] / v["step_time_s_median"]
        mem = f["peak_mem_device_gib"] / v["peak_mem_device_gib"]
    except TypeError:
        return {"step_ratio": None, "memory_ratio": None, "met": None}
    return {"step_ratio": step, "memory_ratio": mem, "met": bool(step <= 1.0 and mem <= 0.2)}


def result_line(runs: dict[str, dict[str, Any]], gates: dict[str, Any], device: str) -> str:
    """The notebook's "Result:" sentence, computed from the runs."""
    parts = []
    for name, row in summary_frame(runs, gates).iterrows():
        if row["error"]:
            parts.append(f"{name}: {row['gate']} ({str(row['error'])[:80]})")
        else:
            parts.append(f"{name}: median step {row['step_time_s_median']:.2f} s, peak "
                         f"{row['peak_mem_device_gib']:.2f} GiB, gate {row['gate']}")
    return f"**Result** ({device}): " + "; ".join(parts) + "."


def gate_latest(runs: dict[str, dict[str, Any]], reference: str, **overrides: Any):
    """Gate the newest run of each backend against the newest ``reference`` run on the same
    device and model, across device calls (:func:`nbhelpers.grpo.gate.check_runs`); ``runs`` as from
    :func:`runs_from_sidecars`.

    Thresholds (:func:`nbhelpers.grpo.gate.thresholds_for`): model kind ``random`` when the runs'
    model block says ``weights: random`` (else ``real``); filtered sampling read from the
    recorded GRPO config (``min_p``, ``top_p``, ``top_k``). Returns ``{backend: GateResult}``, keyed
    ``"backend (device, model)"`` when the runs span several devices or models.
    """
    from types import SimpleNamespace

    from nbhelpers.grpo.gate import check_runs, thresholds_for
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for key, run in runs.items():
        group = (run.get("gpu") or "cpu", (run.get("model") or {}).get("name") or "?")
        groups.setdefault(group, {})[key] = run
    out = {}
    for (gpu, model), members in sorted(groups.items()):
        latest = latest_per_backend(members)
        ref = latest.get(reference) or next(iter(latest.values()), {})
        kind = "random" if (ref.get("model") or {}).get("weights") == "random" else "real"
        cfg = ref.get("config") or {}
        top_k = cfg.get("top_k") or 0
        sampling = SimpleNamespace(min_p=cfg.get("min_p") or 0.0,
                                   top_p=cfg.get("top_p", 1.0) or 1.0, top_k=max(0, top_k))
        gates = check_runs(latest, reference, thresholds_for(kind, sampling, **overrides))
        for name, gate in gates.items():
            out[name if len(groups) == 1 else f"{name} ({gpu}, {model})"] = gate
    return out


def latest_per_backend(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{backend: run}`` keeping the newest ``backend@<UTC run id>`` of each backend."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for key, run in runs.items():
        backend, _, run_id = key.partition("@")
        if backend not in out or run_id > out[backend][0]:
            out[backend] = (run_id, run)
    return {b: run for b, (_, run) in out.items()}
