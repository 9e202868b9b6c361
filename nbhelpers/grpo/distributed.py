"""GRPO past one GPU: ``accelerate launch`` of :func:`nbhelpers.grpo.train`, one rank per GPU.

Contract: :func:`launch` (called by ``train(num_processes=N)`` with N > 1, or with
``vllm_mode="server"``) writes the run's arguments to ``<output_dir>/distributed/args.json``, runs
``accelerate launch --num_processes N ... -m nbhelpers.grpo.rank args.json`` (accelerate's
own launcher, which is torch's ``torchrun``; no process group of ours) and returns rank 0's
result as a :class:`~nbhelpers.grpo.result.GRPOResult`. :func:`nbhelpers.grpo.rank.main` is the
rank entry point: each rank loads the policy on its own device and runs :func:`nbhelpers.grpo.trainer._train_local`
with its own rollout engine. TRL 1.15.0's ``GRPOTrainer`` does the sharding
(trl/trainer/grpo_trainer.py): accelerate's dataloader gives each process its
``per_device_train_batch_size * steps_per_generation`` rows of the ``RepeatSampler``'s generation
batch, ``_generate`` (so ``rollout_func``) runs on that slice only, rewards are gathered for the
group advantages and each process keeps its slice back (``process_index * len(prompts)``); DDP
all-reduces the LoRA gradients, so every rank's optimizer step is the same and the flex engine,
reading its rank's own policy tensors, needs no weight sync.

Launcher flags: ``--multi_gpu`` selects accelerate's multi-process launcher on CUDA *and* on CPU
hosts. ``--cpu`` would not do on a CPU host: accelerate 1.15.0 (commands/launch.py,
``launch_command``) then takes its ``simple_launcher``, one process unless an MPI hostfile is
given. CPU ranks still run on the CPU with gloo: ``GRPOConfig(use_cpu=True)`` there
(:func:`nbhelpers.grpo.setup.build_config`) makes accelerate's ``PartialState(cpu=True)`` pick
``MULTI_CPU`` / gloo (accelerate/state.py ``_prepare_backend``).

Baselines through TRL's own paths: ``backend="vllm"`` with N ranks is TRL's vLLM colocate on every
rank (TRL builds one ``LLM`` per rank, ``distributed_executor_backend="external_launcher"``);
``vllm_mode="server"`` starts ``trl vllm-serve`` on the last visible GPU and trains on the first
N (TRL pushes the merged weights to the server over NCCL each step). :func:`plan_launch` builds
both command lines without running anything.

Each rank records (:class:`nbhelpers.grpo.rank.RankProbe`) its ``_generate`` seconds, peak memory and, for the flex
engine, a fingerprint of the LoRA tensors the engine read at each rollout and of the policy's
after each optimizer step; rank 0 gathers them into ``GRPOResult.config["per_rank"]``.

Run: ``pytest tests/unit/test_distributed.py`` (2 CPU ranks, gloo).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings, LoraSpec

VLLM_MODES = ("colocate", "server")
"""``train(vllm_mode=...)``: TRL's vLLM in every training process, or a ``trl vllm-serve``."""
RESULT_FILE = "result.json"
LOG_FILE = "launch.log"
SERVER_LOG_FILE = "vllm_serve.log"


@dataclass
class LaunchPlan:
    """The processes one multi-process run starts (commands as argument lists, env additions)."""

    train_cmd: list[str]
    train_env: dict[str, str]
    serve_cmd: list[str] | None = None
    serve_env: dict[str, str] = field(default_factory=dict)
    world_size: int = 1


