"""The engine's forward pass over the HF model's own modules (no copy of any weight).

Contract: :class:`EngineModel` wraps a ``*ForCausalLM`` (or a PEFT ``PeftModel`` around one) and
runs a packed token batch against the paged KV cache. It calls the HF modules for embeddings,
RMSNorms (incl. Qwen3's q/k norms), rotary cos/sin (so llama3 RoPE scaling is HF's own code) and the
MLP activation; projections go through :mod:`nbhelpers.engine.lora` (live LoRA). Attention is
``flex_attention`` over the paged cache with the BlockMasks of :mod:`nbhelpers.engine.attention`.

Shapes: ``input_ids, positions, slot_mapping: [T]``; hidden ``[1, T, hidden]``; prefill queries
``[1, H, T, D]``; decode queries ``[B, H, 1, D]`` (T = B, one token per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbhelpers.engine.fused import Elementwise, norm_params, rope
from nbhelpers.engine.kv_cache import KVCache
from nbhelpers.engine.l2_prefetch import L2Prefetch
from nbhelpers.engine.lora import LiveGroup, storage_signature
from nbhelpers.engine.mlp_block import MlpBlock


@dataclass
class AttnBatch:
    """Per-step attention metadata: one BlockMask per layer and whether queries are one per row.

    ``block_masks[i]`` is layer ``i``'s mask (layers with the same mask factory share one object):
    a flex ``BlockMask``, or an ``attention.SdpaMask`` plan (CPU default ``"sdpa"`` kernels), which
    the model's attention function (``attention.paged_attention``) routes to SDPA.
    ``paged_decode``: when set (decode with ``decode_attention="triton"``), models that list
    ``"triton"`` in ``decode_kernels`` call ``paged_decode(i, q [B, H, D], k_cache, v_cache,
    scale) -> [B, H, D]`` instead of flex (``block_masks`` are then ``None``).
    """

    block_masks: list[Any]
    is_decode: bool
    kernel_options: dict[str, Any] | None = None
    paged_decode: Any = None


def flex_attention_fn(compiled: bool, dynamo_limits: bool = False) -> Any:
    """``flex_attention``, ``torch.compile``d (``dynamic=False``) when ``compiled``.
    ``dynamo_limits``: raise dynamo's recompile limits (one compile per batch bucket and
    prefill length: 64 per function, 512 in all) because something in the runner compiles."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    if dynamo_limits:
        torch._dynamo.config.cache_size_limit = 64
        torch._dynamo.config.accumulated_cache_size_limit = 512
    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def base_causal_lm(model: Any) -> Any:
    """The ``*ForCausalLM`` under a PEFT wrapper (``PeftModel.get_base_model()``) or itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class EngineModel:
    """Forward over an HF causal LM's parameters; see the module docstring.

    Built by :func:`nbhelpers.engine.models.build_engine_model` with the architecture's
    ``ArchSpec``. What the runner uses, for every architecture: ``spec``, ``config``, ``layers``,
    ``decode_kernels``, ``fx_eager``/``fx_decode``/``fx_prefill`` (eager / decode's compiled
    or Triton elementwise pieces and sampler / prefill's pieces, eager unless the runner option
    ``prefill_elementwise="triton"``), ``live_groups()``, ``compile_elementwise()``, ``allocate_kv``, ``signature``,
    ``forward``, ``logits``, ``device``/``dtype``, ``l2`` (the runner's
    :class:`~nbhelpers.engine.l2_prefetch.L2Prefetch`: forked after each layer's qkv GEMM,
    joined before its o_proj; Gemma-4's own attention block does not prefetch). A subclass (Gemma-4) changes the block through
    the overridable ``_qkv_group``, ``_init_attention``, ``live_groups``, ``allocate_kv`` and
    ``forward``, never by skipping this constructor.

    Raises:
        ValueError: more than one LoRA adapter (from :class:`LiveGroup`).
    """

    decode_kernels: tuple[str, ...] = ("flex", "triton")
    """``RunnerOptions.decode_attention`` values the model serves."""

    def __init__(self, model: Any, spec: Any, fuse_lora_a: bool = True, flex_fn: Any = None):
        self.hf = base_causal_lm(model)
        self.config = self.hf.config
        self.spec = spec  # nbhelpers.engine.models.ArchSpec
        self.inner = inner = self.hf.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.lm_head = self.hf.lm_head
        self.layers = list(inner.layers)
        self.num_heads = self.config.num_attention_heads
        self.qkv = [self._qkv_group(ly.self_attn, fuse_lora_a) for ly in self.layers]
        self.o = [LiveGroup([ly.self_attn.o_proj]) for ly in self.layers]
        self.gate_up = [LiveGroup([ly.mlp.gate_proj, ly.mlp.up_proj], fuse_lora_a)
                        for ly in self.layers]
        self.down = [LiveGroup([ly.mlp.down_proj]) for ly in self.layers]
        self.flex = flex_fn or flex_attention_fn(compiled=False)
        self.fx_eager = self.fx_decode = Elementwise(compiled=False)
        self.fx_prefill = self.fx_eager  # runner option prefill_elementwise="triton": kernels
        self.skinny: Any = None  # skinny_linear.SkinnyLinear: decode GEMMs (set_skinny_gemm)
        self.l2 = L2Prefetch("off", None)  # o_proj weight prefetch (runner option l2_prefetch)
        self.mlp_block = MlpBlock()  # decode MLP in one launch (runner option mlp_block)
        self._init_attention()

    def _qkv_group(self, attn: Any, fuse_lora_a: bool) -> LiveGroup:
        """The q/k/v projections of one attention module as one group."""
        return LiveGroup([attn.q_proj, attn.k_proj, attn.v_proj], fuse_lora_a)

    def _init_attention(self) -> None:
        """Llama-block geometry: one head_dim, KV-head count and softmax scale for all layers."""
        cfg = self.config
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = self.spec.attn_scale or getattr(self.layers[0].self_attn, "scaling",
                                                     self.head_dim ** -0.5)
        self._silu = getattr(cfg, "hidden_act", None) == "silu"

    def live_groups(self) -> list[LiveGroup]:
        """Every projection group (the runner refreshes them and sets their LoRA-B kernel)."""
        return self.qkv + self.o + self.gate_up + self.down

    def set_skinny_gemm(self, route: Any) -> None:
        """Decode GEMMs of every group and the LM head through ``route`` (a
        :class:`nbhelpers.engine.skinny_linear.SkinnyLinear`; ``None``: ``F.linear``)."""
        self.skinny = route
        for group in self.live_groups():
            group.set_skinny_gemm(route)

    def set_mlp_block(self, mode: str) -> None:
        """Decode MLPs as one Triton launch where :class:`~nbhelpers.engine.mlp_block.MlpBlock`
        serves them (``mode="triton"``), else the unfused path (``"off"``); raises ``ValueError``
        for another mode."""
        self.mlp_block = MlpBlock(mode, len(self.layers), self.config.hidden_size, self.device,
                                  silu=getattr(self, "_silu", False))

    def compile_elementwise(self, kind: str = "compile", compile_sample: bool = True,
                            sample_kernel: str = "torch") -> None:
        """Decode uses torch.compiled (``kind="compile"``) or Triton (``"triton"``, sampler
        compiled iff ``compile_sample``) norm/RoPE/SwiGLU pieces, or eager ones (``"off"``),
        and the sampler ``sample_kernel`` picks (see :mod:`.fused`)."""
        self.fx_decode = Elementwise(kind=kind, compile_sample=compile_sample,
                                     sample_kernel=sample_kernel)

    @property
    def dtype(self) -> Any:
        return self.embed.weight.dtype

    @property
    def device(self) -> Any:
        return self.embed.weight.device

    def allocate_kv(self, num_pages: int, page_size: int) -> KVCache:
        """The paged KV pool this model reads (one ``[1, H_kv, S, D]`` pair per layer)."""
        return KVCache.allocate(len(self.layers), self.num_kv_heads, self.head_dim, num_pages,
                                page_size, self.dtype, self.device)

    def signature(self) -> tuple:
        """Storage pointers of every projection tensor and each part's adapter, LoRA on/off and
        scaling (CUDA-graph staleness guard, ``lora.storage_signature``)."""
        return storage_signature(self.live_groups())

    def forward(self, input_ids: Any, positions: Any, slot_mapping: Any, attn: AttnBatch,
                kv: Any) -> Any:
        """Hidden states after the final norm, ``[T, hidden]``; writes K/V at ``slot_mapping``."""
        x = self.embed(input_ids).unsqueeze(0)  # [1, T, hidden]
        if self.spec.embed_scale != 1.0:
            x = x * self.spec.embed_scale
        cos, sin = self.rotary(x, positions.unsqueeze(0))  # [1, T, D], once for all layers
        fx = self.fx_decode if attn.is_decode else self.fx_prefill
        blk = self.mlp_block if attn.is_decode and self.mlp_block.enabled else None
        if blk is not None:
            blk.begin(x.shape[1])  # zeroes this step's accumulators (one memset)
        h = self._norm(fx, self.layers[0].input_layernorm, x) if self.layers else x
        for i, layer in enumerate(self.layers):
            x, h = self._add_norm(fx, layer.post_attention_layernorm, x,
                                  *self._attention(i, layer, h, cos, sin, slot_mapping, attn, kv))
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            out = blk(i, h, self.gate_up[i], self.down[i], fx) if blk is not None else None
            lora = None  # the block's output has down's LoRA in it
            if out is None:
                (gate, up), lora = self._project(fx, self.gate_up[i], h)
                act = self._act(fx, layer, gate, up, lora)
                down, lora = self._project(fx, self.down[i], act)
                out = down[0]
            x, h = self._add_norm(fx, nxt, x, out, lora)
        return h[0]

    def _act(self, fx: Elementwise, layer: Any, gate: Any, up: Any, lora: Any) -> Any:
        """``act_fn(gate) * up``; ``lora``: the gate_up group's pending LoRA B (:meth:`_project`),
        added by the SiLU kernel, or first where the activation is not SiLU."""
        if self._silu:
            return fx.silu_mul(gate, up) if lora is None else fx.silu_mul(gate, up, lora=lora)
        if lora is not None:
            lora.apply()
        return layer.mlp.act_fn(gate) * up

    @staticmethod
    def _project(fx: Elementwise, group: LiveGroup, x: Any) -> tuple[list[Any], Any]:
        """``(group(x), None)``, or the base outputs and the pending LoRA B
        (``lora_pending.PendingLora``) when ``fx``'s kernels add it (``lora_expand="consumer"``
        with ``fused_elementwise="triton"``, decode); the caller passes it on as ``lora=``."""
        return group.deferred(x) if fx.takes_lora else (group(x), None)

    @staticmethod
    def _norm(fx: Elementwise, module: Any, x: Any) -> Any:
        params = norm_params(module)
        return fx.rms_norm(x, *params) if params else module(x)

    @staticmethod
    def _add_norm(fx: Elementwise, module: Any, x: Any, delta: Any,
                  lora: Any = None) -> tuple[Any, Any]:
        """``x + delta`` and its norm: one fused call for HF RMSNorms, else the module.
        ``lora``: ``delta``'s pending LoRA B (:meth:`_project`), added by the fused call."""
        params = norm_params(module)
        if params and lora is not None:
            return fx.add_rms_norm(x, delta, *params, lora=lora)
        if params:
            return fx.add_rms_norm(x, delta, *params)
        if lora is not None:
            lora.apply()
        x = x + delta
        return x, module(x)

    def _qk_rope_write(self, i: int, layer: Any, q: Any, k: Any, v: Any, qn: Any, kn: Any,
                       cos: Any, sin: Any, slot_mapping: Any, kv: Any, fx: Elementwise) -> Any:
        """q/k norm + RoPE and the KV write as torch ops; q ``[1, H, T, D]``."""
        t = q.shape[1]
        if self.spec.has_qk_norm and (qn is None or kn is None or qn[1] != kn[1]):
            q, k = layer.self_attn.q_norm(q), layer.self_attn.k_norm(k)
            q, k = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)
        else:
            q, k = fx.qk_norm_rope(q, k, qn and qn[0], kn and kn[0], qn[1] if qn else 0.0,
                                   cos, sin)
        v = v.view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        kv.k[i][0].index_copy_(1, slot_mapping, k[0])  # [H_kv, T, D] into physical slots
        kv.v[i][0].index_copy_(1, slot_mapping, v[0])
        return q

    def logits(self, hidden: Any, upcast: bool = True) -> Any:
        """LM head ``[N, vocab]``, fp32 (soft-capped when the architecture says so).

        ``upcast=False`` (the decode step): without a soft cap the head's own dtype is returned,
        for samplers that upcast on read (``sampler.sample`` casts first, ``vocab_sample`` in
        registers): the same values, without a ``[N, vocab]`` fp32 copy kernel a step (14 us at
        Qwen3-4B batch 64 on the H200, 2026-12-07 profile's ``direct_copy``)."""
        import torch
        head, route = self.lm_head, self.skinny
        plain = isinstance(head, torch.nn.Linear) and not hasattr(head, "lora_A")
        if route is not None and plain and route.serves(hidden, head.weight, head.bias):
            out = route(hidden, head.weight, head.bias)  # read at call time (tied too)
        else:
            out = head(hidden)
        cap = self.spec.final_logit_softcap
        if cap:
            out = out.float()
            return cap * (out / cap).tanh()
        return out.float() if upcast else out

    def _attention(self, i: int, layer: Any, h: Any, cos: Any, sin: Any, slot_mapping: Any,
                   attn: AttnBatch, kv: Any) -> tuple[Any, Any]:
        """``(o_proj output [1, T, hidden], its pending LoRA B or None)`` (:meth:`_project`)."""
        t = h.shape[1]
        fx = self.fx_decode if attn.is_decode else self.fx_prefill
        (q, k, v), lora = self._project(fx, self.qkv[i], h)
        self.l2.fork(self.o[i])  # decode only: o_proj's weight into L2 beside attention
        q = q.view(1, t, self.num_heads, self.head_dim)
        k = k.view(1, t, self.num_kv_heads, self.head_dim)
        qn = norm_params(layer.self_attn.q_norm) if self.spec.has_qk_norm else None
        kn = norm_params(layer.self_attn.k_norm) if self.spec.has_qk_norm else None
        hf_norms = self.spec.has_qk_norm and (qn is None or kn is None or qn[1] != kn[1])
        if fx.qk_rope_cache is not None and not hf_norms:  # one kernel, KV written inside
            q = fx.qk_rope_cache(q, k, v, qn and qn[0], kn and kn[0], qn[1] if qn else 0.0,
                                 cos, sin, (kv.k[i], kv.v[i], slot_mapping),
                                 (self.num_heads, self.num_kv_heads, self.head_dim), lora=lora)
        else:
            if lora is not None:  # HF norm modules read q/k: add LoRA B first
                lora.apply()
            q = self._qk_rope_write(i, layer, q, k, v, qn, kn, cos, sin, slot_mapping, kv, fx)
        if attn.is_decode and attn.paged_decode is not None:  # Triton split-KV kernel
            out = attn.paged_decode(i, q[0].transpose(0, 1), kv.k[i], kv.v[i], self.scale)
            return self._o_proj(fx, i, out.reshape(1, t, -1))  # out [B, H, D]
        if attn.is_decode:
            q = q[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        out = self.flex(q, kv.k[i], kv.v[i], score_mod=self.spec.attn_score_mod,
                        block_mask=attn.block_masks[i], scale=self.scale, enable_gqa=True,
                        kernel_options=attn.kernel_options)
        out = out.squeeze(2).unsqueeze(0) if attn.is_decode else out.transpose(1, 2)
        return self._o_proj(fx, i, out.reshape(1, t, -1))

    def _o_proj(self, fx: Elementwise, i: int, out: Any) -> tuple[Any, Any]:
        self.l2.join()  # the prefetch (side stream) ordered before o_proj (l2_prefetch.py)
        outs, lora = self._project(fx, self.o[i], out)
        return outs[0], lora

