"""A decode MLP block (gate/up GEMM, SiLU x up, down GEMM) in one Triton launch:
``docs/decode_floor_plan.md`` piece 1, the engine's runner option ``mlp_block="triton"``
(``engine/mlp_block.py`` routes decode calls here).

Contract: :func:`mlp_block` returns ``acc [M, H]`` fp32, ``down(silu(gate(x)) * up(x))`` for
``x [M, H]`` (``M <= 16``, bf16/fp16/fp32, unit column stride), ``w_gate_up [2I, H]`` (gate rows
then up rows, nn.Linear layout) and ``w_down [H, I]``, rounded as a transformers
Llama/Qwen3 MLP in the weights' dtype rounds: gate and up outputs once to the dtype, the SiLU
once, the product once; the down GEMM's sum stays fp32 (the caller rounds it once, as a GEMM
epilogue would). ``acc`` must be zero on entry (:func:`mlp_block` zeroes the one it allocates;
pass ``out=`` a zeroed buffer to reuse one, e.g. under CUDA graphs). No bias. LoRA
(:class:`MlpLora`: fp32 or 16-bit adapters): gate's and up's B added to their rounded outputs
before the activation (``scaling * xa @ B^T`` in fp32, rounded once: :mod:`.lora_act_mul`'s
order, B tiles ``[BLOCK_R, BLOCK_J]`` read once per column block), and down's A applied to each
program's slice of the activation, the unrounded ``h @ A_d^T`` added into ``xa_down`` with fp32
atomics, so down's B follows in one expand launch (which rounds that sum to a 16-bit B's dtype
first: PEFT's ``lora_A`` output dtype). Works on CUDA and under
``TRITON_INTERPRET=1``.

Design: grid ``cdiv(I, BLOCK_J)``; program ``p`` owns intermediate columns ``[p BLOCK_J, (p+1)
BLOCK_J)``: it streams their gate and up rows over the full ``H`` (no split-K: the activation
needs whole sums), applies SiLU x up in registers, then streams the matching ``BLOCK_J`` columns
of ``w_down`` in ``BLOCK_N`` chunks and adds each ``[M, BLOCK_N]`` partial into ``acc`` with
``tl.atomic_add`` (fp32, relaxed): the down GEMM is split over the intermediate dimension across
programs, with no grid barrier and no second launch. Every weight byte is read once. The order
of the atomic adds is not fixed: results vary in the last fp32 bits run to run (the engine's
serial split-K in ``skinny_gemm.py`` is deterministic; this is the price to measure).

Why: at batch 4 on the H200 the three launches this replaces (gate_up GEMM, act x up,
down GEMM) take 26.8 + 2.7 + 16.4 us a layer against 36.0 us of weight bytes at 4.17 TB/s
(2026-12-07, ``docs/decode_floor_plan.md``). Whether one launch gets closer depends on what the
H200 charges for ``M x H`` fp32 atomics per program: ``scripts/device/ab_mlp_block.py`` times it
against the engine's kernels with cold weights: on an H100 (2026-12-08) ``BLOCK_J`` 128 took
56.1 us at 4 rows against 64.3 (cuBLAS + torch SiLU x up) and 65.2 (skinny), 61.8 against 68.6
and 67.9 at 16 rows (``executed/phase3_flex/bench/ab_mlp_block_20261208_h100_bb16c1e/``).

Run: ``TRITON_INTERPRET=1 pytest tests/engine/test_mlp_block.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from nbhelpers.engine.kernels import lora_prologue as lp
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.act import act_fn
from nbhelpers.engine.kernels.lora_act_mul import _lora_dot
from nbhelpers.engine.kernels.lora_prologue import round_once
from nbhelpers.engine.kernels.skinny_gemm import INTERPRETED, _dot

MAX_ROWS = 64
"""Most rows (decode sequences) one launch takes: one ``tl.dot`` row tile of 16-64 rows. The
engine serves only up to :data:`nbhelpers.engine.mlp_block.ROUTE_MAX_ROWS` (16, what was
measured); 32-64 rows are for the probe (``scripts/device/ab_mlp_block.py --rows 32,64``)."""

MAX_RANK = 64
"""Largest LoRA rank per part (one ``[BLOCK_R, BLOCK_J]`` B tile; :mod:`.lora_prologue`)."""


@triton.jit
def _mlp_block_kernel(x_ptr, wgu_ptr, wd_ptr, acc_ptr, xa_ptr, bg_ptr, bu_ptr, ad_ptr, xad_ptr,
                      m, hidden, inter, stride_x, stride_gu, stride_d, stride_acc, stride_xa,
                      stride_xad, r_g, r_u, r_d, scaling,
                      BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, HAS_LORA: tl.constexpr = False,
                      BLOCK_R: tl.constexpr = 16, RNE: tl.constexpr = False,
                      USE_GDC: tl.constexpr = False):
    if USE_GDC:  # PDL (pdl.py): x and xa come from the previous kernels
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    col_ok = cols < inter
    acc_g = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        g_ptrs = wgu_ptr + cols[:, None].to(tl.int64) * stride_gu + kk[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(g_ptrs + inter.to(tl.int64) * stride_gu, mask=w_mask, other=0.0)
        acc_g = _dot(x, tl.trans(wg), acc_g, UPCAST)
        acc_u = _dot(x, tl.trans(wu), acc_u, UPCAST)
    DT: tl.constexpr = wgu_ptr.dtype.element_ty
    g = round_once(acc_g, DT, RNE)  # the gate_up GEMM's output, rounded once
    u = round_once(acc_u, DT, RNE)
    if HAS_LORA:  # + s * xa @ B^T per part, rounded once (lora_act_mul's order)
        lg = _lora_dot(xa_ptr, stride_xa, 0, bg_ptr, r_g, rows, row_ok, cols, col_ok, BLOCK_R,
                       True, 0.0, False)
        lu = _lora_dot(xa_ptr, stride_xa, r_g, bu_ptr, r_u, rows, row_ok, cols, col_ok,
                       BLOCK_R, True, 0.0, False)
        g = round_once(g + scaling * lg, DT, RNE)
        u = round_once(u + scaling * lu, DT, RNE)
    if USE_GDC:  # every input read: the next kernel may start its prologue
        tl.extra.cuda.gdc_launch_dependents()
    act = act_fn(g, 0).to(DT).to(tl.float32)  # SiLU, the casts of lora_act_mul / act_mul
    h = (act * u).to(DT)  # [BLOCK_M, BLOCK_J], zero in masked columns
    if HAS_LORA:  # down's LoRA A: this column block's share of h @ A_d^T (PEFT: in fp32)
        ks = tl.arange(0, BLOCK_R)
        ad = tl.load(ad_ptr + ks[None, :].to(tl.int64) * inter + cols[:, None],
                     mask=col_ok[:, None] & (ks < r_d)[None, :], other=0.0)  # [BLOCK_J, BLOCK_R]
        pxa = tl.dot(h.to(tl.float32), ad.to(tl.float32), input_precision="ieee")
        tl.atomic_add(xad_ptr + rows[:, None] * stride_xad + ks[None, :], pxa,
                      mask=row_ok[:, None] & (ks < r_d)[None, :], sem="relaxed")
    for n0 in range(0, hidden, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        n_ok = nn < hidden
        wd = tl.load(wd_ptr + nn[:, None].to(tl.int64) * stride_d + cols[None, :],
                     mask=n_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_J]
        part = _dot(h, tl.trans(wd), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        tl.atomic_add(acc_ptr + rows[:, None] * stride_acc + nn[None, :], part,
                      mask=row_ok[:, None] & n_ok[None, :], sem="relaxed")


class MlpLora(NamedTuple):
    """PEFT LoRA of the gate_up and down projections for :func:`mlp_block` (every tensor
    contiguous, on ``x``'s device).

    ``xa [M, r_g + r_u]``: ``x @ [A_gate; A_up]^T`` in the adapters' dtype (the caller's shrink:
    fp32 for PEFT's fp32 adapters, rounded to 16 bits for 16-bit ones or the engine's
    ``lora_dtype="model"`` shadows); ``b_gate [I, r_g]``, ``b_up [I, r_u]``: the parts' B, of
    ``xa``'s dtype; ``scaling``: the gate_up group's; ``a_down [r_d, I]``: down_proj's A (any
    float dtype); ``xa_down [M, r_d]``: fp32, zeroed on entry, the kernel adds the unrounded
    ``h @ A_d^T`` into it (``h`` the activation), so down's B can follow as a separate expand
    (``lora_expand(..., round_to=dtype)``, which rounds this sum to B's dtype first when B is
    16-bit: PEFT's ``lora_A`` output in the adapter dtype)."""

    xa: Any
    b_gate: Any
    b_up: Any
    scaling: float
    a_down: Any
    xa_down: Any


def default_config(dtype: Any, rows: int = 16) -> tuple[int, int, int, int, int]:
    """``(BLOCK_J, BLOCK_K, BLOCK_N, num_warps, num_stages)``: 128/128/128, 4 warps, 3 stages for
    16-bit weights up to 16 rows (the fastest of ``BLOCK_J`` 32/64/128 in
    ``scripts/device/ab_mlp_block.py``, H100 2026-12-08: 56.1 us at 4 rows against 64.3 us
    cuBLAS, 65.2 us skinny); above 16 rows 64/128/128 in 8 warps (two ``[rows, BLOCK_J]`` fp32
    accumulators per program: a register budget, not a measurement); fp32 weights 64/64/64 in
    2 stages (the 128 tiles' fp32 buffers exceed shared memory)."""
    import torch
    if dtype == torch.float32:
        return 64, 64, 64, 4, 2
    if rows > 16:
        return 64, 128, 128, 8, 3
    return 128, 128, 128, 4, 3


def check_lora(lora: MlpLora, m: int, hidden: int, inter: int, device: Any) -> None:
    """Raise ``TypeError`` unless ``lora`` is an :class:`MlpLora`, ``ValueError`` unless its
    fields fit it for ``m`` rows (each named in the message)."""
    import math

    import torch
    if not isinstance(lora, MlpLora):
        raise TypeError(f"mlp_block: lora is a {type(lora).__name__}; pass "
                        "kernels.mlp_block.MlpLora(xa, b_gate, b_up, scaling, a_down, xa_down).")
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for name in ("xa", "b_gate", "b_up", "a_down", "xa_down"):
        t = getattr(lora, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"mlp_block: lora.{name} must be a 2-D torch tensor, got "
                             f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}.")
    if isinstance(lora.scaling, (str, bytes)) or lora.scaling is None:
        raise ValueError(f"mlp_block: lora.scaling={lora.scaling!r}: a finite number.")
    if not math.isfinite(float(lora.scaling)):
        raise ValueError(f"mlp_block: lora.scaling={lora.scaling!r}: a finite number.")
    r_g, r_u, r_d = lora.b_gate.shape[1], lora.b_up.shape[1], lora.a_down.shape[0]
    want = {"xa": (m, r_g + r_u), "b_gate": (inter, r_g), "b_up": (inter, r_u),
            "a_down": (r_d, inter), "xa_down": (m, r_d)}
    dtypes = {"xa": (lora.xa.dtype,), "b_gate": (lora.xa.dtype,), "b_up": (lora.xa.dtype,),
              "a_down": floats, "xa_down": (torch.float32,)}
    if lora.xa.dtype not in floats:
        raise ValueError(f"mlp_block: lora.xa {lora.xa.dtype}: bf16 / fp16 / fp32 only.")
    for name, shape in want.items():
        t = getattr(lora, name)
        if (tuple(t.shape) != shape or t.dtype not in dtypes[name] or not t.is_contiguous()
                or t.device != device):
            raise ValueError(f"mlp_block: lora.{name} {tuple(t.shape)} {t.dtype}: need a "
                             f"contiguous {shape} on {device} of dtype "
                             f"{' / '.join(str(d) for d in dtypes[name])} (xa and the B of "
                             "gate/up share one dtype; xa_down is an fp32 accumulator).")
    if not all(0 < r <= MAX_RANK for r in (r_g, r_u, r_d)):
        raise ValueError(f"mlp_block: LoRA ranks {(r_g, r_u, r_d)}: 1-{MAX_RANK} supported.")


def mlp_block(x: Any, w_gate_up: Any, w_down: Any, out: Any = None, lora: MlpLora | None = None,
              block_j: int | None = None, block_k: int | None = None,
              block_n: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> Any:
    """``acc [M, H]`` fp32 (module docstring). ``out``: a zeroed fp32 ``[M, H]`` buffer (else one
    is allocated and zeroed here). ``lora``: :class:`MlpLora` (its ``xa_down`` zeroed on entry).
    Tiles: :func:`default_config` for the weights' dtype where not given. PDL as the engine's
    other kernels (:mod:`.pdl`): waits before reading ``x``; launch_dependents after its last
    input load.

    Raises:
        ValueError: x or a weight that is not a 2-D bf16 / fp16 / fp32 tensor, tensors on more
            than one device, more than :data:`MAX_ROWS` rows, shapes that do not chain
            (``w_gate_up [2I, H]``, ``w_down [H, I]``), mixed dtypes, a non-unit column stride,
            a tile size that is not a power of 2 >= 16, an ``out`` that is not a contiguous fp32
            ``[M, H]``, or a ``lora`` :func:`check_lora` rejects.
        TypeError: a ``lora`` that is not an :class:`MlpLora`.
    """
    import torch
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in floats:
            raise ValueError(f"mlp_block: {name} must be a 2-D bf16 / fp16 / fp32 tensor, got "
                             f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))} "
                             f"{getattr(t, 'dtype', '')}.")
    if w_gate_up.device != x.device or w_down.device != x.device or (
            out is not None and out.device != x.device):
        raise ValueError(f"mlp_block: x on {x.device}, w_gate_up on {w_gate_up.device}, w_down "
                         f"on {w_down.device}" + (f", out on {out.device}" if out is not None
                                                  else "") + ": one device for all.")
    for name, b in (("block_j", block_j), ("block_k", block_k), ("block_n", block_n)):
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"mlp_block: {name}={b}: a power of 2 >= 16 (a tl.arange size).")
    m, hidden = x.shape
    inter = w_down.shape[1]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"mlp_block: {m} rows; 1-{MAX_ROWS} supported (keep the unfused path).")
    if tuple(w_gate_up.shape) != (2 * inter, hidden) or w_down.shape[0] != hidden:
        raise ValueError(f"mlp_block: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
                         f"w_down {tuple(w_down.shape)}: need w_gate_up [2I, H] (gate rows, then "
                         "up rows) and w_down [H, I].")
    if not x.dtype == w_gate_up.dtype == w_down.dtype:
        raise ValueError(f"mlp_block: dtypes {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}: "
                         "one dtype for x and both weights.")
    if x.stride(1) != 1 or w_gate_up.stride(1) != 1 or w_down.stride(1) != 1:
        raise ValueError("mlp_block: x and the weights need unit column stride.")
    if out is None:
        out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    elif (out.dtype != torch.float32 or tuple(out.shape) != (m, hidden)
          or out.stride(1) != 1):
        raise ValueError(f"mlp_block: out {tuple(out.shape)} {out.dtype}: need a zeroed "
                         f"contiguous fp32 [{m}, {hidden}].")
    if lora is not None:
        check_lora(lora, m, hidden, inter, x.device)
    bj, bk, bn, warps, stages = default_config(x.dtype, m)
    upcast = INTERPRETED or x.dtype == torch.float32
    lo = lora if lora is not None else MlpLora(out, out, out, 0.0, out, out)  # unused slots
    r_g, r_u = (lora.b_gate.shape[1], lora.b_up.shape[1]) if lora is not None else (0, 0)
    r_d = lora.a_down.shape[0] if lora is not None else 0
    _mlp_block_kernel[(triton.cdiv(inter, block_j or bj),)](
        x, w_gate_up, w_down, out, lo.xa, lo.b_gate, lo.b_up, lo.a_down, lo.xa_down, m, hidden,
        inter, x.stride(0), w_gate_up.stride(0), w_down.stride(0), out.stride(0),
        lo.xa.stride(0), lo.xa_down.stride(0), r_g, r_u, r_d, float(lo.scaling),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_J=block_j or bj, BLOCK_K=block_k or bk, BLOCK_N=block_n or bn,
        UPCAST=upcast, HAS_LORA=lora is not None,
        BLOCK_R=max(16, triton.next_power_of_2(max(r_g, r_u, r_d, 1))), RNE=lp.rne(x.dtype),
        num_warps=num_warps or warps, num_stages=num_stages or stages, **pdl.launch_kwargs())
    return out
