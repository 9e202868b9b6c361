"""Elementwise pieces of the Llama/Qwen3 block as pure functions, optionally torch.compiled.

Contract: each function repeats the HF op sequence it replaces (same dtype order), so eager results
are bit-identical to calling the HF modules:

- :func:`rms_norm` = ``Qwen3RMSNorm`` / ``LlamaRMSNorm.forward`` (transformers
  ``models/qwen3/modeling_qwen3.py``): fp32 upcast, ``x * rsqrt(mean(x^2) + eps)``, cast back,
  times the weight. :func:`add_rms_norm` adds the residual first and returns both.
- :func:`qk_norm_rope`: Qwen3's per-head q/k RMSNorm then HF ``apply_rotary_pos_emb``
  (rotate_half form) on ``q [1, T, H, D]``, ``k [1, T, H_kv, D]`` -> ``[1, H, T, D]`` each.
- :func:`silu_mul`: the MLP's ``act_fn(gate) * up`` with ``act_fn = silu``.
- ``sample``: :func:`nbhelpers.engine.sampler.sample` (hash noise, min_p/top-k/top-p, race),
  ~60 passes over ``[B, vocab]`` eager; compiled, a few fused kernels.

Eager, each is 5-25 aten ops (one CUDA kernel each); :class:`Elementwise` with ``compiled=True``
wraps them in ``torch.compile(dynamic=False, fullgraph=True)`` (inductor, no cudagraphs: the
runner captures the whole decode step itself, DESIGN.md "Flex engine: where the speed is"), which
fuses each into one or two Triton kernels. The runner uses the compiled set for decode only
(one shape per batch bucket); prefill lengths vary, so prefill stays eager.
"""

from __future__ import annotations

from typing import Any

from nbhelpers.engine.sampler import check_sample_kernel

HF_RMS_NORMS = frozenset({"Qwen3RMSNorm", "LlamaRMSNorm"})
"""HF norm classes whose forward :func:`rms_norm` reproduces (others are called as modules)."""


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """HF RMSNorm over the last dim; any leading shape; returns ``x``'s dtype times weight."""
    import torch
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: Any, delta: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """Residual add then RMSNorm: ``(x + delta, rms_norm(x + delta))``, shapes ``[..., hidden]``.
    A ``delta`` of another dtype (an fp32 split-GEMM sum, ``engine/mlp_block.py``) is rounded to
    ``x``'s first, as that GEMM's epilogue would."""
    x = x + (delta if delta.dtype == x.dtype else delta.to(x.dtype))
    return x, rms_norm(x, weight, eps)


def rope(x: Any, cos: Any, sin: Any) -> Any:
    """HF ``apply_rotary_pos_emb`` (rotate_half): ``x [1, H, T, D]``, ``cos/sin [1, T, D]``."""
    import torch
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope(q: Any, k: Any, wq: Any, wk: Any, eps: float, cos: Any,
                 sin: Any) -> tuple[Any, Any]:
    """Per-head RMSNorm (skipped when ``wq`` is ``None``) and RoPE; ``[1, T, H, D]`` in,
    ``[1, H, T, D]`` out for q and k."""
    if wq is not None:
        q, k = rms_norm(q, wq, eps), rms_norm(k, wk, eps)
    return rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)


def silu_mul(gate: Any, up: Any) -> Any:
    """``silu(gate) * up`` (SwiGLU MLP), shapes ``[..., intermediate]``."""
    import torch.nn.functional as F
    return F.silu(gate) * up


# ---------------------------------------------------------------- Triton twins (kind="triton")
# Each has its torch twin's signature and result (same shapes and dtype order, equal up to
# rounding: kernels/fused_norm.py, kernels/qk_rope_cache.py) and falls back to the twin where the
# kernel cannot serve the operands. Per Llama/Qwen3 decode layer: 1 triton_qk_rope_cache (q/k
# norm + RoPE + both KV writes) + 2 triton_add_rms_norm + 1 triton_silu_mul.