def visible_gpus() -> int:
    """CUDA devices this process sees (0 on a CPU host)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_launch(backend: str, num_processes: Any, vllm_mode: str, gpus: int,
                 callbacks: Any = ()) -> None:
    """Raise ``ValueError`` naming the fix unless the launch can run on ``gpus`` visible GPUs.

    ``ImportError``: accelerate not installed (``pip install accelerate``)."""
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r}: use an int >= 1 (1 = this process).")
    if vllm_mode not in VLLM_MODES:
        raise ValueError(f"vllm_mode={vllm_mode!r}: use one of {VLLM_MODES}.")
    if vllm_mode == "server" and backend != "vllm":
        raise ValueError(f"vllm_mode='server' with backend={backend!r}: the server is TRL's vLLM "
                         "path; pass backend='vllm' (or vllm_mode='colocate').")
    need = num_processes + (vllm_mode == "server")
    if gpus and need > gpus:
        raise ValueError(f"num_processes={num_processes}{' + 1 vLLM server GPU' * (need > num_processes)}"
                         f" needs {need} GPUs but {gpus} are visible: lower num_processes or "
                         "make more visible (CUDA_VISIBLE_DEVICES).")
    if not gpus and vllm_mode == "server":
        raise ValueError("vllm_mode='server' needs CUDA GPUs (vLLM); none is visible.")
    if list(callbacks):
        raise ValueError("callbacks cannot cross into the ranks' processes: pass callbacks=() "
                         "with num_processes > 1, or run num_processes=1.")
    if importlib.util.find_spec("accelerate") is None:
        raise ImportError("num_processes > 1 runs `accelerate launch`: pip install accelerate "
                          "(the trl extra: pip install -e '.[trl]').")


def free_port() -> int:
    """A TCP port free on this host now (for ``--main_process_port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plan_launch(args_path: Path, num_processes: int, gpus: int, *, vllm_mode: str = "colocate",
                server: tuple[str, int] = ("127.0.0.1", 8000), model_folder: str | None = None,
                max_model_len: int | None = None, port: int | None = None) -> LaunchPlan:
    """The ``accelerate launch`` (and, in server mode, ``trl vllm-serve``) command lines.

    Server mode: the server gets GPU ``num_processes`` (the last one used), the ranks GPUs
    ``0..num_processes-1`` (``CUDA_VISIBLE_DEVICES``). ``gpus`` = 0 means a CPU host.
    """
    # --multi_gpu: accelerate's multi-process launcher (module docstring); it refuses 1 process
    multi = ["--multi_gpu"] if num_processes > 1 else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *multi,
           "--num_processes", str(num_processes), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port or free_port()),
           "-m", "nbhelpers.grpo.rank", str(args_path)]
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())}
    if not gpus:
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    plan = LaunchPlan(cmd, env, world_size=num_processes)
    if vllm_mode == "server":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(num_processes))
        plan.serve_cmd = [sys.executable, "-m", "trl.cli.main", "vllm-serve", "--model",
                          str(model_folder), "--host", server[0], "--port", str(server[1])]
        if max_model_len:
            plan.serve_cmd += ["--max_model_len", str(max_model_len)]
        plan.serve_env = {"CUDA_VISIBLE_DEVICES": str(num_processes)}
    return plan


def launch(model_name: str, settings: GRPOSettings, opts: dict[str, Any],
           config_overrides: dict[str, Any]) -> Any:
    """Run :func:`nbhelpers.grpo.train`'s arguments ``opts`` over ``opts["num_processes"]`` ranks.

    Returns rank 0's :class:`~nbhelpers.grpo.result.GRPOResult`. Raises what
    :func:`check_launch` and :func:`~nbhelpers.grpo.plans.plan_backend` raise (unknown backend,
    ``BackendNotInstalled``) before anything starts, and ``RuntimeError`` (with the log's tail
    and path) when a rank fails.
    """
    from nbhelpers.grpo.plans import plan_backend
    gpus = visible_gpus()
    check_launch(opts["backend"], opts["num_processes"], opts["vllm_mode"], gpus,
                 opts["callbacks"])
    plan_backend(opts["backend"], settings, flex_options=dict(opts["flex_options"] or {}))
    out = Path(opts["output_dir"]) / "distributed"
    out.mkdir(parents=True, exist_ok=True)
    args_path = out / "args.json"
    args_path.write_text(json.dumps(rank_args(model_name, settings, opts, config_overrides),
                                    indent=1))
    plan = plan_launch(args_path, opts["num_processes"], gpus, **_vllm_options(
        model_name, settings, opts, gpus))
    server = _start_server(plan, out) if plan.serve_cmd else None
    try:
        _run_logged(plan.train_cmd, plan.train_env, out / LOG_FILE)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    return read_result(out / RESULT_FILE)


