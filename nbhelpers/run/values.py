"""Value checks of notebook parameters that the type check cannot make, run before anything is
launched, so a bad value fails in a second, not after a run.

Contract: :func:`check_values` raises :class:`~nbhelpers.run.params.UserInputError` for the first
bad value, naming where it came from (``-p NAME`` or ``configs/<stem>.<profile>.yaml``) and what
is accepted. Parameters that are fields of a config dataclass are checked by that dataclass
itself (one source of truth: :mod:`nbhelpers.config`'s ``__post_init__``): the notebook's phase,
from its folder (:func:`nbhelpers.run.phases.phase_of`), picks the dataclasses its notebooks build
from their parameters (:data:`CONFIG_FIELDS`), and each mapped parameter is put into its field
and the dataclass constructed. So ``num_generations`` must be >= 2 in phases 0 and 2
(``GRPOSettings``) and >= 1 in phase 3 (``SamplingParams.n``). Count parameters no dataclass
holds have their lower bound in :data:`NOTEBOOK_MINIMA`; every float parameter is finite, and a
few have a range (:data:`NOTEBOOK_RANGES`). ``model`` must be a registry name / hub
id / folder, ``dataset`` one of ``nbhelpers.grpo.setup.DATASETS``, ``backends`` known to the
phase (each once), phase 1's ``engine_options`` keyed by backends of the run
(:func:`_check_engine_options`), ``n_questions`` <= the GSM8K questions left after a format warm-up,
a format warm-up only with backends that run it (``nbhelpers.grpo.plans.WARMUP_BACKENDS``: every
GRPO backend, ``unsloth`` included; :func:`_check_warmup_backends`), phase 2's
``attn_implementation`` one of ``nbhelpers.grpo.plans.ATTN_IMPLEMENTATIONS`` and, unless
``auto``, only with backends of ``ATTN_BACKENDS`` (:func:`_check_attn`), ``compile_mode`` /
``compile_dynamic`` / ``compile_scope`` one of their words (:mod:`nbhelpers.grpo.compile_report`;
``compile_scope`` also against each named backend) and ``flex_compile_attention`` one of
``auto | on | off``, a ``model`` folder one that holds a ``config.json``, the GRPO phases'
prompt + completion limits within the model's context (:func:`model_context`), each
``reuse_runs`` path a readable phase-2 sidecar of its backend that did not fail
(:func:`nbhelpers.grpo.compare_records.check_reusable`; whether its settings match this run is
checked in the notebook, which knows the model and device), ``output_dir`` a folder that exists
or can be created, not a file (:func:`nbhelpers.run.path_checks.check_output_dir`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbhelpers.config import GRPOSettings, LoraSpec, SamplingParams, Workload
from nbhelpers.run.errors import UserInputError
from nbhelpers.run.path_checks import check_output_dir
from nbhelpers.run.phases import phase_of


@dataclass(frozen=True)
class FieldMap:
    """Notebook parameters that one config dataclass holds.

    Attributes:
        config: the dataclass (validates itself in ``__post_init__``).
        fields: ``{notebook parameter: dataclass field}``.
        off: ``{parameter: value}`` meaning the notebook builds no such dataclass (phase 1's
            ``lora_rank=0``: no adapter), so that value is not checked.
    """

    config: type
    fields: dict[str, str]
    off: dict[str, Any] = field(default_factory=dict)


def _same(*names: str) -> dict[str, str]:
    return {n: n for n in names}


_GRPO = (FieldMap(GRPOSettings, _same(
             "max_steps", "num_generations", "per_device_train_batch_size", "max_prompt_length",
             "max_completion_length", "learning_rate", "beta", "seed", "pad_to_multiple_of",
             "gradient_accumulation_steps")),
         FieldMap(LoraSpec, {"lora_rank": "rank", "lora_alpha": "alpha"}))
_WORKLOAD = _same("prompt_tokens", "max_new_tokens", "rounds", "warmup_rounds")
CONFIG_FIELDS: dict[str, tuple[FieldMap, ...]] = {
    "phase0": _GRPO,
    "phase1": (FieldMap(Workload, {**_WORKLOAD, **_same("n_prompts", "sampling")}),
               FieldMap(LoraSpec, {"lora_rank": "rank"}, off={"lora_rank": 0})),
    "phase2": _GRPO,
    "phase3": (FieldMap(SamplingParams, {"num_generations": "n",
                                         "max_new_tokens": "max_new_tokens"}),
               FieldMap(Workload, _WORKLOAD), FieldMap(LoraSpec, {"lora_rank": "rank"})),
}
"""Per phase, what its notebooks' derived-values cells build (``scripts/make_*notebooks.py``):
``GRPOSettings(..., lora=LoraSpec(rank=lora_rank, alpha=lora_alpha))`` in phases 0 and 2,
``Workload`` + ``LoraSpec(rank=lora_rank, alpha=2 * lora_rank) if lora_rank > 0`` in phase 1,
``SamplingParams(n=num_generations, max_new_tokens=...)``, ``Workload`` and ``LoraSpec`` in
phase 3."""

NOTEBOOK_MINIMA = {"n_questions": 1, "n_prompts": 1, "parity_prompts": 1, "parity_steps": 1,
                   "skip_first": 0, "format_warmup_steps": 0, "cpu_threads": 0}
"""Lower bounds of count parameters that no config dataclass holds (``skip_first >= max_steps``
is allowed: the summary then notes that no post-warm-up step is left; ``cpu_threads`` 0 =
torch's default)."""

NOTEBOOK_RANGES = {"vllm_gpu_memory_utilization": (0.0, 1.0), "timeout_s": (0.0, math.inf),
                   "bandwidth_tb_s": (0.0, math.inf)}
"""``(low, high]`` of float parameters that no config dataclass holds (every float parameter
must also be finite: :func:`_check_floats`)."""

NOTEBOOK_COUNT_LISTS = {"batch_sizes": (1, 512), "batches": (1, 512)}
"""List parameters of counts (34's ``batch_sizes``, 33's ``batches``): non-empty, each entry an
int in ``[low, high]``, each once (512: the flex engine's largest decode batch, ``LLM``'s
``max_num_seqs`` bound and ``bench.flex_configs.sweep_settings``')."""

Where = Callable[[str], str]


def _build(fmap: FieldMap, values: dict[str, Any], where: Where) -> None:
    """Construct ``fmap.config`` from ``values`` (``{parameter: value}``), one field at a time
    (so the error names the parameter that is wrong), then all together (cross-field checks)."""
    def construct(names: list[str]) -> None:
        try:
            fmap.config(**{fmap.fields[n]: values[n] for n in names})
        except (TypeError, ValueError) as exc:
            renamed = [f"{n} is {fmap.config.__name__}.{fmap.fields[n]}" for n in names
                       if n != fmap.fields[n]]
            note = f" ({', '.join(renamed)})" if renamed else ""
            raise UserInputError(f"{', '.join(where(n) for n in names)}: {exc}{note}") from exc

    for name in values:
        construct([name])
    construct(list(values))


def check_config_fields(params: dict[str, Any], notebook: Path, where: Where) -> None:
    """Check every parameter that a config dataclass of ``notebook``'s phase holds (see module).

    Raises:
        UserInputError: the dataclass's own message, prefixed by where the value came from.
    """
    for fmap in CONFIG_FIELDS.get(phase_of(notebook) or "", ()):
        values = {n: params[n] for n in fmap.fields if n in params}
        if any(n in values and values[n] == v for n, v in fmap.off.items()):
            continue
        if values:
            _build(fmap, values, where)


def _check_minima(params: dict[str, Any], notebook: Path, where: Where) -> None:
    held = {n for fmap in CONFIG_FIELDS.get(phase_of(notebook) or "", ()) for n in fmap.fields}
    for name, low in NOTEBOOK_MINIMA.items():
        value = params.get(name)
        if name not in held and isinstance(value, int) and not isinstance(value, bool) \
                and value < low:
            raise UserInputError(f"{where(name)}: {name}={value} must be >= {low}.")


def _check_count_lists(params: dict[str, Any], where: Where) -> None:
    """:data:`NOTEBOOK_COUNT_LISTS`: refused before the notebook runs (an empty or negative
    batch list otherwise fails minutes in, with an internal field's name)."""
    for name, (low, high) in NOTEBOOK_COUNT_LISTS.items():
        value = params.get(name)
        if not isinstance(value, list):
            continue  # the type check against the parameters cell names a non-list
        bad = [v for v in value
               if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high]
        if not value or bad or len(set(value)) != len(value):
            what = ("is empty" if not value else f"has {bad}" if bad else "repeats an entry")
            raise UserInputError(f"{where(name)}: {name}={value} {what}: give a non-empty list "
                                 f"of distinct ints in [{low}, {high}], e.g. [4, 8].")


def _check_floats(params: dict[str, Any], where: Where) -> None:
    """No float parameter is NaN or infinite (a tolerance of NaN fails every claim, an inf
    limit disables it silently); :data:`NOTEBOOK_RANGES` bounds a few more."""
    for name, value in params.items():
        if not isinstance(value, float):
            continue
        low, high = NOTEBOOK_RANGES.get(name, (-math.inf, math.inf))
        if math.isfinite(value) and low < value <= high:
            continue
        span = "" if name not in NOTEBOOK_RANGES else (
            f" in ({low:g}, {high:g}]" if high < math.inf else f" > {low:g}")
        raise UserInputError(f"{where(name)}: {name}={value}: must be a finite number{span}.")


def _check_model_and_dataset(params: dict[str, Any], where: Where) -> None:
    if isinstance(params.get("model"), str):
        from nbhelpers.models import REGISTRY, get_spec
        try:
            get_spec(params["model"])
        except ValueError as exc:
            raise UserInputError(f"{where('model')}: {exc}") from exc
        folder = Path(params["model"]).expanduser()
        if params["model"] not in REGISTRY and folder.is_dir() \
                and not (folder / "config.json").is_file():
            raise UserInputError(f"{where('model')}: model={params['model']!r} is a folder "
                                 "without a config.json, so not a Hugging Face model folder: "
                                 "give the folder that holds config.json and the weights, a "
                                 "hub id 'org/name' or a registry name.")
    if isinstance(params.get("dataset"), str):
        from nbhelpers.grpo.setup import DATASETS
        if params["dataset"] not in DATASETS:
            raise UserInputError(f"{where('dataset')}: dataset={params['dataset']!r}: use one "
                                 f"of {DATASETS}.")


def model_context(model: str) -> int | None:
    """``max_position_embeddings`` of ``model``'s (text) config without loading weights
    (:func:`nbhelpers.engine.llm_checks.model_context_len`): the registry's config builder for
    random-weight entries, ``config.json`` of the converted SmolLM2 folder or of a local model
    folder; ``None`` when it cannot be known here (a hub id, SmolLM2 not converted yet, a config
    without the key)."""
    import json
    from types import SimpleNamespace

    from nbhelpers import assets
    from nbhelpers.engine.llm_checks import model_context_len
    from nbhelpers.models import REGISTRY
    entry = REGISTRY.get(model)
    if entry is not None and entry.config_builder is not None:
        return model_context_len(entry.config_builder())
    try:
        folder = assets.smollm2_folder() if entry is not None else Path(model).expanduser()
        raw = json.loads((folder / "config.json").read_text())
    except (assets.ModelAssetsMissing, OSError, ValueError):
        return None
    text = raw.get("text_config", raw) if isinstance(raw, dict) else None
    return model_context_len(SimpleNamespace(**text)) if isinstance(text, dict) else None


def _check_context(params: dict[str, Any], notebook: Path, where: Where) -> None:
    """GRPO phases: ``max_prompt_length + max_completion_length`` within the model's context
    (:func:`model_context`): a longer completion limit was accepted and trained until the
    model's position table ran out (a new user's trial, 2026-12-07)."""
    if phase_of(notebook) not in ("phase0", "phase2") or not isinstance(params.get("model"), str):
        return
    prompt, completion = params.get("max_prompt_length"), params.get("max_completion_length")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (prompt, completion)):
        return
    context = model_context(params["model"])
    if context is not None and prompt + completion > context:
        raise UserInputError(
            f"{where('max_completion_length')}: max_prompt_length + max_completion_length = "
            f"{prompt} + {completion} = {prompt + completion} tokens exceeds {params['model']}'s "
            f"context of {context} (config max_position_embeddings): lower "
            f"max_completion_length to <= {max(context - prompt, 0)} or max_prompt_length.")


