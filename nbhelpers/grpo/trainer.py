"""The one GRPO trainer: TRL ``GRPOTrainer`` + PEFT LoRA over every rollout backend.

Contract: :func:`train` runs the reference notebook's GRPO setup (dataset and chat template,
:mod:`nbhelpers.grpo.setup`; the four reference reward functions, :mod:`nbhelpers.grpo.rewards`;
LoRA; :class:`~nbhelpers.grpo.callbacks.StatisticsCallback`; seeds; sampling) and changes only how
completions are generated, as :func:`nbhelpers.grpo.plans.plan_backend` says per backend. It
returns a :class:`~nbhelpers.grpo.result.GRPOResult`. Phase 0 and phase 2 both call it; they differ
only in ``warmup_adapter`` (below).

``compile_mode`` compiles the policy (and reference) backbone after the trainer is built and the
compile report lands in ``GRPOResult.config["compile_report"]``. Every backend's ``_generate`` is
timed (``generate_s`` in TRL's logs, seconds, CUDA-synchronised), and every step's wall is split
into generate-and-score, loss forward+backward, optimizer and the rest
(:mod:`nbhelpers.grpo.step_timing`, ``time/*`` keys of each record; flex adds its engine's
``flex/*`` split per rollout). A backend whose engine is not
installed raises :class:`~nbhelpers.backends.base.BackendNotInstalled` naming the pip extra.

Format warm-up. ``format_warmup_steps`` > 0 (every backend:
:data:`~nbhelpers.grpo.plans.WARMUP_BACKENDS`) first runs that many SFT steps of a LoRA adapter on
GSM8K worked solutions in the reference format (:mod:`nbhelpers.grpo.sft_warmup`, the reference
notebook's "pre fine-tune for formatting"), in this process on an HF policy
(:func:`nbhelpers.models.load_model`), the same seed, rows and probe for every backend.
``warmup_adapter`` then decides what GRPO starts from:

* ``"continue"`` (the default, the reference notebook's recipe and phase 0's): GRPO keeps
  training the warmed adapter, and TRL's reference policy is that adapter's copy. This is the
  reference because it is what the ported notebook does.
* ``"merge"`` (phase 2's): the warmed adapter is merged into the base weights
  (``merge_and_unload``) and GRPO trains a fresh adapter, so every backend of one comparison
  (vLLM and Unsloth load plain weights, not an adapter in training) starts from the same base
  policy and a model that scores: rewards vary within a group and the KL checks compare
  trained policies.

Backends of :data:`~nbhelpers.grpo.plans.WARMUP_FOLDER_BACKENDS` (``vllm``, ``unsloth``) start
from a folder of weights, not from the trainer's tensors, so after the warm-up the warmed weights
are saved, adapter merged into the base (``"continue"``: into a copy; the trainer keeps its
unmerged adapter, which TRL merges into vLLM at every weight sync), to
``<output_dir>/format_warmup/merged`` (``merged_rank<R>`` when ranks share ``output_dir``) and
the policy's ``name_or_path`` / ``config._name_or_path`` point there; the warm-up report's
``model_folder`` names it (``None`` for the other backends), and ``vllm_model_folder`` too for
``vllm`` (``None`` for the others; sidecars before unsloth's warm-up have only that key).
vLLM starts its engine from ``model.name_or_path``. Unsloth
(:data:`~nbhelpers.grpo.plans.WARMUP_RELOAD_BACKENDS`) loads its own model class,
``FastLanguageModel``: the warm-up runs on the plain HF policy (bf16 on CUDA, fp32 on the CPU, as
:func:`~nbhelpers.grpo.plans.load_policy` loads the other backends'), which is freed once the
folder is saved, and Unsloth's policy, with a fresh adapter, is loaded from the folder. So
``unsloth`` takes ``warmup_adapter="merge"`` only (``"continue"``: ``ValueError`` before anything
loads).

More than one process. ``num_processes`` > 1, or ``vllm_mode="server"``, hands the run to
:func:`nbhelpers.grpo.distributed.launch`: ``accelerate launch`` starts one rank per GPU (CPU
ranks with gloo on a host without CUDA), each rank runs :func:`_train_local` with its own engine
on its own prompt shard, and rank 0's result comes back as the same :class:`GRPOResult`
(``config["world_size"]``, ``config["per_rank"]``).

Run: ``python -c "from nbhelpers.grpo import train; from nbhelpers.config import GRPOSettings;
print(train('tiny-llama', GRPOSettings(max_steps=2, max_completion_length=8), backend='flex',
output_dir='/tmp/g').summary)"``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo.plans import (
    WARMUP_BACKENDS,
    WARMUP_FOLDER_BACKENDS,
    WARMUP_RELOAD_BACKENDS,
    BackendPlan,
    check_attn_implementation,
    instrument_generation,
    load_policy,
    loaded_attn,
    plan_backend,
    point_policy_at,
)
from nbhelpers.grpo.result import _CONFIG_KEYS, GRPOResult
from nbhelpers.grpo.setup import build_config, build_dataset, peft_config

log = logging.getLogger(__name__)

WARMUP_ADAPTERS = ("continue", "merge")
"""What :func:`train` does with the format warm-up's LoRA adapter (``warmup_adapter``)."""


