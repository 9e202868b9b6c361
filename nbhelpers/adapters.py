"""Canonical, non-zero PEFT LoRA adapters and key normalisation between LoRA wrappers.

Contract:
- :func:`make_adapter` writes a PEFT adapter folder (``adapter_config.json`` +
  ``adapter_model.safetensors``) for any model config, without materialising the base weights
  (the base model lives on the ``meta`` device; only the LoRA matrices get real storage).
- ``lora_B`` is re-initialised from N(0, b_std^2): PEFT initialises B to zero, so a fresh adapter
  is a no-op and LoRA kernels that skip zero work would look free (issue 3, DESIGN.md workload W).
- :func:`canonical_adapter` caches one adapter per (model, rank, alpha, targets, b_std, seed) so
  every backend in a benchmark loads the very same file.
- :func:`normalise_lora_key` maps PEFT's saved keys (``base_model.model.`` prefix, no adapter name)
  and live PeftModel keys (``.default.`` infix) onto one form, used to copy an adapter into another
  wrapper (Unsloth's).

Run: ``python -c "from nbhelpers.adapters import canonical_adapter; print(canonical_adapter('tiny-qwen3',
__import__('nbhelpers').LoraSpec(rank=8, alpha=16)))"``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from nbhelpers.config import LoraSpec

DEFAULT_B_STD = 0.01
"""std of ``lora_B`` when ``LoraSpec.init_b_std`` is 0: small enough to keep a real model's output
sensible, large enough that the LoRA product is not zero (our choice; no upstream source)."""

PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"


def cache_root() -> Path:
    """``$NBHELPERS_CACHE`` or ``~/.cache/nbhelpers`` (adapters go under ``adapters/``)."""
    return Path(os.environ.get("NBHELPERS_CACHE", Path.home() / ".cache" / "nbhelpers"))


def effective_b_std(lora: LoraSpec) -> float:
    """``lora.init_b_std`` when > 0, else :data:`DEFAULT_B_STD` (a canonical adapter is never a no-op)."""
    return lora.init_b_std if lora.init_b_std > 0 else DEFAULT_B_STD


def peft_config(lora: LoraSpec) -> Any:
    """The ``peft.LoraConfig`` for ``lora`` (task CAUSAL_LM, no bias, no rsLoRA)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                      lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")


def _meta_peft_model(hf_config: Any, lora: LoraSpec) -> Any:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(hf_config)
    try:
        return get_peft_model(base, peft_config(lora))
    except ValueError as err:
        raise ValueError(f"LoRA targets {lora.targets} do not match modules of "
                         f"{type(base).__name__}: pass LoraSpec(targets=...) with module names "
                         f"of this architecture ({err})") from err


def init_lora_weights(peft_model: Any, b_std: float, seed: int = 0) -> int:
    """Give every LoRA matrix real fp32 CPU storage: A ~ kaiming-uniform (PEFT's default), B ~
    N(0, b_std^2). Returns the number of LoRA layers. Shapes: A ``[r, in]``, B ``[out, r]``."""
    import math

    import torch

    gen = torch.Generator().manual_seed(seed)
    n_layers = 0
    for name, module in peft_model.named_modules():
        if not (hasattr(module, "lora_A") and ADAPTER_NAME in getattr(module, "lora_A", {})):
            continue
        a, b = module.lora_A[ADAPTER_NAME], module.lora_B[ADAPTER_NAME]
        bound = 1.0 / math.sqrt(a.in_features)  # kaiming_uniform_(a=sqrt(5)) bound, as nn.Linear
        a.weight = torch.nn.Parameter(
            (torch.rand(a.weight.shape, generator=gen) * 2 - 1) * bound)
        b.weight = torch.nn.Parameter(torch.randn(b.weight.shape, generator=gen) * b_std)
        n_layers += 1
    return n_layers