def _check_questions(params: dict[str, Any], where: Where) -> None:
    """``n_questions`` within the offline GSM8K source, and apart from the warm-up's rows."""
    from nbhelpers.grpo.sft_warmup import N_GSM8K, N_SFT_ROWS
    n_q, grpo_max = params.get("n_questions"), N_GSM8K - N_SFT_ROWS
    if params.get("dataset", "gsm8k") == "gsm8k" and isinstance(n_q, int) and n_q > N_GSM8K:
        raise UserInputError(f"{where('n_questions')}: n_questions={n_q}: the offline GSM8K "
                             f"source ships {N_GSM8K} questions; use <= {N_GSM8K}, or -p dataset "
                             "gsm_symbolic (generated) for more.")
    if isinstance(n_q, int) and params.get("format_warmup_steps") and n_q > grpo_max:
        raise UserInputError(f"{where('n_questions')}: n_questions={n_q} with a format warm-up: "
                             f"GRPO's questions would overlap the warm-up's (the last {N_SFT_ROWS} "
                             f"GSM8K questions); use <= {grpo_max} or -p format_warmup_steps 0.")


def _check_backends(params: dict[str, Any], notebook: Path, where: Where) -> None:
    """Phase 2 names GRPO trainers (``grpo.setup.BACKENDS``), the others rollout backends."""
    from nbhelpers.grpo.setup import BACKENDS as GRPO
    if isinstance(params.get("backends"), list):
        from nbhelpers.backends import BACKENDS as ROLLOUT
        known = GRPO if phase_of(notebook) == "phase2" else ROLLOUT
        if not params["backends"]:
            raise UserInputError(f"{where('backends')}: backends=[]: name at least one of "
                                 f"{known}.")
        if bad := [b for b in params["backends"] if b not in known]:
            raise UserInputError(f"{where('backends')}: unknown backend(s) {bad}: use {known}.")
        if twice := sorted({b for b in params["backends"] if params["backends"].count(b) > 1}):
            raise UserInputError(f"{where('backends')}: backends={params['backends']} names "
                                 f"{twice} more than once: give each backend once, e.g. "
                                 f"{list(dict.fromkeys(params['backends']))}.")
    ref = params.get("reference_backend")
    if isinstance(ref, str) and ref not in GRPO:  # a typo would skip every cross check
        raise UserInputError(f"{where('reference_backend')}: reference_backend={ref!r}: use one "
                             f"of {GRPO}.")


