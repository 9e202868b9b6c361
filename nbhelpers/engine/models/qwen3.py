"""Qwen3 (``Qwen3ForCausalLM``): Llama layout plus per-head RMSNorm on q and k before RoPE.

Source: transformers ``models/qwen3/modeling_qwen3.py`` (``Qwen3Attention.forward``:
``q_norm(q_proj(x).view(..., head_dim))``). Sliding-window layers (``use_sliding_window``) are
mapped to the ``sliding_window`` mask factory per ``config.layer_types``.
"""

from __future__ import annotations

from typing import Any

from nbhelpers.engine.attention import sliding_window
from nbhelpers.engine.models import ArchSpec


def arch_spec(hf_config: Any) -> ArchSpec:
    layer_types = getattr(hf_config, "layer_types", None) or []
    window = getattr(hf_config, "sliding_window", None)
    masks = tuple(sliding_window(window) if t == "sliding_attention" and window else None
                  for t in layer_types)
    return ArchSpec(name="Qwen3ForCausalLM", has_qk_norm=True, layer_masks=masks)
