"""Llama-2/3.x (``LlamaForCausalLM``), SmolLM2 included.

The llama3 RoPE scaling (``rope_scaling={"rope_type": "llama3", ...}``) needs nothing here: the
engine takes cos/sin from the HF model's own ``rotary_emb`` module, which implements it
(transformers ``modeling_rope_utils._compute_llama3_parameters``).
"""

from __future__ import annotations

from typing import Any

from nbhelpers.engine.models import ArchSpec


def arch_spec(hf_config: Any) -> ArchSpec:
    return ArchSpec(name="LlamaForCausalLM", has_qk_norm=False)
