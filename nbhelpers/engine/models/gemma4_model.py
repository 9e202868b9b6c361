"""Gemma-4 text forward for the flex engine: :class:`Gemma4EngineModel` and :class:`SharedKVCache`.

Contract: same interface as :class:`nbhelpers.engine.layers.EngineModel` (``forward(input_ids,
positions, slot_mapping, attn, kv) -> [T, hidden]``, ``logits``, ``signature``, ``allocate_kv``),
over the HF ``Gemma4ForCausalLM`` modules' own tensors (live LoRA through
:mod:`nbhelpers.engine.lora`). Every line of the block follows transformers 5.17
``models/gemma4/modeling_gemma4.py``; the list of differences from the Llama block, with the line
each comes from, is the docstring of :mod:`nbhelpers.engine.models.gemma4`.

KV sharing in the paged cache: a KV-shared layer has no tensors of its own; ``SharedKVCache.k[i]``
*is* the store layer's tensor (same object), so a shared layer reads the store layer's pages through
the same ``block_table`` with its own mask (sliding or full). Nothing is copied, no dense
``[max_batch, H_kv, max_seq, D]`` side buffer exists.

Shapes: ``input_ids, positions, slot_mapping: [T]``; hidden ``[1, T, hidden]``; per-layer inputs
``[1, T, L, P]`` (L layers, P = ``hidden_size_per_layer_input``); queries ``[1, H, T, D_i]``
(prefill) or ``[B, H, 1, D_i]`` (decode); KV pool per storing layer ``[1, H_kv_i, S, D_i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbhelpers.engine.fused import rope as _rope
from nbhelpers.engine.kv_cache import KVCache
from nbhelpers.engine.layers import EngineModel, base_causal_lm
from nbhelpers.engine.lora import LiveGroup


@dataclass
class SharedKVCache(KVCache):
    """Per-layer K/V where KV-shared layers alias their store layer's tensors.

    ``store_of[i]`` is the layer whose pages layer ``i`` reads (``i`` itself for a storing layer).
    ``bytes()`` and ``copy_page()`` visit each storing layer once.
    """

    store_of: list[int] = field(default_factory=list)

    @classmethod
    def allocate_shared(cls, shapes: list[tuple[int, int] | None], store_of: list[int],
                        num_pages: int, page_size: int, dtype: Any, device: Any) -> SharedKVCache:
        """``shapes[i] = (H_kv, D)`` for a storing layer, ``None`` for a shared one.

        Raises:
            ValueError: a shared layer points at a layer that stores nothing.
        """
        import torch
        k: list[Any] = [None] * len(shapes)
        v: list[Any] = [None] * len(shapes)
        for i, shape in enumerate(shapes):
            if shape is not None:
                size = (1, shape[0], num_pages * page_size, shape[1])
                k[i] = torch.zeros(size, dtype=dtype, device=device)
                v[i] = torch.zeros(size, dtype=dtype, device=device)
        for i, src in enumerate(store_of):
            if shapes[src] is None:
                raise ValueError(f"Gemma-4 KV sharing: layer {i} reads layer {src}, which stores "
                                 "no K/V; check num_kv_shared_layers and layer_types.")
            k[i], v[i] = k[src], v[src]
        return cls(k, v, page_size, list(store_of))

    def _unique(self) -> list[Any]:
        owners = sorted(set(self.store_of))
        return [self.k[i] for i in owners] + [self.v[i] for i in owners]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._unique())

    def copy_page(self, src: int, dst: int) -> None:
        ps = self.page_size
        for t in self._unique():
            t[:, :, dst * ps:(dst + 1) * ps].copy_(t[:, :, src * ps:(src + 1) * ps])


class Gemma4EngineModel(EngineModel):
    """Flex-engine forward over a (PEFT-wrapped or plain) ``Gemma4ForCausalLM``.

    Raises:
        ValueError: MoE blocks (``enable_moe_block``, Gemma-4 26B-A4B), bidirectional attention
            (``use_bidirectional_attention='all'``) or a KV-shared layer without a store layer.
    """

    decode_kernels = ("flex", "triton")  # Triton: per-layer D (256/512), window, store layer's KV

    def __init__(self, model: Any, spec: Any, fuse_lora_a: bool = True, flex_fn: Any = None):
        _check_supported(base_causal_lm(model).config)
        super().__init__(model, spec, fuse_lora_a=fuse_lora_a, flex_fn=flex_fn)

    # ------------------------------------------------------------------ engine interface
    def _qkv_group(self, attn: Any, fuse_lora_a: bool) -> LiveGroup:
        """q/k/v of a storing layer (q/k when ``attention_k_eq_v``), q only for a KV-shared one."""
        mods = [attn.q_proj] + ([] if attn.is_kv_shared_layer else [attn.k_proj])
        if not attn.is_kv_shared_layer and attn.v_proj is not None:
            mods.append(attn.v_proj)
        return LiveGroup(mods, fuse_lora_a)

    def _init_attention(self) -> None:
        """Per-layer types, head dims, KV heads, scales (1.0, line 1177), KV store layers and PLE
        groups. ``num_kv_heads`` (the most of any layer) is the model-wide default that
        ``paged_decode`` plans with; ``config.num_key_value_heads`` raises there when layers
        differ (``attention_k_eq_v``: ``num_global_key_value_heads`` on full layers)."""
        layers, inner = self.layers, self.inner
        self.layer_types = [ly.self_attn.layer_type for ly in layers]
        self.store_of = _store_layers(layers)
        self.head_dims = [ly.self_attn.head_dim for ly in layers]
        self.kv_heads = [layers[s].self_attn.k_proj.out_features // self.head_dims[s]
                         for s in self.store_of]  # a shared layer reads its store layer's pool
        self.num_kv_heads = max(self.kv_heads)
        self.scales = [ly.self_attn.scaling for ly in layers]
        self.ple_dim = self.config.hidden_size_per_layer_input or 0
        self.ple = ([LiveGroup([ly.per_layer_input_gate]) for ly in layers],
                    [LiveGroup([ly.per_layer_projection]) for ly in layers],
                    LiveGroup([inner.per_layer_model_projection])) if self.ple_dim else None

    def live_groups(self) -> list[LiveGroup]:
        """The block's projection groups plus the per-layer-input gates and projections."""
        extra = [] if self.ple is None else self.ple[0] + self.ple[1] + [self.ple[2]]
        return super().live_groups() + extra

    def allocate_kv(self, num_pages: int, page_size: int) -> SharedKVCache:
        """Pages for the storing layers only; shared layers alias them (see module docstring)."""
        shapes = [None if self.store_of[i] != i else (self.kv_heads[i], self.head_dims[i])
                  for i in range(len(self.layers))]
        return SharedKVCache.allocate_shared(shapes, self.store_of, num_pages, page_size,
                                             self.dtype, self.device)

    def forward(self, input_ids: Any, positions: Any, slot_mapping: Any, attn: Any,
                kv: Any) -> Any:
        """Hidden states after the final norm, ``[T, hidden]``; writes K/V at ``slot_mapping``."""
        x = self.embed(input_ids).unsqueeze(0)  # [1, T, hidden]; sqrt(hidden) inside (l. 1576)
        ple = self.per_layer_inputs(input_ids, x)  # once per step  [1, T, L, P]
        rope = {t: self.rotary(x, positions.unsqueeze(0), t)  # once per step per layer type
                for t in sorted(set(self.layer_types))}
        if self._fused(attn):
            return self._decode_fused(x, ple, rope, slot_mapping, attn, kv)
        for i, layer in enumerate(self.layers):
            h = self._attention(i, layer, layer.input_layernorm(x), rope[self.layer_types[i]],
                                slot_mapping, attn, kv)
            x = x + layer.post_attention_layernorm(h)
            gate, up = self.gate_up[i](layer.pre_feedforward_layernorm(x))
            h = self.down[i](layer.mlp.act_fn(gate) * up)[0]
            x = x + layer.post_feedforward_layernorm(h)
            if ple is not None:
                x = x + self._per_layer_branch(i, layer, x, ple[:, :, i])
            x = x * layer.layer_scalar
        return self.norm(x)[0]

    def _fused(self, attn: Any) -> bool:
        """Decode through the Triton kernels (``fused_elementwise="triton"``): GELU-tanh MLPs
        and CUDA tensors (or the CPU under the interpreter), else the module path."""
        fx = self.fx_decode
        return (attn.is_decode and getattr(fx, "kind", "off") == "triton" and
                getattr(self.config, "hidden_activation", None) == "gelu_pytorch_tanh" and
                fx.supported(self.embed.weight))

    def _decode_fused(self, x: Any, ple: Any, rope: dict, slot_mapping: Any, attn: Any,
                      kv: Any) -> Any:
        """The decode block of :meth:`forward` with every norm/residual/scale pair in one
        ``add_norm`` launch (``fused_norm.py``): ``x + post_attn(h)`` with ``pre_ff``;
        ``x + post_ff(m)`` (with the next ``input_layernorm`` and ``layer_scalar`` when there is
        no per-layer input); ``(x + post_ple(p)) * layer_scalar`` with the next norm."""
        fx, n = self.fx_decode, len(self.layers)
        h = fx.add_norm(x, out_norm=_gnorm(self.layers[0].input_layernorm), store_res=False)[1]
        for i, layer in enumerate(self.layers):
            a = self._attention(i, layer, h, rope[self.layer_types[i]], slot_mapping, attn, kv)
            x, h = fx.add_norm(a, x, out_norm=_gnorm(layer.pre_feedforward_layernorm),
                               delta_norm=_gnorm(layer.post_attention_layernorm))
            gate, up = self.gate_up[i](h)
            m = self.down[i](fx.act_mul(gate, up, "gelu_tanh"))[0]
            nxt = _gnorm(self.layers[i + 1].input_layernorm if i + 1 < n else self.norm)
            post_ff, scale = _gnorm(layer.post_feedforward_layernorm), layer.layer_scalar
            if ple is None:
                x, h = fx.add_norm(m, x, out_norm=nxt, delta_norm=post_ff, scale=scale)
                continue
            x = fx.add_norm(m, x, delta_norm=post_ff)[0]
            g, ple_i = self.ple[0][i](x)[0], ple[:, :, i]
            p = fx.act_mul(g, ple_i, "gelu_tanh") if g.dtype == ple_i.dtype else \
                layer.act_fn(g) * ple_i  # HF's promotion when the dtypes differ
            x, h = fx.add_norm(self.ple[1][i](p)[0], x, out_norm=nxt, scale=scale,
                               delta_norm=_gnorm(layer.post_per_layer_input_norm))
        return h[0]

    # ------------------------------------------------------------------ pieces
    def per_layer_inputs(self, input_ids: Any, x: Any) -> Any:
        """HF ``get_per_layer_inputs`` + ``project_per_layer_inputs`` (lines 1711-1788).

        Shapes: ``input_ids [T]``, ``x [1, T, hidden]`` (scaled embeddings) -> ``[1, T, L, P]``,
        or ``None`` when the model has no per-layer inputs.
        """
        if self.ple is None:
            return None
        inner, n = self.inner, len(self.layers)
        tok = inner.embed_tokens_per_layer(input_ids).view(1, -1, n, self.ple_dim)
        proj = self.ple[2](x)[0] * inner.per_layer_model_projection_scale
        proj = inner.per_layer_projection_norm(proj.view(1, -1, n, self.ple_dim))
        return (proj + tok) * inner.per_layer_input_scale

    def _per_layer_branch(self, i: int, layer: Any, x: Any, ple_i: Any) -> Any:
        """``norm(proj(act(gate(x)) * ple_i))`` (lines 1431-1438); ``x [1, T, hidden]``."""
        h = layer.act_fn(self.ple[0][i](x)[0]) * ple_i
        return layer.post_per_layer_input_norm(self.ple[1][i](h)[0])

    def _attention(self, i: int, layer: Any, h: Any, cos_sin: tuple[Any, Any],
                   slot_mapping: Any, attn: Any, kv: Any) -> Any:
        sa, t, d = layer.self_attn, h.shape[1], self.head_dims[i]
        cos, sin = cos_sin
        outs = self.qkv[i](h)
        if self._fused(attn):  # q/k/v norms + RoPE + KV write in one launch
            q = self._qkv_fused(i, sa, outs, d, cos, sin, slot_mapping, kv)
        else:
            q = _rope(sa.q_norm(outs[0].view(1, t, -1, d)).transpose(1, 2), cos, sin)
            if self.store_of[i] == i:
                self._store_kv(i, sa, outs, t, d, cos, sin, slot_mapping, kv)
        src = self.store_of[i]
        if attn.is_decode and attn.paged_decode is not None:  # Triton kernel, store layer's pages
            out = attn.paged_decode(i, q[0].transpose(0, 1), kv.k[src], kv.v[src], self.scales[i])
            return self.o[i](out.reshape(1, t, -1))[0]  # out [B, H, D]
        if attn.is_decode:
            q = q[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        out = self.flex(q, kv.k[src], kv.v[src], block_mask=attn.block_masks[i],
                        scale=self.scales[i], enable_gqa=True,
                        kernel_options=_layer_kernel_options(attn, q, d))
        out = out.squeeze(2).unsqueeze(0) if attn.is_decode else out.transpose(1, 2)
        return self.o[i](out.reshape(1, t, -1))[0]

    def _qkv_fused(self, i: int, sa: Any, outs: list[Any], d: int, cos: Any, sin: Any,
                   slot_mapping: Any, kv: Any) -> Any:
        """``qk_rope_cache.qk_norm_rope_cache`` for one layer: q ``[1, H, T, D]``; a storing
        layer's k_norm+RoPE K and v_norm V (raw K when ``attention_k_eq_v``) into the pool."""
        store = self.store_of[i] == i
        k = outs[1] if store else None
        v = (outs[2] if len(outs) == 3 else outs[1]) if store else None
        wk = sa.k_norm.weight if store else sa.q_norm.weight
        q = self.fx_decode.qk_norm_rope_cache(
            outs[0], k, v, outs[0].shape[-1] // d, k.shape[-1] // d if store else 0, d, cos,
            sin, kv.k[i] if store else None, kv.v[i] if store else None, slot_mapping,
            qk_norm=(sa.q_norm.weight, wk, sa.q_norm.eps, "gemma"),
            v_norm=(sa.v_norm.eps, "gemma") if store else None)
        return q.transpose(0, 1).unsqueeze(0)

    def _store_kv(self, i: int, sa: Any, outs: list[Any], t: int, d: int, cos: Any, sin: Any,
                  slot_mapping: Any, kv: Any) -> None:
        """k_norm + RoPE on K, v_norm on V (K itself when ``attention_k_eq_v``), into the pool."""
        k_raw = outs[1].view(1, t, -1, d)
        v_raw = outs[2].view(1, t, -1, d) if len(outs) == 3 else k_raw  # line 1243
        k = _rope(sa.k_norm(k_raw).transpose(1, 2), cos, sin)  # [1, H_kv, T, D]
        v = sa.v_norm(v_raw).transpose(1, 2)
        kv.k[i][0].index_copy_(1, slot_mapping, k[0])
        kv.v[i][0].index_copy_(1, slot_mapping, v[0])


# flex_attention kernel options per (head_dim, is_decode) on CUDA; absent = the runner's options
# (prefill tiles 64 x 64, 2 stages: 32 + 2 x 64 = 160 KiB of shared memory at head_dim 256) or
# torch's decode defaults (BLOCK_N 64, 1 stage: 16 + 128 KiB at 512). Prefill at head_dim 512 needs
# smaller tiles: Q 32 x 512 (32 KiB) + 2 stages x (K + V) 32 x 512 (128 KiB) = 160 KiB < 227 KiB
# (H200 shared memory per block); see bench/gemma4_kernels.py for the measured alternatives.
_KERNEL_OPTIONS: dict[tuple[int, bool], dict[str, Any]] = {
    (512, False): {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4},
}


def kernel_options(head_dim: int, is_decode: bool) -> dict[str, Any] | None:
    """flex_attention ``kernel_options`` for a head_dim on the GPU, or ``None`` (defaults).

    Args: ``head_dim`` of the layer (256 sliding / 512 full on E2B); ``is_decode``: one query
    per row (flex decoding kernel) vs packed prefill.
    """
    return _KERNEL_OPTIONS.get((head_dim, is_decode))


def _layer_kernel_options(attn: Any, q: Any, head_dim: int) -> dict[str, Any] | None:
    """This head_dim's flex ``kernel_options`` on CUDA (:func:`kernel_options`), else the
    runner's (``attn.kernel_options``: its prefill tiles, sized for head_dim 128)."""
    if q.device.type != "cuda":
        return attn.kernel_options
    own = kernel_options(head_dim, is_decode=attn.is_decode)
    return dict(own) if own is not None else attn.kernel_options


def _gnorm(module: Any) -> tuple[Any, float, str]:
    """``(weight | None, eps, "gemma")`` of an HF ``Gemma4RMSNorm`` for ``fused_norm.add_norm``."""
    return (module.weight if module.with_scale else None), float(module.eps), "gemma"


def _store_layers(layers: list[Any]) -> list[int]:
    """``store_of[i]``: ``i`` for a storing layer, else the last non-shared layer of the same
    type (HF ``store_full_length_kv``, lines 1183-1187, read back at line 1237).

    Raises:
        ValueError: a KV-shared layer whose layer type has no store layer.
    """
    stores = {ly.self_attn.layer_type: i for i, ly in enumerate(layers)
              if ly.self_attn.store_full_length_kv}
    out = []
    for i, ly in enumerate(layers):
        sa = ly.self_attn
        if sa.is_kv_shared_layer and sa.layer_type not in stores:
            raise ValueError(f"Gemma-4 layer {i} ({sa.layer_type}) shares KV but no earlier "
                             "layer of that type stores it: lower num_kv_shared_layers.")
        out.append(stores[sa.layer_type] if sa.is_kv_shared_layer else i)
    return out


def _check_supported(cfg: Any) -> None:
    if getattr(cfg, "enable_moe_block", False):
        raise ValueError("flex engine: Gemma-4 MoE blocks (enable_moe_block=True, e.g. 26B-A4B) "
                         "are not implemented; use a dense Gemma-4 (E2B/E4B/31B) or hf_generate.")
    if getattr(cfg, "use_bidirectional_attention", None) == "all":
        raise ValueError("flex engine: use_bidirectional_attention='all' is not causal LM "
                         "decoding; set it to None for rollouts.")