def _check_warmup_backends(params: dict[str, Any], notebook: Path, where: Where) -> None:
    """Phase 2 with ``format_warmup_steps`` > 0: every backend must run the warm-up
    (:data:`nbhelpers.grpo.plans.WARMUP_BACKENDS`, today every GRPO backend: ``vllm`` and
    ``unsloth`` start from the saved merged folder), else its row would fail after the other
    backends ran. ``unsloth`` takes ``warmup_adapter="merge"`` only, which is what phase 2 passes
    (``nbhelpers.grpo.compare.WARMUP_ADAPTER``; no notebook has a ``warmup_adapter`` parameter,
    and phase 0's runs ``hf_generate`` alone), so nothing more is checked here."""
    steps, backends = params.get("format_warmup_steps"), params.get("backends")
    if phase_of(notebook) != "phase2" or not steps or not isinstance(backends, list):
        return
    from nbhelpers.grpo.plans import WARMUP_BACKENDS
    if bad := [b for b in backends if b not in WARMUP_BACKENDS]:
        keep = [b for b in backends if b in WARMUP_BACKENDS]
        fix = f"-p backends '[{', '.join(keep)}]'" if keep else f"backends of {WARMUP_BACKENDS}"
        raise UserInputError(
            f"{where('backends')}, {where('format_warmup_steps')}: backends {bad} with "
            f"format_warmup_steps={steps}: the format warm-up runs for {WARMUP_BACKENDS} "
            f"only; drop {bad} ({fix}) or pass -p format_warmup_steps 0.")