def train(model_name: str, settings: GRPOSettings, *, backend: str = "hf_generate",
          dataset: str = "gsm8k", n_questions: int = 32, output_dir: str | os.PathLike,
          progress: bool = True, skip_first: int = 3, compile_mode: str = "none",
          compile_dynamic: bool | None = None, compile_scope: str = "auto",
          attn_implementation: str | None = None, vllm_sleep_mode: bool = False,
          vllm_gpu_memory_utilization: float = 0.3,
          flex_options: dict[str, Any] | None = None,
          reward_funcs: Sequence[Callable[..., list[float]]] | None = None,
          callbacks: Sequence[Any] = (), format_warmup_steps: int = 0,
          warmup_adapter: Literal["continue", "merge"] = "continue", num_processes: int = 1,
          vllm_mode: Literal["colocate", "server"] = "colocate",
          vllm_server_host: str = "127.0.0.1", vllm_server_port: int = 8000,
          **config_overrides: Any) -> GRPOResult:
    """Run ``settings.max_steps`` GRPO steps of ``model_name`` with rollouts from ``backend``.

    ``n_questions`` questions of ``dataset`` that fit ``settings.max_prompt_length``; ``progress``
    shows the trainer's progress bar; ``skip_first`` warm-up steps are left out of
    ``GRPOResult.summary``'s medians. ``compile_mode``: :data:`nbhelpers.grpo.compile_report.
    COMPILE_MODES`; ``compile_dynamic``: ``torch.compile(dynamic=)`` (``None``, the default:
    torch's own, static then dynamic after a recompile; the reference's ``--compile_dynamic`` is
    ``True``), in the compile report; ``compile_scope``: what one compile covers (``"auto"``,
    ``"backbone"``, ``"layers"``: :func:`nbhelpers.grpo.compile_report.resolve_compile_scope`;
    the scope compiled is the report's ``compile_scope``: ``layers`` on a model without a layer
    list compiles the backbone, with a note). ``attn_implementation``: the policy model's
    attention,
    one of :data:`~nbhelpers.grpo.plans.ATTN_IMPLEMENTATIONS` (``None`` / ``"auto"``, the
    default: transformers' own, ``sdpa`` for the phase-2 models; ``"sdpa"``, ``"eager"``,
    ``"flash_attention_4"``: CUDA and the ``fa4`` extra), for backends
    :data:`~nbhelpers.grpo.plans.ATTN_BACKENDS` (every one but ``unsloth``, which loads its own
    model class: refused); it is the trainer's forwards' attention, and ``hf_generate``
    generates with it, ``hf_cb`` with ``paged|<it>``, ``vllm`` / ``flex`` with their own (a
    note in ``GRPOResult.config["notes"]``); the attention the policy was loaded with is
    ``GRPOResult.config["attn_implementation"]``. The vLLM options and ``flex_options``
    (:class:`~nbhelpers.grpo.flex_rollout.FlexRollout` fields) apply to their backend only (a note
    in ``GRPOResult.config["notes"]`` otherwise). ``reward_funcs`` default to the reference's four;
    ``callbacks`` are extra trainer callbacks (one with a ``bind_run(*, stats, watch, config,
    max_steps)`` method gets the run's
    :class:`~nbhelpers.grpo.callbacks.StatisticsCallback`, compile watch, config and step count
    before step 1: :class:`~nbhelpers.grpo.progress.ProgressWriter`); ``config_overrides`` extra
    ``GRPOConfig`` fields.
    ``format_warmup_steps`` / ``warmup_adapter``: the format warm-up (module docstring).
    ``num_processes`` ranks (data parallel, one per GPU) and ``vllm_mode`` (``"server"``: TRL's
    ``trl vllm-serve`` on one more GPU at ``vllm_server_host:vllm_server_port``): module docstring
    and :func:`nbhelpers.grpo.distributed.launch`, which names its own errors.

    Raises:
        ValueError: unknown backend (or a rollout-only one) / dataset / compile mode or
            ``compile_dynamic`` / ``compile_scope`` word /
            ``warmup_adapter``, an ``attn_implementation`` not in ``ATTN_IMPLEMENTATIONS``, or
            not ``auto`` with ``unsloth``, or ``flash_attention_4`` on a host without CUDA,
            no prompt fits, or a format warm-up with ``warmup_adapter="continue"`` and a
            backend of ``WARMUP_RELOAD_BACKENDS`` (``unsloth``: pass ``"merge"``) or with
            ``n_questions`` > 60 (its questions would overlap),
            ``skip_first`` < 0 (all checked before any step runs).
        TypeError: ``settings`` is not a :class:`~nbhelpers.config.GRPOSettings`, or a keyword
            that is neither one of train's nor a ``GRPOConfig`` field
            (:func:`check_config_overrides`, before anything loads).
        BackendNotInstalled: the backend's engine is missing, or ``flash_attention_4``'s
            (flash-attn-4) is (message names the extra; raised before anything loads).
        nbhelpers.models.ModelAssetsMissing: the model's assets are not fetched
            (``python -m nbhelpers fetch NAME``).
    """
    if not isinstance(settings, GRPOSettings):
        raise TypeError(f"settings={settings!r}: pass nbhelpers.config.GRPOSettings(...).")
    check_config_overrides(config_overrides)
    check_attn_implementation(attn_implementation, backend)  # before anything loads or launches
    _check_compile_words(compile_mode, compile_dynamic, compile_scope, backend)
    opts = {k: v for k, v in locals().items()
            if k not in ("model_name", "settings", "config_overrides")}
    if num_processes != 1 or vllm_mode != "colocate":
        from nbhelpers.grpo import distributed
        return distributed.launch(model_name, settings, opts, config_overrides)
    return _train_local(model_name, settings, opts, config_overrides)


