"""Phase 2's sidecars: write one per backend (+ the run's summary), read them back, and gate the
newest run of each backend across device calls (``29_compare``).

Contract: :func:`backend_sidecar` / :func:`write_sidecars` write schema-v1 sidecars of phase
``phase2`` (``<stem>__<backend>.json`` beside the summary at ``sidecar_path``; the same paths as
the partial records of :mod:`~nbhelpers.grpo.compare_records`, which they replace);
:func:`runs_from_sidecars` returns ``(runs, gates)`` keyed ``"<backend>@<run_id>"`` (a run
whose policy attention was not the default one: ``"<backend> (<attn>)@<run_id>"``,
:func:`backend_label`);
:func:`filter_device` keeps one device's runs; :func:`load_runs` reads a folder's runs for
``29_compare`` (and the runner's pre-launch check), refusing a folder without any; :func:`gate_latest` gates the newest run of each
backend against the reference within one (device, model, shape) group
(:func:`nbhelpers.grpo.compare_shapes.latest_per_group`) and :func:`gate_conclusion` says what
failed, in sentences. Reached through
:mod:`nbhelpers.grpo.compare`, the notebooks' face.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo.compare_shapes import latest_per_group
from nbhelpers.grpo.compare_tables import gate_word, headline, is_frame, is_summary, summary_frame
from nbhelpers.stats import sidecar_root

PHASE = "phase2"


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


NO_SIDECARS = "run 20_grpo_equivalence first, or point sidecar_dir at the folder it wrote"


def load_runs(sidecar_dir: str | Path, device: str = "", cwd: Path | None = None
              ) -> tuple[Path, list[dict[str, Any]], dict[str, dict], dict[str, dict]]:
    """``(root, sidecars, runs, gates)`` of the phase-2 sidecars under ``sidecar_dir``
    (:func:`nbhelpers.stats.sidecar_root`, :func:`~nbhelpers.stats.read_sidecars`,
    :func:`runs_from_sidecars`), keeping the runs on ``device`` (:func:`filter_device`): what
    ``29_compare`` reads, checked before anything is built from it (the runner makes the same
    checks before launch).

    Raises:
        ValueError: no phase-2 backend run under the folder (missing, not a folder, empty, or
            only other phases' or summary sidecars): the message says which and names
            20_grpo_equivalence; or ``device`` matches none of them (:func:`filter_device`).
    """
    from nbhelpers.stats import no_runs_why, read_sidecars
    root = sidecar_root(sidecar_dir, cwd)
    every = read_sidecars(root) if root.is_dir() else []
    sidecars = [s for s in every if s.get("phase") == PHASE]
    runs, gates = runs_from_sidecars(sidecars)
    if not runs:
        why = no_runs_why(root, every, PHASE, "only notebook summaries, no <run>__<backend>.json")
        raise ValueError(f"no phase-2 sidecars under {root} ({why}): {NO_SIDECARS}.")
    runs, gates = filter_device(runs, gates, device)
    return root, sidecars, runs, gates


PARTIAL_NOTE = ("written when this backend finished, before the notebook did (no gate yet); the "
                "notebook's final write replaces this file")
INTERRUPTED_NOTE = ("written when this backend was stopped before it finished (the notebook "
                    "interrupted, e.g. at a device call's time cap, or its process died): the "
                    "rows are the steps it logged (<stem>__<backend>.progress.jsonl), the "
                    "summary their medians; not a finished run, never gated as one")


def backend_sidecar(name: str, run: dict[str, Any], settings: GRPOSettings,
                    model_info: dict[str, Any], gate: Any = None,
                    run_id: str | None = None, partial: bool = False,
                    reused: dict[str, Any] | None = None) -> dict[str, Any]:
    """Schema-v1 sidecar of one backend's GRPO run; ``rounds`` = post-warm-up steps.

    ``status``: ``ok`` | ``failed`` (the run's ``error``) | ``interrupted`` (the run has
    ``interrupted``, :func:`nbhelpers.grpo.progress.interrupted_run`: the block is kept as
    ``interrupted`` ``{n_steps, max_steps, cause, last_step_utc}``, its ``error`` says
    ``interrupted after N logged steps``); ``partial``: written as the backend
    finished (or stopped), before the notebook did
    (:func:`nbhelpers.grpo.compare_records.write_partial`);
    ``grpo_request``: what defines the run for reuse (``run["request"]``); ``reused_runs``: the
    runs of earlier sidecars this run was gated beside (``{backend: reused_from}``);
    ``rates_note``: the token rates are over each step's rollout (``generate_s``), not the step.
    """
    from nbhelpers.grpo.phase0_report import RATES_NOTE, grpo_rounds
    from nbhelpers.stats import make_sidecar
    s, steps = run.get("summary") or {}, run.get("rows") or []
    rounds = grpo_rounds(run["config"], steps, s.get("skip_first", 0)) if steps else []
    workload = {"n_prompts": settings.per_device_train_batch_size // settings.num_generations,
                "prompt_tokens_mean": None, "max_new_tokens": settings.max_completion_length,
                "ignore_eos": False, "sampling": settings.sampling_params().to_dict()}
    gate_d = gate if gate is None or isinstance(gate, dict) else gate.as_dict()
    stopped = run.get("interrupted")
    record = {"status": "interrupted" if stopped else "failed" if run.get("error") else "ok",
              "partial": partial, "grpo_request": run.get("request"), "reused_runs": reused or {}}
    if stopped:
        record["interrupted"] = stopped
    if partial:
        record["partial_note"] = INTERRUPTED_NOTE if stopped else PARTIAL_NOTE
    return make_sidecar(
        phase=PHASE, backend=name, model=model_info, lora=asdict(settings.lora),
        workload=workload, rounds=rounds, error=run.get("error"), run_id=run_id,
        peak_mem={"allocated": s.get("peak_mem_allocated_gib"),
                  "device": s.get("peak_mem_device_gib")},
        extra={"grpo_summary": s, "grpo_steps": steps, "grpo_config": _jsonable(run.get("config")),
               "traceback_tail": (run.get("traceback") or "")[-4000:] or None,
               "grpo_wall_s": run.get("wall_s"), "grpo_completions_sample": run.get("completions"),
               "gate": gate_d, "importance_sampling": is_summary(run), **record,
               "rates_note": RATES_NOTE,
               "headline": {"step_time_s_median": s.get("step_time_s_median"),
                            "peak_mem_gib": s.get("peak_mem_device_gib"),
                            "gate": gate_word({name: gate_d}, name) if gate_d else None}
               | ({"record": "interrupted" if stopped else "partial"} if partial else {})})


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else str(obj)


DEFAULT_ATTN = "sdpa"
"""The attention a phase-2 policy is loaded with under ``attn_implementation="auto"``
(transformers' default for the lab's models); sidecars from before ``grpo_config`` recorded
``attn_implementation`` ran it."""


def backend_label(backend: str, config: dict[str, Any] | None) -> str:
    """``backend``, or ``"<backend> (<attn>)"`` when the run's policy was loaded with another
    attention than :data:`DEFAULT_ATTN` (``grpo_config["attn_implementation"]``), so that
    ``29_compare`` keeps it apart from that backend's default run (its own newest run, row and
    gate) within one (device, model, shape) group."""
    attn = (config or {}).get("attn_implementation")
    return backend if attn in (None, DEFAULT_ATTN) else f"{backend} ({attn})"


def runs_from_sidecars(sidecars: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """``(runs, gates)`` keyed ``"<backend label>@<run_id>"`` (:func:`backend_label`) from
    phase-2 per-backend sidecars.

    A run holds what :mod:`~nbhelpers.grpo.compare_shapes` reads its shape from (``config``,
    ``request``, ``workload``, ``lora``) and where it came from: ``sidecar`` (the file name,
    when :func:`nbhelpers.stats.read_sidecars` gave ``_path``), ``utc`` (``env.utc``) and
    ``run_id`` (the notebook run's UTC stamp, as in the key); ``interrupted`` (``None``, or
    the block of a run stopped before it finished: :func:`backend_sidecar`)."""
    runs, gates = {}, {}
    for side in sidecars:
        if side.get("phase") != PHASE or side.get("backend") == "all" or "grpo_steps" not in side:
            continue  # notebook summaries and the runner's failure sidecars are not backend runs
        run_id = str(side["run_id"]).removesuffix(f"_{side['backend']}")
        key = f"{backend_label(side['backend'], side.get('grpo_config'))}@{run_id}"
        runs[key] = {"rows": side.get("grpo_steps") or [], "summary": side.get("grpo_summary"),
                     "wall_s": side.get("grpo_wall_s"), "error": side.get("error"),
                     "config": side.get("grpo_config"), "model": side.get("model"),
                     "request": side.get("grpo_request"), "workload": side.get("workload"),
                     "lora": side.get("lora"), "gpu": (side.get("env") or {}).get("gpu") or "cpu",
                     "sidecar": Path(side["_path"]).name if side.get("_path") else None,
                     "utc": (side.get("env") or {}).get("utc"), "run_id": run_id,
                     "interrupted": side.get("interrupted")}
        if side.get("gate"):
            gates[key] = side["gate"]
    return runs, gates


def write_sidecars(runs: dict[str, dict[str, Any]], gates: dict[str, Any],
                   settings: GRPOSettings, model_info: dict[str, Any],
                   sidecar_path: str | Path) -> list[Path]:
    """One sidecar per backend (``<stem>__<backend>.json`` beside ``sidecar_path``, replacing the
    partial one written as it finished) and, at ``sidecar_path``, the run's summary (backend
    ``all``: per-backend table, gate, failures, ``reused``). A run reused from an earlier sidecar
    (``reused_from``) gets no sidecar of its own (its source holds it): ``reused`` names it."""
    from nbhelpers.grpo.gate import GateFailed, assert_gate
    from nbhelpers.stats import make_sidecar, run_stamp, write_sidecar
    path, run_id = Path(sidecar_path), run_stamp()  # the file name's stamp under the runner
    reused = {n: r["reused_from"] for n, r in runs.items() if r.get("reused_from")}
    written = []
    for name, run in runs.items():
        if name in reused:
            continue
        side = backend_sidecar(name, run, settings, model_info, gates.get(name),
                               run_id=f"{run_id}_{name}", reused=reused)
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
                               "importance_sampling": is_frame(runs).reset_index().to_dict(
                                   orient="records"),
                               "sidecars": [p.name for p in written], "reused": reused})
    return [write_sidecar(main, path), *written]


def _gate_groups(runs: dict[str, dict[str, Any]], reference: str, overrides: dict[str, Any]):
    """Per (device, model, shape) group: ``(latest, thresholds, label)``; ``label(backend)`` is
    :func:`gate_latest`'s key for that backend's run."""
    from types import SimpleNamespace

    from nbhelpers.grpo.gate import thresholds_for
    groups = latest_per_group(runs)
    for (gpu, model, shape), latest in groups.items():
        ref = latest.get(reference) or next(iter(latest.values()), {})
        kind = "random" if (ref.get("model") or {}).get("weights") == "random" else "real"
        cfg = ref.get("config") or {}
        top_k = cfg.get("top_k") or 0
        sampling = SimpleNamespace(min_p=cfg.get("min_p") or 0.0,
                                   top_p=cfg.get("top_p", 1.0) or 1.0, top_k=max(0, top_k))
        suffix = "" if len(groups) == 1 else f" ({gpu}, {model}, {shape})"
        yield latest, thresholds_for(kind, sampling, **overrides), (
            lambda name, suffix=suffix: name + suffix)


def gate_latest(runs: dict[str, dict[str, Any]], reference: str, **overrides: Any):
    """Gate the newest run of each backend against the newest ``reference`` run of the same
    device, model and shape (:func:`nbhelpers.grpo.compare_shapes.group_key`; the newest run
    that did not fail, else the newest failed one: :func:`latest_per_group`), across device
    calls (:func:`nbhelpers.grpo.gate.check_runs`); ``runs`` as from :func:`runs_from_sidecars`.
    Runs of different shapes are never gated against each other.

    Thresholds (:func:`nbhelpers.grpo.gate.thresholds_for`): model kind ``random`` when the runs'
    model block says ``weights: random`` (else ``real``); filtered sampling read from the
    recorded GRPO config (``min_p``, ``top_p``, ``top_k``). Returns ``{backend: GateResult}``, keyed
    ``"backend (device, model, shape)"`` when the runs span several groups.
    """
    from nbhelpers.grpo.gate import check_runs
    out = {}
    for latest, thresholds, label in _gate_groups(runs, reference, overrides):
        for name, gate in check_runs(latest, reference, thresholds).items():
            out[label(name)] = gate
    return out


def gate_conclusion(runs: dict[str, dict[str, Any]], cross: dict[str, Any], reference: str,
                    **overrides: Any) -> str:
    """The cross-run gate (``cross``: :func:`gate_latest` of the same ``runs``, ``reference``
    and ``overrides``) as sentences for 29's Result line: ``cross-run gate: pass.``, or ``cross-run
    gate FAILED: <n> checks (<key>.<check>, ...).`` followed by one sentence per failed
    ``grad_norm_vs_reference`` (:func:`nbhelpers.grpo.gate.grad_gap_sentence`: the policy
    gradient much smaller than the reference's, and when TRL's applied IS weight is small, that
    its importance-sampling correction scales the loss and the switches that stop it)."""
    from nbhelpers.grpo.compare_tables import failed_checks
    from nbhelpers.grpo.gate import grad_gap_sentence
    failed = failed_checks(cross)
    if not failed:
        return "cross-run gate: pass."
    out = [f"cross-run gate FAILED: {len(failed)} check{'s' if len(failed) > 1 else ''} ("
           + ", ".join(f"{f['backend']}.{f['check']}" for f in failed) + ")."]
    for latest, thresholds, label in _gate_groups(runs, reference, overrides):
        ref = latest.get(reference)
        ref_rows = None if ref is None or ref.get("error") else ref.get("rows")
        for name, run in latest.items():
            if not any(f["backend"] == label(name) and f["check"] == "grad_norm_vs_reference"
                       for f in failed):
                continue
            sentence = grad_gap_sentence(label(name), run.get("rows") or [], ref_rows,
                                         reference, thresholds)
            if sentence:
                out.append(sentence)
    return " ".join(out)