def triton_rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """:func:`rms_norm` in one launch (``kernels/fused_norm.py``)."""
    from nbhelpers.engine.kernels import fused_norm as fn
    if not (fn.supported(x, weight) and weight.dtype == x.dtype):
        return rms_norm(x, weight, eps)
    return fn.add_norm(x, out_norm=(weight, eps, "llama"), store_res=False)[1]


def triton_add_rms_norm(x: Any, delta: Any, weight: Any, eps: float,
                        lora: Any = None) -> tuple[Any, Any]:
    """:func:`add_rms_norm` (``(x + delta, norm(x + delta))``) in one launch. ``lora``: the
    pending LoRA B of the projection ``delta`` comes from (``lora_pending.PendingLora``, one
    part; ``lora_expand="consumer"``), added inside the kernel, or first (``apply()``) where the
    kernel does not serve it."""
    from nbhelpers.engine.kernels import fused_norm as fn
    ok = fn.supported(x, delta, weight) and weight.dtype == x.dtype and (
        delta.dtype == x.dtype or fn.rounds_delta(delta, x))
    lora = _take_lora(lora, ok and lora is not None and fn.lora_supported(lora, 1, delta))
    if not ok:
        return add_rms_norm(x, delta, weight, eps)
    return fn.add_norm(delta, x, out_norm=(weight, eps, "llama"), lora=lora)


def _take_lora(lora: Any, kernel_adds_it: bool) -> Any:
    """``lora`` when the kernel adds it, else ``None`` after adding it in place (``apply()``)."""
    if lora is None or kernel_adds_it:
        return lora
    lora.apply()
    return None


def triton_silu_mul(gate: Any, up: Any, lora: Any = None) -> Any:
    """:func:`silu_mul` in one launch; ``lora``: the gate_up group's pending LoRA B (two parts,
    as :func:`triton_add_rms_norm`'s)."""
    from nbhelpers.engine.kernels import fused_norm as fn
    ok = fn.supported(gate, up) and gate.dtype == up.dtype
    lora = _take_lora(lora, ok and lora is not None and fn.lora_supported(lora, 2, gate, up))
    if not ok:
        return silu_mul(gate, up)
    return fn.act_mul(gate, up, "silu", lora=lora)


def triton_qk_rope_cache(q: Any, k: Any, v: Any, wq: Any, wk: Any, eps: float, cos: Any,
                         sin: Any, kv: tuple[Any, Any, Any], heads: tuple[int, int, int],
                         lora: Any = None) -> Any:
    """q/k RMSNorm (skipped when ``wq`` is ``None``) + RoPE + KV write; returns q ``[1, H, T, D]``.

    Args: ``q, k, v`` the q/k/v projections ``[1, T, *]``; ``cos/sin [1, T, D]``; ``kv =
    (k_cache, v_cache, slot_mapping)`` with caches ``[1, H_kv, S, D]`` and ``slot_mapping [T]``;
    ``heads = (H, H_kv, D)``. Writes ``k_cache[0, :, slot_mapping]`` and ``v_cache[...]`` as
    ``layers.EngineModel._attention``'s ``index_copy_`` did (``kernels/qk_rope_cache.py``).
    ``lora``: the q/k/v group's pending LoRA B (three parts, as :func:`triton_add_rms_norm`'s).
    """
    from nbhelpers.engine.kernels import fused_norm as fn
    from nbhelpers.engine.kernels import qk_rope_cache as qrc
    kc, vc, slots = kv
    h, hkv, d = heads
    t = q.shape[1]
    ok = qrc.supported(q, cos, kc, d) and not (wq is not None and wq.dtype != q.dtype)
    lora = _take_lora(lora, ok and lora is not None and fn.lora_supported(lora, 3, q, k, v))
    if not ok:
        qr, kr = qk_norm_rope(q.view(1, t, h, d), k.view(1, t, hkv, d), wq, wk, eps, cos, sin)
        kc[0].index_copy_(1, slots, kr[0])
        vc[0].index_copy_(1, slots, v.view(1, t, hkv, d).transpose(1, 2)[0])
        return qr
    out = qrc.qk_norm_rope_cache(q, k, v, h, hkv, d, cos, sin, kc, vc, slots,
                                 qk_norm=None if wq is None else (wq, wk, eps, "llama"),
                                 lora=lora)
    return out.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D] (a view)