def _check_compile_words(mode: Any, dynamic: Any, scope: Any, backend: str) -> None:
    """The compile keywords checked before a local run or a multi-process launch (each raises
    ``ValueError`` naming its choices)."""
    from nbhelpers.grpo import compile_report
    compile_report.check_compile_mode(mode)
    compile_report.compile_dynamic_flag(dynamic)
    compile_report.resolve_compile_scope(scope, backend)


def check_config_overrides(config_overrides: dict[str, Any]) -> None:
    """Raise ``TypeError`` for a :func:`train` keyword that is no ``trl.GRPOConfig`` field, before
    anything loads; the message names the closest name and where it goes (a keyword of
    :func:`train`, a :class:`~nbhelpers.config.GRPOSettings` field, or a ``GRPOConfig`` field).
    Without trl installed nothing is checked (the run then fails on the import itself)."""
    if not config_overrides:
        return
    try:
        from trl import GRPOConfig
    except ImportError:
        return
    import dataclasses
    import inspect
    config = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    if not (unknown := sorted(set(config_overrides) - config)):
        return
    own = [n for n, p in inspect.signature(train).parameters.items()
           if p.kind is p.KEYWORD_ONLY]
    groups = ((own, "a keyword of train(): train(..., {}=...)"),
              ([f.name for f in dataclasses.fields(GRPOSettings)],
               "a GRPOSettings field: settings=GRPOSettings(..., {}=...)"),
              (sorted(config), "a trl.GRPOConfig field: train(..., {}=...)"))
    hints = "".join(f" {h}" for h in (_closest(n, groups) for n in unknown) if h)
    raise TypeError(f"train: unknown keyword(s) {unknown}.{hints} train() takes its own keywords "
                    f"{own}; run settings go in GRPOSettings(...); any other keyword must be a "
                    "trl.GRPOConfig field (dataclasses.fields(trl.GRPOConfig)), passed on to "
                    "GRPOConfig as an override.")


