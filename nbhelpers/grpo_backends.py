"""GRPO over every rollout backend: one TRL ``GRPOTrainer`` setup, per-backend wiring only.

Contract: :func:`train` runs :mod:`nbhelpers.grpo`'s setup (dataset, chat template, the reference
reward functions, LoRA, :class:`~nbhelpers.grpo_stats.StatisticsCallback`, seeds, sampling) and
changes only how completions are generated:

* ``hf_generate``: TRL's ``model.generate`` path (nothing set).
* ``hf_cb``: TRL's transformers continuous batching (``use_transformers_continuous_batching``).
* ``vllm``: TRL's vLLM colocate (``use_vllm=True, vllm_mode="colocate"``; ``vllm_sleep_mode``,
  ``vllm_gpu_memory_utilization``). TRL builds ``LLM(model=model.name_or_path)``, so the policy is
  loaded from :func:`nbhelpers.models.model_folder` (weights written once for random kinds).
* ``unsloth``: Unsloth ``FastLanguageModel(fast_inference=False)`` + its patched TRL trainer.
* ``flex``: our engine on the policy's own tensors through TRL's ``rollout_func``
  (:mod:`nbhelpers.grpo_flex`).

The vLLM-only settings (and ``flex_options``) are ignored for the other backends with a note in
``GRPOResult.config["notes"]``.
``compile_mode`` compiles the policy (and reference) forward after the trainer is built and the
compile report lands in ``GRPOResult.config["compile_report"]``. Every backend's ``_generate`` is
timed (``generate_s`` in TRL's logs, seconds, CUDA-synchronised). A backend whose engine is not
installed raises :class:`~nbhelpers.backends.base.BackendNotInstalled` naming the pip extra.

Run: ``python -c "from nbhelpers.grpo import train; from nbhelpers.config import
GRPOSettings; print(train('tiny-llama', GRPOSettings(max_steps=2, max_completion_length=8),
backend='flex', output_dir='/tmp/g').summary)"``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import BACKENDS  # one list: nbhelpers.grpo.train dispatches here

log = logging.getLogger(__name__)

VLLM_ONLY = ("vllm_sleep_mode", "vllm_gpu_memory_utilization")
WARMUP_BACKENDS = ("hf_generate", "hf_cb", "flex")
"""Backends whose policy is an in-process HF model that :func:`train`'s format warm-up can merge
into (vLLM loads weights from a folder, Unsloth loads its own model)."""
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
"""Set (if unset) before ``import vllm``: the settings vLLM 0.26.0 ran with on the H200
(DESIGN.md "The H200 machine"; FlashInfer's sampler is not in the bundle)."""
GENERATE_KEY = "generate_s"
"""TRL log key: seconds spent in ``GRPOTrainer._generate`` (rollout incl. detokenisation)."""


def check_backend(backend: str) -> None:
    """Raise ``ValueError`` naming :data:`BACKENDS` unless ``backend`` is one of them."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: unknown; use one of {BACKENDS}.")


@dataclass
class BackendPlan:
    """What one backend changes: ``GRPOConfig`` fields, trainer class and kwargs, notes."""

    backend: str
    config_overrides: dict[str, Any] = field(default_factory=dict)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    trainer_cls: Any = None
    rollout: Any = None
    notes: list[str] = field(default_factory=list)


TRL_VLLM_MAX_NUM_BATCHED_TOKENS = 4096
"""``max_num_batched_tokens`` TRL 1.15.0's colocate ``LLM(...)`` hard-codes
(``trl/generation/vllm_generation.py``)."""


def vllm_max_model_length(settings: GRPOSettings) -> int:
    """``vllm_max_model_length`` for TRL colocate: prompt + completion, raised so that
    ``max_num_seqs * max_model_len >= 4096`` (TRL's fixed ``max_num_batched_tokens``).

    TRL sets ``max_num_seqs = per_device_train_batch_size * tensor_parallel * steps_per_generation``
    (4 in phase 2), so 4 x 512 = 2048 < 4096 and vLLM 0.26.0 warns "max_num_batched_tokens (4096)
    exceeds max_num_seqs * max_model_len (2048). This may lead to unexpected behavior." Its kernel
    warm-up then runs a dummy batch of 4096 tokens split over the 4 requests
    (``gpu_model_runner._dummy_run``), 1024 tokens each, past a 512-token block table: the first
    phase 2 vLLM run on the H200 died with "CUDA error: an illegal memory access" right after
    engine start; with this length it ran (2026-11-30, ``executed/phase2_grpo/
    20_grpo_equivalence/*27cfed8__vllm.json``). A longer max_model_len only sizes vLLM's buffers:
    GRPO's prompt/completion limits still apply.
    """
    steps_per_generation = max(1, settings.gradient_accumulation_steps)
    max_num_seqs = max(1, settings.per_device_train_batch_size * steps_per_generation)
    need = -(-TRL_VLLM_MAX_NUM_BATCHED_TOKENS // max_num_seqs)
    return max(settings.max_prompt_length + settings.max_completion_length, need)


def plan_backend(backend: str, settings: GRPOSettings, *, vllm_sleep_mode: bool = False,
                 vllm_gpu_memory_utilization: float = 0.3,
                 flex_options: dict[str, Any] | None = None) -> BackendPlan:
    """The :class:`BackendPlan` of ``backend`` (engine imports checked here, before loading).

    Raises:
        ValueError: unknown backend.
        BackendNotInstalled: ``vllm`` / ``unsloth`` not importable (message names the extra).
    """
    from nbhelpers.backends import _common
    check_backend(backend)
    plan = BackendPlan(backend)
    if backend != "vllm" and (vllm_sleep_mode or vllm_gpu_memory_utilization != 0.3):
        plan.notes.append(f"{', '.join(VLLM_ONLY)} apply to backend='vllm' only: ignored for "
                          f"{backend!r}.")
    if flex_options and backend != "flex":
        plan.notes.append(f"flex_options apply to backend='flex' only: ignored for {backend!r}.")
    if backend == "vllm":
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        _common.require("vllm", "vllm", "vllm")
        plan.config_overrides = {
            "use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": vllm_sleep_mode,
            "vllm_gpu_memory_utilization": vllm_gpu_memory_utilization,
            "vllm_max_model_length": vllm_max_model_length(settings)}
    elif backend == "hf_cb":
        plan.config_overrides = {"use_transformers_continuous_batching": True}
    elif backend == "unsloth":
        _common.require("unsloth", "unsloth", "unsloth")
    elif backend == "flex":
        plan.rollout, plan.trainer_cls = _flex_rollout(settings, flex_options or {})
        plan.trainer_kwargs = {"rollout_func": plan.rollout}
        plan.notes.append("flex: TRL rollout_func on the policy's own tensors (no weight sync); "
                          "TRL's importance-sampling correction is vLLM-only, so it is off here.")
    return plan


def _flex_rollout(settings: GRPOSettings, options: dict[str, Any]) -> tuple[Any, Any]:
    from nbhelpers.grpo import fixed_batch_size
    from nbhelpers.grpo_flex import FlexGRPOTrainer, FlexRollout
    max_len = options.pop("max_model_len", None) or (settings.max_prompt_length
                                                     + settings.max_completion_length + 1)
    batch = fixed_batch_size(settings.per_device_train_batch_size, settings.num_generations,
                             settings.gradient_accumulation_steps)
    kv = options.pop("kv_tokens", None) or batch * settings.gradient_accumulation_steps * max_len
    return FlexRollout(max_model_len=max_len, kv_tokens=kv, **options), FlexGRPOTrainer


def load_policy(backend: str, model_name: str, settings: GRPOSettings,
                on_gpu: bool) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, peft_config or None)`` as ``backend`` needs them.

    ``unsloth`` returns its own PEFT model (``peft_config`` None); ``vllm`` points the model's
    ``name_or_path`` at an HF folder with weights (TRL's colocate ``LLM`` loads it).
    """
    from nbhelpers import models
    from nbhelpers.grpo import peft_config
    if backend == "unsloth":
        return _load_unsloth(model_name, settings, on_gpu)
    model, tok = models.load_model(model_name, dtype="bfloat16" if on_gpu else "float32",
                                   device="cuda" if on_gpu else "cpu", seed=settings.seed)
    if backend == "vllm":
        folder = str(models.model_folder(model_name, with_weights=True,
                                         device="cuda" if on_gpu else "cpu"))
        model.name_or_path = folder
        model.config._name_or_path = folder
    return model, tok, peft_config(settings.lora)


def _load_unsloth(model_name: str, settings: GRPOSettings, on_gpu: bool) -> tuple[Any, Any, None]:
    from nbhelpers import models
    from nbhelpers.backends.unsloth import peft_kwargs, unsloth_env
    for key, value in unsloth_env().items():
        os.environ.setdefault(key, value)
    from unsloth import FastLanguageModel  # before trl's trainer is used: Unsloth patches it
    model, tok = FastLanguageModel.from_pretrained(
        model_name=str(models.model_folder(model_name, with_weights=True)),
        max_seq_length=settings.max_prompt_length + settings.max_completion_length,
        dtype=None if on_gpu else "float32", load_in_4bit=False, fast_inference=False)
    kwargs = peft_kwargs(settings.lora) | {
        "use_gradient_checkpointing": settings.gradient_checkpointing,
        "random_state": settings.seed}
    return FastLanguageModel.get_peft_model(model, **kwargs), tok, None


def instrument_generation(trainer: Any) -> None:
    """Time ``trainer._generate`` (every backend's rollout) into TRL's ``generate_s`` metric."""
    from nbhelpers.stats import _cuda_sync
    inner = trainer._generate

    @functools.wraps(inner)
    def timed(prompts):
        _cuda_sync()
        t0 = time.perf_counter()
        out = inner(prompts)
        _cuda_sync()
        mode = "train" if trainer.model.training else "eval"
        trainer._metrics[mode][GENERATE_KEY].append(time.perf_counter() - t0)
        return out

    trainer._generate = timed


def train(model_name: str, settings: GRPOSettings, *, backend: str = "hf_generate",
          dataset: str = "gsm8k", n_questions: int = 32, output_dir: str | os.PathLike,
          progress: bool = True, skip_first: int = 3, compile_mode: str = "none",
          vllm_sleep_mode: bool = False, vllm_gpu_memory_utilization: float = 0.3,
          flex_options: dict[str, Any] | None = None,
          reward_funcs: Sequence[Callable[..., list[float]]] | None = None,
          callbacks: Sequence[Any] = (), format_warmup_steps: int = 0,
          **config_overrides: Any):
    """Run ``settings.max_steps`` GRPO steps of ``model_name`` with rollouts from ``backend``.

    Same arguments as :func:`nbhelpers.grpo.train`, plus ``compile_mode`` (see
    :data:`nbhelpers.compile_report.COMPILE_MODES`), the vLLM options, ``flex_options``
    (:class:`~nbhelpers.grpo_flex.FlexRollout` fields), ``reward_funcs`` (default: the reference
    notebook's four) and extra trainer ``callbacks``. Returns a :class:`~nbhelpers.grpo.GRPOResult`
    whose ``config`` also holds ``notes``, ``compile_report``, ``flex_generate_s`` and
    ``format_warmup``.

    ``format_warmup_steps`` > 0 (backends of :data:`WARMUP_BACKENDS`): first that many SFT steps
    of a LoRA adapter on GSM8K worked solutions in the reference format
    (:func:`nbhelpers.grpo._format_warmup`, the reference's "pre fine-tune for formatting"), merged
    into the base weights (``merge_and_unload``); GRPO then trains a fresh adapter on that base
    and TRL's reference policy is the warmed base. Every backend of one comparison thus starts
    from the same policy and a model that scores, so rewards vary within a group, advantages are
    non-zero and the KL checks compare trained policies (a model that never matches the format
    gives every completion the same reward, zero advantages and zero gradients).

    Raises:
        ValueError: unknown backend / dataset / compile mode, no prompt fits, or a format warm-up
            with a backend outside :data:`WARMUP_BACKENDS` or with ``n_questions`` > 60.
        BackendNotInstalled: the backend's engine is missing (message names the extra).
    """
    from nbhelpers.compile_report import CompileWatch, check_compile_mode
    from nbhelpers.grpo import _is_cuda, build_dataset
    compile_mode = check_compile_mode(compile_mode)
    if format_warmup_steps and backend not in WARMUP_BACKENDS:
        raise ValueError(f"format_warmup_steps={format_warmup_steps} with backend={backend!r}: "
                         f"the warm-up runs in-process on backends {WARMUP_BACKENDS}; for "
                         f"{backend!r} pass format_warmup_steps=0 (or a warmed model folder as "
                         "model).")
    if format_warmup_steps < 0:
        raise ValueError(f"format_warmup_steps={format_warmup_steps}: must be >= 0.")
    plan = plan_backend(backend, settings, vllm_sleep_mode=vllm_sleep_mode,
                        vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
                        flex_options=dict(flex_options or {}))
    model, tok, peft = load_policy(backend, model_name, settings, _is_cuda())
    from nbhelpers import data
    data.apply_reference_chat_template(tok)
    train_ds, ds_stats = build_dataset(dataset, tok, n_questions, settings.max_prompt_length,
                                       settings.seed)
    warm: dict[str, Any] = {}
    if format_warmup_steps:
        model, warm = warm_and_merge(model, tok, settings, format_warmup_steps, n_questions,
                                     train_ds[0]["prompt"][-1]["content"],
                                     Path(output_dir) / "format_warmup")
    trainer, parts = _build_trainer(plan, model, tok, peft, train_ds, settings, output_dir,
                                    progress, reward_funcs, callbacks, config_overrides)
    watch = CompileWatch(compile_mode)
    t0 = time.perf_counter()
    with watch:
        from nbhelpers.compile_report import compile_trainer_models
        compiled = compile_trainer_models(trainer, compile_mode)
        trainer.train()
    wall_s = time.perf_counter() - t0
    extra = {"notes": plan.notes, "compile_report": watch.report() | {"compiled": compiled},
             "flex_generate_s": list(plan.rollout.generate_s) if plan.rollout else None,
             "format_warmup": warm or None}
    return _result(model_name, plan, trainer, parts, settings, ds_stats, wall_s, skip_first,
                   extra)


def warm_and_merge(model: Any, tok: Any, settings: GRPOSettings, steps: int, n_questions: int,
                   probe_question: str, output_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The format warm-up of :func:`train` (docstring there): ``(merged model, report)``; the
    report is :func:`nbhelpers.sft_warmup.format_warmup`'s (``steps``, ``wall_s``, ``losses``,
    ``before``/``after`` probe completions).

    Raises:
        ValueError: ``n_questions`` > 60 (GRPO's questions would overlap the warm-up's).
    """
    from nbhelpers.grpo import _format_warmup, peft_config
    peft_model, report = _format_warmup(model, tok, settings, peft_config(settings.lora), steps,
                                        n_questions, probe_question, output_dir)
    merged = peft_model.merge_and_unload()
    merged.train()
    return merged, dict(report)


def _build_trainer(plan: BackendPlan, model: Any, tok: Any, peft: Any, train_ds: Any,
                   settings: GRPOSettings, output_dir: Any, progress: bool,
                   reward_funcs: Any, callbacks: Sequence[Any],
                   config_overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from nbhelpers import rewards
    from nbhelpers.grpo import build_config
    from nbhelpers.grpo_stats import CompletionRecorder, StatisticsCallback
    from nbhelpers.shims import trl_fused_logprob_cpu
    if trl_fused_logprob_cpu.install():
        log.info("TRL's Triton log-prob kernel is unavailable: using the pure-torch shim")
    if plan.trainer_cls is None:
        from trl import GRPOTrainer
        plan.trainer_cls = GRPOTrainer
    args = build_config(settings, Path(output_dir), disable_tqdm=not progress,
                        **(plan.config_overrides | config_overrides))
    stats, recorder = StatisticsCallback(), CompletionRecorder()
    funcs = list(reward_funcs) if reward_funcs is not None else rewards.REWARD_FUNCS
    trainer = plan.trainer_cls(model=model, reward_funcs=recorder.wrap(funcs), args=args,
                               train_dataset=train_ds, processing_class=tok, peft_config=peft,
                               callbacks=[stats, recorder, *callbacks], **plan.trainer_kwargs)
    instrument_generation(trainer)
    return trainer, {"args": args, "stats": stats, "recorder": recorder}


def _result(model_name: str, plan: BackendPlan, trainer: Any, parts: dict[str, Any],
            settings: GRPOSettings, ds_stats: dict[str, Any], wall_s: float, skip_first: int,
            extra: dict[str, Any]):
    from nbhelpers.grpo import _CONFIG_KEYS, GRPOResult
    args, stats = parts["args"], parts["stats"]
    config = {k: getattr(args, k) for k in _CONFIG_KEYS} | {"lora": asdict(settings.lora)}
    return GRPOResult(
        model_name=model_name, backend=plan.backend, records=stats.records,
        summary=stats.summary(skip_first), completions=parts["recorder"].rows,
        log_history=list(trainer.state.log_history), reward_names=list(trainer.reward_func_names),
        dataset_stats=dict(ds_stats), config=config | extra, wall_s=wall_s)


def step_rows(result: Any) -> list[dict[str, Any]]:
    """Per-step rows: the StatisticsCallback record joined with the extra TRL log keys
    (``generate_s``, ``sampling/sampling_logp_difference/{mean,max}``, ``step_time``)."""
    extra_keys = (GENERATE_KEY, "step_time", "sampling/sampling_logp_difference/mean",
                  "sampling/sampling_logp_difference/max")
    by_step = {h.get("step"): h for h in result.log_history if "train_runtime" not in h}
    rows = []
    for rec in result.records:
        logs = by_step.get(rec["step"], {})
        rows.append(dict(rec) | {k: logs[k] for k in extra_keys if k in logs})
    return rows
