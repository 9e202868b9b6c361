"""One GRPO entry point (TRL ``GRPOTrainer`` + PEFT LoRA) with per-step statistics.

Contract: :func:`build_config` turns :class:`~nbhelpers.config.GRPOSettings` into a
``trl.GRPOConfig`` (batch size fixed up instead of TRL's crash, vLLM-style ``top_k=-1`` translated,
``use_cpu`` on CPU hosts, bf16 on GPUs); :func:`train` runs the reference notebook's GRPO setup
(reward functions, chat template, LoRA) on one rollout backend and returns a :class:`GRPOResult`.
This first version has the ``hf_generate`` backend (TRL's ``model.generate`` path) only.

Run: ``python -c "from nbhelpers.grpo import train; from nbhelpers.config import GRPOSettings;
print(train('tiny-llama', GRPOSettings(max_steps=2, max_completion_length=8), output_dir='/tmp/g'
).summary)"``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.shims.transformers_top_k import vllm_top_k_to_transformers

log = logging.getLogger(__name__)

BACKENDS = ("hf_generate", "hf_cb", "vllm", "unsloth", "flex")
"""Rollout backends GRPO training runs with (``hf_generate`` here, the others through
:func:`nbhelpers.grpo_backends.train`)."""
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


def _is_cuda() -> bool:
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
    on_gpu = _is_cuda()
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


def build_dataset(dataset: str, tokenizer, n_questions: int, max_prompt_length: int, seed: int):
    """A ``datasets.Dataset`` of ``{"prompt": [system, user], "answer", "id"}`` rows, filtered as
    the reference does (:func:`nbhelpers.data.filter_by_prompt_length`: longest 10 % dropped, and
    none over ``max_prompt_length`` tokens), plus the filter's stats dict.

    Raises:
        ValueError: no prompt fits ``max_prompt_length`` (raise it).
    """
    from datasets import Dataset

    from nbhelpers import data
    rows = data.to_grpo_rows(load_questions(dataset, n_questions, seed))
    rows, stats = data.filter_by_prompt_length(rows, tokenizer, max_prompt_length)
    return Dataset.from_list(rows), stats


@dataclass
class GRPOResult:
    """What :func:`train` measured.

    Attributes:
        records: one dict per optimiser step
            (see :class:`~nbhelpers.grpo_stats.StatisticsCallback`).
        summary: post-warm-up medians (``StatisticsCallback.summary``).
        completions: sampled rows ``{"step", "question", "completion", "answer", <reward fn>...}``.
        log_history: the trainer's ``state.log_history`` (TRL's raw logs).
        reward_names: the reward functions' names, in TRL's order.
        config: the effective GRPOConfig values that matter for comparisons.
        dataset_stats: the prompt-length filter's stats.
        wall_s: seconds from trainer construction to the end of ``train()``.
        format_warmup: the SFT format warm-up's report (:func:`nbhelpers.sft_warmup.format_warmup`:
            steps, wall_s, losses, before/after completions); empty when it did not run.
    """

    model_name: str
    backend: str
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    completions: list[dict[str, Any]]
    log_history: list[dict[str, Any]]
    reward_names: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    dataset_stats: dict[str, Any] = field(default_factory=dict)
    wall_s: float | None = None
    format_warmup: dict[str, Any] = field(default_factory=dict)

    def sidecar_extra(self) -> dict[str, Any]:
        """Keys for ``make_sidecar(extra=...)``: GRPO stats beside the schema-v1 keys."""
        return {"grpo_summary": self.summary, "grpo_steps": self.records,
                "grpo_config": self.config, "grpo_wall_s": self.wall_s,
                "grpo_completions_sample": self.completions[:8],
                "dataset_stats": self.dataset_stats, "format_warmup": self.format_warmup}


def _check_backend(backend: str) -> None:
    if backend in BACKENDS:
        return
    if backend in ROLLOUT_ONLY_BACKENDS:
        raise ValueError(f"backend={backend!r} is {ROLLOUT_ONLY_BACKENDS[backend]}.")
    raise ValueError(f"backend={backend!r}: unknown; use one of {BACKENDS}.")


_CONFIG_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                "generation_batch_size", "max_completion_length", "learning_rate", "beta",
                "temperature", "top_p", "top_k", "min_p", "seed", "max_steps", "bf16", "use_cpu")


def train(model_name: str, settings: GRPOSettings, *, backend: str = "hf_generate",
          dataset: str = "gsm8k", n_questions: int = 32, output_dir: str | os.PathLike,
          progress: bool = True, skip_first: int = 3, format_warmup_steps: int = 0,
          **config_overrides: Any) -> GRPOResult:
    """Run ``settings.max_steps`` GRPO steps of ``model_name`` with LoRA ``settings.lora``.

    The reference notebook's setup: its chat template and system prompt
    (:func:`nbhelpers.data.apply_reference_chat_template`), its four reward functions
    (:data:`nbhelpers.rewards.REWARD_FUNCS`), ``n_questions`` questions of ``dataset`` that fit
    ``settings.max_prompt_length``. ``progress`` shows the trainer's progress bar; ``skip_first``
    warm-up steps are left out of ``GRPOResult.summary``'s medians. ``format_warmup_steps`` > 0
    first trains the LoRA adapter that GRPO then continues with that many SFT steps on GSM8K
    worked solutions in the reference format (:mod:`nbhelpers.sft_warmup`, the reference's
    "pre fine-tune for formatting"; ``hf_generate`` only).

    Raises:
        ValueError: unknown backend (or a rollout-only one), unknown dataset, no prompt fits,
            ``n_questions`` > 60 with a format warm-up (its questions would overlap).
        nbhelpers.models.ModelAssetsMissing: the model's assets are not fetched
            (``python -m nbhelpers fetch NAME``).

    The other rollout backends (``hf_cb``, ``vllm``, ``unsloth``, ``flex``) run through
    :func:`nbhelpers.grpo_backends.train` (same setup; its extra options pass through).
    """
    from nbhelpers import grpo_backends
    if backend != "hf_generate" and backend in grpo_backends.BACKENDS:
        return grpo_backends.train(model_name, settings, backend=backend, dataset=dataset,
                                   n_questions=n_questions, output_dir=output_dir,
                                   progress=progress, skip_first=skip_first, **config_overrides)
    _check_backend(backend)
    from trl import GRPOTrainer

    from nbhelpers import data, models, rewards
    from nbhelpers.grpo_stats import CompletionRecorder, StatisticsCallback
    from nbhelpers.shims import trl_fused_logprob_cpu

    if trl_fused_logprob_cpu.install():
        log.info("TRL's Triton log-prob kernel is unavailable: using the pure-torch shim")
    on_gpu = _is_cuda()
    model, tokenizer = models.load_model(model_name, dtype="bfloat16" if on_gpu else "float32",
                                         device="cuda" if on_gpu else "cpu", seed=settings.seed)
    data.apply_reference_chat_template(tokenizer)
    train_ds, ds_stats = build_dataset(dataset, tokenizer, n_questions,
                                       settings.max_prompt_length, settings.seed)
    args = build_config(settings, Path(output_dir), disable_tqdm=not progress, **config_overrides)
    peft, warm = peft_config(settings.lora), {}
    if format_warmup_steps > 0:
        model, warm = _format_warmup(model, tokenizer, settings, peft, format_warmup_steps,
                                     n_questions, train_ds[0]["prompt"][-1]["content"],
                                     Path(output_dir) / "format_warmup")
        peft = None  # GRPOTrainer continues the warmed-up adapter (and copies it as "ref")
    stats, recorder = StatisticsCallback(), CompletionRecorder()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=recorder.wrap(rewards.REWARD_FUNCS),
                          args=args, train_dataset=train_ds, processing_class=tokenizer,
                          peft_config=peft, callbacks=[stats, recorder])
    trainer.train()
    wall_s = time.perf_counter() - t0
    return GRPOResult(
        model_name=model_name, backend=backend, records=stats.records,
        summary=stats.summary(skip_first), completions=recorder.rows,
        log_history=list(trainer.state.log_history),
        reward_names=list(trainer.reward_func_names), dataset_stats=dict(ds_stats),
        config={k: getattr(args, k) for k in _CONFIG_KEYS} | {"lora": asdict(settings.lora)},
        wall_s=wall_s, format_warmup=warm)


def _format_warmup(model, tokenizer, settings: GRPOSettings, peft, steps: int, n_questions: int,
                   probe_question: str, output_dir: Path):
    """Wrap ``model`` in LoRA and run :func:`nbhelpers.sft_warmup.format_warmup` on it."""
    from peft import get_peft_model

    from nbhelpers import sft_warmup
    rows = sft_warmup.sft_rows(n_questions)
    model = get_peft_model(model, peft)
    report = sft_warmup.format_warmup(model, tokenizer, rows, steps, output_dir=str(output_dir),
                                      seed=settings.seed, probe_question=probe_question,
                                      max_new_tokens=settings.max_completion_length)
    log.info("format warm-up: %d SFT steps in %.1f s", steps, report["wall_s"])
    return model, report