def _closest(name: str, groups: tuple[tuple[list[str], str], ...]) -> str:
    """Where ``name`` (or its closest match, ``difflib``) belongs, first group first; ``""`` if
    nowhere."""
    import difflib
    for names, where in groups:
        if name in names:
            return f"{name!r} is {where.format(name)}."
    for names, where in groups:
        if close := difflib.get_close_matches(name, names, n=1, cutoff=0.75):
            return f"{name!r}: did you mean {close[0]!r}, {where.format(close[0])}?"
    return ""


def _train_local(model_name: str, settings: GRPOSettings, opts: dict[str, Any],
                 config_overrides: dict[str, Any], hooks: Any = None) -> GRPOResult:
    """:func:`train` in this process (``opts``: its keyword arguments). ``hooks`` (per-rank
    probes, :mod:`nbhelpers.grpo.distributed`) gets ``.plan(plan)`` before the trainer is built
    and ``.trainer(trainer)`` after."""
    from nbhelpers.grpo import compile_report
    compile_mode = compile_report.check_compile_mode(opts["compile_mode"])
    dynamic = compile_report.compile_dynamic_flag(opts.get("compile_dynamic"))
    scope = compile_report.resolve_compile_scope(opts.get("compile_scope"), opts["backend"])
    _check_warmup(opts["format_warmup_steps"], opts["warmup_adapter"], opts["backend"],
                  opts["skip_first"])
    attn = check_attn_implementation(opts.get("attn_implementation"), opts["backend"])
    plan = plan_backend(opts["backend"], settings, vllm_sleep_mode=opts["vllm_sleep_mode"],
                        vllm_gpu_memory_utilization=opts["vllm_gpu_memory_utilization"],
                        flex_options=dict(opts["flex_options"] or {}), attn_implementation=attn)
    if hooks is not None:
        hooks.plan(plan)
    model, tok, peft, train_ds, ds_stats, warm = _load_warmed(plan, model_name, settings, opts,
                                                               attn)
    loaded = loaded_attn(model)  # what transformers resolved (auto: sdpa for most models)
    sdpa_guard = _padding_sdpa_guard(settings, model, plan.notes)
    trainer, parts = _build_trainer(plan, model, tok, peft, train_ds, settings,
                                    opts["output_dir"], opts["progress"], opts["reward_funcs"],
                                    opts["callbacks"], config_overrides)
    if hooks is not None:
        hooks.trainer(trainer)
    if scope == "layers" and compile_report.decoder_layers(trainer.model) is None:
        scope = "backbone"  # what compile_trainer_models falls back to
        plan.notes.append("compile_scope 'layers': the model has no decoder-layer list "
                          "(.layers / .h), so its backbone is compiled as one graph")
    watch = compile_report.CompileWatch(compile_mode, dynamic=dynamic,
                                        scope=scope if compile_mode != "none" else None)
    _bind_callbacks(opts["callbacks"], parts, watch,
                    _run_config(parts["args"], settings) | {"attn_implementation": loaded,
                                                            "notes": plan.notes})
    with sdpa_guard:
        wall_s, compiled = _fit(trainer, watch, compile_mode, dynamic, scope,
                                timer=parts["stats"].timer)
    extra = {"notes": plan.notes, "compile_report": watch.report() | {"compiled": compiled},
             "flex_generate_s": list(plan.rollout.generate_s) if plan.rollout else None,
             "format_warmup": warm or None,
             "warmup_adapter": opts["warmup_adapter"] if warm else None,
             "attn_implementation": loaded}
    return _result(model_name, plan, trainer, parts, settings, ds_stats, wall_s,
                   opts["skip_first"], extra, warm)


