"""Residual add + RMSNorm and gated activation (SiLU / GELU-tanh times up), one Triton kernel each.

Contract: :func:`add_norm` computes, per row of ``[R, N]`` (one program per row, the row in
registers, fp32 math inside),

    ``res = (x + norm_d(delta)) * scale``   (each piece optional)
    ``out = norm_o(res)``

where a norm is ``(weight, eps, style)``: ``"llama"`` = HF ``LlamaRMSNorm`` / ``Qwen3RMSNorm``
(fp32 ``h * rsqrt(mean(h^2) + eps)``, cast to the input dtype, times the weight in that dtype),
``"gemma"`` = HF ``Gemma4RMSNorm`` (fp32 normed times ``weight.float()``, then cast; ``weight``
``None`` = ``with_scale=False``). Every intermediate the HF modules round to the model dtype
(the norm's output, ``x + delta``, ``* layer_scalar``) is rounded here too, so fp32 results agree
with torch to fp32 rounding and bf16 ones to about one bf16 ulp (the interpreter's fp32 -> bf16
cast truncates where compiled Triton rounds to nearest even). :func:`act_mul` is
``act(gate) * up`` with ``act`` = SiLU (Llama/Qwen3) or GELU-tanh (Gemma-4,
``gelu_pytorch_tanh``, as ``x * sigmoid(2 z)``, the identity ``0.5 (1 + tanh z) = sigmoid(2 z)``).

One launch per call covers: Llama/Qwen3's ``add_rms_norm`` (and the first ``rms_norm``), and
Gemma-4's sandwich norms (``x + post_norm(h)`` then ``pre_norm``; ``(x + norm(p)) * layer_scalar``
then the next layer's ``input_layernorm``). No host sync, allocations only through torch, so it is
capturable in a CUDA graph.

Sources: vLLM ``csrc/layernorm_kernels.cu`` ``fused_add_rms_norm_kernel`` (residual add and norm
in one pass, one block per token), Liger-Kernel ``ops/rms_norm.py`` (Triton RMSNorm, one program
per row, ``casting_mode`` "llama" vs "gemma") and ``ops/swiglu.py`` / ``ops/geglu.py`` (SiLU and
GELU-tanh gated products); FlashInfer ``norm.cuh`` ``FusedAddRMSNormKernel``.

PDL (runner option ``pdl``, :mod:`.pdl`; ``USE_GDC``): both kernels ``gdc_wait()`` first in
every program and ``gdc_launch_dependents()`` once their inputs are read (only the stores
remain). With ``PREWAIT`` (``pdl="early"``) add+RMSNorm loads its weights before the wait: the
RMSNorm weights ``wd``/``wo``, Gemma's ``layer_scalar`` and, with LoRA, the first ``LORA_K``
ranks of B (:func:`.lora_prologue.lora_cols` peels its first step); each only under the
constexpr that says it exists, so a dummy pointer (an activation) is never read early. The row,
``x`` and ``xa`` follow the wait; the arithmetic is unchanged, so the result is bit-identical
(interpreter; bf16 on the H200: pdl.py).
(``PREWAIT`` without ``USE_GDC``, which no launcher passes, only moves those loads up.)

Run the tests on the CPU with ``TRITON_INTERPRET=1`` (``tests/engine/test_fused_kernels.py``).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels import lora_prologue as lp
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.act import act_fn
from nbhelpers.engine.kernels.lora_prologue import add_lora, lora_b_tile, round_once

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""``TRITON_INTERPRET=1`` at import: the kernels then run on CPU tensors."""

STYLES = {None: 0, "llama": 1, "gemma": 2}
"""Norm style -> kernel constant (0: no norm; gemma without weight is style 2, HAS_W False)."""

ACTS = {"silu": 0, "gelu_tanh": 1}
MAX_COLS = 16384
"""Widest row :func:`add_norm` keeps in registers (Gemma-4 31B hidden 5376, Qwen3-4B 2560)."""


