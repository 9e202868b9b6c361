"""``hf_generate``: plain ``model.generate`` with the PEFT adapter active (the naive TRL path).

Contract (DESIGN.md "Backend contract"): ``load`` a vanilla HF model (+ unmerged PEFT LoRA, fp32
adapter params as PEFT makes them), ``generate`` all prompts in one left-padded batch under one
:class:`~nbhelpers.config.SamplingParams`, ``close`` frees the device memory.

Engine options (``load(**engine_options)``): ``device`` (default cuda if visible),
``attn_implementation`` (default ``sdpa``), ``adapter_path`` (default: the cached canonical
adapter), ``seed`` (random-init weights).
"""

from __future__ import annotations

from typing import Any

from nbhelpers.backends import _common
from nbhelpers.backends.base import Completion
from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams, resolve_sampling
from nbhelpers.engine.llm_checks import check_generate_kwargs


class HFGenerateBackend:
    """transformers ``generate`` (+ PEFT). Raises ``RuntimeError`` when used before ``load``."""

    name = "hf_generate"

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.adapter_path: str | None = None
        self.options: dict[str, Any] = {}

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None:
        _common.require("transformers", self.name, "cpu")
        unknown = set(engine_options) - {"device", "attn_implementation", "adapter_path", "seed"}
        if unknown:
            raise ValueError(f"{self.name}: unknown engine options {sorted(unknown)}; use device, "
                             "attn_implementation, adapter_path, seed.")
        self.options = {"attn_implementation": "sdpa", **engine_options}
        self.model, self.tokenizer, self.adapter_path = _common.load_hf(
            model, lora, device=self.options.get("device"),
            attn_implementation=self.options["attn_implementation"],
            adapter_path=self.options.get("adapter_path"), seed=self.options.get("seed", 0))
        self.eos = _common.eos_ids(self.model, self.tokenizer)
        self.pad_id = _common.pad_id_of(self.tokenizer, self.eos)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None, *,
                 sampling_params: SamplingParams | None = None,
                 **unexpected: Any) -> list[Completion]:
        """One left-padded ``model.generate`` (``sampling_params=``: vLLM's name, an alias)."""
        check_generate_kwargs(unexpected, owner=self.name)  # vLLM names: TypeError naming the fix
        sampling = resolve_sampling(self.name, sampling, sampling_params)
        if self.model is None:
            raise RuntimeError(f"{self.name}.generate before load(): call load(model, lora) first.")
        return _common.batched_generate(self.model, prompts, sampling, self.eos, self.pad_id)

    def close(self) -> None:
        self.model = None
        _common.free_device_memory()
