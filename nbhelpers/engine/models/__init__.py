"""Architecture registry keyed by the HF architecture name (``config.architectures[0]``).

Contract: each architecture file exposes ``arch_spec(hf_config) -> ArchSpec``; model differences are
fields of :class:`ArchSpec` (QK RMSNorm, embedding scale, logit soft-cap, per-layer mask factories)
or, for a block that is not the Llama block (Gemma-4), a subclass of
:class:`nbhelpers.engine.layers.EngineModel` overriding its hooks, never ``if model_type`` inside
the engine. :func:`build_engine_model` builds the engine model of any registered architecture.
Imports are lazy: ``get_arch_spec`` imports only the file of the architecture asked for.

Run: ``python -c "from nbhelpers.engine.models import list_architectures; print(list_architectures())"``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_REGISTRY: dict[str, str] = {
    "Qwen3ForCausalLM": "nbhelpers.engine.models.qwen3",
    "LlamaForCausalLM": "nbhelpers.engine.models.llama",
    "Gemma4ForCausalLM": "nbhelpers.engine.models.gemma4",
}


@dataclass(frozen=True)
class ArchSpec:
    """What the engine needs to know about an architecture beyond the HF modules themselves.

    Attributes:
        name: HF architecture name.
        has_qk_norm: RMSNorm on q and k per head before RoPE (Qwen3: ``self_attn.q_norm/k_norm``).
        embed_scale: multiply the input embeddings (Gemma: sqrt(hidden)); 1.0 for Qwen3/Llama.
        attn_scale: softmax scale, ``None`` = the HF attention module's ``scaling`` (head_dim^-0.5).
        final_logit_softcap: ``cap * tanh(logits / cap)`` on the LM head output, ``None`` = off.
        layer_masks: per-layer extra logical mask factory (``None`` entries = plain causal).
        attn_score_mod: flex ``score_mod`` shared by every layer (e.g. ``soft_cap``), or ``None``.
        engine_model: see the field's docstring.
    """

    name: str
    has_qk_norm: bool = False
    embed_scale: float = 1.0
    attn_scale: float | None = None
    final_logit_softcap: float | None = None
    layer_masks: tuple[Callable | None, ...] = field(default=())
    attn_score_mod: Callable | None = None
    engine_model: Callable | None = None
    """Subclass of ``layers.EngineModel`` built instead of it (same constructor ``(model, spec,
    fuse_lora_a, flex_fn)``) for blocks that are not the Llama block (Gemma-4); ``None`` =
    EngineModel."""

    def mask_for_layer(self, i: int) -> Callable | None:
        return self.layer_masks[i] if i < len(self.layer_masks) else None


def list_architectures() -> list[str]:
    """The HF architecture names the engine runs."""
    return sorted(_REGISTRY)


def get_arch_spec(hf_config: Any) -> ArchSpec:
    """The :class:`ArchSpec` for an HF config, by ``hf_config.architectures[0]``.

    Raises:
        ValueError: the architecture is missing or not registered (message lists the known ones).
    """
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in _REGISTRY:
        raise ValueError(f"flex engine: architecture {archs[:1] or None} is not supported; known: "
                         f"{list_architectures()}. Set config.architectures or add a file under "
                         "nbhelpers/engine/models/ and register it in _REGISTRY.")
    return importlib.import_module(_REGISTRY[archs[0]]).arch_spec(hf_config)


def build_engine_model(model: Any, fuse_lora_a: bool = True, flex_fn: Any = None) -> Any:
    """The engine model of ``model`` (an HF ``*ForCausalLM``, PEFT-wrapped or not):
    ``layers.EngineModel``, or the architecture's subclass (``ArchSpec.engine_model``).

    Raises:
        ValueError: the architecture is not registered (see :func:`get_arch_spec`).
    """
    from nbhelpers.engine.layers import EngineModel, base_causal_lm
    spec = get_arch_spec(base_causal_lm(model).config)
    return (spec.engine_model or EngineModel)(model, spec, fuse_lora_a=fuse_lora_a,
                                              flex_fn=flex_fn)
