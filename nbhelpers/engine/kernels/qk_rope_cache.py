"""q/k RMSNorm + RoPE + paged KV-cache write in one Triton kernel (decode and prefill shapes).

Contract: :func:`qk_norm_rope_cache` takes the q/k/v projections of ``T`` tokens (``q [1, T, H*D]``
or ``[1, T, H, D]``, k/v with ``H_kv`` heads; strided views of the q/k/v group output are fine)
and, in one launch over ``(T, H + H_kv)`` programs (one head of one token each):

- q heads: optional per-head RMSNorm (Qwen3 ``q_norm``, Gemma-4 ``q_norm``), then HF
  ``apply_rotary_pos_emb`` (rotate_half: ``x * cos + cat(-x2, x1) * sin``) with ``cos/sin
  [1, T, D]`` -> a new ``[T, H, D]`` tensor (returned);
- k heads: the same with ``k_norm``, written to ``k_cache[0, h, slot_mapping[t], :]``;
- v heads: optional weightless RMSNorm (Gemma-4 ``v_norm``), written to
  ``v_cache[0, h, slot_mapping[t], :]`` (the ``[1, H_kv, S, D]`` pool of ``engine/kv_cache.py``,
  what ``index_copy_(1, slot_mapping, ...)`` writes today).

With ``k=None`` (a Gemma-4 KV-shared layer) only q is computed. With ``lora`` (the q/k/v group's
pending LoRA B, ``lora_expand="consumer"``) each head adds its columns of ``scaling * xa @ B^T``
on load (:mod:`.lora_prologue`), so no expand launch runs before this one: all r ranks of a half
in one ``[D/2, r]`` load (2 dependent loads a q head, 4 a k/v program; the first version looped
4 ranks a step: 16 and 32, on one warp, which is where its time went at batch 4). Dtype order as HF: the norm's
output, each RoPE product and their sum are rounded to the model dtype (fp32 math inside), so fp32
agrees with the torch path to fp32 rounding, bf16 to about one ulp (the interpreter truncates
fp32 -> bf16 where compiled Triton rounds to nearest even). Norm styles as
:mod:`.fused_norm` (``"llama"`` for Qwen3, ``"gemma"`` for Gemma-4).

Sources: vLLM ``csrc/pos_encoding_kernels.cu`` ``rotary_embedding_kernel`` (neox / rotate_half
form, one block per token over its heads) and ``csrc/cache_kernels.cu`` ``reshape_and_cache``
(slot_mapping -> physical slot); SGLang's fused q/k-norm + RoPE (``sgl-kernel``
``fused_qk_norm_rope``) and vLLM's ``fused_qk_norm_rope`` custom op (Qwen3 per-head norms folded
into the RoPE kernel); FlashInfer ``apply_rope_pos_ids`` + ``append_paged_kv_cache``.

PDL (runner option ``pdl``, :mod:`.pdl`; ``USE_GDC``): ``gdc_wait()`` first in every program,
``gdc_launch_dependents()`` after the program's last load (a q head: before its stores; a k/v
head: before the v store, the k store already issued: the loads and stores keep today's order).
With ``PREWAIT`` (``pdl="early"``) a program loads its weights before the wait, addressed from
its program id and the arguments only: the q/k norm weight (``q_norm`` for a q head, ``k_norm``
for a k/v program) and, with LoRA, its B tiles (q's or k's, and v's, masked off in a q
program); cos/sin, the slot and everything indexed by tokens follow the wait. The B tiles load
at that point in every build (without ``PREWAIT`` just after the wait): loaded in the q / k-v
branches instead, the sm_90 build chose other layouts and the early build summed the q/k
norm's squares in another order (head_dim 128, r 32). Same arithmetic: bit-identical in the
interpreter, and in the sm_90 build since contraction is off too (:data:`FP_FUSION`;
``tests/engine/test_pdl_early_ptx.py``; ``PREWAIT`` without ``USE_GDC``, which no launcher
passes, only moves the early loads up).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from nbhelpers.engine.kernels import lora_prologue as lp
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.fused_norm import INTERPRETED, STYLES, lora_supported
from nbhelpers.engine.kernels.lora_prologue import add_lora, lora_b_tile

__all__ = ["FP_FUSION", "INTERPRETED", "qk_norm_rope_cache", "supported"]

FP_FUSION = False
"""``enable_fp_fusion`` of every launch: no FMA contraction (PTX ``mul.rn``/``add.rn``, ptxas
``--fmad=false``), so each RoPE product is rounded as HF rounds it and the result does not
depend on the operand order LLVM gives an add. With contraction on, LLVM shrank
``rnd(rnd(a*b) + rnd(c*d))`` to bf16 ops and the backend fused one product into an
``fma.rn.bf16`` (fp32: ``fma.rn.f32``), skipping its rounding; which product followed where the
weight loads sit, so the ``PREWAIT`` build fused ``x2 * cos2`` where the others fused
``x1 * sin2``: the ``pdl="early"`` bf16 logprob gap of 2026-12-02 (``pdl.py``;
``tests/engine/test_pdl_early_ptx.py``)."""


@triton.jit
def _rnd(x, DT: tl.constexpr):
    return x.to(DT).to(tl.float32)


@triton.jit
def _norm_halves(x1, x2, w_ptr, c, m, half, eps, STYLE: tl.constexpr, HAS_W: tl.constexpr,
                 DT: tl.constexpr, w1, w2, PRE: tl.constexpr):
    """HF RMSNorm over one head given as two halves ``[BLOCK_H]`` (fp32), rounded to ``DT``;
    ``PRE``: the weight's halves are ``w1``, ``w2`` (fp32, loaded before the PDL wait)."""
    r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half) + eps)
    y1, y2 = x1 * r, x2 * r
    if STYLE == 1:  # llama: cast, then times the weight in the dtype
        if not PRE:
            w1, w2 = _weight_halves(w_ptr, c, m, half)
        return _rnd(w1 * _rnd(y1, DT), DT), _rnd(w2 * _rnd(y2, DT), DT)
    if HAS_W:  # gemma: fp32 times weight.float(), then cast
        if not PRE:
            w1, w2 = _weight_halves(w_ptr, c, m, half)
        y1, y2 = y1 * w1, y2 * w2
    return _rnd(y1, DT), _rnd(y2, DT)