def _vllm_options(model_name: str, settings: GRPOSettings, opts: dict[str, Any],
                  gpus: int) -> dict[str, Any]:
    """For ``backend="vllm"``: the weights folder TRL's ``LLM`` loads, written once here (N ranks
    would race to write it), and in server mode the server's :func:`plan_launch` options."""
    if opts["backend"] != "vllm":
        return {}
    from nbhelpers import models
    from nbhelpers.grpo.plans import vllm_max_model_length
    # built on the CPU: the parent holds no GPU memory while the ranks run (TRL's first
    # sync_weights replaces these values with the policy's anyway)
    folder = models.model_folder(model_name, with_weights=True, device="cpu")
    if opts["vllm_mode"] != "server":
        return {}
    return {"vllm_mode": "server", "server": (opts["vllm_server_host"], opts["vllm_server_port"]),
            "model_folder": str(folder), "max_model_len": vllm_max_model_length(settings)}


def rank_args(model_name: str, settings: GRPOSettings, opts: dict[str, Any],
              config_overrides: dict[str, Any]) -> dict[str, Any]:
    """The JSON the ranks read: ``train()``'s arguments with rewards as ``module:qualname``."""
    opts = dict(opts, output_dir=str(opts["output_dir"]), callbacks=[],
                reward_funcs=_reward_paths(opts["reward_funcs"]))
    if opts["vllm_mode"] == "server":
        config_overrides = dict(config_overrides, vllm_mode="server",
                                vllm_server_host=opts["vllm_server_host"],
                                vllm_server_port=opts["vllm_server_port"])
    return {"model_name": model_name, "settings": asdict(settings), "opts": opts,
            "config_overrides": config_overrides}


def _reward_paths(funcs: Any) -> list[str] | None:
    if funcs is None:
        return None
    paths = []
    for fn in funcs:
        mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if not mod or mod == "__main__" or "<" in name:
            raise ValueError(f"reward function {fn!r} cannot be imported by the ranks: define it "
                             "at module level in an importable module (not __main__, no lambda).")
        paths.append(f"{mod}:{name}")
    return paths


def resolve_reward(path: str) -> Any:
    """The function at ``"module:qualname"`` (:func:`rank_args`'s form)."""
    mod, _, name = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def settings_from_dict(data: dict[str, Any]) -> GRPOSettings:
    """:class:`GRPOSettings` from its ``asdict`` (JSON lists back to tuples)."""
    lora = dict(data["lora"], targets=tuple(data["lora"]["targets"]))
    return GRPOSettings(**(data | {"lora": LoraSpec(**lora)}))


def _run_logged(cmd: list[str], env: dict[str, str], log_path: Path) -> None:
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT,
                            check=False).returncode
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"accelerate launch exited {rc}; log {log_path}:\n{tail}")


def _start_server(plan: LaunchPlan, out: Path) -> subprocess.Popen:
    """``trl vllm-serve`` in the background; TRL's trainer waits for it (``vllm_server_timeout``)."""
    with open(out / SERVER_LOG_FILE, "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(plan.serve_cmd, env=os.environ | plan.serve_env, stdout=log,
                                stderr=subprocess.STDOUT)


def read_result(path: Path) -> Any:
    """The :class:`~nbhelpers.grpo.result.GRPOResult` rank 0 wrote to ``path``."""
    from nbhelpers.grpo.result import GRPOResult
    if not path.exists():
        raise RuntimeError(f"{path} missing: rank 0 did not finish (see {path.parent / LOG_FILE}).")
    return GRPOResult(**json.loads(path.read_text()))