def _check_attn(params: dict[str, Any], notebook: Path, where: Where) -> None:
    """Phase 2's ``attn_implementation``: one of its words, and a word other than ``auto`` only
    with backends whose HF policy it sets (:data:`nbhelpers.grpo.plans.ATTN_BACKENDS`: not
    ``unsloth``, whose row would fail after the others ran). Whether this host can run
    ``flash_attention_4`` is :func:`nbhelpers.run.host_checks.check_attn_host`'s."""
    attn, backends = params.get("attn_implementation"), params.get("backends")
    if phase_of(notebook) != "phase2" or not isinstance(attn, str):
        return
    from nbhelpers.grpo.plans import ATTN_BACKENDS, ATTN_IMPLEMENTATIONS
    if attn not in ATTN_IMPLEMENTATIONS:
        raise UserInputError(f"{where('attn_implementation')}: attn_implementation={attn!r}: "
                             f"use one of {ATTN_IMPLEMENTATIONS}.")
    bad = [b for b in backends if b not in ATTN_BACKENDS] if isinstance(backends, list) else []
    if attn != "auto" and bad:
        keep = [b for b in backends if b in ATTN_BACKENDS]
        fix = f"-p backends '[{', '.join(keep)}]'" if keep else f"backends of {ATTN_BACKENDS}"
        raise UserInputError(
            f"{where('backends')}, {where('attn_implementation')}: backends {bad} with "
            f"attn_implementation={attn!r}: {bad} load their own model class and attention; "
            f"drop {bad} ({fix}) or pass -p attn_implementation auto.")