@triton.jit
def _weight_halves(w_ptr, c, m, half):
    """A per-head norm weight ``[D]`` as two fp32 halves ``[BLOCK_H]``."""
    w1 = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + c, mask=m, other=0.0).to(tl.float32)
    return w1, w2


@triton.jit
def _load_head(src, c, m, half, xa_row, b_ptr, rank, b_row0, scaling, HAS_LORA: tl.constexpr,
               DT: tl.constexpr, RNE: tl.constexpr, BLOCK_H: tl.constexpr,
               LORA_K: tl.constexpr, b1, b2, PRE: tl.constexpr):
    """One head's two halves (fp32); with ``HAS_LORA`` plus ``scaling * xa @ B^T`` for its
    columns (B rows ``b_row0 + [0, 2 * half)``), rounded once (:mod:`.lora_prologue`): every
    rank in one ``[BLOCK_H, LORA_K]`` load a half (``LORA_K >= rank``, the wrapper's
    ``one_load_k``), both halves' loads in flight together (straight-line code). ``PRE``: the
    two B tiles are ``b1``, ``b2`` (:func:`_b_halves`, loaded before the PDL wait)."""
    x1 = tl.load(src + c, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + c, mask=m, other=0.0).to(tl.float32)
    if HAS_LORA:
        x1 = add_lora(x1, xa_row, b_ptr, rank, b_row0 + c, m, scaling, DT, RNE, BLOCK_H, LORA_K,
                      1, b1, PRE)
        x2 = add_lora(x2, xa_row, b_ptr, rank, b_row0 + half + c, m, scaling, DT, RNE, BLOCK_H,
                      LORA_K, 1, b2, PRE)
    return x1, x2


