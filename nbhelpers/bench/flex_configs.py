"""Notebook 33's sweep, one process per configuration: each (variant, LoRA mode) pair runs every
batch of the sweep in its own ``python -m nbhelpers.bench.flex_configs`` child.

Contract: :func:`plan_configs` turns the notebook's ``lora_modes`` (``"none"`` | ``"bf16"`` |
``"fp32"``, or the old booleans: :func:`nbhelpers.bench.flex_ab.lora_mode`), ``variants``
(``[{"name", "options"}]``, RunnerOptions overrides over ``engine_options``, checked by
:func:`nbhelpers.bench.flex_ab.check_variants`; none given: one ``"default"``) into
:class:`Config` rows, raising ``ValueError`` before any point runs; :func:`sweep_settings` checks
the workload. :func:`run_configs` runs each configuration in a fresh child that builds the random
model, attaches the LoRA of its mode and measures every batch with
:func:`nbhelpers.bench.flex_sweep.run_flex_point` (the same function as
``scripts/bench_flex.py``), writing one schema-v1 sidecar per point (``variant``, ``lora_mode``,
``adapter_dtype`` (what PEFT holds), ``config_pid``, ``point_wall_s``) into a temporary folder;
the parent returns them in (variant, mode, batch) order, with an ``error`` sidecar for every point
a child did not write (its exit code and stderr tail).

Why a process per configuration: the 2026-12-01 H200 run measured all twelve points of 33 in the
notebook's kernel, so torch.compile caches, CUDA graph pools and the allocator state of one
configuration carried into the next (``scripts/bench_flex.py --points`` already ran one process
per point, :mod:`nbhelpers.bench.flex_ab`). Batches of one configuration share its process
(model and adapter built once; that is also what a GRPO run does between rollouts).

Run (internal, the child): ``python -m nbhelpers.bench.flex_configs '<job JSON>'``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nbhelpers.bench import flex_ab as ab

REPO = Path(__file__).resolve().parents[2]
SHAPES = ("tiny", "qwen3-4b")


@dataclass(frozen=True)
class Config:
    """One process of the sweep: a named set of RunnerOptions and a LoRA mode."""

    variant: str
    lora_mode: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def tag(self) -> str:
        return f"{self.variant}_{self.lora_mode}"


def plan_configs(lora_modes: Any, variants: Any = None,
                 engine_options: dict[str, Any] | None = None) -> list[Config]:
    """Every (variant, LoRA mode) as a :class:`Config`, variants outer, modes in the given
    order (repeats dropped); ``variants`` empty or ``None``: one ``"default"`` with
    ``engine_options``, else each variant's options over ``engine_options``.

    Raises:
        ValueError: ``lora_modes`` not a non-empty list of modes, or a bad variant / option
            (the message names the allowed values or the fix). TypeError: ``engine_options``
            not a dict.
    """
    if not isinstance(lora_modes, (list, tuple)) or not lora_modes:
        raise ValueError(f"lora_modes: give a non-empty list such as ['none', 'bf16', 'fp32'], "
                         f"got {lora_modes!r}.")
    modes = list(dict.fromkeys(ab.lora_mode(m, f"lora_modes[{i}]")
                               for i, m in enumerate(lora_modes)))
    base = ab.check_engine_options({} if engine_options is None else engine_options,
                                   "engine_options")
    picked = ab.check_variants(variants or [{"name": "default"}], "variants", base)
    return [Config(v["name"], m, v["options"]) for v in picked for m in modes]


def sweep_settings(*, shape: str, device: str, batches: Any, prompt_tokens: int,
                   max_new_tokens: int, rounds: int, lora_rank: int, profile: bool,
                   sync_every: int = 32) -> dict[str, Any]:
    """The workload every child measures, checked. Raises ``ValueError`` naming the fix."""
    if shape not in SHAPES or device not in ("cpu", "cuda"):
        raise ValueError(f"shape {shape!r} / device {device!r}: use shape one of {SHAPES} and "
                         "device cpu or cuda.")
    if (not isinstance(batches, (list, tuple)) or not batches
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 512
                       for b in batches)):
        raise ValueError(f"batches: give a non-empty list of ints in [1, 512], got {batches!r}.")
    for name, value in (("prompt_tokens", prompt_tokens), ("max_new_tokens", max_new_tokens),
                        ("rounds", rounds), ("lora_rank", lora_rank), ("sync_every", sync_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1.")
    return {"shape": shape, "device": device, "batches": list(batches),
            "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens, "rounds": rounds,
            "lora_rank": lora_rank, "profile": bool(profile), "sync_every": sync_every}


def point_tag(cfg: Config, batch: int) -> str:
    return f"nb33_{cfg.tag}_b{batch}"


def run_configs(configs: list[Config], settings: dict[str, Any], run_id: str,
                timeout_s: float = 1800, log: Callable[[str], Any] = print) -> list[dict]:
    """Each configuration in its own child process (module docstring); the point sidecars in
    (configuration, batch) order, an ``error`` sidecar for any point its child did not write."""
    sides: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="flex_configs_") as tmp:
        for cfg in configs:
            t0 = time.perf_counter()
            job = {"config": asdict(cfg), "settings": settings, "run_id": run_id, "out": tmp}
            err = _run_child(job, timeout_s)
            got = [_read(Path(tmp), run_id, cfg, b) for b in settings["batches"]]
            sides += [s or _error_sidecar(cfg, b, settings, run_id, err or "no sidecar written")
                      for s, b in zip(got, settings["batches"])]
            log(f"{cfg.tag}: {sum(s is not None for s in got)}/{len(got)} points in "
                f"{time.perf_counter() - t0:.0f} s{' (' + err[:200] + ')' if err else ''}")
    return sides


def _run_child(job: dict[str, Any], timeout_s: float) -> str | None:
    """Run one child; ``None`` on exit 0, else the reason (exit code and stderr tail)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "nbhelpers.bench.flex_configs", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"child timed out after {timeout_s:.0f} s"
    return None if proc.returncode == 0 else (f"child exit {proc.returncode}: "
                                              f"{(proc.stderr or '')[-2000:]}")


