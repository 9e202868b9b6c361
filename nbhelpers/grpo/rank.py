"""One rank of a multi-process GRPO run: what each process does under ``accelerate launch``.

Contract: :func:`main` (``python -m nbhelpers.grpo.rank ARGS_JSON``, started by
:func:`nbhelpers.grpo.distributed.launch`) sets up accelerate's process state, loads the policy on
this rank's device and runs :func:`nbhelpers.grpo.trainer._train_local` with a :class:`RankProbe`;
rank 0 writes the :class:`~nbhelpers.grpo.result.GRPOResult` as JSON with every rank's record
(gathered with accelerate's ``gather_object``) in ``config["per_rank"]`` and the process count in
``config["world_size"]``.

A rank's record: ``generate_s`` (seconds per ``GRPOTrainer._generate`` call, CUDA-synchronised),
peak memory (:func:`peak_memory`), and for the flex engine ``rollouts`` (per call: the step, the
completions made and :func:`lora_fingerprint` of the LoRA tensors the *engine* read,
:func:`engine_lora_tensors`) beside ``lora_initial`` / ``lora_after_step`` (the policy's LoRA
after each optimizer step). Rollout k+1's fingerprint equal to step k's shows the engine sampled
from the updated weights; equal ``lora_after_step`` on all ranks shows DDP kept them in sync.

Run: ``pytest tests/unit/test_distributed.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nbhelpers.grpo.distributed import RESULT_FILE, resolve_reward, settings_from_dict


def lora_fingerprint(tensors: Any) -> list[list[float]]:
    """Order-free fingerprint of LoRA tensors: sorted ``[sum, sum of squares]`` per tensor
    (float64). Two sets of tensors with equal values give equal lists."""
    import torch
    with torch.no_grad():
        return sorted([float(t.double().sum()), float(t.double().square().sum())]
                      for t in tensors)


def policy_lora_tensors(model: Any) -> list[Any]:
    """The PEFT model's ``lora_A`` / ``lora_B`` weights (the ones the optimizer updates)."""
    return [p for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n]


def engine_lora_tensors(llm: Any) -> list[Any]:
    """The LoRA A/B tensors the flex engine's projections read (:mod:`nbhelpers.engine.lora`)."""
    from nbhelpers.engine.lora import LiveGroup, LiveLinear
    found = []
    for value in vars(llm.runner.model).values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            parts = item.parts if isinstance(item, LiveGroup) else (
                [item] if isinstance(item, LiveLinear) else [])
            found += [t for p in parts if p.has_lora for t in p.lora_tensors()[:2]]
    return found


def peak_memory() -> dict[str, float | None]:
    """This process's peak memory: CUDA allocated / reserved (GiB) or the CPU's max RSS (GiB)."""
    import resource

    import torch
    gib = 1024 ** 3
    if torch.cuda.is_available():
        return {"peak_mem_allocated_gib": torch.cuda.max_memory_allocated() / gib,
                "peak_mem_reserved_gib": torch.cuda.max_memory_reserved() / gib}
    return {"peak_mem_allocated_gib": None,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}



class _ProbedRollout:
    """A flex ``rollout_func`` that records the engine's LoRA fingerprint after each call."""

    __name__ = "flex_rollout"

    def __init__(self, inner: Any, probe: RankProbe):
        self.inner, self.probe = inner, probe

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        out = self.inner(prompts, trainer)
        self.probe.rollouts.append({"global_step": trainer.state.global_step,
                                    "num_completions": len(out["completion_ids"]),
                                    "lora": lora_fingerprint(engine_lora_tensors(self.inner.llm))})
        return out


class RankProbe:
    """Per-rank records (module docstring); the ``hooks`` of :func:`_train_local`."""

    def __init__(self, rank: int):
        self.rank, self.rollouts, self.generate_s = rank, [], []
        self.lora_after_step: list[list[list[float]]] = []
        self.lora_initial: list[list[float]] | None = None
        self.policy: Any = None

    def plan(self, plan: Any) -> None:
        if plan.rollout is not None:
            plan.trainer_kwargs["rollout_func"] = _ProbedRollout(plan.rollout, self)

    def trainer(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        from nbhelpers.stats import _cuda_sync
        inner, probe = trainer._generate, self

        def timed(prompts):
            _cuda_sync()
            t0 = time.perf_counter()
            out = inner(prompts)
            _cuda_sync()
            probe.generate_s.append(time.perf_counter() - t0)
            return out

        class _Steps(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kw):
                probe.policy = model
                probe.lora_initial = lora_fingerprint(policy_lora_tensors(model))

            def on_step_end(self, args, state, control, model=None, **kw):
                probe.lora_after_step.append(lora_fingerprint(policy_lora_tensors(model)))

        trainer._generate = timed
        trainer.add_callback(_Steps())

    def report(self) -> dict[str, Any]:
        """This rank's record (JSON-ready)."""
        return {"rank": self.rank, "generate_s": self.generate_s, "rollouts": self.rollouts,
                "lora_initial": self.lora_initial, "lora_after_step": self.lora_after_step,
                **peak_memory()}


def _init_rank() -> Any:
    """accelerate's process state (gloo on CPU hosts, NCCL on GPUs), device set before loading."""
    import torch
    from accelerate import PartialState
    state = PartialState(cpu=not torch.cuda.is_available())
    if torch.cuda.is_available():
        torch.cuda.set_device(state.local_process_index)
    return state


def check_flex_sharding(backend: str, env: dict[str, str] | None = None) -> None:
    """Raise ``NotImplementedError`` naming the fix when ``backend="flex"`` runs under a launch
    that shards the parameters (FSDP, DeepSpeed ZeRO-3; accelerate's ``ACCELERATE_USE_FSDP`` /
    ``ACCELERATE_DEEPSPEED_ZERO_STAGE``): the engine reads each projection's full ``base_layer``
    and LoRA tensors in place, which a rank then no longer holds (README "Scaling past one GPU")."""
    import os
    env = os.environ if env is None else env
    if backend != "flex":
        return
    fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    zero3 = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and \
        env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "") == "3"
    if fsdp or zero3:
        raise NotImplementedError(
            f"backend='flex' under {'FSDP' if fsdp else 'DeepSpeed ZeRO-3'}: the flex engine needs "
            "every rank to hold the full weights and LoRA tensors (not supported yet). Use plain "
            "DDP (--multi_gpu) or DeepSpeed ZeRO-1/2, or backend='vllm' for sharded training.")


def main(argv: list[str]) -> None:
    """Rank entry point: ``python -m nbhelpers.grpo.rank ARGS_JSON`` under accelerate."""
    from accelerate.utils import gather_object

    from nbhelpers.grpo.trainer import _train_local
    args = json.loads(Path(argv[0]).read_text())
    check_flex_sharding(args["opts"]["backend"])
    state = _init_rank()
    opts = args["opts"]
    if opts["reward_funcs"] is not None:
        opts["reward_funcs"] = [resolve_reward(p) for p in opts["reward_funcs"]]
    probe = RankProbe(state.process_index)
    result = _train_local(args["model_name"], settings_from_dict(args["settings"]), opts,
                          args["config_overrides"], hooks=probe)
    per_rank = gather_object([probe.report()])
    if state.is_main_process:
        result.config |= {"world_size": state.num_processes, "per_rank": per_rank}
        out = Path(opts["output_dir"]) / "distributed" / RESULT_FILE
        out.write_text(json.dumps(asdict(result), default=str))
    state.wait_for_everyone()


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