def _check_engine_options(params: dict[str, Any], sources: dict[str, str], notebook: Path,
                          where: Where) -> None:
    """Phase 1's ``engine_options`` maps a backend to its options (``{backend: {option:
    value}}``): every key must be a rollout backend and every value a mapping, and a key given
    with ``-p engine_options`` must be a backend of this run (a config file may hold options
    for backends that a ``-p backends`` override leaves out: the H200 sweep runs in parts)."""
    opts = params.get("engine_options")
    if phase_of(notebook) != "phase1" or not isinstance(opts, dict):
        return
    from nbhelpers.backends import BACKENDS
    run = params.get("backends") if isinstance(params.get("backends"), list) else None
    from_cli = sources.get("engine_options", "").startswith("-p")
    allowed = run if from_cli and run is not None else list(BACKENDS)
    form = ("engine_options maps a backend to its options, e.g. -p engine_options "
            "'{vllm: {gpu_memory_utilization: 0.5}}'")
    for key, value in opts.items():
        if key not in allowed:
            what = (f"not a backend of this run ({run})" if key in BACKENDS
                    else f"not a backend ({list(BACKENDS)})")
            raise UserInputError(f"{where('engine_options')}: key {key!r} is {what}, so its "
                                 f"options would be ignored: {form}.")
        if not isinstance(value, dict):
            raise UserInputError(f"{where('engine_options')}: engine_options[{key!r}]={value!r}"
                                 f" is not a mapping of options: {form}.")