@triton.jit
def _b_halves(b_ptr, rank, b_row0, c, m, half, LORA_K: tl.constexpr):
    """One head's B tiles ``[BLOCK_H, LORA_K]`` (fp32, every rank: ``LORA_K >= rank``)."""
    ks = tl.arange(0, LORA_K)
    return (lora_b_tile(b_ptr, rank, b_row0 + c, m, ks),
            lora_b_tile(b_ptr, rank, b_row0 + half + c, m, ks))


@triton.jit
def _head(x1, x2, w_ptr, c, m, half, eps, cos1, cos2, sin1, sin2, STYLE: tl.constexpr,
          HAS_W: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr, w1, w2,
          PRE: tl.constexpr):
    """Norm one head given as two halves (STYLE != 0; ``w1``, ``w2``, ``PRE``:
    :func:`_norm_halves`), rotate it (ROPE)."""
    if STYLE != 0:
        x1, x2 = _norm_halves(x1, x2, w_ptr, c, m, half, eps, STYLE, HAS_W, DT, w1, w2, PRE)
    if ROPE:
        o1 = _rnd(_rnd(x1 * cos1, DT) + _rnd(-x2 * sin1, DT), DT)
        o2 = _rnd(_rnd(x2 * cos2, DT) + _rnd(x1 * sin2, DT), DT)
        return o1, o2
    return x1, x2


