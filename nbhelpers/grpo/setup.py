"""The shared pieces of every GRPO run: TRL config, PEFT config, questions and dataset.

Contract: :func:`build_config` turns :class:`~nbhelpers.config.GRPOSettings` into a
``trl.GRPOConfig`` (batch size fixed up instead of TRL's crash, vLLM-style ``top_k=-1`` translated,
``use_cpu`` on CPU hosts, bf16 on GPUs); :func:`build_dataset` gives the reference notebook's
prompts; :func:`check_backend` names the backends :func:`nbhelpers.grpo.train` runs with.
Nothing heavy at import (TRL, PEFT and datasets are imported inside the functions).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.shims.transformers_top_k import vllm_top_k_to_transformers

log = logging.getLogger(__name__)

BACKENDS = ("hf_generate", "hf_cb", "vllm", "unsloth", "flex")
"""Rollout backends :func:`nbhelpers.grpo.train` runs with (:mod:`nbhelpers.grpo.plans`)."""
ROLLOUT_ONLY_BACKENDS = {
    name: "a phase 1 rollout backend only: TRL's GRPOTrainer drives continuous batching itself "
          "(use backend='hf_cb')"
    for name in ("hf_cb_nograph", "cb_sync")
}
DATASETS = ("gsm8k", "gsm_symbolic", "dapo_math")


def fixed_batch_size(per_device_train_batch_size: int, num_generations: int,
                     gradient_accumulation_steps: int = 1, world_size: int = 1) -> int:
    """The smallest ``per_device_train_batch_size`` >= the given one that TRL accepts.

    TRL 1.15.0 (``trl/trainer/grpo_config.py``, ``GRPOConfig.__post_init__``) sets
    ``generation_batch_size = per_device_train_batch_size * world_size * steps_per_generation``
    (``steps_per_generation`` defaults to ``gradient_accumulation_steps``) and raises
    ``ValueError`` unless it is divisible by ``num_generations``. With one process and no
    accumulation this is the next multiple of ``num_generations``. Counts are completions, not
    prompts.

    Raises:
        ValueError: any argument < 1.
    """
    args = (per_device_train_batch_size, num_generations, gradient_accumulation_steps, world_size)
    if min(args) < 1:
        raise ValueError(f"fixed_batch_size{args}: every count must be >= 1.")
    step = num_generations // math.gcd(num_generations, gradient_accumulation_steps * world_size)
    return -(-per_device_train_batch_size // step) * step


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_cuda() -> bool:
    """Whether this process trains on a CUDA GPU (bf16) or on the CPU (fp32)."""
    import torch
    return torch.cuda.is_available()


def build_config(settings: GRPOSettings, output_dir: str | os.PathLike, **overrides: Any):
    """A ``trl.GRPOConfig`` for ``settings``; ``overrides`` are extra ``GRPOConfig`` fields.

    ``per_device_train_batch_size`` is raised to :func:`fixed_batch_size` with a logged warning;
    ``top_k`` goes through :mod:`nbhelpers.shims.transformers_top_k`; the warm-up ratio becomes
    ``warmup_steps`` (a float < 1 is a ratio in transformers 5.17). On a host without CUDA,
    ``use_cpu=True`` and fp32; with CUDA, ``bf16=True``. Logging goes nowhere
    (``report_to="none"``) and no checkpoints are saved.

    Raises:
        TypeError: an override names no ``GRPOConfig`` field.
    """
    from trl import GRPOConfig

    steps_per_gen = overrides.get("steps_per_generation") or settings.gradient_accumulation_steps
    batch = fixed_batch_size(settings.per_device_train_batch_size, settings.num_generations,
                             steps_per_gen, _world_size())
    if batch != settings.per_device_train_batch_size:
        log.warning("per_device_train_batch_size=%d raised to %d: TRL needs per_device_train_batch"
                    "_size * world_size * steps_per_generation divisible by num_generations=%d",
                    settings.per_device_train_batch_size, batch, settings.num_generations)
    on_gpu = is_cuda()
    kwargs: dict[str, Any] = {
        "output_dir": str(output_dir), "max_steps": settings.max_steps,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": settings.gradient_accumulation_steps,
        "num_generations": settings.num_generations,
        "max_completion_length": settings.max_completion_length,
        "learning_rate": settings.learning_rate, "lr_scheduler_type": settings.lr_scheduler_type,
        "warmup_steps": settings.warmup_ratio, "weight_decay": settings.weight_decay,
        "beta": settings.beta, "temperature": settings.temperature, "top_p": settings.top_p,
        "top_k": vllm_top_k_to_transformers(settings.top_k), "min_p": settings.min_p or None,
        "seed": settings.seed, "logging_steps": settings.logging_steps,
        "gradient_checkpointing": settings.gradient_checkpointing,
        "pad_to_multiple_of": settings.pad_to_multiple_of or None,
        "use_cpu": not on_gpu, "bf16": on_gpu, "report_to": "none", "save_strategy": "no",
        "optim": "adamw_torch"}
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def peft_config(lora: LoraSpec):
    """A PEFT ``LoraConfig`` (causal LM) from a :class:`~nbhelpers.config.LoraSpec`."""
    from peft import LoraConfig
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.targets), task_type="CAUSAL_LM", bias="none")


def load_questions(dataset: str, n_questions: int, seed: int) -> list[dict[str, Any]]:
    """``n_questions`` rows ``{"question", "answer", ...}`` from one of :data:`DATASETS`.

    Raises:
        ValueError: unknown dataset name or ``n_questions < 1``.
    """
    from nbhelpers import data
    if n_questions < 1:
        raise ValueError(f"n_questions={n_questions}: must be >= 1.")
    if dataset == "gsm8k":
        return data.load_gsm8k(n_questions)
    if dataset == "gsm_symbolic":
        return data.gsm_symbolic(n_questions, seed)
    if dataset == "dapo_math":
        return data.load_dapo_math(n_questions)
    raise ValueError(f"dataset={dataset!r}: use one of {DATASETS}.")


def build_dataset(dataset: str, tokenizer, n_questions: int, max_prompt_length: int, seed: int,
                  questions: list[dict[str, Any]] | None = None):
    """A ``datasets.Dataset`` of ``{"prompt": [system, user], "answer", "id"}`` rows, filtered as
    the reference does (:func:`nbhelpers.data.filter_by_prompt_length`: longest 10 % dropped, and
    none over ``max_prompt_length`` tokens), plus the filter's stats dict. ``questions``: rows
    :func:`load_questions` already returned for these arguments (the trainer loads them before
    the model, so a dataset that cannot load fails before the weights do); ``None`` loads them.

    Raises:
        ValueError: no prompt fits ``max_prompt_length`` (raise it).
    """
    from datasets import Dataset

    from nbhelpers import data
    if questions is None:
        questions = load_questions(dataset, n_questions, seed)
    rows = data.to_grpo_rows(questions)
    rows, stats = data.filter_by_prompt_length(rows, tokenizer, max_prompt_length)
    return Dataset.from_list(rows), stats


def check_backend(backend: str) -> None:
    """Raise ``ValueError`` naming :data:`BACKENDS` unless ``backend`` is one of them (a phase 1
    rollout-only backend gets the reason it cannot drive GRPO)."""
    if backend in BACKENDS:
        return
    if backend in ROLLOUT_ONLY_BACKENDS:
        raise ValueError(f"backend={backend!r} is {ROLLOUT_ONLY_BACKENDS[backend]}.")
    raise ValueError(f"backend={backend!r}: unknown; use one of {BACKENDS}.")
