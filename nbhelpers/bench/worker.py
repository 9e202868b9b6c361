"""One benchmark run of one backend, in its own process (spawned by :mod:`nbhelpers.bench.rollout`).

Contract: ``python -m nbhelpers.bench.worker SPEC.json`` reads the spec the harness wrote (backend
name, engine options, model, LoRA, workload, prompt-id file, rounds, sidecar path), loads the
backend, runs warm-up rounds then timed rounds on the same prompt ids, counts tokens from the
returned Completions and writes one schema-v1 sidecar. Any exception is recorded in the sidecar's
``error`` (traceback tail) and the process exits 1; a crash or timeout that kills the process is
recorded by the parent instead. Memory is freed with the process.

Parent side (used by :func:`nbhelpers.bench.rollout.run_backends`): :func:`spawn` runs one worker in its
own session with a wall limit (a timeout kills the whole process group), :func:`collect` returns
the worker's sidecar or writes a failure sidecar with the exit code / timeout and the log tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams, Workload

ADAPTER_ENGINES = ("hf_generate", "hf_cb", "cb_sync", "unsloth", "vllm", "flex")
"""Engines that accept the ``adapter_path`` option (the harness's shared adapter)."""
VERSION_DISTS = ("torch", "transformers", "peft", "accelerate", "trl", "vllm", "unsloth",
                 "unsloth_zoo", "flash-attn-4", "triton")
TRACEBACK_TAIL_CHARS = 4000
LOG_TAIL_CHARS = 3000


def versions() -> dict[str, str | None]:
    """Installed versions of the engines and their stacks (None when absent)."""
    out: dict[str, str | None] = {}
    for dist in VERSION_DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def warmup_sampling(sampling: SamplingParams, max_new_tokens: int | None) -> SamplingParams:
    """The timed sampling with a shorter ``max_new_tokens`` for the warm-up (when given)."""
    if not max_new_tokens:
        return sampling
    return SamplingParams(**{**sampling.to_dict(), "max_new_tokens": int(max_new_tokens)})


def count_round(prompts: list[list[int]], completions: list[Any], n: int) -> dict[str, float]:
    """``new_tokens`` / ``prompt_tokens`` of one round from what the engine returned.

    Raises:
        RuntimeError: the engine returned a different number of completions than asked for.
    """
    if len(completions) != len(prompts) * n:
        raise RuntimeError(f"engine returned {len(completions)} completions for {len(prompts)} "
                           f"prompts x n={n}.")
    return {"new_tokens": sum(len(c.token_ids) for c in completions),
            "prompt_tokens": sum(len(p) for p in prompts) * n}


def lora_from_block(block: dict[str, Any] | None) -> LoraSpec | None:
    """The LoraSpec of a sidecar ``lora`` block (extra keys such as ``b_std`` ignored)."""
    if not block:
        return None
    fields = LoraSpec.__dataclass_fields__
    kw = {k: v for k, v in block.items() if k in fields}
    return LoraSpec(**{**kw, "targets": tuple(kw["targets"])})


def _load(spec: dict[str, Any], state: dict[str, Any]) -> Any:
    from nbhelpers.backends import get_backend, resolve
    from nbhelpers.stats import timer

    backend = get_backend(spec["backend"])
    opts = {**backend.default_options, **spec["engine_options"]}
    if spec.get("adapter_path") and resolve(spec["backend"])[0] in ADAPTER_ENGINES:
        opts.setdefault("adapter_path", spec["adapter_path"])
    lora = lora_from_block(spec.get("lora"))
    state["backend"] = backend
    with timer() as t:
        backend.load(ModelSpec(**spec["model_spec"]), lora, **opts)
    state["init_s"] = t["s"]
    return backend


def _run_rounds(spec: dict[str, Any], backend: Any, prompts: list[list[int]],
                state: dict[str, Any]) -> None:
    from tqdm.auto import tqdm

    from nbhelpers.stats import timer

    sampling = Workload(**spec["workload"]).sampling_params()
    if hasattr(backend, "size_for_workload"):
        backend.size_for_workload(prompts, sampling)  # size before a short warm-up
    warm = warmup_sampling(sampling, spec.get("warmup_max_new_tokens"))
    with timer() as t:
        for _ in range(spec["warmup_rounds"]):
            backend.generate(prompts, warm)
    state["warmup_s"] = t["s"]
    for _ in tqdm(range(spec["rounds"]), desc=spec["label"], file=sys.stderr):
        with timer() as t:
            completions = backend.generate(prompts, sampling)
        state["rounds"].append({"wall_s": t["s"], **count_round(prompts, completions,
                                                                 sampling.n)})
        state["finish_reasons"] = sorted({c.finish_reason for c in completions})


def build_sidecar(spec: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """The schema-v1 sidecar of this run from the spec and the collected state."""
    from nbhelpers.stats import make_sidecar

    backend = state.get("backend")
    extra = {"engine_options": spec["engine_options"], "init_s": state.get("init_s"),
             "warmup_s": state.get("warmup_s"), "versions": versions(),
             "engine_info": getattr(backend, "info", None), "engine": spec["backend"],
             "warmup_rounds": spec["warmup_rounds"],
             "warmup_max_new_tokens": spec.get("warmup_max_new_tokens"),
             "finish_reasons": state.get("finish_reasons"),
             "close_error": state.get("close_error")}
    return make_sidecar(phase="phase1", backend=spec["label"], model=spec["model"],
                        lora=spec.get("lora"), workload=spec["workload_block"],
                        rounds=state["rounds"], peak_mem=state.get("peak_mem"),
                        error=state.get("error"), run_id=spec["run_id"], extra=extra)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, time, close; returns the sidecar (also written to ``spec['sidecar']``)."""
    from nbhelpers.stats import peak_memory_gib, write_sidecar

    state: dict[str, Any] = {"rounds": []}
    prompts = [json.loads(line) for line in Path(spec["prompts_path"]).read_text().splitlines()]
    try:
        backend = _load(spec, state)
        _run_rounds(spec, backend, prompts, state)
        state["peak_mem"] = peak_memory_gib()
    except BaseException:  # noqa: BLE001 -- recorded in the sidecar; the parent sees exit 1
        state["error"] = traceback.format_exc()[-TRACEBACK_TAIL_CHARS:]
        state["peak_mem"] = state.get("peak_mem") or peak_memory_gib()
    finally:
        if state.get("backend") is not None:
            try:
                state["backend"].close()
            except Exception:  # noqa: BLE001 -- must not hide the first error
                state["close_error"] = traceback.format_exc()[-1000:]
    side = build_sidecar(spec, state)
    write_sidecar(side, spec["sidecar"])
    return side


# ---- parent side: spawn a worker, collect its sidecar or record its failure ----

def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


def spawn(spec: dict[str, Any], spec_path: Path, log_path: Path) -> tuple[int | None, str]:
    """Run one worker process; returns (exit code or None on timeout, log tail). The worker runs in
    its own session so a timeout kills its whole process group (vLLM's engine core included)."""
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "nbhelpers.bench.worker", str(spec_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=spec["timeout_s"])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, _tail(log_path)


def failure_sidecar(spec: dict[str, Any], error: str) -> dict[str, Any]:
    """A sidecar for a run whose worker died before writing one (crash, kill, timeout)."""
    from nbhelpers.stats import make_sidecar

    return make_sidecar(phase="phase1", backend=spec["label"], model=spec["model"],
                        lora=spec.get("lora"), workload=spec["workload_block"], error=error,
                        run_id=spec["run_id"],
                        extra={"engine_options": spec["engine_options"], "init_s": None,
                               "warmup_s": None, "versions": None, "engine": spec["backend"]})


def collect(spec: dict[str, Any], rc: int | None, log_tail: str) -> dict[str, Any]:
    """The worker's sidecar, or a failure sidecar naming the exit code / timeout and log tail."""
    from nbhelpers.stats import validate_sidecar, write_sidecar

    path = Path(spec["sidecar"])
    if rc is not None and path.is_file():
        side = json.loads(path.read_text())
        validate_sidecar(side)
        return {**side, "_path": str(path)}
    why = (f"timeout after {spec['timeout_s']:.0f} s" if rc is None
           else f"worker exited with code {rc} without a sidecar")
    side = failure_sidecar(spec, f"{why}; log tail:\n{log_tail}")
    write_sidecar(side, path)
    return {**side, "_path": str(path)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m nbhelpers.bench.worker SPEC.json", file=sys.stderr)
        return 2
    side = run(json.loads(Path(argv[0]).read_text()))
    return 0 if side["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