def _path(out: Path, run_id: str, cfg: Config, batch: int) -> Path:
    return out / f"{run_id}_{point_tag(cfg, batch)}.json"


def _read(out: Path, run_id: str, cfg: Config, batch: int) -> dict | None:
    path = _path(out, run_id, cfg, batch)
    return json.loads(path.read_text()) if path.exists() else None


def _extra(cfg: Config, adapter_dtype: str | None, wall_s: float) -> dict[str, Any]:
    return {"variant": {"name": cfg.variant, "options": cfg.options}, "lora_mode": cfg.lora_mode,
            "adapter_dtype": adapter_dtype, "config_pid": os.getpid(), "point_wall_s": wall_s}


def _error_sidecar(cfg: Config, batch: int, settings: dict[str, Any], run_id: str,
                   error: str) -> dict[str, Any]:
    from nbhelpers.bench import flex_sweep as eb
    return eb.flex_sidecar(point_tag(cfg, batch), {"name": settings["shape"]}, None, batch,
                           settings["prompt_tokens"], settings["max_new_tokens"], None,
                           error=error, extra={**_extra(cfg, None, 0.0), "config_pid": None},
                           run_id=run_id)


def run_child(job: dict[str, Any]) -> None:
    """The child: model, LoRA per mode, every batch measured and written (a failing batch,
    e.g. out of memory at 256, leaves an ``error`` sidecar and the next batch still runs)."""
    from nbhelpers.bench import flex_sweep as eb
    from nbhelpers.bench.floor import lora_of
    from nbhelpers.config import LoraSpec
    from nbhelpers.stats import write_sidecar
    cfg, st = Config(**job["config"]), job["settings"]
    model = ab.random_model(st["shape"], st["device"])
    info = {"name": st["shape"], "architecture": type(model).__name__, "weights": "random",
            "n_params": sum(p.numel() for p in model.parameters())}  # base model, LoRA not counted
    lora = None if cfg.lora_mode == "none" else LoraSpec(rank=st["lora_rank"],
                                                          alpha=2 * st["lora_rank"])
    model = ab.attach_mode(model, lora, cfg.lora_mode)
    adapter_dtype = lora_of(model)[1]
    for batch in st["batches"]:
        t0, res, err = time.perf_counter(), None, None
        try:
            res = eb.run_flex_point(model, batch, st["prompt_tokens"], st["max_new_tokens"],
                                    rounds=st["rounds"], sync_every=st["sync_every"],
                                    profile=st["profile"], **cfg.options)
        except Exception as exc:  # noqa: BLE001 -- recorded in the point's sidecar
            err = f"{type(exc).__name__}: {exc}"
            _free_cuda()
        side = eb.flex_sidecar(point_tag(cfg, batch), info, lora, batch, st["prompt_tokens"],
                               st["max_new_tokens"], res, error=err,
                               extra=_extra(cfg, adapter_dtype, time.perf_counter() - t0),
                               run_id=job["run_id"])
        write_sidecar(side, _path(Path(job["out"]), job["run_id"], cfg, batch))
        print(f"{point_tag(cfg, batch)}: {'error ' + err if err else 'ok'}", flush=True)


def _free_cuda() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    run_child(json.loads(sys.argv[1]))
