"""Paged split-KV ("flash-decoding") decode attention in Triton, GQA-grouped.

What: one query token per row (``q: [B, H, D]``, any strides with unit last stride) against the
engine's paged KV pool (``k_cache, v_cache: [1, H_kv, num_slots, D]``, slot = ``page * page_size +
offset``, see ``kv_cache.py``) through ``block_table [B, max_pages]``; row ``b`` sees logical
positions ``[max(0, L_b - sliding_window), L_b)`` with ``L_b = seq_lens[b] = pos_b + 1``.
Output ``[B, H, D]`` in q's dtype. Logits are ``scale * q.k`` then, when ``soft_cap`` is set,
``soft_cap * tanh(logits / soft_cap)`` (Gemma-2 logit soft-cap, flex's ``score_mod`` order).

How: stage 1 runs one program per ``(row, kv head, split)``; the program holds all ``H / H_kv``
query heads of its KV head as the rows of one ``tl.dot`` tile (padded to ``BLOCK_H >= 16``), walks
its share of the row's ``BLOCK_N``-token tiles with the online softmax, and writes the normalised
partial output ``[B, H, S, D]`` and its log-sum-exp ``[B, H, S]`` (fp32). Stage 2 merges the ``S``
splits per ``(row, head)``: ``out = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m)``. This is the
design of vLLM's ``vllm/attention/ops/triton_decode_attention.py`` (``_fwd_grouped_kernel_stage1``,
``_fwd_kernel_stage2``; after SGLang and LightLLM, Apache-2.0), rewritten for this pool layout
(head-major ``[H_kv, slots, D]``), per-row windows and tile-aligned splits.

CUDA graphs: no host sync; shapes (hence grid and workspace) depend only on ``B``, ``H``, ``D`` and
``num_splits`` (static per batch bucket); :class:`PagedDecode` keeps one workspace per
``(B, num_splits)`` shared by all layers (they run in order on one stream).

Run: ``TRITON_INTERPRET=1 pytest tests/engine/test_paged_decode.py`` (CPU interpreter).
Requires ``triton`` (imported at module import: the engine imports this file only when
``RunnerOptions.decode_attention == "triton"``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

PROGRAMS_PER_SM = 4
"""Stage-1 programs per SM the split heuristic aims at (a guess to measure on the H200)."""
MIN_SPLIT_TOKENS = 64
"""Split count upper bound: no split shorter than this many tokens of ``max_model_len``."""
MAX_SPLITS = 16
KERNEL_OPTIONS = ("num_splits", "BLOCK_N", "num_warps", "num_stages", "programs_per_sm")


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1  # tanh via sigmoid, as vLLM's kernel (portable to HIP)


@triton.jit
def _split_tiles(seq_len, window, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 USE_WINDOW: tl.constexpr):
    """``(lo, s_lo, s_hi)``: first visible position and this split's ``BLOCK_N`` tiles."""
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    t_lo = lo // BLOCK_N  # tiles are aligned to absolute positions
    t_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(t_hi - t_lo, NUM_SPLITS)
    s_lo = t_lo + split * per_split
    return lo, s_lo, tl.minimum(s_lo + per_split, t_hi)