@triton.jit
def _rnd(x, DT: tl.constexpr):
    """Round fp32 ``x`` to the model dtype and back (a no-op for fp32)."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _rms(h, w_ptr, cols, m, n, eps, STYLE: tl.constexpr, HAS_W: tl.constexpr,
         DT: tl.constexpr, w_pre, PRE: tl.constexpr):
    """HF RMSNorm of the fp32 row ``h`` (style: 1 llama, 2 gemma), rounded to ``DT``; the
    weight (fp32) is ``w_pre`` when ``PRE`` (loaded before the PDL wait; needs ``HAS_W``, which
    a llama norm always has), else loaded here."""
    hn = h * tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    if STYLE == 1:
        if PRE:
            w = w_pre
        else:
            w = _load_w(w_ptr, cols, m)
        return _rnd(w * _rnd(hn, DT), DT)
    if HAS_W:
        if PRE:
            hn = hn * w_pre
        else:
            hn = hn * _load_w(w_ptr, cols, m)
    return _rnd(hn, DT)


@triton.jit
def _load_w(w_ptr, cols, m):
    """A norm weight's columns ``cols`` (masked by ``m``) as fp32."""
    return tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _add_norm_kernel(x_ptr, d_ptr, res_ptr, out_ptr, wd_ptr, wo_ptr, s_ptr, xa_ptr, b_ptr,
                     n_cols, stride_x, stride_d, stride_xa, rank, eps_d, eps_o, scaling,
                     HAS_X: tl.constexpr, D_STYLE: tl.constexpr, D_W: tl.constexpr,
                     HAS_SCALE: tl.constexpr, STORE_RES: tl.constexpr, O_STYLE: tl.constexpr,
                     O_W: tl.constexpr, HAS_LORA: tl.constexpr, LORA_K: tl.constexpr,
                     LORA_RNE: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
                     PREWAIT: tl.constexpr, EARLY_TRIGGER: tl.constexpr = False,
                     D_ROUND: tl.constexpr = False):
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if EARLY_TRIGGER:  # pdl="prefetch": the next kernel (a GEMM) may launch now (pdl.py)
            tl.extra.cuda.gdc_launch_dependents()
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if not PREWAIT:  # PDL (pdl.py): the row comes from the previous kernel
            tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    DT: tl.constexpr = res_ptr.dtype.element_ty
    wd, wo, sv, b0 = 0.0, 0.0, 0.0, 0.0  # the PREWAIT values (unused otherwise)
    if PREWAIT:  # "early" (pdl.py): the weights that exist (a missing one's slot holds an
        # activation pointer; a llama norm always has its weight), then the wait
        if D_W:
            wd = _load_w(wd_ptr, cols, m)
        if O_W:
            wo = _load_w(wo_ptr, cols, m)
        if HAS_SCALE:
            sv = tl.load(s_ptr).to(tl.float32)
        if HAS_LORA:  # B's first LORA_K ranks (lora_prologue.lora_cols peels its first step)
            b0 = lora_b_tile(b_ptr, rank, cols, m, tl.arange(0, LORA_K))
        if USE_GDC:  # the row, x and xa only after the previous kernel
            tl.extra.cuda.gdc_wait()
    y = tl.load(d_ptr + row * stride_d + cols, mask=m, other=0.0).to(tl.float32)
    if D_ROUND:  # an fp32 delta (mlp_block's accumulator): the GEMM epilogue's rounding
        y = round_once(y, DT, LORA_RNE)
    if HAS_LORA:  # delta = y_base + s * xa @ B^T, rounded once (lora_prologue.py)
        y = add_lora(y, xa_ptr + row * stride_xa, b_ptr, rank, cols, m, scaling, DT, LORA_RNE,
                     BLOCK, LORA_K, 0, b0, PREWAIT)
    if D_STYLE != 0:
        y = _rms(y, wd_ptr, cols, m, n_cols, eps_d, D_STYLE, D_W, DT, wd, PREWAIT)
    if HAS_X:
        y = _rnd(tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32) + y,
                 DT)
    if HAS_SCALE:
        if PREWAIT:
            y = _rnd(y * sv, DT)
        else:
            y = _rnd(y * tl.load(s_ptr).to(tl.float32), DT)
    if USE_GDC:  # noqa: SIM102 (every input read: the next kernel may start its prologue)
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    if STORE_RES:
        tl.store(res_ptr + row * n_cols + cols, y.to(DT), mask=m)
    if O_STYLE != 0:
        o = _rms(y, wo_ptr, cols, m, n_cols, eps_o, O_STYLE, O_W, DT, wo, PREWAIT)
        tl.store(out_ptr + row * n_cols + cols, o.to(DT), mask=m)


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, ACT: tl.constexpr,
                    BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
                    EARLY_TRIGGER: tl.constexpr = False):
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if EARLY_TRIGGER:  # pdl="prefetch": the next kernel (a GEMM) may launch now (pdl.py)
            tl.extra.cuda.gdc_launch_dependents()
    if USE_GDC:  # PDL (pdl.py): gate and up come from the previous kernel
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    DT: tl.constexpr = o_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    a = act_fn(g, ACT)
    if USE_GDC:  # noqa: SIM102 (every input read: the next kernel may start its prologue)
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    tl.store(o_ptr + row * n_cols + cols, (_rnd(a, DT) * u).to(DT), mask=m)


