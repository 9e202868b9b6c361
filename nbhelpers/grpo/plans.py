"""Per-backend wiring of one GRPO run: what each rollout backend changes in TRL's setup.

Contract: :func:`plan_backend` returns a :class:`BackendPlan` (``GRPOConfig`` overrides, trainer
class and kwargs, notes) and checks the backend's engine is importable before anything loads;
:func:`load_policy` loads the policy as the backend needs it; :func:`instrument_generation` times
every backend's rollout into TRL's ``generate_s`` metric.

* ``hf_generate``: TRL's ``model.generate`` path (nothing set).
* ``hf_cb``: TRL's transformers continuous batching (``use_transformers_continuous_batching``).
* ``vllm``: TRL's vLLM colocate (``use_vllm=True, vllm_mode="colocate"``; ``vllm_sleep_mode``,
  ``vllm_gpu_memory_utilization``). TRL builds ``LLM(model=model.name_or_path)``, so the policy is
  loaded from :func:`nbhelpers.models.model_folder` (weights written once for random kinds); after
  a format warm-up :func:`point_policy_at` points it at the warmed, merged folder instead.
* ``unsloth``: Unsloth ``FastLanguageModel(fast_inference=False)`` + its patched TRL trainer,
  loaded from :func:`nbhelpers.models.model_folder` (after a format warm-up: from the warmed,
  merged folder, :data:`WARMUP_RELOAD_BACKENDS`).
* ``flex``: our engine on the policy's own tensors through TRL's ``rollout_func``
  (:mod:`nbhelpers.grpo.flex_rollout`).

The policy's attention (``train(attn_implementation=...)``, :func:`check_attn_implementation`)
is the trainer model's, for its loss and logprob forwards: ``hf_generate`` also generates with
it, ``hf_cb`` with ``paged|<it>`` (transformers 5.17 ``ContinuousBatchingManager.
switch_to_cb_friendly_attn``), ``vllm`` and ``flex`` with their engines' own.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo.result import GENERATE_KEY
from nbhelpers.grpo.setup import check_backend, fixed_batch_size, peft_config

log = logging.getLogger(__name__)

VLLM_ONLY = ("vllm_sleep_mode", "vllm_gpu_memory_utilization")
WARMUP_BACKENDS = ("hf_generate", "hf_cb", "flex", "vllm", "unsloth")
"""Backends :func:`train`'s format warm-up runs for (every GRPO backend): it trains and merges a
LoRA adapter on an in-process HF policy, the backend's own for all but
:data:`WARMUP_RELOAD_BACKENDS`."""
WARMUP_RELOAD_BACKENDS = ("unsloth",)
"""Backends that load their own model class (Unsloth's ``FastLanguageModel``), so the format
warm-up runs on the plain HF policy (:func:`load_policy` of ``hf_generate``), the warmed weights
are saved merged (:data:`WARMUP_FOLDER_BACKENDS`), that model is freed and the backend's policy is
loaded from the folder (:func:`load_policy`'s ``folder``). ``warmup_adapter="merge"`` only: the
backend trains a fresh adapter of its own on the merged weights."""
CUDA_BACKENDS = ("vllm", "unsloth")
"""Backends that train only on a CUDA GPU (vLLM's engine and Unsloth's kernels): the runner
refuses them on a host without CUDA before the notebook starts
(:func:`nbhelpers.run.host_checks.check_host`)."""
WARMUP_FOLDER_BACKENDS = ("vllm", "unsloth")
"""Backends that start from a folder of weights rather than the warmed model in memory: after the
format warm-up :func:`train` saves the warmed weights, adapter merged in, as an HF folder
(:func:`nbhelpers.grpo.sft_warmup.save_merged_folder`) and points the policy at it
(:func:`point_policy_at`). vLLM's engine loads ``model.name_or_path`` when it starts (TRL's
colocate ``LLM(model=model.name_or_path)``); Unsloth's policy is loaded from the folder
(:data:`WARMUP_RELOAD_BACKENDS`)."""
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_4")
"""``train(attn_implementation=...)`` words: the policy model's attention (``auto`` or ``None``:
transformers' default, ``sdpa`` for the phase-2 models)."""
ATTN_BACKENDS = ("hf_generate", "hf_cb", "flex", "vllm")
"""Backends whose policy :func:`load_policy` loads with :func:`nbhelpers.models.load_model`, so
they honour an ``attn_implementation`` (Unsloth's ``FastLanguageModel`` picks its own)."""
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
"""Set (if unset) before ``import vllm``: the settings vLLM 0.26.0 ran with on the H200
(DESIGN.md "The H200 machine"; FlashInfer's sampler is not in the bundle)."""
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
                 flex_options: dict[str, Any] | None = None,
                 attn_implementation: str | None = None) -> BackendPlan:
    """The :class:`BackendPlan` of ``backend`` (engine imports checked here, before loading);
    ``attn_implementation`` (checked by :func:`check_attn_implementation`) adds a note of what
    generates with it.

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
    if attn_implementation is not None:
        plan.notes.append(_attn_note(backend, attn_implementation))
    if backend == "vllm":
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        _common.require("vllm", "vllm", "vllm")
        plan.config_overrides = {
            "use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": vllm_sleep_mode,
            "vllm_gpu_memory_utilization": vllm_gpu_memory_utilization,
            "vllm_max_model_length": vllm_max_model_length(settings)}
        from nbhelpers.grpo.flex_rollout import FlexGRPOTrainer  # TRL's IS path + the IS report
        plan.trainer_cls = FlexGRPOTrainer
    elif backend == "hf_cb":
        plan.config_overrides = {"use_transformers_continuous_batching": True}
    elif backend == "unsloth":
        _common.require("unsloth", "unsloth", "unsloth")
    elif backend == "flex":
        plan.rollout, plan.trainer_cls = _flex_rollout(settings, flex_options or {})
        plan.trainer_kwargs = {"rollout_func": plan.rollout}
        plan.notes.append("flex: TRL rollout_func on the policy's own tensors (no weight sync); "
                          "TRL's importance-sampling correction on one support (engine full-"
                          "softmax logprobs, FlexGRPOTrainer; vllm_importance_sampling_* apply).")
    return plan


def _flex_rollout(settings: GRPOSettings, options: dict[str, Any]) -> tuple[Any, Any]:
    from nbhelpers.grpo.flex_rollout import FlexGRPOTrainer, FlexRollout
    max_len = options.pop("max_model_len", None) or (settings.max_prompt_length
                                                     + settings.max_completion_length + 1)
    batch = fixed_batch_size(settings.per_device_train_batch_size, settings.num_generations,
                             settings.gradient_accumulation_steps)
    kv = options.pop("kv_tokens", None) or batch * settings.gradient_accumulation_steps * max_len
    options.setdefault("prefill_pad", prefill_pad_for(settings.max_prompt_length))
    return FlexRollout(max_model_len=max_len, kv_tokens=kv, **options), FlexGRPOTrainer


def prefill_pad_for(max_prompt_length: int, unit: int = 128) -> int:
    """The flex engine's ``prefill_pad`` for a GRPO run: ``max_prompt_length`` rounded up to
    ``unit`` tokens. The engine pads each packed prefill to a multiple of it (where a shape costs
    a compile: CUDA or compiled attention), so a rollout's prompts of any length up to the limit
    give one query length and compiled flex_attention compiles once, at the first rollout. Why:
    the H200 phase 2 run (``executed/phase2_grpo/20_grpo_equivalence/20261202T042838Z_h200_
    69de6e1__flex.json``, prefill_pad 128) recompiled at step 6 ("tensor 'query' size mismatch
    at index 2. expected 128, actual 256": the first prompt past 128 tokens), a 2.0 s prefill
    against ~0.1 s. Cost: up to ``unit - 1`` more padded tokens per prompt than before.
    ``flex_options={"prefill_pad": n}`` overrides it."""
    return max(unit, -(-max_prompt_length // unit) * unit)


def _attn_note(backend: str, attn: str) -> str:
    gen = {"hf_generate": f"generates with it too ({attn})",
           "hf_cb": f"continuous batching generates with paged|{attn}"}
    return (f"attn_implementation={attn!r}: the trainer model's attention (loss and logprob "
            f"forwards); {backend} {gen.get(backend, 'generates with its own engine attention')}.")


def check_attn_implementation(attn: str | None, backend: str,
                              on_gpu: bool | None = None) -> str | None:
    """What :func:`load_policy` passes to transformers for ``attn`` (``train``'s keyword):
    ``None`` for ``None`` / ``"auto"`` (transformers' default), else ``attn``, checked before
    anything loads; ``on_gpu`` (``None``: ask torch) matters for ``flash_attention_4`` only,
    which also registers the FA4 names where transformers lacks them
    (:func:`nbhelpers.shims.flash_attn4.apply`; a no-op on transformers 5.17).

    Raises:
        ValueError: ``attn`` not one of :data:`ATTN_IMPLEMENTATIONS` (or None), an unknown
            backend, a word other than ``auto`` for a backend outside :data:`ATTN_BACKENDS`
            (``unsloth``), or ``flash_attention_4`` without CUDA (FA4 installed).
        BackendNotInstalled: ``flash_attention_4`` without flash-attn-4 (names the ``fa4``
            extra).
    """
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={attn!r}: use one of {ATTN_IMPLEMENTATIONS} "
                         "(None = 'auto': transformers' default).")
    check_backend(backend)
    if attn in (None, "auto"):
        return None
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attn_implementation={attn!r} with backend={backend!r}: {backend} "
                         f"loads its own model class and attention; attn_implementation applies "
                         f"to backends {ATTN_BACKENDS}; pass 'auto' (or None) for {backend!r}.")
    if attn == "flash_attention_4":
        _require_fa4(backend, on_gpu)
    return attn


def _require_fa4(backend: str, on_gpu: bool | None) -> None:
    from nbhelpers.backends import _common
    from nbhelpers.grpo.setup import is_cuda
    from nbhelpers.shims import flash_attn4
    if not (is_cuda() if on_gpu is None else on_gpu) and flash_attn4.fa4_installed():
        raise ValueError("attn_implementation='flash_attention_4': FlashAttention-4 has CUDA "
                         "kernels only and torch sees no CUDA device here; use 'sdpa' (or "
                         "'auto') on this host.")
    _common.require_fa4(f"{backend} (flash_attention_4)")  # missing FA4: names the extra


def loaded_attn(model: Any) -> str | None:
    """The attention ``model`` was loaded with (``config._attn_implementation``; a PEFT model
    answers for its base), ``None`` when it does not say."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def load_policy(backend: str, model_name: str, settings: GRPOSettings, on_gpu: bool, *,
                attn_implementation: str | None = None,
                folder: str | os.PathLike | None = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, peft_config or None)`` as ``backend`` needs them.

    ``unsloth`` returns its own PEFT model (``peft_config`` None), loaded from ``folder`` (an HF
    folder with weights; ``None``: ``models.model_folder(model_name, with_weights=True)``; after
    a format warm-up :func:`~nbhelpers.grpo.trainer.train` passes the warmed, merged folder).
    Every other backend loads ``model_name`` with :func:`nbhelpers.models.load_model` (bf16 on
    CUDA when ``on_gpu``, else fp32 on the CPU; seed ``settings.seed``); ``vllm`` points the
    model's ``name_or_path`` at an HF folder with weights (TRL's colocate ``LLM`` loads it).
    ``attn_implementation`` (:func:`check_attn_implementation`'s result) goes to
    :func:`nbhelpers.models.load_model`; ``None``: transformers' default.

    Raises:
        ValueError: an ``attn_implementation`` with ``unsloth`` (it loads its own class), or a
            ``folder`` with a backend other than ``unsloth`` (they load ``model_name``).
    """
    from nbhelpers import models
    if backend == "unsloth":
        if attn_implementation is not None:
            raise ValueError(f"attn_implementation={attn_implementation!r}: backend 'unsloth' "
                             f"picks its own attention; use one of {ATTN_BACKENDS}.")
        return _load_unsloth(model_name, settings, on_gpu, folder)
    if folder is not None:
        raise ValueError(f"load_policy(folder={str(folder)!r}) with backend={backend!r}: only "
                         f"'unsloth' loads its policy from a folder; pass folder=None (the model "
                         f"is loaded from model_name={model_name!r}).")
    model, tok = models.load_model(model_name, dtype="bfloat16" if on_gpu else "float32",
                                   device="cuda" if on_gpu else "cpu", seed=settings.seed,
                                   attn_implementation=attn_implementation)
    if backend == "vllm":
        point_policy_at(model, models.model_folder(model_name, with_weights=True,
                                                   device="cuda" if on_gpu else "cpu"))
    return model, tok, peft_config(settings.lora)


def point_policy_at(model: Any, folder: str | os.PathLike) -> None:
    """Set ``name_or_path`` and ``config._name_or_path`` of ``model`` to ``folder`` (a string),
    where TRL's colocate ``LLM(model=model.name_or_path)`` loads its weights from. A
    ``peft.PeftModel`` is pointed through its base model (``PeftModel`` reads both from it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.name_or_path = str(folder)
    base.config._name_or_path = str(folder)


def _load_unsloth(model_name: str, settings: GRPOSettings, on_gpu: bool,
                  folder: str | os.PathLike | None = None) -> tuple[Any, Any, None]:
    """Unsloth's PEFT policy, tokenizer and ``None`` (no ``peft_config``: the model carries its
    adapter), loaded from ``folder`` (``None``: ``models.model_folder(model_name,
    with_weights=True)``)."""
    from nbhelpers import models
    from nbhelpers.backends.unsloth import peft_kwargs, unsloth_env
    for key, value in unsloth_env().items():
        os.environ.setdefault(key, value)
    from unsloth import FastLanguageModel  # before trl's trainer is used: Unsloth patches it
    if folder is None:
        folder = models.model_folder(model_name, with_weights=True)
    model, tok = FastLanguageModel.from_pretrained(
        model_name=str(folder),
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