@triton.jit
def _tile_slots(bt_row, start, offs_n, valid, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Physical slots ``[BLOCK_N]`` of logical positions ``offs_n`` through the block table."""
    if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one scalar page lookup
        page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
        slots = page * PAGE_SIZE + start % PAGE_SIZE + tl.arange(0, BLOCK_N)
    else:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slots = page * PAGE_SIZE + offs_n % PAGE_SIZE
    return slots


@triton.jit
def _online_softmax_tile(q, k, v, valid, m_i, l_i, acc, scale, soft_cap,
                         USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax: ``q [BLOCK_H, D]``, ``k [D, BLOCK_N]``, ``v [BLOCK_N, D]``;
    returns the updated ``(m_i, l_i, acc)`` (running max, denominator, unnormalised output)."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile has a visible key: m_new is finite
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _paged_attention_stage1(Q, K, V, BlockTable, SeqLens, MidO, MidLse, scale, soft_cap, window,
            stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
            stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)  # positions in int32, slots in int64
    lo, s_lo, s_hi = _split_tiles(seq_len, window, split, BLOCK_N, NUM_SPLITS, USE_WINDOW)
    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = BlockTable + b * stride_bt
    for t in range(s_lo, s_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (offs_n < seq_len) & (offs_n >= lo)
        slots = _tile_slots(bt_row, t * BLOCK_N, offs_n, valid, BLOCK_N, PAGE_SIZE)
        k = tl.load(K + kvh * stride_kh + slots[None, :] * stride_ks + offs_d[:, None],
                    mask=valid[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(V + kvh * stride_vh + slots[:, None] * stride_vs + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = _online_softmax_tile(q, k, v, valid, m_i, l_i, acc, scale, soft_cap,
                                             USE_SOFT_CAP, DOT_PRECISION)
    has = l_i > 0  # False for an empty split (more splits than tiles)
    l_safe = tl.where(has, l_i, 1.0)
    mid = MidO + b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(mid[:, None] + offs_d[None, :], acc / l_safe[:, None],
             mask=mask_h[:, None] & mask_d[None, :])
    lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _paged_attention_stage2(MidO, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
            stride_ob, stride_oh,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
            BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    base = b * stride_mb + h * stride_mh
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # empty splits: exp(-inf) = 0
    o = tl.load(MidO + base + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=mask_d)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per row: enough stage-1 programs to fill the GPU, none shorter than 64 tokens.

    ``ceil(programs_per_sm * num_sms / (batch * num_kv_heads))``, clipped to
    ``[1, min(MAX_SPLITS, ceil(max_seq_len / MIN_SPLIT_TOKENS))]``. Qwen3-4B (8 KV heads) on the
    H200 (132 SMs) at batch 32: 3 splits (768 programs); batch 1, 1024 tokens: 16.
    """
    want = -(-programs_per_sm * num_sms // max(1, batch * num_kv_heads))
    return max(1, min(want, MAX_SPLITS, -(-max_seq_len // MIN_SPLIT_TOKENS)))


def paged_decode_attention(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any,
                           scale: float, page_size: int, num_splits: int,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           workspace: tuple[Any, Any] | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int = 2) -> Any:
    """Decode attention of ``q [B, H, D]`` over the paged pool; returns ``[B, H, D]``.

    Args:
        k_cache, v_cache: ``[1, H_kv, num_slots, D]`` (unit stride on D); ``H % H_kv == 0``.
        block_table: ``[B, max_pages]`` int32/int64 physical page ids (logical page order).
        seq_lens: ``[B]`` int, tokens visible to the query (``pos + 1``), each ``>= 1``.
        workspace: ``(mid_o [B, H, S, D], mid_lse [B, H, S])`` fp32, contiguous; ``None`` =
            allocate here (fine under CUDA-graph capture: the shape is static).
        block_n: keys per tile (power of 2, >= 16); default 64 for ``D <= 128`` else 32.
    Raises:
        ValueError: shapes or dtypes that do not fit (heads, head dim, workspace, block_n).
    """
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    block_n = block_n or (64 if dim <= 128 else 32)
    _check(q, k_cache, v_cache, heads, kv_heads, block_n)
    group = heads // kv_heads
    mid_o, mid_lse = workspace or new_workspace(bsz, heads, num_splits, dim, q.device)
    if mid_o.shape != (bsz, heads, num_splits, dim) or not mid_o.is_contiguous():
        raise ValueError(f"paged decode: workspace {tuple(mid_o.shape)} != "
                         f"{(bsz, heads, num_splits, dim)} (contiguous fp32).")
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    block_d = triton.next_power_of_2(max(dim, 16))
    _paged_attention_stage1[(bsz, kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse, scale, soft_cap or 1.0,
        sliding_window or 0, q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), block_table.stride(0), mid_o.stride(0),
        mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_N=block_n, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        USE_WINDOW=bool(sliding_window), USE_SOFT_CAP=bool(soft_cap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    _paged_attention_stage2[(bsz, heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=dim,
        BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4)
    return out


def new_workspace(batch: int, heads: int, num_splits: int, dim: int,
                  device: Any) -> tuple[Any, Any]:
    """``(mid_o [B, H, S, D], mid_lse [B, H, S])`` fp32 partial outputs and log-sum-exps."""
    return (torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=device),
            torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device))


def _check(q: Any, k_cache: Any, v_cache: Any, heads: int, kv_heads: int, block_n: int) -> None:
    if (heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1]
            or not q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"paged decode: q {tuple(q.shape)} {q.dtype} vs k/v pool "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}: need H % H_kv == 0 and equal "
                         "head dims and dtypes.")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged decode: q and the k/v pools need unit stride on the head dim.")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged decode: BLOCK_N={block_n} must be a power of 2 >= 16.")


def build_paged_decode(model: Any, options: Any) -> PagedDecode | None:
    """:class:`PagedDecode` for an engine model and ``RunnerOptions``, or ``None`` (with a warning)
    when the model keeps its own attention (``model.decode_kernels`` lacks ``"triton"``: Gemma-4).

    Raises:
        ValueError: see :class:`PagedDecode`; CPU tensors without ``TRITON_INTERPRET=1`` set
            before this module was imported (Triton reads it when the kernels are decorated).
    """
    if "triton" not in model.decode_kernels:
        warnings.warn(f"decode_attention='triton': {type(model).__name__} keeps flex_attention "
                      "for decode.", stacklevel=3)
        return None
    if model.device.type == "cpu" and type(_paged_attention_stage1).__name__ != "InterpretedFunction":
        raise ValueError("decode_attention='triton' on the CPU runs in Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before importing nbhelpers.engine.kernels.paged_decode.")
    return PagedDecode(model.spec, len(model.layers), model.num_kv_heads, options.page_size,
                       options.max_model_len, model.device, options.decode_kernel_options)


class PagedDecode:
    """The engine's decode attention when ``RunnerOptions.decode_attention == "triton"``.

    Reads each layer's sliding window and the soft-cap from the :class:`ArchSpec` (the factories
    of ``attention.py`` tag their closures with ``window`` / ``cap``), picks ``num_splits`` per
    batch bucket (:func:`choose_num_splits`, or ``options["num_splits"]``) and keeps one
    workspace per ``(B, H, S, D)``. ``options``: ``num_splits``, ``BLOCK_N``, ``num_warps``,
    ``num_stages``, ``programs_per_sm``.

    Raises:
        ValueError: an unknown option, or a layer mask / score_mod the kernel cannot express
            (anything but ``sliding_window`` and ``soft_cap``).
    """

    def __init__(self, spec: Any, num_layers: int, num_kv_heads: int, page_size: int,
                 max_model_len: int, device: Any, options: dict | None = None):
        opts = dict(options or {})
        unknown = sorted(set(opts) - set(KERNEL_OPTIONS))
        if unknown:
            raise ValueError(f"decode_attention='triton': unknown decode_kernel_options "
                             f"{unknown}; accepted: {list(KERNEL_OPTIONS)}.")
        self.windows = [_window(spec.mask_for_layer(i), i) for i in range(num_layers)]
        self.soft_cap = _soft_cap(spec.attn_score_mod)
        self.page_size, self.max_model_len = page_size, max_model_len
        self.num_kv_heads = num_kv_heads
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if torch.device(device).type == "cuda" else 1)
        self.num_splits = opts.pop("num_splits", None)
        self.programs_per_sm = opts.pop("programs_per_sm", PROGRAMS_PER_SM)
        self.launch = {"block_n": opts.pop("BLOCK_N", None), **opts}
        self.workspaces: dict[tuple, tuple[Any, Any]] = {}

    def splits_for(self, batch: int) -> int:
        return self.num_splits or choose_num_splits(batch, self.num_kv_heads, self.max_model_len,
                                                    self.num_sms, self.programs_per_sm)

    def bind(self, block_table: Any, seq_lens: Any) -> Callable[..., Any]:
        """``fn(layer, q [B, H, D], k_cache, v_cache, scale) -> [B, H, D]`` for this step."""
        return functools.partial(self._layer, block_table, seq_lens)

    def _layer(self, block_table: Any, seq_lens: Any, i: int, q: Any, k_cache: Any,
               v_cache: Any, scale: float) -> Any:
        bsz, heads, dim = q.shape
        splits = self.splits_for(bsz)
        key = (bsz, heads, splits, dim, str(q.device))
        if key not in self.workspaces:
            self.workspaces[key] = new_workspace(bsz, heads, splits, dim, q.device)
        return paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                                      self.page_size, splits, self.windows[i], self.soft_cap,
                                      self.workspaces[key], **self.launch)


def _window(mask: Any, layer: int) -> int | None:
    if mask is None:
        return None
    if getattr(mask, "window", None) is None:
        raise ValueError(f"decode_attention='triton': layer {layer} has a mask the Triton kernel "
                         "cannot express (only sliding_window); use decode_attention='flex'.")
    return int(mask.window)


def _soft_cap(score_mod: Any) -> float | None:
    if score_mod is None:
        return None
    if getattr(score_mod, "cap", None) is None:
        raise ValueError("decode_attention='triton': the architecture's score_mod is not "
                         "soft_cap; use decode_attention='flex'.")
    return float(score_mod.cap)