def _rows(t: Any) -> Any:
    """``t`` as ``[R, N]`` (a view where strides allow); last dim must be unit-stride."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def supported(*tensors: Any) -> bool:
    """Whether the kernels can run on these tensors: all on one CUDA device (or CPU tensors
    under the interpreter), floating point, last dim at most :data:`MAX_COLS`."""
    ok_dev = all(t.is_cuda for t in tensors) or (INTERPRETED and all(
        t.device.type == "cpu" for t in tensors))
    return ok_dev and all(t.is_floating_point() for t in tensors) and \
        tensors[0].shape[-1] <= MAX_COLS


def add_norm(delta: Any, x: Any = None, out_norm: tuple | None = None,
             delta_norm: tuple | None = None, scale: Any = None,
             store_res: bool = True, lora: Any = None) -> tuple[Any, Any]:
    """``(res, out)`` of the module docstring; ``delta``, ``x [..., N]`` (one dtype),
    ``out_norm``/``delta_norm`` ``(weight [N] | None, eps, "llama" | "gemma")`` or ``None``,
    ``scale`` a one-element tensor (Gemma-4 ``layer_scalar``) or ``None``. ``res`` is ``None``
    when ``store_res`` is False, ``out`` when ``out_norm`` is ``None``; both ``delta``'s shape.
    ``lora``: a one-part ``lora_pending.PendingLora`` whose ``y`` is ``delta`` (o_proj,
    down_proj): ``delta`` is read as ``y_base + scaling * xa @ B^T`` (:mod:`.lora_prologue`).
    An fp32 ``delta`` with a 16-bit ``x`` (the unrounded sum of a split GEMM,
    :mod:`.mlp_block`) is rounded to ``x``'s dtype first, as that GEMM's epilogue would; ``res``
    and ``out`` then have ``x``'s dtype.

    Raises:
        ValueError: ``x`` and ``delta`` of different shapes or dtypes (other than an fp32
            ``delta`` with a bf16/fp16 ``x``), a ``"llama"`` norm
            whose weight dtype differs from ``delta``'s (torch would promote; use the module),
            or a ``lora`` that :func:`lora_supported` rejects (call its ``apply()`` instead).
    """
    import torch
    split_sum = x is not None and rounds_delta(delta, x)
    if x is not None and (x.shape != delta.shape or (x.dtype != delta.dtype and not split_sum)):
        raise ValueError(f"add_norm: x {tuple(x.shape)} {x.dtype} must match delta "
                         f"{tuple(delta.shape)} {delta.dtype} (or delta fp32 with a bf16/fp16 "
                         "x).")
    if lora is not None and not lora_supported(lora, 1, delta):
        raise ValueError("add_norm: this LoRA record is not one the kernel serves "
                         "(lora_supported); call lora.apply() and pass lora=None.")
    dtype = x.dtype if x is not None else delta.dtype  # the model dtype
    for nrm in (out_norm, delta_norm):
        if nrm is not None and nrm[2] == "llama" and nrm[0].dtype != dtype:
            raise ValueError(f"add_norm: llama-style weight {nrm[0].dtype} != {dtype}.")
    d2 = _rows(delta)
    x2 = _rows(x) if x is not None else d2
    n = d2.shape[1]
    res = torch.empty_like(x2) if store_res else x2  # x2: the model dtype (DT) either way
    out = torch.empty_like(x2) if out_norm is not None else d2
    dn, on = delta_norm or (None, 0.0, None), out_norm or (None, 0.0, None)
    xa, sxa, b, rank, _, s = lp.kernel_args(lora) if lora is not None else (d2, 0, d2, 0, 0, 0.0)
    _add_norm_kernel[(d2.shape[0],)](
        x2, d2, res, out, dn[0] if dn[0] is not None else d2,
        on[0] if on[0] is not None else d2, scale if scale is not None else d2, xa, b, n,
        x2.stride(0), d2.stride(0), sxa, rank, float(dn[1]), float(on[1]), s,
        HAS_X=x is not None, D_STYLE=STYLES[dn[2]], D_W=dn[0] is not None,
        HAS_SCALE=scale is not None, STORE_RES=store_res, O_STYLE=STYLES[on[2]],
        O_W=on[0] is not None, HAS_LORA=lora is not None, LORA_K=lp.LORA_K,
        LORA_RNE=lp.rne(dtype), BLOCK=triton.next_power_of_2(n), D_ROUND=split_sum,
        num_warps=_warps(n) if lora is None else lp.warps_for(triton.next_power_of_2(n),
                                                              _warps(n)),
        **pdl.launch_kwargs(prewait=True, trigger=True))
    shape = delta.shape
    return (res.view(shape) if store_res else None,
            out.view(shape) if out_norm is not None else None)


def rounds_delta(delta: Any, x: Any) -> bool:
    """Whether :func:`add_norm` takes ``delta`` in another dtype than ``x``: an fp32 ``delta``
    (the unrounded sum of a split GEMM, :mod:`.mlp_block`) with a bf16 / fp16 ``x``, rounded to
    ``x``'s dtype first."""
    import torch
    return delta.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)


