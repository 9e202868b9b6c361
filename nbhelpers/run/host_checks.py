"""Checks of a notebook's parameters against this host (:func:`check_host`, from the runner's
``plan_jobs``) and the engine's options (:func:`check_engine_options_param`, with the other value
checks of :func:`nbhelpers.run.values.check_values`), before any kernel starts, so a GPU-sized request on a CPU host or a bad flex option fails in a second with the fix
instead of minutes later inside the notebook (fresh-user trial, 2026-12-01: ``-p shape
qwen3-4b`` ran a random 4.0 B-parameter model for 356 s on 2 cores and was recorded ``ok``;
``-p device cuda`` and ``-p engine_options '{pdl: yes}'`` failed in cell 5).

- ``device`` (phase 3 notebooks: where the model runs) ``cuda``/``cuda:N`` needs CUDA here.
- A random-weight registry model (phases 1, 2 and 3) or 33's ``shape`` above
  :data:`CPU_PARAMS_LIMIT` parameters (the H200 workloads: qwen3-4b, llama-3.2-3b,
  gemma-4-e2b) needs CUDA here.
- Phase 1's and phase 2's ``backends`` ``vllm`` / ``unsloth`` (phase 1: their variants and
  ``hf_cb_fa4`` too) need CUDA here (:func:`check_cuda_backends`); phase 2's
  ``attn_implementation`` ``flash_attention_4`` needs CUDA and FlashAttention-4 here
  (:func:`check_attn_host`).
- ``29_compare``'s ``sidecar_dir`` holds phase-2 runs and its ``device`` matches one of them;
  ``19_compare``'s ``executed_dir`` holds phase-1 backend sidecars (:func:`check_compare_sidecars`).
- Phase 3's ``engine_options`` (flat :class:`~nbhelpers.engine.runner_options.RunnerOptions`
  overrides) pass :func:`nbhelpers.bench.flex_ab.check_engine_options` and 34's
  ``parity_engine_options`` :func:`check_parity_options` (any host); 33's
  ``variants`` / ``lora_modes`` pass its plan's checks on the host that runs it
  (:func:`check_flex_plan_params`), and so do phase 1's flex options
  (:func:`check_flex_backend_options`).
"""
from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbhelpers.run.errors import UserInputError
from nbhelpers.run.phases import is_compare, phase_of

