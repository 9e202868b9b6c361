"""Helpers shared by the transformers-based backends (hf_generate, hf_cb, cb_sync, unsloth).

Contract: pure functions over plain Python values plus a few torch/transformers helpers imported
inside the functions. Nothing heavy is imported at module import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from nbhelpers.backends.base import BackendNotInstalled, Completion
from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams


def require(module: str, backend: str, extra: str) -> Any:
    """Import ``module`` or raise :class:`BackendNotInstalled` naming the pip extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise BackendNotInstalled(backend, extra, err) from err


def require_fa4(backend: str) -> None:
    """Raise :class:`BackendNotInstalled` (``backend`` names who asked, the ``fa4`` extra the
    fix) unless flash-attn-4 is importable; else register the FA4 attention names and fix
    transformers' paged call (:func:`nbhelpers.shims.flash_attn4.apply`)."""
    from nbhelpers.shims import flash_attn4
    if not flash_attn4.fa4_installed():
        raise BackendNotInstalled(backend, "fa4")
    flash_attn4.apply()


def validate_prompts(prompts: list[list[int]]) -> None:
    """Raise ``ValueError`` unless ``prompts`` is a non-empty list of non-empty int-id lists."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists, e.g. "
                         "nbhelpers.data.workload_prompt_ids(tokenizer, n_prompts).")
    for i, p in enumerate(prompts):
        if not p or not all(isinstance(t, int) and t >= 0 for t in p):
            raise ValueError(f"prompts[{i}] must be a non-empty list of non-negative ints (token "
                             "ids); tokenize text first (tokenizer(text).input_ids).")


def expand_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt repeated ``n`` times, prompt-major (``[p0, p0, p1, p1, ...]`` for n=2)."""
    return [list(p) for p in prompts for _ in range(n)]


def eos_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """EOS ids from the model's generation config, then its config, then the tokenizer."""
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None),
                tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None and eos != -1:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []


def generation_kwargs(sampling: SamplingParams, eos: list[int], pad_id: int) -> dict[str, Any]:
    """``transformers.GenerationConfig`` kwargs for ``sampling`` (vLLM meaning -> transformers).

    top_k -1/0 -> ``None`` (transformers rejects -1: DESIGN.md "Backend contract");
    temperature 0 -> greedy; ``ignore_eos`` drops EOS from the stop ids (``eos_token_id=-1`` when no
    stop id is left; the EOS token can still be sampled, as in vLLM) while ``stop_token_ids`` still
    stop; top_p 1.0 and min_p 0 are passed as ``None`` (disabled).
    Every knob is set explicitly so a checkpoint's ``generation_config.json`` (Qwen3 ships top_k=20)
    cannot leak in.
    """
    stop = ([] if sampling.ignore_eos else list(eos)) + list(sampling.stop_token_ids)
    kw: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "min_new_tokens": None,
                          "do_sample": not sampling.is_greedy, "num_beams": 1,
                          "pad_token_id": pad_id, "eos_token_id": stop or -1,
                          "temperature": None, "top_p": None, "top_k": None, "min_p": None,
                          "repetition_penalty": None, "use_cache": True}
    if not sampling.is_greedy:
        kw.update(temperature=sampling.temperature, top_k=sampling.top_k_or_none,
                  top_p=sampling.top_p if sampling.top_p < 1.0 else None,
                  min_p=sampling.min_p if sampling.min_p > 0 else None)
    return kw


def generation_config(sampling: SamplingParams, eos: list[int], pad_id: int) -> Any:
    """A ``transformers.GenerationConfig`` built from :func:`generation_kwargs`."""
    from transformers import GenerationConfig

    return GenerationConfig(**generation_kwargs(sampling, eos, pad_id))


def finish_reason(token_ids: list[int], sampling: SamplingParams, eos: list[int]) -> str:
    """``"stop"`` when the last token is a stop id (and EOS is not ignored), else ``"length"``."""
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos))
    return "stop" if token_ids and token_ids[-1] in stops else "length"


def trim_completion(prompt: list[int], tokens: list[int], sampling: SamplingParams,
                    eos: list[int]) -> Completion:
    """A Completion from a generated row: cut after the first stop id (right padding dropped)."""
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos))
    out: list[int] = []
    for t in tokens[: sampling.max_new_tokens]:
        out.append(int(t))
        if t in stops:
            break
    return Completion(prompt_ids=list(prompt), token_ids=out, logprobs=None,
                      finish_reason=finish_reason(out, sampling, eos))


def torch_dtype(name: str) -> Any:
    """``torch.bfloat16`` etc. from ``ModelSpec.dtype``."""
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_hf(model: ModelSpec, lora: LoraSpec | None, *, device: str | None = None,
            attn_implementation: str | None = None, adapter_path: str | None = None,
            seed: int = 0) -> tuple[Any, Any, str | None]:
    """Vanilla HF model (+ PEFT adapter when ``lora``) in eval mode, its tokenizer, adapter path.

    The adapter is ``adapter_path`` or the cached :func:`nbhelpers.adapters.canonical_adapter` of
    ``model.name``; it stays unmerged (the naive TRL path). LoRA params keep PEFT's fp32.
    """
    from nbhelpers import adapters as lora_mod
    from nbhelpers import models

    dev = device or default_device()
    hf, tok = models.load_model(model.name, dtype=model.dtype, device=dev,
                                attn_implementation=attn_implementation, seed=seed)
    if lora is None:
        return hf.eval(), tok, None
    path = adapter_path or str(lora_mod.canonical_adapter(model.name, lora))
    return lora_mod.apply_adapter(hf, path).to(dev), tok, path


def pad_id_of(tokenizer: Any, eos: list[int]) -> int:
    """The tokenizer's pad id, else the first EOS id, else 0."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else (eos[0] if eos else 0)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    """Left-padded ``input_ids`` and ``attention_mask``, both ``[B, P_max]`` int64 (CPU)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def batched_generate(model: Any, prompts: list[list[int]], sampling: SamplingParams,
                     eos: list[int], pad_id: int, **extra: Any) -> list[Completion]:
    """One left-padded ``model.generate`` over all prompts (x ``sampling.n``), prompt-major.

    ``extra`` goes to ``generate`` (e.g. Unsloth's own kwargs). Seeds torch's global generator with
    ``sampling.seed`` when given. Returns ``len(prompts) * n`` Completions.
    """
    import torch

    validate_prompts(prompts)
    rows = expand_prompts(prompts, sampling.n)
    ids, mask = left_pad(rows, pad_id)
    dev = next(model.parameters()).device
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    gen_cfg = generation_config(sampling, eos, pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                             generation_config=gen_cfg, **extra)  # [B, P_max + T]
    new = out[:, ids.shape[1]:].tolist()
    return [trim_completion(p, row, sampling, eos) for p, row in zip(rows, new)]


def free_device_memory() -> None:
    """``gc.collect()`` then ``torch.cuda.empty_cache()`` (no-op on the CPU)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