ELEMENTWISE_MODES = ("off", "compile", "triton")
"""``Elementwise.kind``: eager torch ops, torch.compiled pieces, or the Triton kernels of
``engine/kernels/fused_norm.py`` / ``qk_rope_cache.py`` (one launch per piece, plus
:meth:`Elementwise.qk_rope_cache`, which also writes the KV cache)."""


class Elementwise:
    """The functions above, eager (``kind="off"``), compiled (``"compile"``: one inductor graph
    each) or as Triton kernels (``"triton"``; ``sample`` compiled iff ``compile_sample``).
    ``sample_kernel="triton"`` (any kind): ``sample`` calls with ``use_sort=False`` go to
    ``engine/kernels/vocab_sample.py`` (two launches), the others to the sampler chosen above.
    ``compiled`` is True for any kind but ``"off"`` (the graph capture's eager retry and
    ``bench.profile`` count each piece as one launch). ``qk_rope_cache`` is ``None`` unless
    ``kind="triton"``. ``takes_lora`` (``kind="triton"``): ``add_rms_norm``, ``silu_mul`` and
    ``qk_rope_cache`` accept ``lora=`` (a pending LoRA B, ``lora_expand="consumer"``)."""

    NAMES = ("rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul", "sample")

    def __init__(self, compiled: bool = False, kind: str | None = None,
                 compile_sample: bool | None = None, sample_kernel: str = "torch"):
        import functools

        import torch

        from nbhelpers.engine.sampler import sample
        self.kind = kind or ("compile" if compiled else "off")
        if self.kind not in ELEMENTWISE_MODES:
            raise ValueError(f"Elementwise kind={self.kind!r}: use one of {ELEMENTWISE_MODES}.")
        self.compiled = self.kind != "off"
        self.takes_lora = self.kind == "triton"  # consumers accept lora= (lora_pending.py)
        self.qk_rope_cache: Any = None
        comp = self.kind == "compile"
        for name in self.NAMES:
            fn = sample if name == "sample" else globals()[name]
            on = comp or (name == "sample" and self.kind == "triton" and compile_sample)
            setattr(self, name, torch.compile(fn, dynamic=False, fullgraph=True) if on else fn)
        if check_sample_kernel(sample_kernel) == "triton":  # min_p-only steps: 2 Triton launches
            from nbhelpers.engine.kernels import vocab_sample
            self.sample = functools.partial(vocab_sample.routed_sample, fallback=self.sample)
        if self.kind == "triton":
            self._use_triton()

    def _use_triton(self) -> None:
        """Norms, SwiGLU and q/k norm + RoPE + KV write through the Triton kernels."""
        from nbhelpers.engine.kernels import fused_norm as fn
        from nbhelpers.engine.kernels import qk_rope_cache as qrc
        self.rms_norm, self.add_rms_norm = triton_rms_norm, triton_add_rms_norm
        self.silu_mul, self.qk_rope_cache = triton_silu_mul, triton_qk_rope_cache
        # the raw kernels, for Gemma-4's decode (gemma-style norms, layer_scalar, GELU-tanh)
        self.add_norm, self.act_mul = fn.add_norm, fn.act_mul
        self.qk_norm_rope_cache, self.supported = qrc.qk_norm_rope_cache, fn.supported
        self.NAMES = (*Elementwise.NAMES, "qk_rope_cache", "add_norm", "act_mul",
                      "qk_norm_rope_cache")


def norm_params(module: Any) -> tuple[Any, float] | None:
    """``(weight, eps)`` of an HF RMSNorm that :func:`rms_norm` reproduces, else ``None``."""
    if type(module).__name__ in HF_RMS_NORMS and hasattr(module, "variance_epsilon"):
        return module.weight, float(module.variance_epsilon)
    return None