def _load_warmed(plan: BackendPlan, model_name: str, settings: GRPOSettings,
                 opts: dict[str, Any], attn: str | None
                 ) -> tuple[Any, Any, Any, Any, dict[str, Any], dict[str, Any]]:
    """``(model, tokenizer, peft_config, train_dataset, dataset_stats, warm-up report or {})``:
    :func:`_load_inputs`, then :func:`_maybe_warmup` on that policy. A backend of
    ``WARMUP_RELOAD_BACKENDS`` (``unsloth``) with a warm-up gets the plain HF policy
    (``load_policy`` of ``hf_generate``) for it; once the merged folder is saved that model is
    freed (the seconds it took are logged) and the backend's policy is loaded from the folder
    (module docstring)."""
    reload = bool(opts["format_warmup_steps"]) and plan.backend in WARMUP_RELOAD_BACKENDS
    model, tok, peft, train_ds, ds_stats = _load_inputs(
        BackendPlan("hf_generate") if reload else plan, model_name, settings, opts["dataset"],
        opts["n_questions"], attn)
    model, peft, warm = _maybe_warmup(model, tok, peft, settings, opts, train_ds)
    if reload:
        from nbhelpers import data
        from nbhelpers.backends import _common
        from nbhelpers.grpo import setup
        t0 = time.perf_counter()
        del model  # the last reference: the warmed HF policy's memory goes back before Unsloth's
        _common.free_device_memory()
        log.info("format warm-up: the warmed HF policy freed in %.1f s; %s loads its policy from "
                 "%s", time.perf_counter() - t0, plan.backend, warm["model_folder"])
        model, tok, peft = load_policy(plan.backend, model_name, settings, setup.is_cuda(),
                                       attn_implementation=attn, folder=warm["model_folder"])
        data.apply_reference_chat_template(tok)
    return model, tok, peft, train_ds, ds_stats, warm