def _check_compile(params: dict[str, Any], where: Where) -> None:
    from nbhelpers.grpo.compile_report import (
        check_compile_mode,
        compile_dynamic_flag,
        resolve_compile_scope,
    )
    backends = params.get("backends")
    backends = [b for b in backends if isinstance(b, str)] if isinstance(backends, list) else []

    def check_scope(word: str) -> None:  # per backend: 'layers' is refused for KV-cache ones
        for backend in backends or [""]:
            resolve_compile_scope(word, backend)

    def check_flex_attention(word: str) -> None:  # phase 2's flex_compile_attention
        from nbhelpers.grpo.compare import flex_options
        flex_options(compile_attention=word)

    for name, check in (("compile_mode", check_compile_mode),
                        ("compile_dynamic", compile_dynamic_flag),
                        ("compile_scope", check_scope),
                        ("flex_compile_attention", check_flex_attention)):
        if isinstance(params.get(name), str):
            try:
                check(params[name])
            except ValueError as exc:
                raise UserInputError(f"{where(name)}: {exc}") from exc


def _check_reuse_runs(params: dict[str, Any], where: Where, repo: Path) -> None:
    """Each ``reuse_runs`` ``{backend: path}`` entry names a GRPO backend and a readable phase-2
    sidecar of it (:func:`nbhelpers.grpo.compare_records.check_reusable`; relative paths from
    ``repo``, the notebook's working directory), so a bad path fails here, not after setup."""
    reuse = params.get("reuse_runs")
    if not isinstance(reuse, dict):
        return
    from nbhelpers.grpo.compare_records import check_reusable
    from nbhelpers.grpo.setup import BACKENDS
    for backend, path in reuse.items():
        if backend not in BACKENDS or not isinstance(path, (str, Path)):
            raise UserInputError(f"{where('reuse_runs')}: reuse_runs={{{backend!r}: {path!r}}}:"
                                 f" map a backend of {BACKENDS} to the path of its earlier "
                                 "<run>__<backend>.json sidecar, e.g. -p reuse_runs "
                                 "'{flex: executed/phase2_grpo/20_grpo_equivalence/"
                                 "<run>__flex.json}'.")
        try:
            check_reusable(backend, path, repo)
        except ValueError as exc:
            raise UserInputError(f"{where('reuse_runs')}: {exc}") from exc


def check_values(params: dict[str, Any], sources: dict[str, str], notebook: Path,
                 repo: Path | None = None) -> None:
    """All the checks of the module docstring, in order; ``sources`` maps a parameter to where its
    value came from; ``repo``: the checkout the notebook runs in (its working directory; default
    the one three folders above ``notebook``).

    Raises:
        UserInputError: the first bad value, naming where it came from and what is accepted.
    """
    def where(name: str) -> str:
        return f"{sources.get(name, name)} ({notebook.name})"

    check_config_fields(params, notebook, where)
    _check_minima(params, notebook, where)
    _check_count_lists(params, where)
    _check_floats(params, where)
    _check_model_and_dataset(params, where)
    _check_context(params, notebook, where)
    _check_questions(params, where)
    _check_backends(params, notebook, where)
    _check_warmup_backends(params, notebook, where)
    _check_attn(params, notebook, where)
    _check_engine_options(params, sources, notebook, where)
    _check_compile(params, where)
    _check_reuse_runs(params, where, repo or notebook.resolve().parents[2])
    check_output_dir(params, where, repo or notebook.resolve().parents[2])
    from nbhelpers.run.host_checks import check_engine_options_param  # phase 3's flex options
    check_engine_options_param(params, phase_of(notebook), where)