@triton.jit
def _qk_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, cos_ptr,
                          sin_ptr, wq_ptr, wk_ptr, xa_ptr, bq_ptr, bk_ptr, bv_ptr, stride_q,
                          stride_k, stride_v, stride_cs, stride_ch, stride_xa, n_q, head_dim,
                          r_q, r_k, r_v, eps_qk, eps_v, scaling,
                          QK_STYLE: tl.constexpr, QK_W: tl.constexpr, V_STYLE: tl.constexpr,
                          HAS_LORA: tl.constexpr, LORA_K: tl.constexpr, LORA_RNE: tl.constexpr,
                          BLOCK_H: tl.constexpr, USE_GDC: tl.constexpr, PREWAIT: tl.constexpr):
    if USE_GDC:  # noqa: SIM102 (constexpr tests stand alone)
        if not PREWAIT:  # PDL (pdl.py): q/k/v, cos/sin and slots come from the previous kernels
            tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = head_dim // 2
    c = tl.arange(0, BLOCK_H)
    m = c < half
    DT: tl.constexpr = qo_ptr.dtype.element_ty
    w1, w2, b1, b2, bv1, bv2 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0  # the PREWAIT values
    is_kv = h >= n_q
    if PREWAIT:  # noqa: SIM102 ("early", pdl.py: this program's weights, from h and the args)
        if QK_W:  # q_norm for a q head, k_norm for a k/v program
            w1, w2 = _weight_halves(tl.where(is_kv, wk_ptr, wq_ptr), c, m, half)
    if HAS_LORA:  # q's or k's B, and v's (masked off in a q program): here in every build (in
        # "early" before the wait), so the layouts Triton picks, hence the norm's fp32
        # reduction order, do not depend on PREWAIT (loaded in the branches below, the early
        # build summed the q/k norm's squares in another layout at head_dim 128)
        row0 = tl.where(is_kv, h - n_q, h) * head_dim  # the head's first B row in its part
        b1, b2 = _b_halves(tl.where(is_kv, bk_ptr, bq_ptr), tl.where(is_kv, r_k, r_q), row0,
                           c, m, half, LORA_K)
        mv = c < tl.where(is_kv, half, 0)  # m in a k/v program, nothing in a q one
        bv1, bv2 = _b_halves(bv_ptr, r_v, row0, c, mv, half, LORA_K)
    if USE_GDC:  # noqa: SIM102
        if PREWAIT:  # q/k/v, xa, cos/sin and slots only after the previous kernel
            tl.extra.cuda.gdc_wait()
    cs = t * stride_cs
    cos1 = tl.load(cos_ptr + cs + c, mask=m, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + half + c, mask=m, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs + c, mask=m, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + half + c, mask=m, other=0.0).to(tl.float32)
    xa_row = xa_ptr + t * stride_xa  # this token's x @ A^T: [r_q | r_k | r_v]
    if h < n_q:
        x1, x2 = _load_head(q_ptr + t * stride_q + h * head_dim, c, m, half, xa_row, bq_ptr, r_q,
                            h * head_dim, scaling, HAS_LORA, DT, LORA_RNE, BLOCK_H, LORA_K, b1,
                            b2, True)
        o1, o2 = _head(x1, x2, wq_ptr, c, m, half, eps_qk, cos1, cos2, sin1, sin2, QK_STYLE,
                       QK_W, True, DT, w1, w2, PREWAIT)
        if USE_GDC:  # every input read: the next kernel may start its prologue
            tl.extra.cuda.gdc_launch_dependents()
        dst = qo_ptr + (t * n_q + h) * head_dim
        tl.store(dst + c, o1.to(DT), mask=m)
        tl.store(dst + half + c, o2.to(DT), mask=m)
    else:
        hk = h - n_q
        slot = tl.load(slot_ptr + t).to(tl.int64)
        off = hk * stride_ch + slot * head_dim
        x1, x2 = _load_head(k_ptr + t * stride_k + hk * head_dim, c, m, half, xa_row + r_q,
                            bk_ptr, r_k, hk * head_dim, scaling, HAS_LORA, DT, LORA_RNE, BLOCK_H,
                            LORA_K, b1, b2, True)
        o1, o2 = _head(x1, x2, wk_ptr, c, m, half, eps_qk, cos1, cos2, sin1, sin2, QK_STYLE,
                       QK_W, True, DT, w1, w2, PREWAIT)
        tl.store(kc_ptr + off + c, o1.to(DT), mask=m)
        tl.store(kc_ptr + off + half + c, o2.to(DT), mask=m)
        x1, x2 = _load_head(v_ptr + t * stride_v + hk * head_dim, c, m, half,
                            xa_row + r_q + r_k, bv_ptr, r_v, hk * head_dim, scaling, HAS_LORA,
                            DT, LORA_RNE, BLOCK_H, LORA_K, bv1, bv2, True)
        v1, v2 = _head(x1, x2, wk_ptr, c, m, half, eps_v, cos1, cos2, sin1, sin2, V_STYLE,
                       False, False, DT, 0.0, 0.0, False)
        if USE_GDC:  # every input read: the next kernel may start its prologue
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(vc_ptr + off + c, v1.to(DT), mask=m)
        tl.store(vc_ptr + off + half + c, v2.to(DT), mask=m)


