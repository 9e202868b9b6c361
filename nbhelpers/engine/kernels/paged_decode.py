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

Two split policies over the same stage-1 program (``kernel=``): ``"v1"`` spreads each row's tiles
evenly over ``num_splits`` (:func:`choose_num_splits`, from ``max_model_len``) and always runs
stage 2; ``"v2"`` sizes the grid to the SMs (:func:`plan_num_splits`: ``B * H_kv * S >= 2 x
SMs``), gives every split of a row at least ``min_split_tokens`` (short rows use fewer splits, as
SGLang's ``python/sglang/srt/layers/attention/triton_ops/decode_attention.py`` with per-request
``num_kv_splits`` and ``MIN_BLOCK_KV``) and, at ``S == 1``, writes the output from stage 1 (no
stage 2, no workspace). Default :data:`DEFAULT_KERNEL` = "v1" until the H200 A/B
(``scripts/device/ab_paged_decode.py``) measures v2. Head dims up to 512 (Gemma-4 full layers):
``BLOCK_D`` = next power of two, ``BLOCK_N`` from :func:`default_block_n`.

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
TARGET_WAVES = 2.0
"""Kernel "v2": stage-1 programs per SM the grid aims at (``B * H_kv * S >= 2 * num_SMs``)."""
MIN_SPLIT_TOKENS_V2 = 128
"""Kernel "v2": fewest tokens per split of a row (2 pages of 64 on the H200 configs)."""
KERNELS = ("v1", "v2")
DEFAULT_KERNEL = "v1"
"""The engine's kernel until the H200 A/B (``scripts/device/ab_paged_decode.py``) says "v2"."""
KERNEL_OPTIONS = ("kernel", "num_splits", "BLOCK_N", "num_warps", "num_stages",
                  "programs_per_sm", "waves", "min_split_tokens")


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1  # tanh via sigmoid, as vLLM's kernel (portable to HIP)


