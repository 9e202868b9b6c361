"""Phase 1 rollout benchmark harness: every backend in its own process, same prompt ids.

Contract: :func:`run_backends` makes the workload's prompt ids once (``nbhelpers.data.
workload_prompt_ids``) and the canonical LoRA adapter once, then runs ``python -m
nbhelpers.bench.worker SPEC.json`` per backend (memory is freed between engines). Each run writes a
schema-v1 sidecar (``phase="phase1"``); a crash, timeout or exception is recorded in that backend's
``error`` (traceback / log tail) and the next backend still runs. :func:`decode_limit_tok_per_s`
gives the bandwidth ceiling; :func:`results_frame` / :func:`comparison_table` / :func:`bar_figure`
turn sidecars into the notebook's table and charts; :func:`load_backend_sidecars` reads
``19_compare``'s folder (and the runner's pre-launch check), refusing one without any.

Per-backend harness keys in ``engine_options[name]`` (removed before ``load``): ``rounds``,
``warmup_rounds``, ``warmup_max_new_tokens`` (a short warm-up for slow engines: it still compiles
/ captures every shape except the longest KV lengths), ``timeout_s``.

Run: see notebooks/phase1_rollout/10_lora_rollout.ipynb.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nbhelpers.bench import worker as bench_worker
from nbhelpers.config import LoraSpec, Workload

HARNESS_KEYS = ("rounds", "warmup_rounds", "warmup_max_new_tokens", "timeout_s")
H200_COPY_BANDWIDTH_BYTES_PER_S = 4.3e12
"""Measured copy bandwidth on the H200 (DESIGN.md "Reference workloads", physical limit)."""


def backend_label(name: str, lora: LoraSpec | None) -> str:
    """Sidecar backend name: the registry name, ``_lora`` appended when an adapter is active."""
    return f"{name}_lora" if lora is not None else name


def prepare_prompts(model: str, workload: Workload) -> list[list[int]]:
    """Workload prompt ids from the model's tokenizer (``nbhelpers.data.workload_prompt_ids``)."""
    from nbhelpers import data, models

    tok = models.load_tokenizer(model)
    return data.workload_prompt_ids(tok, workload.n_prompts, workload.prompt_tokens,
                                    seed=workload.seed)


def write_prompts(prompts: list[list[int]], path: Path) -> None:
    """Prompt ids as JSON lines (one list per line; not ``*.json``, which sidecar readers scan)."""
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))


def workload_block(workload: Workload, prompts: list[list[int]]) -> dict[str, Any]:
    """The sidecar ``workload`` block (actual prompt lengths, sampling as a dict)."""
    return {"n_prompts": len(prompts),
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "prompt_tokens_min": min(map(len, prompts)),
            "prompt_tokens_max": max(map(len, prompts)),
            "max_new_tokens": workload.max_new_tokens, "ignore_eos": workload.ignore_eos,
            "sampling": workload.sampling_params().to_dict(), "sampling_preset": workload.sampling}


def _spec(name: str, options: dict[str, Any], common: dict[str, Any],
          workload: Workload, out: Path) -> dict[str, Any]:
    opts = dict(options)
    harness = {k: opts.pop(k) for k in HARNESS_KEYS if k in opts}
    label = backend_label(name, common["lora_spec"])
    return {**common["base"], "backend": name, "label": label, "engine_options": opts,
            "rounds": int(harness.get("rounds", workload.rounds)),
            "warmup_rounds": int(harness.get("warmup_rounds", workload.warmup_rounds)),
            "warmup_max_new_tokens": harness.get("warmup_max_new_tokens"),
            "timeout_s": float(harness.get("timeout_s", common["timeout_s"])),
            "sidecar": str(out / f"{common['base']['run_id']}_{common['tag']}_{label}.json")}