def _tokens(x: Any, heads: int, head_dim: int) -> tuple[Any, int]:
    """``x [1, T, heads*D]`` / ``[1, T, heads, D]`` / ``[T, ...]`` -> (tensor, token stride)."""
    x2 = x.reshape(-1, heads * head_dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.stride(0)


def supported(q: Any, cos: Any, k_cache: Any = None, head_dim: int = 0) -> bool:
    """Whether the kernel serves these operands: CUDA (or CPU under the interpreter), even
    ``head_dim``, ``cos`` of width ``head_dim`` with unit last stride, a ``[1, H_kv, S, D]``
    cache of ``q``'s dtype with unit last stride."""
    dev_ok = q.is_cuda or (INTERPRETED and q.device.type == "cpu")
    cache_ok = k_cache is None or (k_cache.dim() == 4 and k_cache.stride(-1) == 1 and
                                   k_cache.stride(2) == head_dim and k_cache.dtype == q.dtype)
    return (dev_ok and head_dim % 2 == 0 and cos.shape[-1] == head_dim and
            cos.stride(-1) == 1 and cache_ok)


def qk_norm_rope_cache(q: Any, k: Any, v: Any, num_heads: int, num_kv_heads: int,
                       head_dim: int, cos: Any, sin: Any, k_cache: Any, v_cache: Any,
                       slot_mapping: Any, qk_norm: tuple | None = None,
                       v_norm: tuple | None = None, lora: Any = None) -> Any:
    """Rotated (normed) q ``[T, H, D]``; writes normed+rotated k and (normed) v into the cache.

    ``qk_norm``: ``(wq [D], wk [D], eps, style)`` or ``None`` (Llama); ``v_norm``: ``(eps,
    "gemma")`` (weightless, Gemma-4) or ``None``; ``k=None``: q only (KV-shared layer).
    ``cos/sin [1, T, D]``; ``slot_mapping [T]`` int64 physical slots; caches
    ``[1, H_kv, S, D]``. ``lora``: the q/k/v group's three-part ``lora_pending.PendingLora``
    whose ``y`` holds ``q``, ``k``, ``v``: each head is read as ``y_base + scaling * xa_part @
    B_part^T`` before its norm (:mod:`.lora_prologue`). See the module docstring for the math
    and rounding.

    Raises:
        ValueError: a ``lora`` that ``fused_norm.lora_supported`` rejects, or with ``k=None``
            (call its ``apply()`` instead).
    """
    import torch
    if lora is not None and (k is None or not lora_supported(lora, 3, q, k, v)):
        raise ValueError("qk_norm_rope_cache: this LoRA record is not one the kernel serves "
                         "(fused_norm.lora_supported); call lora.apply() and pass lora=None.")
    q2, sq = _tokens(q, num_heads, head_dim)
    t = q2.shape[0]
    qo = torch.empty(t, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if k is not None:
        k2, sk = _tokens(k, num_kv_heads, head_dim)
        v2, sv = _tokens(v, num_kv_heads, head_dim)
    else:
        k2, sk, v2, sv, num_kv_heads = q2, sq, q2, sq, 0
    kc, vc = (k_cache, v_cache) if k is not None else (qo, qo)
    wq, wk, eps, style = qk_norm or (None, None, 0.0, None)
    c2, s2 = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
    xa, sxa, bq, bk, bv, rq, rk, rv, _, _, _, s = (
        lp.kernel_args(lora) if lora is not None else (q2, 0, q2, q2, q2, 0, 0, 0, 0, 0, 0, 0.0))
    block_h = triton.next_power_of_2(max(head_dim // 2, 1))
    warps = 1 if head_dim <= 128 else 2
    lora_k = lp.one_load_k(lora.ranks) if lora is not None else lp.LORA_K
    if lora is not None:  # two [BLOCK_H, lora_k] B tiles live (one head's halves)
        warps = lp.warps_for(2 * block_h, warps, lora_k)
    _qk_rope_cache_kernel[(t, num_heads + num_kv_heads)](
        q2, k2, v2, qo, kc, vc, slot_mapping, c2, s2, wq if wq is not None else q2,
        wk if wk is not None else q2, xa, bq, bk, bv, sq, sk, sv, c2.stride(0),
        kc.stride(1) if k is not None else 0, sxa, num_heads, head_dim, rq, rk, rv, float(eps),
        float(v_norm[0]) if v_norm else 0.0, s, QK_STYLE=STYLES[style], QK_W=wq is not None,
        V_STYLE=STYLES[v_norm[1]] if v_norm else 0, HAS_LORA=lora is not None,
        LORA_K=lora_k, LORA_RNE=lp.rne(q.dtype), BLOCK_H=block_h, num_warps=warps,
        enable_fp_fusion=FP_FUSION, **pdl.launch_kwargs(prewait=True))
    return qo