@triton.jit
def _split_tiles(seq_len, window, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 USE_WINDOW: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """``(lo, s_lo, s_hi)``: first visible position and this split's ``BLOCK_N`` tiles.

    Tiles wholly behind the window are never visited. ``MIN_SPLIT_TILES > 0`` (kernel "v2"): no
    split of this row gets fewer tiles, so short rows use fewer of the ``NUM_SPLITS`` programs
    (the rest exit at once); SGLang's per-request ``num_kv_splits`` with ``MIN_BLOCK_KV``."""
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    t_lo = lo // BLOCK_N  # tiles are aligned to absolute positions
    t_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(t_hi - t_lo, NUM_SPLITS)
    if MIN_SPLIT_TILES > 0:
        per_split = tl.maximum(per_split, MIN_SPLIT_TILES)
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
def _paged_attention_stage1(Q, K, V, BlockTable, SeqLens, MidO, MidLse, Out, scale, soft_cap,
            window,
            stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
            stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
            DOT_PRECISION: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, DIRECT: tl.constexpr):
    """Stage 1: one program per ``(row, kv head, split)``, all ``GROUP`` q heads of the kv head
    as the ``BLOCK_H`` rows of the ``tl.dot`` tiles (each K/V tile is read once per kv head).
    ``DIRECT``: ``Out`` (strides ``stride_mb/mh`` then) gets the final output."""
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)  # positions in int32, slots in int64
    lo, s_lo, s_hi = _split_tiles(seq_len, window, split, BLOCK_N, NUM_SPLITS, USE_WINDOW,
                                  MIN_SPLIT_TILES)
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
    mask_hd = mask_h[:, None] & mask_d[None, :]
    if DIRECT:  # one split (kernel "v2"): the normalised output is final, no stage 2
        out = Out + b * stride_mb + heads * stride_mh
        tl.store(out[:, None] + offs_d[None, :], (acc / l_safe[:, None]).to(Out.dtype.element_ty),
                 mask=mask_hd)
    else:
        mid = MidO + b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(mid[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=mask_hd)
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
    """Kernel "v1" splits per row: enough stage-1 programs to fill the GPU, none under 64 tokens.

    ``ceil(programs_per_sm * num_sms / (batch * num_kv_heads))``, clipped to
    ``[1, min(MAX_SPLITS, ceil(max_seq_len / MIN_SPLIT_TOKENS))]``. Qwen3-4B (8 KV heads) on the
    H200 (132 SMs) at batch 32: 3 splits (768 programs); batch 1, 1024 tokens: 16.
    """
    want = -(-programs_per_sm * num_sms // max(1, batch * num_kv_heads))
    return max(1, min(want, MAX_SPLITS, -(-max_seq_len // MIN_SPLIT_TOKENS)))


def plan_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                    waves: float = TARGET_WAVES,
                    min_split_tokens: int = MIN_SPLIT_TOKENS_V2) -> int:
    """Kernel "v2" grid splits: ``batch * num_kv_heads * S >= waves * num_sms`` programs.

    ``S = ceil(waves * num_sms / (batch * num_kv_heads))`` clipped to ``[1, min(MAX_SPLITS,
    ceil(max_seq_len / min_split_tokens))]``; ``S == 1`` runs without stage 2. The grid is static
    (CUDA graphs), the work is not: each row spreads its visible tiles over at most
    ``ceil(L_b / min_split_tokens)`` of the ``S`` splits (``MIN_SPLIT_TILES`` in the kernel), so
    a short row leaves its other programs empty. Follows SGLang's ``get_num_kv_splits`` (splits
    from batch x heads vs the device's SM count, per request from its length). H200 (132 SMs):
    Qwen3-4B (8 KV heads) at ``max_seq_len`` 1024: batch 32 -> 2, batch 64 -> 1, batch 4 -> 8
    (9 wanted, 1024 / 128 caps it); Gemma-4 E2B (1 KV head) batch 32 -> 8.
    """
    if batch < 1 or num_kv_heads < 1 or max_seq_len < 1 or num_sms < 1 or min_split_tokens < 1:
        raise ValueError(f"plan_num_splits: batch={batch}, num_kv_heads={num_kv_heads}, "
                         f"max_seq_len={max_seq_len}, num_sms={num_sms}, min_split_tokens="
                         f"{min_split_tokens}: all must be >= 1.")
    want = int(-(-waves * num_sms // (batch * num_kv_heads)))
    return max(1, min(want, MAX_SPLITS, -(-max_seq_len // min_split_tokens)))


def default_block_n(head_dim: int) -> int:
    """Keys per tile: 64 up to D 128, 32 at D 256, 16 above (shared memory per stage: K and V
    tiles ``2 * BLOCK_N * BLOCK_D * 2`` bytes = 32 KiB at bf16 for all three, so 2 stages fit
    the H200's 227 KiB with room for q and the layout conversions)."""
    return 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16


def paged_decode_attention(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any,
                           scale: float, page_size: int, num_splits: int,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           workspace: tuple[Any, Any] | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int = 2, kernel: str = "v1",
                           min_split_tokens: int = MIN_SPLIT_TOKENS_V2) -> Any:
    """Decode attention of ``q [B, H, D]`` over the paged pool; returns ``[B, H, D]``.

    Args:
        k_cache, v_cache: ``[1, H_kv, num_slots, D]`` (unit stride on D); ``H % H_kv == 0``.
            A KV-shared layer (Gemma-4) passes its store layer's tensors.
        block_table: ``[B, max_pages]`` int32/int64 physical page ids (logical page order).
        seq_lens: ``[B]`` int, tokens visible to the query (``pos + 1``), each ``>= 1``.
        workspace: ``(mid_o [B, H, S, D], mid_lse [B, H, S])`` fp32, contiguous; ``None`` =
            allocate here (fine under CUDA-graph capture: the shape is static).
        block_n: keys per tile (power of 2, >= 16); default :func:`default_block_n`.
        kernel: ``"v1"`` (each row's tiles split evenly over all ``num_splits``, stage 2 always)
            or ``"v2"`` (splits of at least ``min_split_tokens`` per row; ``num_splits == 1``
            writes the output from stage 1, one launch). Same math, same stage-1 program.
    Raises:
        ValueError: shapes or dtypes that do not fit (heads, head dim, workspace, block_n), an
            unknown ``kernel``.
    """
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    block_n = block_n or default_block_n(dim)
    _check(q, k_cache, v_cache, heads, kv_heads, block_n, kernel)
    direct = kernel == "v2" and num_splits == 1
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    if direct:
        mid_o, mid_lse = out.unsqueeze(2), out  # strides of out; mid_lse unused
    else:
        mid_o, mid_lse = workspace or new_workspace(bsz, heads, num_splits, dim, q.device)
        if mid_o.shape != (bsz, heads, num_splits, dim) or not mid_o.is_contiguous():
            raise ValueError(f"paged decode: workspace {tuple(mid_o.shape)} != "
                             f"{(bsz, heads, num_splits, dim)} (contiguous fp32).")
    block_d = triton.next_power_of_2(max(dim, 16))
    min_tiles = max(1, min_split_tokens // block_n) if kernel == "v2" else 0
    _paged_attention_stage1[(bsz, kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse, out, scale, soft_cap or 1.0,
        sliding_window or 0, q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), block_table.stride(0), mid_o.stride(0),
        mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=heads // kv_heads, BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, USE_WINDOW=bool(sliding_window), USE_SOFT_CAP=bool(soft_cap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MIN_SPLIT_TILES=min_tiles, DIRECT=direct, num_warps=num_warps, num_stages=num_stages)
    if not direct:
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


def _check(q: Any, k_cache: Any, v_cache: Any, heads: int, kv_heads: int, block_n: int,
           kernel: str = "v1") -> None:
    if kernel not in KERNELS:
        raise ValueError(f"paged decode: kernel={kernel!r}; choose one of {list(KERNELS)}.")
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
    when the model keeps its own attention (``model.decode_kernels`` lacks ``"triton"``).

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
    kv_heads = getattr(model, "num_kv_heads", None) or model.config.num_key_value_heads
    return PagedDecode(model.spec, len(model.layers), kv_heads, options.page_size,
                       options.max_model_len, model.device, options.decode_kernel_options)


class PagedDecode:
    """The engine's decode attention when ``RunnerOptions.decode_attention == "triton"``.

    Reads each layer's sliding window and the soft-cap from the :class:`ArchSpec` (the factories
    of ``attention.py`` tag their closures with ``window`` / ``cap``), picks ``num_splits`` per
    batch bucket and layer shape (kernel "v1": :func:`choose_num_splits`; "v2":
    :func:`plan_num_splits`; or ``options["num_splits"]``) and keeps one workspace per
    ``(B, H, S, D)``. ``options`` (``RunnerOptions.decode_kernel_options``): ``kernel``
    (default :data:`DEFAULT_KERNEL`), ``num_splits``, ``BLOCK_N``, ``num_warps``, ``num_stages``,
    ``programs_per_sm`` (v1), ``waves`` and ``min_split_tokens`` (v2).

    Raises:
        ValueError: an unknown option or kernel, or a layer mask / score_mod the kernel cannot
            express (anything but ``sliding_window`` and ``soft_cap``).
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
        self.kernel = opts.pop("kernel", DEFAULT_KERNEL)
        if self.kernel not in KERNELS:
            raise ValueError(f"decode_kernel_options['kernel']={self.kernel!r}: choose one of "
                             f"{list(KERNELS)}.")
        self.num_splits = opts.pop("num_splits", None)
        self.programs_per_sm = opts.pop("programs_per_sm", PROGRAMS_PER_SM)
        self.waves = opts.pop("waves", TARGET_WAVES)
        self.launch = {"block_n": opts.pop("BLOCK_N", None), "kernel": self.kernel, **opts}
        self.workspaces: dict[tuple, tuple[Any, Any]] = {}

    def splits_for(self, batch: int, num_kv_heads: int | None = None) -> int:
        """Grid splits for a batch bucket (and a layer's KV heads; default the model's)."""
        kv_heads = num_kv_heads or self.num_kv_heads
        if self.num_splits:
            return self.num_splits
        if self.kernel == "v1":
            return choose_num_splits(batch, kv_heads, self.max_model_len, self.num_sms,
                                     self.programs_per_sm)
        return plan_num_splits(batch, kv_heads, self.max_model_len, self.num_sms, self.waves,
                               self.launch.get("min_split_tokens", MIN_SPLIT_TOKENS_V2))

    def bind(self, block_table: Any, seq_lens: Any) -> Callable[..., Any]:
        """``fn(layer, q [B, H, D], k_cache, v_cache, scale) -> [B, H, D]`` for this step."""
        return functools.partial(self._layer, block_table, seq_lens)

    def _layer(self, block_table: Any, seq_lens: Any, i: int, q: Any, k_cache: Any,
               v_cache: Any, scale: float) -> Any:
        bsz, heads, dim = q.shape
        splits = self.splits_for(bsz, k_cache.shape[1])
        key = (bsz, heads, splits, dim, str(q.device))
        if key not in self.workspaces and not (self.kernel == "v2" and splits == 1):
            self.workspaces[key] = new_workspace(bsz, heads, splits, dim, q.device)
        return paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                                      self.page_size, splits, self.windows[i], self.soft_cap,
                                      self.workspaces.get(key), **self.launch)


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