def lora_supported(lora: Any, num_parts: int, y_base: Any, *more: Any) -> bool:
    """Whether a kernel here adds ``lora`` (a ``lora_pending.PendingLora`` of ``num_parts``
    parts) while reading ``y_base`` (part 0; ``more``: parts 1, ...) of its ``y``:
    :func:`.lora_prologue.supported` and every input a row-for-row view of its part."""
    return lp.supported(lora, num_parts, y_base) and all(
        lora.reads(t, i) for i, t in enumerate((y_base, *more)))


def _warps(n: int) -> int:
    """Warps per row program: 4 up to 4096 columns, 8 above (Liger's ``calculate_settings``)."""
    return 4 if n <= 4096 else 8


def act_mul(gate: Any, up: Any, act: str = "silu", lora: Any = None) -> Any:
    """``act(gate) * up``, ``[..., I]`` each (strided views such as a gate_up split are fine),
    rounded like HF (``act`` to the dtype, then the product); ``act`` in :data:`ACTS`.
    ``lora``: the gate_up group's two-part ``lora_pending.PendingLora`` whose ``y`` holds
    ``gate`` and ``up``: each is read as ``y_base + scaling * xa_part @ B_part^T``
    (:mod:`.lora_act_mul`: a rows x column-block grid, B read once per block).

    Raises:
        ValueError: shapes or dtypes differ, an unknown ``act``, or a ``lora`` that
            :func:`lora_supported` rejects (call its ``apply()`` instead).
    """
    import torch
    if gate.shape != up.shape or gate.dtype != up.dtype or act not in ACTS:
        raise ValueError(f"act_mul: gate {tuple(gate.shape)} {gate.dtype}, up "
                         f"{tuple(up.shape)} {up.dtype}, act {act!r} (one of {tuple(ACTS)}).")
    if lora is not None and not lora_supported(lora, 2, gate, up):
        raise ValueError("act_mul: this LoRA record is not one the kernel serves "
                         "(lora_supported); call lora.apply() and pass lora=None.")
    g2, u2 = _rows(gate), _rows(up)
    rows, n = g2.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if lora is not None:  # rows x column blocks, B read once per block (lora_act_mul.py)
        from nbhelpers.engine.kernels import lora_act_mul
        lora_act_mul.act_mul_lora(g2, u2, out, ACTS[act], lora)
        return out.view(gate.shape)
    block = min(1024, triton.next_power_of_2(n))
    _act_mul_kernel[(rows, triton.cdiv(n, block))](
        g2, u2, out, n, g2.stride(0), u2.stride(0), ACT=ACTS[act], BLOCK=block, num_warps=4,
        **pdl.launch_kwargs(trigger=True))
    return out.view(gate.shape)
