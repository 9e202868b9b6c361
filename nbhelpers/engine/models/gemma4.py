"""Gemma-4 text backbone (``Gemma4ForCausalLM``, e.g. google/gemma-4-E2B) in the flex engine.

What: the :class:`~nbhelpers.engine.models.ArchSpec` for Gemma-4 (sliding-window mask factory per
``layer_types``, final logit soft-cap, the engine-model class). The forward and the flex_attention
kernel options per head_dim are :mod:`nbhelpers.engine.models.gemma4_model`.

Differences from the Llama/Qwen3 block, checked line by line against transformers 5.17.0
``models/gemma4/modeling_gemma4.py`` (M) and ``configuration_gemma4.py`` (C); where the issue's list
and the code differ, the code wins and the entry says so:

1. KV sharing (M 1181-1187, 1233-1255): the last ``num_kv_shared_layers`` layers have no k_proj/
   v_proj/k_norm/v_norm (M 1194-1207) and read the K/V of the *last non-shared layer of the same
   layer type* (``store_full_length_kv``), e.g. E2B: sliding layers 15-34 read layer 13, full
   layers read layer 14. Engine: ``SharedKVCache`` aliases the store layer's paged tensors; the
   shared layer applies its own mask over the same pages.
2. Two attention regimes via ``per_layer_config`` (C 210-221, M 1173-1174): full layers use
   ``global_head_dim`` (512 on E2B) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``;
   sliding layers use ``head_dim`` 256. ``config.head_dim`` itself raises
   ``AmbiguousGlobalPerLayerAttributeError`` (transformers/integrations/heterogeneity), so the engine
   reads ``self_attn.head_dim`` per layer.
3. RoPE per layer type (C 203-208, M 1080-1160, computed once per type at M 1679-1681): sliding =
   default RoPE theta 1e4; full = theta 1e6 *proportional* RoPE with ``partial_rotary_factor``
   0.25 (modeling_rope_utils.py 246-259: the first 25 % of the rotary frequencies rotate, the rest
   get inv_freq 0, i.e. cos 1 / sin 0). The issue's list omits the partial factor; the engine calls
   the HF ``rotary_emb(x, positions, layer_type)`` once per type per step.
4. Sliding window 512 (C ``sliding_window``; M 1171 sets it only on sliding layers): the mask is
   ``kv > q - window`` (masking_utils.py 100), the engine's ``sliding_window(w)`` factory. The
   paged pool keeps every token (no ring buffer) and the decode BlockMask still visits all of a
   row's pages, the mask hiding those behind the window: at <= 1024 tokens that is <= 8 pages of
   128 instead of <= 5, a cost only long contexts would notice. With ``decode_attention="triton"``
   (``kernels/paged_decode.py``) decode skips the pages wholly behind the window instead.
5. Attention scale 1.0, not head_dim^-0.5 (M 1177): q_norm and k_norm (RMSNorm per head, M 1229,
   1245) set the logit scale. V is RMS-normalised too, without a weight (``v_norm``, M 1197, 1249).
   With ``attention_k_eq_v`` (not on E2B) V is the raw K projection (M 1175, 1243).
6. No attention-logit soft-cap: the text attention passes no ``softcap`` (M 1261-1271), so unlike
   Gemma-2 there is no score_mod; ``attn_score_mod`` stays ``None``.
7. Four norms per block, double residual (M 1397-1428): ``x += post_attention_layernorm(attn(
   input_layernorm(x)))``; ``x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``.
   RMSNorm is ``x * (mean(x^2) + eps)^-0.5 * weight`` in fp32 (M 206-215, weight not 1 + w).
8. Per-layer inputs (PLE), computed once per step (M 1711-1788): ``embed_tokens_per_layer(ids)``
   (scaled by sqrt(P), M 1595) reshaped ``[T, L, P]`` plus ``per_layer_projection_norm(
   per_layer_model_projection(embeds) * hidden^-0.5)``, summed and scaled by 2^-0.5 (M 1597, 1603).
   Each layer adds a third residual (M 1430-1438): ``x += post_per_layer_input_norm(
   per_layer_projection(act(per_layer_input_gate(x)) * ple[:, :, i]))`` (a fifth norm).
9. Per-layer scalar (M 1440): the *whole* hidden state, residual included, is multiplied by
   ``layer_scalar`` after the block (not only the branch output).
10. Double-wide MLP on KV-shared layers (M 1063-1072, ``use_double_wide_mlp``): intermediate size
   x2 there; shapes come from the modules, nothing to do.
11. Embedding scale sqrt(hidden) applied inside ``Gemma4TextScaledWordEmbedding`` in the weight
   dtype (M 1444-1456, 1576): the engine calls the module, so ``embed_scale`` stays 1.0 here.
12. Final logit soft-cap ``tanh(logits / 30) * 30`` (M 1864-1867): ``final_logit_softcap``; the
   engine applies it to fp32 logits (HF in the model dtype: bf16 on the GPU).
13. GELU-tanh activation (``hidden_activation``), used through the HF ``act_fn`` modules.
Not supported (clear errors): MoE blocks (``enable_moe_block``, M 1376-1426) and
``use_bidirectional_attention='all'`` (C 186-188).

The real google/gemma-4-E2B text config (public copies, e.g. larql's ``test_parse_gemma4_e2b_
config``) has 35 layers, full at 4, 9, ..., 34, num_kv_shared_layers 20, head_dim 256/512, 8 heads
/ 1 KV head, sliding_window 512, PLE 256 x 262,144, soft-cap 30, the rope block of item 3:
``nbhelpers.model_configs.gemma_4_e2b`` builds exactly that.

Run: ``pytest tests/engine/test_gemma4.py``.
"""

from __future__ import annotations

from typing import Any

from nbhelpers.engine.attention import sliding_window
from nbhelpers.engine.models import ArchSpec
from nbhelpers.engine.models.gemma4_model import Gemma4EngineModel, kernel_options

__all__ = ["arch_spec", "kernel_options"]  # kernel_options: re-exported for bench/gemma4_report

def arch_spec(hf_config: Any) -> ArchSpec:
    """ArchSpec of a ``Gemma4TextConfig``: sliding mask on sliding layers, final soft-cap.

    Raises:
        ValueError: ``layer_types`` missing or naming a type other than sliding/full attention.
    """
    types = list(getattr(hf_config, "layer_types", None) or [])
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if not types or bad:
        raise ValueError(f"Gemma-4 config: layer_types {bad or types} unsupported; expected "
                         "'sliding_attention'/'full_attention' per layer.")
    window = sliding_window(hf_config.sliding_window)  # one object: one BlockMask per step
    masks = tuple(window if t == "sliding_attention" else None for t in types)
    return ArchSpec(name="Gemma4ForCausalLM", has_qk_norm=True, embed_scale=1.0, attn_scale=1.0,
                    final_logit_softcap=hf_config.final_logit_softcapping, layer_masks=masks,
                    attn_score_mod=None, engine_model=Gemma4EngineModel)
