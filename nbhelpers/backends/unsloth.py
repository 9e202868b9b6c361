"""``unsloth``: Unsloth ``FastLanguageModel`` with ``fast_inference=False`` (no vLLM inside).

Contract (DESIGN.md "Backend contract"): ``load`` opens the registry model's *weights* folder
(``nbhelpers.models.model_folder(name, with_weights=True)``: Unsloth cannot use dummy weights),
wraps it with ``FastLanguageModel.get_peft_model`` when LoRA is asked for and copies the canonical
PEFT adapter into that wrapper (:func:`nbhelpers.adapters.copy_adapter_into`: keys normalised for the
``base_model.model.`` prefix and the ``.default.`` infix), then ``FastLanguageModel.for_inference``.
``generate`` is one batched, left-padded ``model.generate`` over all prompts.

Env set before ``import unsloth`` (DESIGN.md "The H200 machine"): ``UNSLOTH_DISABLE_STATISTICS=1``,
``UNSLOTH_DECODE_CUDA_GRAPHS=1`` (decode CUDA graphs, as its RL rollouts use), ``HF_HUB_OFFLINE=1``.
Engine options: ``max_seq_length`` (default 1024), ``adapter_path``, ``decode_cuda_graphs`` (bool).
Needs the ``unsloth`` extra; without it ``load`` raises ``BackendNotInstalled``.
"""

from __future__ import annotations

import os
from typing import Any

from nbhelpers.backends import _common
from nbhelpers.backends.hf_generate import HFGenerateBackend
from nbhelpers.config import LoraSpec, ModelSpec

UNSLOTH_OPTIONS = {"max_seq_length", "adapter_path", "decode_cuda_graphs"}


def unsloth_env(decode_cuda_graphs: bool = True) -> dict[str, str]:
    """Environment Unsloth reads at import time (statistics off, offline, decode graphs)."""
    return {"UNSLOTH_DISABLE_STATISTICS": "1", "HF_HUB_OFFLINE": "1",
            "UNSLOTH_DECODE_CUDA_GRAPHS": "1" if decode_cuda_graphs else "0"}


def peft_kwargs(lora: LoraSpec) -> dict[str, Any]:
    """``FastLanguageModel.get_peft_model`` kwargs matching the canonical adapter's LoraSpec."""
    return {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": list(lora.targets),
            "lora_dropout": lora.dropout, "bias": "none", "use_gradient_checkpointing": False,
            "random_state": 3407}


class UnslothBackend(HFGenerateBackend):
    """Unsloth fast_inference=False (see the module docstring); ``generate``/``close`` are
    :class:`HFGenerateBackend`'s (one batched ``model.generate`` on Unsloth's patched model)."""

    name = "unsloth"

    def __init__(self) -> None:
        super().__init__()
        self.info: dict[str, Any] = {}

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None:
        unknown = set(engine_options) - UNSLOTH_OPTIONS
        if unknown:
            raise ValueError(f"{self.name}: unknown engine options {sorted(unknown)}; use "
                             f"{sorted(UNSLOTH_OPTIONS)}.")
        for key, value in unsloth_env(engine_options.get("decode_cuda_graphs", True)).items():
            os.environ.setdefault(key, value)
        unsloth = _common.require("unsloth", self.name, "unsloth")
        from nbhelpers import adapters as lora_mod
        from nbhelpers import models

        flm = unsloth.FastLanguageModel
        folder = str(models.model_folder(model.name, with_weights=True,
                                         device=_common.default_device()))
        self.model, self.tokenizer = flm.from_pretrained(
            model_name=folder, max_seq_length=engine_options.get("max_seq_length", 1024),
            dtype=_common.torch_dtype(model.dtype), load_in_4bit=False, fast_inference=False)
        if lora is not None:
            path = engine_options.get("adapter_path") or lora_mod.canonical_adapter(model.name, lora)
            self.model = flm.get_peft_model(self.model, **peft_kwargs(lora))
            self.info["lora_B_filled"] = lora_mod.copy_adapter_into(self.model, path)
        flm.for_inference(self.model)
        self.eos = _common.eos_ids(self.model, self.tokenizer)
        self.pad_id = _common.pad_id_of(getattr(self.tokenizer, "tokenizer", self.tokenizer),
                                        self.eos)