def make_adapter(hf_config: Any, lora: LoraSpec, out_dir: str | os.PathLike,
                 seed: int = 0) -> Path:
    """Write a canonical PEFT adapter for a model ``hf_config`` into ``out_dir``.

    Args:
        hf_config: a ``transformers.PretrainedConfig`` (e.g. ``AutoConfig.from_pretrained``).
        lora: rank, alpha, targets; ``lora_B`` std is :func:`effective_b_std`.
        out_dir: folder to (over)write.
        seed: seed of the CPU generator that fills A and B.

    Returns:
        ``out_dir`` as a Path; it loads with ``PeftModel.from_pretrained`` and vLLM's LoRARequest.

    Raises:
        ValueError: when no module matches ``lora.targets``.
    """
    out = Path(out_dir)
    model = _meta_peft_model(hf_config, lora)
    n_layers = init_lora_weights(model, effective_b_std(lora), seed)
    if n_layers == 0:
        raise ValueError(f"no LoRA layer created for targets {lora.targets}: check the names.")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    meta = {"n_lora_layers": n_layers, "b_std": effective_b_std(lora), "seed": seed,
            "rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}
    (out / "nbhelpers_adapter.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def adapter_key(model_name: str, lora: LoraSpec, seed: int = 0) -> str:
    """Cache key: model name, rank, alpha, targets, B std and seed (sha1, 12 hex digits)."""
    raw = json.dumps([model_name, lora.rank, lora.alpha, sorted(lora.targets),
                      effective_b_std(lora), seed])
    return hashlib.sha1(raw.encode()).hexdigest()[:12]


def canonical_adapter(model_name: str, lora: LoraSpec, seed: int = 0,
                      root: str | os.PathLike | None = None) -> Path:
    """The cached canonical adapter of registry model ``model_name`` (made on first use).

    The config comes from ``nbhelpers.models.build_config``. Returns the adapter folder.
    """
    root = Path(root) if root is not None else cache_root() / "adapters"
    out = root / f"{model_name.replace('/', '--')}-r{lora.rank}-{adapter_key(model_name, lora, seed)}"
    if (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists():
        return out
    return make_adapter(model_hf_config(model_name), lora, out, seed)


def model_hf_config(model_name: str) -> Any:
    """The HF config of a registry model (``nbhelpers.models.build_config``; no weights)."""
    from nbhelpers import models

    return models.build_config(model_name)


def normalise_lora_key(key: str) -> str:
    """One spelling for LoRA keys from any PEFT wrapper.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` (live PeftModel) and
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (saved adapter) both become
    ``model.layers.0.self_attn.q_proj.lora_A.weight``.
    """
    key = key.removeprefix(PEFT_PREFIX)
    return key.replace(f".{ADAPTER_NAME}.", ".")


def load_adapter_state(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """The adapter's tensors keyed by :func:`normalise_lora_key` (CPU, stored dtype)."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: make the adapter with nbhelpers.adapters."
                                "canonical_adapter(model_name, lora) first.")
    return {normalise_lora_key(k): v for k, v in load_file(str(path)).items()}


def copy_adapter_into(model: Any, adapter_dir: str | os.PathLike) -> int:
    """Copy a saved adapter into the LoRA parameters of a live PEFT-wrapped ``model`` (e.g. the one
    ``FastLanguageModel.get_peft_model`` returns), matching keys with :func:`normalise_lora_key`.

    Returns:
        the number of ``lora_B`` tensors filled.

    Raises:
        KeyError: an adapter tensor has no matching parameter (or the reverse), naming examples.
        ValueError: a shape mismatch (different rank or targets).
    """
    import torch

    saved = load_adapter_state(adapter_dir)
    live = {normalise_lora_key(n): p for n, p in model.named_parameters() if ".lora_" in n}
    missing, extra = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
    if missing or extra:
        raise KeyError(f"adapter/model LoRA keys differ: {len(missing)} only in adapter (e.g. "
                       f"{missing[:2]}), {len(extra)} only in model (e.g. {extra[:2]}); build the "
                       "wrapper with the same LoraSpec (rank, targets).")
    with torch.no_grad():
        for key, tensor in saved.items():
            if live[key].shape != tensor.shape:
                raise ValueError(f"{key}: adapter shape {tuple(tensor.shape)} != model "
                                 f"{tuple(live[key].shape)}; use the adapter's rank.")
            live[key].copy_(tensor.to(live[key].dtype))
    return sum(1 for k in saved if ".lora_B." in k)


def apply_adapter(model: Any, adapter_dir: str | os.PathLike) -> Any:
    """``PeftModel.from_pretrained(model, adapter_dir)`` in eval mode (adapter active, unmerged)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()
