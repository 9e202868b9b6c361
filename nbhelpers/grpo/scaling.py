"""Scaling runs: one backend at 1 and N processes at a fixed per-GPU batch, as one sidecar.

Contract: :func:`run_scaling` launches both runs through :func:`nbhelpers.grpo.distributed.launch`
and returns a schema-v1 sidecar whose ``scaling`` block (:func:`scaling_record`) holds the step
times, ``scaling_efficiency`` and per-rank generation time and memory. It lives beside
``distributed`` (not in it) because it needs :func:`nbhelpers.grpo.train`'s keywords, and
``trainer`` imports ``distributed``. The 2-GPU command is in README "Scaling past one GPU".
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo.distributed import launch


def scaling_record(one: Any, many: Any) -> dict[str, Any]:
    """Weak scaling of one backend: ``one`` ran on 1 GPU, ``many`` on N at the same per-GPU batch.

    ``scaling_efficiency`` = median step seconds at 1 GPU / median step seconds at N (1.0 = the
    N-times larger global batch costs no extra time per step). Per-rank rows: median
    ``_generate`` seconds and peak memory (GiB) from ``many.config["per_rank"]``.

    Raises:
        ValueError: a run without ``step_time_s_median`` or ``many`` without ``per_rank``.
    """
    t1, tn = one.summary.get("step_time_s_median"), many.summary.get("step_time_s_median")
    if not t1 or not tn or "per_rank" not in many.config:
        raise ValueError("scaling_record needs both runs' summary['step_time_s_median'] and the "
                         "N-process run's config['per_rank'] (train(num_processes=N)).")
    from statistics import median
    ranks = [{"rank": r["rank"], "generate_s_median": median(r["generate_s"]) if r["generate_s"]
              else None} | {k: v for k, v in r.items() if k.startswith("peak_")}
             for r in many.config["per_rank"]]
    return {"backend": many.backend, "world_size": many.config["world_size"],
            "per_device_train_batch_size": many.config["per_device_train_batch_size"],
            "step_time_s_median_1gpu": t1, "step_time_s_median_ngpu": tn,
            "scaling_efficiency": t1 / tn, "per_rank": ranks}


def _train_opts(**kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(opts, config_overrides)`` as :func:`nbhelpers.grpo.train` builds them: its keyword
    defaults updated by ``kwargs``; names that are not its keywords are ``GRPOConfig`` fields."""
    import inspect

    from nbhelpers.grpo.trainer import train
    params = inspect.signature(train).parameters.values()
    opts = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    overrides = {k: v for k, v in kwargs.items() if k not in opts}
    return opts | {k: v for k, v in kwargs.items() if k in opts}, overrides


def run_scaling(model_name: str, settings: GRPOSettings, backend: str, num_processes: int, *,
                output_dir: str | os.PathLike, vllm_mode: str = "colocate",
                **train_kwargs: Any) -> tuple[dict[str, Any], Any, Any]:
    """``(sidecar, 1-GPU result, N-process result)`` of one backend at a fixed per-GPU batch.

    Both runs are launched processes (:func:`launch`; the 1-GPU one without a process group), so
    neither sees the other's memory. The 1-GPU run is the same backend on one process (for
    ``vllm_mode="server"``: TRL's vLLM colocate on one GPU, so the efficiency says what giving
    generation its own GPU buys). The
    sidecar is schema v1 (:func:`nbhelpers.stats.make_sidecar`, phase ``phase2``, backend
    ``<backend>_x<N>[_server]``) with :func:`scaling_record` under ``scaling`` and the N-process
    run's :meth:`~nbhelpers.grpo.result.GRPOResult.sidecar_extra`.
    """
    from nbhelpers.stats import make_sidecar
    out = Path(output_dir)
    one = launch(model_name, settings, *_train_opts(backend=backend, output_dir=out / "x1",
                                                    **train_kwargs))
    many = launch(model_name, settings, *_train_opts(
        backend=backend, output_dir=out / f"x{num_processes}", num_processes=num_processes,
        vllm_mode=vllm_mode, **train_kwargs))
    rec = scaling_record(one, many)
    peak = max((r.get("peak_mem_allocated_gib") or 0.0 for r in rec["per_rank"]), default=0.0)
    side = make_sidecar(
        phase="phase2", backend=f"{backend}_x{num_processes}"
        + ("_server" if vllm_mode == "server" else ""), lora=asdict(settings.lora),
        peak_mem={"allocated": peak or None}, extra=many.sidecar_extra() | {"scaling": rec},
        workload={"n_prompts": settings.per_device_train_batch_size // settings.num_generations,
                  "max_new_tokens": settings.max_completion_length, "ignore_eos": False,
                  "sampling": settings.sampling_params().to_dict()},
        model={"name": model_name})
    return side, one, many