def run_backends(backends: list[str], model: str, lora: LoraSpec | None, workload: Workload,
                 out_dir: str | os.PathLike, engine_options: dict[str, dict] | None = None, *,
                 timeout_s: float = 900.0, prompts: list[list[int]] | None = None,
                 run_id: str | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Benchmark each backend in its own subprocess; returns the sidecars in ``backends`` order.

    Args:
        backends: names from ``nbhelpers.backends.BACKENDS`` (variants included).
        model: registry model name; lora: adapter spec or None (no adapter).
        workload: sizes, sampling preset, rounds (overridable per backend, module docstring).
        out_dir: sidecars go here; logs, specs and prompt ids under ``out_dir/_work``.
        engine_options: per backend name, ``load`` options plus harness keys.
        timeout_s: per-backend wall limit (overridable with ``timeout_s`` per backend).
        prompts: prompt ids to use instead of :func:`prepare_prompts`.

    Raises:
        ValueError: unknown backend name or empty ``backends`` (before anything runs).
    """
    from tqdm.auto import tqdm

    from nbhelpers import models
    from nbhelpers.backends import resolve
    from nbhelpers.stats import device_tag, utc_stamp

    if not backends:
        raise ValueError("backends is empty: name at least one of nbhelpers.backends.BACKENDS.")
    for name in backends:
        resolve(name)
    out, work = Path(out_dir), Path(out_dir) / "_work"
    work.mkdir(parents=True, exist_ok=True)
    prompts = prompts if prompts is not None else prepare_prompts(model, workload)
    write_prompts(prompts, work / "prompt_ids.jsonl")
    adapter = _adapter(model, lora)
    spec_model = models.get_spec(model)
    common = {"lora_spec": lora, "timeout_s": timeout_s, "tag": device_tag(), "base": {
        "run_id": run_id or utc_stamp(), "model": models.describe(model),
        "model_spec": asdict(spec_model), "lora": _lora_block(lora), "adapter_path": adapter,
        "workload": asdict(workload), "workload_block": workload_block(workload, prompts),
        "prompts_path": str(work / "prompt_ids.jsonl")}}
    sides = []
    bar = tqdm(backends, desc="backends", disable=not progress)
    for name in bar:
        spec = _spec(name, (engine_options or {}).get(name, {}), common, workload, out)
        bar.set_postfix_str(spec["label"])
        rc, tail = bench_worker.spawn(spec, work / f"{spec['label']}.spec.json",
                              work / f"{spec['label']}.log")
        sides.append(bench_worker.collect(spec, rc, tail))
    return sides


def _adapter(model: str, lora: LoraSpec | None) -> str | None:
    if lora is None:
        return None
    from nbhelpers.adapters import canonical_adapter

    return str(canonical_adapter(model, lora))


def _lora_block(lora: LoraSpec | None) -> dict[str, Any] | None:
    if lora is None:
        return None
    from nbhelpers.adapters import effective_b_std

    return {**asdict(lora), "targets": list(lora.targets), "b_std": effective_b_std(lora)}


def lora_param_count(hf_config: Any, lora: LoraSpec) -> int:
    """LoRA parameters: sum over layers and targets of r * (in + out) of each projection.

    Qwen3-4B, r=32, all 7 targets: 36 * 32 * (2*(2560+4096) + 2*(2560+1024) + 3*(2560+9728))
    = 66.06 M (matches research/measurements/gold_hf_h200_2026-11-30.json ``lora_params_m``).
    """
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, q, kv, i = c.hidden_size, c.num_attention_heads * hd, c.num_key_value_heads * hd, \
        c.intermediate_size
    dims = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
            "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    unknown = set(lora.targets) - set(dims)
    if unknown:
        raise ValueError(f"lora_param_count knows {sorted(dims)}, not {sorted(unknown)}.")
    return c.num_hidden_layers * lora.rank * sum(dims[t] for t in lora.targets)


def decode_limit_tok_per_s(hf_config: Any, n_params: int, batch: int, prompt_tokens: float,
                           max_new_tokens: int, *, lora: LoraSpec | None = None,
                           bandwidth_bytes_per_s: float = H200_COPY_BANDWIDTH_BYTES_PER_S,
                           param_bytes: int = 2, kv_bytes: int = 2,
                           lora_bytes: int = 4) -> float:
    """Memory-bandwidth ceiling of decode throughput (tokens/s), prefill ignored.

    Each decode step reads every weight once plus the KV cache of the whole batch:
    ``bytes_step = n_params * param_bytes + lora_params * lora_bytes + batch * ctx_mean *
    num_layers * 2 * num_kv_heads * head_dim * kv_bytes`` with ``ctx_mean = prompt_tokens +
    (max_new_tokens + 1) / 2`` (the mean context over the decode); the step takes at least
    ``bytes_step / bandwidth`` and yields ``batch`` tokens. Source: DESIGN.md "Reference
    workloads" (weights 8.04 GB at ~4.3 TB/s measured copy bandwidth on the H200) and
    research/anchors.md section 0 (the same formula at 4.8 TB/s peak gives ~15.4k tok/s for W).
    LoRA adapters are counted in fp32 (``lora_bytes=4``, PEFT's default).
    """
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * hd * kv_bytes
    ctx_mean = prompt_tokens + (max_new_tokens + 1) / 2
    lora_b = lora_param_count(c, lora) * lora_bytes if lora is not None else 0
    step_bytes = n_params * param_bytes + lora_b + batch * ctx_mean * kv_per_token
    return batch * bandwidth_bytes_per_s / step_bytes


FRAME_COLUMNS = ("backend", "engine", "model", "lora", "decode_tok_per_s", "decode_tok_per_s_min",
                 "decode_tok_per_s_max", "wall_s", "n_rounds",
                 "peak_mem_allocated_gib", "peak_mem_device_gib", "gpu", "run_id", "error")


def _spread(rounds: list[dict[str, float]] | None) -> dict[str, float | None]:
    rates = [r["new_tokens"] / r["wall_s"] for r in rounds or [] if r.get("wall_s")]
    return {"decode_tok_per_s_min": min(rates, default=None),
            "decode_tok_per_s_max": max(rates, default=None)}


def results_frame(sidecars: list[dict[str, Any]]) -> Any:
    """Tidy DataFrame, one row per sidecar: backend, engine, model, lora, tok/s (median, min and max
    over the timed rounds), median wall s, memory GiB, gpu, run id, error tail."""
    import pandas as pd

    rows = [{"backend": s["backend"], "engine": s.get("engine", s["backend"]),
             "model": (s.get("model") or {}).get("name"), "lora": s.get("lora") is not None,
             "decode_tok_per_s": s.get("decode_tok_per_s_median"), **_spread(s.get("rounds")),
             "wall_s": s.get("wall_s_median"), "n_rounds": len(s.get("rounds") or []),
             "peak_mem_allocated_gib": s.get("peak_mem_allocated_gib"),
             "peak_mem_device_gib": s.get("peak_mem_device_gib"), "gpu": (s.get("env") or {})
             .get("gpu"), "run_id": s.get("run_id"), "error": (s.get("error") or "")[-200:]}
            for s in sidecars]
    return pd.DataFrame(rows, columns=list(FRAME_COLUMNS))


def comparison_table(frame: Any, limit_tok_per_s: dict[bool, float] | None = None) -> Any:
    """Adds ``pct_of_vllm`` (vs the ``vllm`` engine with the same lora flag) and ``pct_of_limit``
    (vs ``limit_tok_per_s[lora]``); missing references give NaN."""
    out = frame.copy()
    ref = out[out["engine"] == "vllm"].groupby("lora")["decode_tok_per_s"].max()
    out["pct_of_vllm"] = [100 * t / ref[lo] if lo in ref.index and t is not None and ref[lo]
                          else float("nan") for t, lo in zip(out["decode_tok_per_s"], out["lora"])]
    lim = limit_tok_per_s or {}
    out["pct_of_limit"] = [100 * t / lim[lo] if lo in lim and t is not None else float("nan")
                           for t, lo in zip(out["decode_tok_per_s"], out["lora"])]
    return out


def bar_figure(frame: Any, columns: list[str], ylabel: str, title: str) -> Any:
    """Grouped bars, one group per backend row, one bar per column; colours per engine
    (``nbhelpers.plots.color``), hatched for extra columns. Returns a Figure (no pyplot)."""
    from matplotlib.figure import Figure

    from nbhelpers.plots import color

    fig = Figure(figsize=(max(5.0, 0.9 * len(frame) * len(columns)), 3.4), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(columns)
    for j, col in enumerate(columns):
        xs = [i + j * width for i in range(len(frame))]
        ax.bar(xs, frame[col].fillna(0.0), width, label=col, hatch="//" if j else None,
               color=[color(e) for e in frame["engine"]], edgecolor="black", linewidth=0.5)
    ax.set_xticks([i + width * (len(columns) - 1) / 2 for i in range(len(frame))],
                  frame["backend"], rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(columns) > 1:
        ax.legend(fontsize=8)
    return fig


def workload_limits(model: str, workload: Workload, prompts: list[list[int]], lora: LoraSpec,
                    bandwidth_bytes_per_s: float = H200_COPY_BANDWIDTH_BYTES_PER_S
                    ) -> dict[bool, float]:
    """:func:`decode_limit_tok_per_s` for ``model`` on these prompts, keyed by "LoRA active"."""
    from nbhelpers import models

    cfg, n = models.build_config(model), models.n_params(model)
    mean = sum(map(len, prompts)) / len(prompts)
    kw = {"bandwidth_bytes_per_s": bandwidth_bytes_per_s}
    batch = len(prompts) * workload.sampling_params().n
    return {False: decode_limit_tok_per_s(cfg, n, batch, mean, workload.max_new_tokens, **kw),
            True: decode_limit_tok_per_s(cfg, n, batch, mean, workload.max_new_tokens,
                                         lora=lora, **kw)}


def summary_sidecar(sides: list[dict[str, Any]], table: Any, notebook: str,
                    params: dict[str, Any]) -> dict[str, Any]:
    """The notebook's own sidecar (``kind="summary"``, no rounds): the table rows, the backend
    sidecar paths and, in ``error``, one line per failed backend (None when all succeeded)."""
    from nbhelpers.stats import make_sidecar

    failed = [f"{s['backend']}: {(s['error'] or '').strip().splitlines()[-1:]}" for s in sides
              if s.get("error")]
    return make_sidecar(phase="phase1", backend=f"summary:{notebook}",
                        model=sides[0]["model"] if sides else None,
                        workload=sides[0]["workload"] if sides else None,
                        error="; ".join(failed) or None,
                        extra={"kind": "summary", "notebook": notebook, "parameters": params,
                               "table": json.loads(table.to_json(orient="records")),
                               "backend_sidecars": [s.get("_path") for s in sides]})


def result_line(table: Any) -> str:
    """One-sentence result: the fastest successful backend per LoRA mode, its tok/s and shares."""
    ok = table[table["decode_tok_per_s"].notna()]
    if ok.empty:
        return "**Result:** no backend produced tokens (see the errors above)."
    parts = []
    for lora, group in ok.groupby("lora"):
        best = group.loc[group["decode_tok_per_s"].idxmax()]
        vllm = best.get("pct_of_vllm")
        share = ("no vLLM row in this run" if vllm is None or math.isnan(vllm)
                 else f"{vllm:.0f} % of vLLM")  # NaN when vLLM did not run or failed
        parts.append(f"{'with' if lora else 'without'} LoRA, {best['backend']} is fastest at "
                     f"{best['decode_tok_per_s']:,.0f} tok/s ({best['pct_of_limit']:.1f} % of "
                     f"the bandwidth limit, {share})")
    failed = table[table["decode_tok_per_s"].isna()]["backend"].tolist()
    return "**Result:** " + "; ".join(parts) + (f". Failed: {failed}." if failed else ".")


NO_SIDECARS = "run 10_lora_rollout first, or point executed_dir at the folder it wrote"


def backend_sidecars(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Every phase 1 *backend* sidecar under ``root``: those this harness wrote (they carry an
    ``engine`` key); notebook summaries and the runner's failure sidecars are left out."""
    from nbhelpers.stats import read_sidecars

    return [s for s in read_sidecars(root, phase="phase1") if "engine" in s]


def load_backend_sidecars(executed_dir: str | os.PathLike, require_any: bool = True,
                          cwd: Path | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """``(root, sidecars)``: :func:`backend_sidecars` under ``executed_dir`` read as
    ``19_compare`` reads it (:func:`nbhelpers.stats.sidecar_root`), checked before anything is
    built from them (the runner makes the same check before launch).

    Raises:
        ValueError: ``require_any`` and no phase-1 backend sidecar under the folder (missing,
            not a folder, empty, or only other phases' sidecars or notebook summaries): the
            message says which and names 10_lora_rollout.
    """
    from nbhelpers.stats import no_runs_why, read_sidecars, sidecar_root

    root = sidecar_root(executed_dir, cwd)
    sides = backend_sidecars(root)
    if require_any and not sides:
        why = no_runs_why(root, read_sidecars(root) if root.is_dir() else [], "phase1",
                          "only notebook summaries, no <run>_backends/*.json")
        raise ValueError(f"no phase-1 sidecars under {root} ({why}): {NO_SIDECARS}.")
    return root, sides