CPU_PARAMS_LIMIT = 1_000_000_000
"""Largest random-weight model a CPU run accepts: the tiny test models and SmolLM2-135M pass,
the H200 shapes (3-5 B parameters) do not."""


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (imported lazily: only asked for GPU-sized requests)."""
    import torch
    return torch.cuda.is_available()


def check_engine_options_param(params: dict[str, Any], phase: str,
                               where: Callable[[str], str]) -> None:
    """Phase 3's flat ``engine_options`` (and 34's ``parity_engine_options``,
    :func:`check_parity_options`) through the engine's own option checks (any host:
    :func:`nbhelpers.run.values.check_values` calls it). Raises :class:`UserInputError`."""
    if phase != "phase3":
        return
    from nbhelpers.bench.flex_ab import check_engine_options
    for name, check in (("engine_options", check_engine_options),
                        ("parity_engine_options", check_parity_options)):
        opts = params.get(name)
        if not isinstance(opts, dict) or not opts:
            continue  # the type check names a non-dict
        try:
            check(opts, name)
        except (TypeError, ValueError) as exc:
            raise UserInputError(f"{where(name)}: {exc}") from exc


PARITY_SET = ("page_size", "num_pages", "max_model_len")
"""What notebook 34's :func:`nbhelpers.bench.gemma4_report.parity_llm` sets itself (page_size
from its own ``page_size`` parameter, the pool and the length from the prompts)."""


def check_parity_options(options: dict[str, Any], where: str) -> None:
    """Notebook 34's ``parity_engine_options`` (``LLM(**options)`` beside :data:`PARITY_SET`):
    ``LLM``'s own arguments and RunnerOptions fields only, each value through RunnerOptions'
    checks; a bad one failed in cell 11 after the models loaded, leaving a failed notebook and
    INDEX row (fresh-user trial, 2026-12-02: ``-p parity_engine_options '{pdl: Early}'``).

    Raises:
        ValueError: a name set by the notebook, an unknown name or a bad value.
    """
    from nbhelpers.engine.llm_checks import LLM_ARGS
    from nbhelpers.engine.runner_options import RunnerOptions, option_names
    if fixed := sorted(set(options) & set(PARITY_SET)):
        raise ValueError(f"{where}: {fixed} are set by the notebook (page_size: -p page_size; "
                         "the pool and max_model_len from the prompts); drop them.")
    known = (option_names() | set(LLM_ARGS)) - set(PARITY_SET)
    if unknown := sorted(set(options) - known):
        close = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
        hint = "".join(f" ({u!r}: did you mean {c[0]!r}?)" for u, c in close.items() if c)
        raise ValueError(f"{where}: unknown engine option(s) {unknown}{hint}; use "
                         f"{sorted(known)}.")
    try:
        RunnerOptions(**{k: v for k, v in options.items() if k in option_names()})
    except (TypeError, ValueError, ImportError) as err:
        raise ValueError(f"{where}: {err}") from err


def check_flex_plan_params(params: dict[str, Any], phase: str,
                           where: Callable[[str], str]) -> None:
    """Notebook 33's ``variants`` (each over ``engine_options``) and ``lora_modes`` through the
    checks its plan cell makes (:func:`nbhelpers.bench.flex_configs.plan_configs`), so a bad
    variant fails here instead of in cell 5 after the kernel started, with a failed notebook,
    sidecar and INDEX row written (fresh-user trial, 2026-12-02: ``-p variants '[{"name": "a",
    "options": {"sample_kernel": "Triton"}}]'``). Only the parameters given are checked (the
    notebook's own defaults are valid). Called from :func:`check_host`, where this host runs the
    notebook: a variant's options may need a package only the GPU host stages
    (``prefill_attention: fa4``, step ``f4b``), so a dry run's planning does not ask.
    Raises :class:`UserInputError`."""
    if phase != "phase3":
        return
    from nbhelpers.bench import flex_ab, flex_configs
    base = params.get("engine_options")
    checks = (("variants", lambda v: flex_ab.check_variants(
                  v, "variants", base if isinstance(base, dict) else None)),
              ("lora_modes", flex_configs.plan_configs))
    for name, check in checks:
        value = params.get(name)
        if not isinstance(value, list) or (name == "variants" and not value):
            continue  # the type check names a non-list; no variants: the notebook's 'default'
        try:
            check(value)
        except (TypeError, ValueError) as exc:
            raise UserInputError(f"{where(name)}: {exc}") from exc


def check_flex_backend_options(params: dict[str, Any], where: Callable[[str], str]) -> None:
    """Phase 1's ``engine_options["flex"]`` (the harness keys aside,
    :data:`nbhelpers.bench.rollout.HARNESS_KEYS`) through the flex backend's own checks
    (:func:`nbhelpers.backends.flex.check_engine_options`) when flex is a backend of the run: a
    bad value failed at the backend's load, and the notebook ran on to its last cell and wrote a
    failed notebook, sidecars and an INDEX row (fresh-user trial, 2026-12-02: ``-p backends
    '[flex]' -p engine_options '{flex: {sample_kernel: Triton}}'``, 29 s). On the host that runs
    it (a kernel's package may be missing only here). Raises :class:`UserInputError`."""
    opts, backends = params.get("engine_options"), params.get("backends")
    flex = opts.get("flex") if isinstance(opts, dict) else None
    if not isinstance(flex, dict) or (isinstance(backends, list) and "flex" not in backends):
        return
    from nbhelpers.backends.flex import check_engine_options
    from nbhelpers.bench.rollout import HARNESS_KEYS
    try:
        check_engine_options({k: v for k, v in flex.items() if k not in HARNESS_KEYS})
    except (TypeError, ValueError, ImportError) as exc:
        raise UserInputError(f"{where('engine_options')}: engine_options['flex']: {exc}") from exc


def check_cb_backend_options(params: dict[str, Any], where: Callable[[str], str]) -> None:
    """Phase 1's continuous-batching backends (``hf_cb``, ``cb_sync`` and their variants,
    :func:`nbhelpers.backends.resolve`): each one's variant defaults plus its
    ``engine_options[<backend>]`` (harness keys aside) through
    :func:`nbhelpers.backends.hf_cb.check_cb_options`, with CUDA as this host has it. A bad key
    or value (``use_cuda_graph: yes`` off CUDA, ``blok_size``) started a kernel and archived a
    failed run 15-20 s later (helper-16's trial, 2026-12-07). Raises :class:`UserInputError`."""
    opts, backends = params.get("engine_options"), params.get("backends")
    if not isinstance(backends, list):
        return
    opts = opts if isinstance(opts, dict) else {}
    from nbhelpers.backends import resolve
    from nbhelpers.backends.base import BackendNotInstalled
    from nbhelpers.backends.hf_cb import check_cb_options
    from nbhelpers.bench.rollout import HARNESS_KEYS
    for backend in backends:
        try:
            engine, defaults = resolve(backend)
        except ValueError:
            continue  # the value checks name an unknown backend
        given = opts.get(backend)
        if engine not in ("hf_cb", "cb_sync") or not isinstance(given, dict):
            continue
        merged = {**defaults, **{k: v for k, v in given.items() if k not in HARNESS_KEYS}}
        extra = frozenset({"watchdog_s"}) if engine == "cb_sync" else frozenset()
        try:
            check_cb_options(merged, backend, cuda=cuda_available(), extra=extra)
        except (ValueError, BackendNotInstalled) as exc:
            raise UserInputError(f"{where('engine_options')}: engine_options[{backend!r}]: "
                                 f"{exc}") from exc


def check_dataset_host(params: dict[str, Any], where: Callable[[str], str]) -> None:
    """Phase 2's ``dataset dapo_math`` needs the Hugging Face hub (or a local cache with
    ``HF_HUB_OFFLINE=1``): asked here before launch (:func:`nbhelpers.data.dapo_math_unreachable`,
    a 3 s connect), since offline it started a kernel, failed 31 s later and archived a failed
    run and sidecars that a later 29_compare read (helper-16's trial, 2026-12-07). Raises
    :class:`UserInputError`."""
    if params.get("dataset") != "dapo_math":
        return
    from nbhelpers.data import dapo_math_unreachable
    problem = dapo_math_unreachable()
    if problem:
        raise UserInputError(f"{where('dataset')}: dataset='dapo_math': {problem} "
                             "(-p dataset gsm8k)")


CPU_BACKENDS = {"phase1": "hf_generate, hf_cb", "phase2": "hf_generate, flex"}
"""What the CUDA check offers instead when every backend of the run needs CUDA, per phase (the
CPU configs' backends; phase 1's CPU config leaves flex out: slow on 2 cores)."""


def needs_cuda(backend: str) -> bool:
    """Whether ``backend`` runs only on a CUDA GPU: an engine of
    :data:`nbhelpers.grpo.plans.CUDA_BACKENDS` (vLLM, Unsloth) or a rollout variant of one
    (:func:`nbhelpers.backends.resolve`), or a variant on FlashAttention-4 (``hf_cb_fa4``:
    :data:`nbhelpers.shims.flash_attn4.FA4_NAMES`, CUDA kernels only)."""
    from nbhelpers.backends import resolve
    from nbhelpers.grpo.plans import CUDA_BACKENDS
    from nbhelpers.shims.flash_attn4 import FA4_NAMES
    try:
        engine, options = resolve(backend)
    except ValueError:
        return backend in CUDA_BACKENDS  # not a rollout name: the value checks name it
    return engine in CUDA_BACKENDS or options.get("attn_implementation") in FA4_NAMES


def check_cuda_backends(params: dict[str, Any], where: Callable[[str], str],
                        phase: str = "phase2") -> None:
    """Phase 1's and phase 2's ``backends`` that need CUDA (:func:`needs_cuda`: ``vllm``,
    ``unsloth``; phase 1's ``hf_cb_fa4`` too) need it here: on a CPU host they failed after
    launch (fresh-user trial, 2026-12-03: phase 2's ``-p backends '[vllm]'`` wrote a failed
    notebook, two sidecars and INDEX rows 13 s later, ``'[vllm, flex]'`` ran flex's whole
    format warm-up first; phase 1's ``-p backends '[vllm]'`` a failed notebook, sidecars and an
    INDEX row 14 s later). Raises :class:`UserInputError` naming the backends and the fix."""
    backends = params.get("backends")
    need = [b for b in backends if needs_cuda(b)] if isinstance(backends, list) else []
    if not need or cuda_available():
        return
    keep = [b for b in backends if b not in need]
    ref = params.get("reference_backend")
    fix = (f"drop {need} (-p backends '[{', '.join(keep)}]'"
           + (f" -p reference_backend {keep[0]}" if ref in need else "") + ")" if keep
           else f"use backends that run on the CPU (-p backends '[{CPU_BACKENDS[phase]}]'"
           + (" -p reference_backend hf_generate" if ref in need else "") + ")")
    raise UserInputError(f"{where('backends')}: backends {need} need a CUDA GPU and torch sees "
                         f"none on this host: {fix}, or run on a CUDA host with --profile h200.")


def check_attn_host(params: dict[str, Any], where: Callable[[str], str]) -> None:
    """Phase 2's ``attn_implementation`` of :data:`nbhelpers.shims.flash_attn4.FA4_NAMES` needs
    a CUDA GPU and flash-attn-4 here (without them every backend's row fails after launch with
    ``BackendNotInstalled``, as phase 1's ``hf_cb_fa4`` does on a CPU host). Raises
    :class:`UserInputError` naming the fix."""
    from nbhelpers.shims.flash_attn4 import FA4_NAMES, fa4_installed
    attn = params.get("attn_implementation")
    if attn not in FA4_NAMES:
        return
    if not cuda_available():
        raise UserInputError(f"{where('attn_implementation')}: attn_implementation={attn!r} "
                             "needs a CUDA GPU (FlashAttention-4 kernels) and torch sees none on "
                             "this host: use -p attn_implementation auto (or sdpa), or run on a "
                             "CUDA host with --profile h200.")
    if not fa4_installed():
        raise UserInputError(f"{where('attn_implementation')}: attn_implementation={attn!r} "
                             "needs flash-attn-4, not importable here: stage the fa4 bundle "
                             "(nbhelpers/bundles/sets.py; PYTHONPATH=/tmp/fa4_site:/tmp/fa4_site/"
                             "nvidia_cutlass_dsl/dsl_packages) or pip install -e '.[fa4]', or "
                             "use -p attn_implementation auto.")


def check_compare_sidecars(params: dict[str, Any], notebook: Path, repo: Path,
                           where: Callable[[str], str]) -> None:
    """A compare notebook's sidecars, read as it reads them (from ``repo``: the kernel's working
    directory): ``29_compare``'s ``sidecar_dir`` must hold phase-2 backend runs and its
    ``device`` match one of their devices (or be empty)
    (:func:`nbhelpers.grpo.compare_sidecars.load_runs`); ``19_compare``'s ``executed_dir`` must
    hold phase-1 backend sidecars when ``require_any``
    (:func:`nbhelpers.bench.rollout.load_backend_sidecars`). A missing, empty or wrong folder
    failed after launch (29: a pandas ``KeyError``, an unknown device in cell 5; 19: its last
    cell's assert), each leaving a failed notebook, sidecar and INDEX row (fresh-user trial,
    2026-12-03). Checked when the folder parameter is given (their configs give it).
    Raises :class:`UserInputError` naming the folder or the devices the sidecars hold."""
    if not is_compare(notebook):
        return
    if phase_of(notebook) == "phase1" and isinstance(params.get("executed_dir"), str):
        from nbhelpers.bench.rollout import load_backend_sidecars
        try:
            load_backend_sidecars(params["executed_dir"], params.get("require_any", True), repo)
        except ValueError as exc:
            raise UserInputError(f"{where('executed_dir')}: {exc}") from exc
    if phase_of(notebook) != "phase2" or not isinstance(params.get("sidecar_dir"), str):
        return
    from nbhelpers.grpo.compare_sidecars import filter_device, load_runs
    try:
        _, _, runs, gates = load_runs(params["sidecar_dir"], cwd=repo)
    except ValueError as exc:
        raise UserInputError(f"{where('sidecar_dir')}: {exc}") from exc
    try:
        filter_device(runs, gates, params.get("device") or "")
    except ValueError as exc:
        raise UserInputError(f"{where('device')}: {exc}") from exc


def check_host(params: dict[str, Any], phase: str, where: Callable[[str], str],
               notebook: Path | None = None, repo: Path | None = None,
               sidecars_pending: bool = False) -> None:
    """``device`` and the model size against this host: called where this host will run the
    notebook (the runner's :func:`~nbhelpers.run.runner.plan_jobs`), not where a device call is
    only planned (``scripts/device/run_step.py --dry-run`` checks h200 configs on the CPU);
    33's variants and LoRA modes too (:func:`check_flex_plan_params`), phase 1's flex
    options (:func:`check_flex_backend_options`), phase 2's FA4 attention
    (:func:`check_attn_host`), phase 1's and phase 2's CUDA-only backends
    (:func:`check_cuda_backends`) and model size, and, given its ``notebook`` and the ``repo``
    it runs in, 19_compare's and 29_compare's sidecars (:func:`check_compare_sidecars`; not
    when ``sidecars_pending``: the same run executes the notebooks that write them first).
    Raises :class:`UserInputError` naming the parameter and the fix."""
    if phase == "phase1":
        check_flex_backend_options(params, where)
        check_cb_backend_options(params, where)
    if phase == "phase2":
        check_attn_host(params, where)
        check_dataset_host(params, where)
    if phase in ("phase1", "phase2"):
        check_cuda_backends(params, where, phase)
        _check_size(params, where, phase)
        if notebook is not None and not sidecars_pending:
            check_compare_sidecars(params, notebook, repo or notebook.resolve().parents[2],
                                   where)
    if phase != "phase3":
        return
    check_flex_plan_params(params, phase, where)
    device = params.get("device")
    if isinstance(device, str) and device.startswith("cuda") and not cuda_available():
        raise UserInputError(f"{where('device')}: device={device!r} but torch sees no CUDA GPU "
                             "on this host: use -p device cpu here, or run on the GPU host "
                             "with --profile h200.")
    _check_size(params, where, phase)


SMALL_MODELS = {"phase1": "a tiny one such as -p model tiny-qwen3 (the CPU config's)",
                "phase2": "a small model such as -p model smollm2-135m-instruct (real weights, "
                          "the CPU config's) or tiny-llama",
                "phase3": "a tiny one (tiny-qwen3, tiny-llama, tiny-gemma4)"}
"""What the size check offers instead of a GPU-sized ``model``, per phase (33's ``shape``:
``-p shape tiny``)."""


def _check_size(params: dict[str, Any], where: Callable[[str], str], phase: str) -> None:
    from nbhelpers import models
    for name in ("shape", "model"):
        value = params.get(name)
        if not isinstance(value, str) or value.startswith("tiny"):
            continue  # the tiny test models (and 33's "tiny" shape): CPU-sized by design
        try:
            spec = models.get_spec(value)
        except (KeyError, ValueError, AttributeError):
            continue  # not a registry name: the model checks name the fix
        if spec.kind != "random" or models.n_params(spec) <= CPU_PARAMS_LIMIT:
            continue
        if not cuda_available():
            raise UserInputError(
                f"{where(name)}: {name}={value!r} is a GPU workload (random weights, "
                f"{models.n_params(spec) / 1e9:.1f} B parameters) and torch sees no CUDA GPU "
                "here: on this host use "
                f"{'a tiny one (-p shape tiny)' if name == 'shape' else SMALL_MODELS[phase]}"
                ", or run it with --profile h200 on the GPU host.")