def _maybe_warmup(model: Any, tok: Any, peft: Any, settings: GRPOSettings, opts: dict[str, Any],
                  train_ds: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, peft_config, warm-up report or {})``: :func:`_format_warmup` when asked, then
    for a backend of ``WARMUP_FOLDER_BACKENDS`` the warmed folder, named by the report's
    ``model_folder`` (and ``vllm_model_folder`` for ``vllm``; both ``None`` where no folder is
    written: module docstring)."""
    if not opts["format_warmup_steps"]:
        return model, peft, {}
    out = Path(opts["output_dir"]) / "format_warmup"
    model, peft, warm = _format_warmup(model, tok, settings, opts["format_warmup_steps"],
                                       opts["n_questions"], train_ds[0]["prompt"][-1]["content"],
                                       out, opts["warmup_adapter"])
    folder = None
    if opts["backend"] in WARMUP_FOLDER_BACKENDS:
        folder = str(_warm_folder(model, tok, out))
    warm["model_folder"] = folder
    warm["vllm_model_folder"] = folder if opts["backend"] == "vllm" else None
    return model, peft, warm


def _warm_folder(model: Any, tok: Any, out: Path) -> Path:
    """Save the warmed policy, adapter merged in, under ``out`` and point ``model`` at it.

    ``out / "merged"`` (``merged_rank<RANK>`` when ``WORLD_SIZE`` > 1: ranks share ``out``).
    """
    from nbhelpers.grpo import sft_warmup
    world = int(os.environ.get("WORLD_SIZE", "1"))
    name = "merged" if world <= 1 else f"merged_rank{os.environ.get('RANK', '0')}"
    t0 = time.perf_counter()
    folder = sft_warmup.save_merged_folder(model, tok, out / name)
    point_policy_at(model, folder)
    log.info("format warm-up: merged weights saved to %s in %.1f s; the backend's policy "
             "(vLLM's engine, Unsloth's model) starts from there", folder,
             time.perf_counter() - t0)
    return folder


def _padding_sdpa_guard(settings: GRPOSettings, model: Any, notes: list[str]) -> Any:
    """The context the trainer runs in: for ``pad_to_multiple_of`` on a CUDA policy, SDPA
    without its cuDNN backend (flash, memory-efficient and math stay allowed,
    ``torch.nn.attention.sdpa_kernel``), with a run note; else a no-op context.

    Why: on an H100 (2026-12-07, step ``t19``, ``scripts/device/pad_nan_train_probe.py`` under
    ``torch.autograd.detect_anomaly``) the padded tiny-llama bf16 GRPO runs of both
    ``hf_generate`` and ``flex`` failed in ``ScaledDotProductCudnnAttentionBackward0``, which
    returned NaN in its first output (the query gradient); the padded lengths (multiples of 64)
    are what made SDPA pick cuDNN there. With cuDNN excluded the same runs trained with finite
    gradients, within bf16 noise of the unpadded runs (grad norm 0.20417 vs 0.20414 at step 1)."""
    import contextlib
    param = next(iter(model.parameters()), None)
    if not (settings.pad_to_multiple_of and param is not None and param.is_cuda):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    notes.append(f"pad_to_multiple_of={settings.pad_to_multiple_of} on CUDA: SDPA runs without "
                 "its cuDNN backend (its backward returned NaN query gradients for these padded "
                 "batches on an H100, 2026-12-07)")
    log.info(notes[-1])
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def _fit(trainer: Any, watch: Any, compile_mode: str, dynamic: bool | None = None,
         scope: str = "backbone", timer: Any = None) -> tuple[float, Any]:
    """``(wall seconds, compiled models)`` of ``trainer.train()`` under the compile ``watch``;
    ``timer`` (the run's :class:`~nbhelpers.grpo.step_timing.StepTimer`) is closed after it, a
    failed run included, so no ``gc.callbacks`` hook outlives the run."""
    from nbhelpers.grpo.compile_report import compile_trainer_models
    t0 = time.perf_counter()
    try:
        with watch:
            compiled = compile_trainer_models(trainer, compile_mode, dynamic=dynamic,
                                              scope=scope)
            trainer.train()
    finally:
        if timer is not None:
            timer.close()
    return time.perf_counter() - t0, compiled


def _check_warmup(steps: int, adapter: str, backend: str, skip_first: int = 0) -> None:
    """Raise ``ValueError`` (naming the fix) before anything loads for ``skip_first`` or
    ``format_warmup_steps`` not an int >= 0 (a bool is not one), a ``warmup_adapter`` outside ``WARMUP_ADAPTERS``, a
    warm-up with a backend outside ``WARMUP_BACKENDS``, or one with a backend of
    ``WARMUP_RELOAD_BACKENDS`` (``unsloth``) and ``warmup_adapter`` other than ``"merge"``."""
    if not isinstance(skip_first, int) or isinstance(skip_first, bool) or skip_first < 0:
        raise ValueError(f"skip_first={skip_first!r}: must be an int >= 0 (warm-up steps left "
                         "out of the summary's medians).")  # checked before any step runs
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        # a float passed this check and failed ~20 s later inside transformers' Trainer, a str
        # raised a bare TypeError here, True ran one step (helper-19's trial, 2026-12-07)
        raise ValueError(f"format_warmup_steps={steps!r}: must be an int >= 0 (SFT steps of "
                         "the format warm-up; 0: none), e.g. format_warmup_steps=60.")
    if adapter not in WARMUP_ADAPTERS:
        raise ValueError(f"warmup_adapter={adapter!r}: use one of {WARMUP_ADAPTERS}.")
    if steps and backend not in WARMUP_BACKENDS:
        raise ValueError(f"format_warmup_steps={steps} with backend={backend!r}: the warm-up runs "
                         f"for backends {WARMUP_BACKENDS}; for {backend!r} pass "
                         "format_warmup_steps=0 (or a warmed model folder as model).")
    if steps and backend in WARMUP_RELOAD_BACKENDS and adapter != "merge":
        raise ValueError(f"format_warmup_steps={steps} with backend={backend!r} and "
                         f"warmup_adapter={adapter!r}: {backend} loads its own model class from "
                         "the warmed weights saved with the adapter merged in, so there is no "
                         "warm-up adapter to continue; pass warmup_adapter='merge' (phase 2's) "
                         "or format_warmup_steps=0.")


def _load_inputs(plan: BackendPlan, model_name: str, settings: GRPOSettings, dataset: str,
                 n_questions: int, attn_implementation: str | None = None
                 ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """``(model, tokenizer, peft_config, train_dataset, dataset_stats)`` for one run. The
    questions load and the prompts are filtered by ``max_prompt_length`` (with the model's
    tokenizer alone) before the weights are read, so a dataset that cannot load (``dapo_math``
    offline) or a ``max_prompt_length`` no prompt fits fails in seconds (before, the latter
    failed after the model had loaded: helper-15's trial, 2026-12-07). The rows hold text, so
    the dataset built with that tokenizer is the one the trainer gets."""
    from nbhelpers import data, models
    from nbhelpers.grpo import setup
    questions = setup.load_questions(dataset, n_questions, settings.seed)
    pre_tok = models.load_tokenizer(model_name)
    data.apply_reference_chat_template(pre_tok)
    train_ds, ds_stats = build_dataset(dataset, pre_tok, n_questions, settings.max_prompt_length,
                                       settings.seed, questions=questions)
    model, tok, peft = load_policy(plan.backend, model_name, settings, setup.is_cuda(),
                                   attn_implementation=attn_implementation)
    data.apply_reference_chat_template(tok)
    return model, tok, peft, train_ds, ds_stats


def _format_warmup(model: Any, tok: Any, settings: GRPOSettings, steps: int, n_questions: int,
                   probe_question: str, output_dir: Path,
                   adapter: str) -> tuple[Any, Any, dict[str, Any]]:
    """The format warm-up of :func:`train` (docstring there): ``(model, peft_config for GRPO or
    None to continue the model's adapter, report)``; the report is
    :func:`nbhelpers.grpo.sft_warmup.format_warmup`'s (``steps``, ``wall_s``, ``losses``,
    ``before``/``after`` probe completions)."""
    from peft import get_peft_model

    from nbhelpers.grpo import sft_warmup
    rows = sft_warmup.sft_rows(n_questions)
    peft_model = get_peft_model(model, peft_config(settings.lora))
    report = sft_warmup.format_warmup(peft_model, tok, rows, steps, output_dir=str(output_dir),
                                      seed=settings.seed, probe_question=probe_question,
                                      max_new_tokens=settings.max_completion_length)
    log.info("format warm-up: %d SFT steps in %.1f s (%s)", steps, report["wall_s"], adapter)
    if adapter == "continue":
        return peft_model, None, dict(report)  # GRPOTrainer keeps training it (and copies a ref)
    merged = peft_model.merge_and_unload()
    merged.train()
    return merged, peft_config(settings.lora), dict(report)


def _build_trainer(plan: BackendPlan, model: Any, tok: Any, peft: Any, train_ds: Any,
                   settings: GRPOSettings, output_dir: Any, progress: bool,
                   reward_funcs: Any, callbacks: Sequence[Any],
                   config_overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from nbhelpers.grpo import rewards
    from nbhelpers.grpo.callbacks import CompletionRecorder, StatisticsCallback
    from nbhelpers.grpo.step_timing import StepTimer
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
    stats.timer = StepTimer().install(trainer)
    return trainer, {"args": args, "stats": stats, "recorder": recorder}


def _run_config(args: Any, settings: GRPOSettings) -> dict[str, Any]:
    """The GRPOConfig values a result records (``_CONFIG_KEYS``) and the LoRA block."""
    return {k: getattr(args, k, None) for k in _CONFIG_KEYS} | {"lora": asdict(settings.lora)}


def _bind_callbacks(callbacks: Sequence[Any], parts: dict[str, Any], watch: Any,
                    config: dict[str, Any]) -> None:
    """Give each extra callback with a ``bind_run`` (:class:`~nbhelpers.grpo.progress.
    ProgressWriter`) the run's statistics callback, compile watch and config, before step 1."""
    for cb in callbacks:
        bind = getattr(cb, "bind_run", None)
        if callable(bind):
            bind(stats=parts["stats"], watch=watch, config=config,
                 max_steps=getattr(parts["args"], "max_steps", None))


def _result(model_name: str, plan: BackendPlan, trainer: Any, parts: dict[str, Any],
            settings: GRPOSettings, ds_stats: dict[str, Any], wall_s: float, skip_first: int,
            extra: dict[str, Any], warm: dict[str, Any]) -> GRPOResult:
    args, stats = parts["args"], parts["stats"]
    config = _run_config(args, settings)
    return GRPOResult(
        model_name=model_name, backend=plan.backend, records=stats.records,
        summary=stats.summary(skip_first), completions=parts["recorder"].rows,
        log_history=list(trainer.state.log_history), reward_names=list(trainer.reward_func_names),
        dataset_stats=dict(ds_stats), config=config | extra, wall_s=wall_s, format_warmup=warm)
