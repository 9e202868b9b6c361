"""A projection group's base GEMM with its LoRA inside, one Triton launch: ``y = x W^T + s (x A^T) B^T``.

Contract: :func:`lora_gemm` returns ``y [M, N]`` (the base dtype) for the skinny decode rows
``x [M, K]`` (``M <= MAX_ROWS``) of a :class:`~nbhelpers.engine.lora.LiveGroup`: base weights
``W [N, K]`` (nn.Linear layout, the parts' rows stacked: ``N = sum(out_i)``), optional bias,
LoRA ``A [R, K]`` (``R = sum(r_i)``, the fused A buffer or the ``ext`` rows of W) and each part's
own ``B_i [out_i, r_i]`` (live PEFT tensors, up to :data:`MAX_PARTS` pointers, read at call time),
bf16 or PEFT's fp32 adapters read directly (no cast kernel); fp32 bases (tiny CPU test models)
too. Math: ``x W^T`` in fp32 accumulation of 16-bit products (IEEE fp32 for an fp32 base);
``x A^T`` and ``(x A^T) B^T`` in fp32 (x upcast in registers, IEEE fp32 dot, no TF32; with bf16 adapters the products are exact in fp32 and ``xa`` stays fp32, not rounded to
bf16 as PEFT's bf16 ``lora_A`` output is); ``base + s * lora (+ bias)`` summed in fp32 and rounded
once to ``y``'s dtype (PEFT rounds the base output first: results differ from PEFT by <= 1 ulp).

Design (grid ``(cdiv(N, BLOCK_N), SPLIT_K)``). Each program owns one N tile, which lies in one part
(``BLOCK_N`` divides every ``out_i`` but the last: :func:`block_ok`), and one K chunk. Its K loop
loads the x tile once and uses it twice: ``acc += x W_tile^T`` and ``xa += x A_part^T`` (the
part's ``r_i`` rows of A only), as vLLM's fused MoE-LoRA kernel reuses the activation tile
(``vllm/lora/ops/triton_ops/fused_moe_lora_op.py``; Punica shrink/expand, arXiv:2310.18547). The
expand ``xa [M, r] @ B_tile^T [r, BLOCK_N]`` runs in the epilogue. The shrink needs the whole K
reduction before the expand, so with ``SPLIT_K > 1`` (skinny o/down projections, K >= 4096,
where ``N / BLOCK_N`` alone leaves SMs idle) every program ``atomic_add``-s its partial ``acc``
and ``xa`` into a zeroed fp32 workspace and bumps its tile's counter; the program that sees
``SPLIT_K - 1`` (the last of the tile; the counter's acq_rel atomic orders the partials before
it) reads the sums and runs the epilogue: CUTLASS's "serial split-K" semaphore. One launch plus
one workspace memset; no host sync (graph-capturable). Sum order varies with ``SPLIT_K > 1``.

Bytes: each N-tile program reads A's ``r_i`` rows over its K chunk, so A is read
``cdiv(out_i, BLOCK_N)`` times per part (from L2 after the first): ``r * K * a_bytes`` per tile
against ``BLOCK_N * K * 2`` of W, ratio ``r * a_bytes / (2 * BLOCK_N)``: r=32 fp32 adapters,
BLOCK_N=128: 50 % of W's bytes on top (L2 traffic; DRAM reads A once, 0.3 MB of qkv's 31 MB);
BLOCK_N=256: 25 %; bf16 adapters half that. B is read once (each tile its own rows). Hence
:data:`CONFIGS` favour wide N tiles with split-K to fill the 132 SMs. Shared memory per program
(:func:`smem_bytes`) grows with BLOCK_M, the stages and the LoRA rank: the tuner's candidates
(:func:`configs_for`) and :func:`default_config` stay within the device's limit
(:func:`shared_memory_limit`; 227 KiB on an H200, which config 4 and 5 exceed at 64 rows).

Interpreter (``TRITON_INTERPRET=1``, CPU tests): 16-bit ``tl.dot`` operands are upcast first (its
bf16 dot returned garbage, see :mod:`.lora_expand`) and the bf16 store rounds by bit arithmetic.

Tests: ``tests/engine/test_lora_gemm.py``; GPU A/B: ``scripts/device/ab_lora_gemm.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from nbhelpers.engine.kernels.lora_expand import _bf16_rne

MAX_PARTS = 3
MAX_ROWS = 64
"""Rows served (decode); above that the caller keeps cuBLAS + shrink/expand."""
INTERPRETED = bool(triton.knobs.runtime.interpret)


class Config(NamedTuple):
    """One launch configuration: N tile, K tile, K splits, warps, pipeline stages."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


CONFIGS = (Config(64, 128, 1), Config(128, 128, 1), Config(128, 128, 2), Config(256, 64, 4),
           Config(128, 256, 4, 4, 2), Config(256, 128, 8, 8), Config(128, 64, 8),
           Config(64, 256, 16, 4, 2))
"""Candidates the tuner (:mod:`.lora_gemm_tune`) times per (M bucket, N, K) among those that fit
the device's shared memory (:func:`configs_for`); ``split_k`` is clamped so every split has at
least one K tile."""


@triton.jit
def _part(col0, end0, end1, b0, b1, b2, roff1, roff2, r0, r1, r2):
    """(B pointer, first column, first rank row, rank) of the part holding column ``col0``."""
    b, start, roff, rank = b0, end0 * 0, roff1 * 0, r0
    if col0 >= end0:
        b, start, roff, rank = b1, end0, roff1, r1
    if col0 >= end1:
        b, start, roff, rank = b2, end1, roff2, r2
    return b, start, roff, rank


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b``: IEEE fp32 for fp32 operands (no TF32) and under the interpreter."""
    if UPCAST or a.dtype == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["m", "end0", "end1", "roff1", "roff2", "r0", "r1", "r2"])
def _lora_gemm(x_ptr, w_ptr, a_ptr, b0, b1, b2, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
               m, n, k, stride_x, stride_y, end0, end1, roff1, roff2, r0, r1, r2, scaling,
               k_per_split, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
               SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
               BF16_RNE: tl.constexpr):
    tile = tl.program_id(0)
    col0 = tile * BLOCK_N
    b_ptr, start, roff, rank = _part(col0, end0, end1, b0, b1, b2, roff1, roff2, r0, r1, r2)
    rows = tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    row_ok, col_ok, r_ok = rows < m, cols < n, rr < rank
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * k + kk[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # W^T tile [BLOCK_K, BLOCK_N]
        acc = _dot(x, w, acc, UPCAST)
        if HAS_LORA:  # same x tile: the shrink of this part's ranks, fp32
            a = tl.load(a_ptr + (roff + rr)[None, :].to(tl.int64) * k + kk[:, None],
                        mask=r_ok[None, :] & k_ok[:, None], other=0.0)  # A^T [BLOCK_K, BLOCK_R]
            xa = tl.dot(x.to(tl.float32), a.to(tl.float32), xa, input_precision="ieee")
    if SPLIT:  # serial split-K: publish partials, the tile's last program finishes
        y_ws = ws_ptr + rows[:, None] * n + cols[None, :]
        tl.atomic_add(y_ws, acc, mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")
        xa_ws = (ws_ptr + BLOCK_M * n + tile * BLOCK_M * BLOCK_R + rows[:, None] * BLOCK_R
                 + rr[None, :])
        if HAS_LORA:
            tl.atomic_add(xa_ws, xa, sem="relaxed")
        tl.debug_barrier()  # all threads' partials precede thread 0's release (CUTLASS Semaphore)
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")  # orders the partials above
        if done == tl.num_programs(1) - 1:
            acc = tl.load(y_ws, mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                          cache_modifier=".cg")
            if HAS_LORA:
                xa = tl.load(xa_ws, cache_modifier=".cg")
            _epilogue(acc, xa, b_ptr, start, rank, bias_ptr, y_ptr, stride_y, scaling, rows, cols,
                      rr, row_ok, col_ok, r_ok, HAS_LORA, HAS_BIAS, BF16_RNE)
    else:
        _epilogue(acc, xa, b_ptr, start, rank, bias_ptr, y_ptr, stride_y, scaling, rows, cols,
                  rr, row_ok, col_ok, r_ok, HAS_LORA, HAS_BIAS, BF16_RNE)


@triton.jit
def _epilogue(acc, xa, b_ptr, start, rank, bias_ptr, y_ptr, stride_y, scaling, rows, cols, rr,
              row_ok, col_ok, r_ok, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
              BF16_RNE: tl.constexpr):
    """``y = acc + scaling * xa @ B_tile^T (+ bias)``, fp32, rounded once to y's dtype."""
    if HAS_LORA:  # expand: this tile's rows of B_part, loaded as B^T [BLOCK_R, BLOCK_N]
        b = tl.load(b_ptr + (cols - start)[None, :].to(tl.int64) * rank + rr[:, None],
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        acc = acc + scaling * tl.dot(xa, b.to(tl.float32), input_precision="ieee")
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    if BF16_RNE:
        tl.store(y_ptrs, _bf16_rne(acc), mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_ok(sizes: list[int], block_n: int) -> bool:
    """Whether an N tile of ``block_n`` never straddles two parts (divides all but the last)."""
    return all(s % block_n == 0 for s in sizes[:-1])


def supported(x: Any, w: Any, sizes: list[int], a: Any = None, bs: list[Any] | None = None,
              ranks: list[int] | None = None) -> bool:
    """Whether :func:`lora_gemm` serves these operands (else the caller's cuBLAS path).

    Needs ``x [M, K]`` with ``1 <= M <= MAX_ROWS``, unit column stride, bf16/fp16/fp32, ``W [sum(sizes),
    K]`` contiguous in x's dtype, 1 to :data:`MAX_PARTS` parts, a tile of 16 dividing all parts
    but the last; with LoRA, contiguous ``A [sum(ranks), K]`` and ``B_i [sizes[i], ranks[i]]``,
    all bf16/fp16/fp32 of one dtype, ranks <= 128; one CUDA device (or the interpreter).
    """
    import torch
    floats = (torch.bfloat16, torch.float16, torch.float32)
    ok = (x.dim() == 2 and w.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1
          and x.dtype in floats and w.dtype == x.dtype and w.is_contiguous()
          and tuple(w.shape) == (sum(sizes), x.shape[1]) and 0 < len(sizes) <= MAX_PARTS
          and block_ok(sizes, 16) and w.device == x.device and (x.is_cuda or INTERPRETED))
    if not ok or a is None:
        return ok
    return (bs is not None and ranks is not None and len(bs) == len(ranks) == len(sizes)
            and a.dtype in floats and a.is_contiguous() and a.device == x.device
            and tuple(a.shape) == (sum(ranks), x.shape[1]) and 0 < max(ranks) <= 128
            and all(b.dtype == a.dtype and b.is_contiguous() and tuple(b.shape) == (o, r)
                    and b.device == x.device for b, o, r in zip(bs, sizes, ranks)))


def block_m_for(m: int) -> int:
    """The row tile (BLOCK_M) of a launch with ``m`` rows: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


def block_r_for(ranks: list[int] | None) -> int:
    """The rank tile (BLOCK_R) for these LoRA ranks (16 without LoRA)."""
    return max(16, triton.next_power_of_2(max(ranks))) if ranks else 16


def smem_bytes(cfg: Config, m: int, x_bytes: int = 2, a_bytes: int = 0, max_rank: int = 0) -> int:
    """Shared memory (bytes) one program of ``_lora_gemm`` allocates with ``cfg`` for ``m`` rows.

    ``x_bytes``: base element size (2 bf16/fp16, 4 fp32); ``a_bytes``: LoRA A's (2 or 4; 0 without
    LoRA); ``max_rank``: the largest part rank. Terms (BM, BN, BK, BR the tiles, S num_stages):
    x and W tiles, ``S`` buffers with 16-bit operands at BM >= 64 (wgmma) else ``S - 1``;
    with LoRA the A^T tile's ``S - 1`` buffers (``BK * BR * a_bytes`` each), its fp32 copy for
    the IEEE dot when A is 16-bit, and x's copy for that dot (``BM * BK * 2`` with wgmma, else
    ``* 4``). Measured against ``metadata.shared`` of ahead-of-time sm_90 builds specialised as
    a launch on the engine's contiguous operands is (16-divisible pointers and strides): equal for
    all 184 Triton 3.6 (the H200 image's) builds of a bf16 base over every :data:`CONFIGS` entry,
    BM 16/32/64, BR 32-128, bf16/fp32/no adapters, with and without bias, and for 8 Triton 3.9
    ones; at or above the 48 fp32-base builds (no wgmma). A row stride that is not 16-divisible
    pipelines fewer loads (the H200 test's x: 245,760 for config 4 where this gives 278,528).
    The slow AOT test in ``tests/engine/test_lora_gemm.py`` re-checks the bound.
    """
    bk, bm = cfg.block_k, block_m_for(m)
    wgmma = bm >= 64 and x_bytes == 2
    buffers = cfg.num_stages if wgmma else cfg.num_stages - 1
    total = buffers * (bm * bk + bk * cfg.block_n) * x_bytes
    if a_bytes:
        a_tile = bk * block_r_for([max_rank])
        total += ((cfg.num_stages - 1) * a_tile * a_bytes + (a_tile * 4 if a_bytes < 4 else 0)
                  + bm * bk * (2 if wgmma else 4))
    return total


def shared_memory_limit(device: Any) -> int | None:
    """Shared memory one program may use on ``device`` (bytes; CUDA's per-block opt-in maximum,
    what Triton's launcher checks: 232,448 on an H200), ``None`` off CUDA or interpreted."""
    import torch
    device = torch.device(device)
    if device.type != "cuda" or INTERPRETED:
        return None
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if limit is None:  # older torch: Triton's own query
        from triton.runtime import driver
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(limit)


def fit_args(x: Any, a: Any = None, ranks: list[int] | None = None) -> dict[str, Any]:
    """``{"x_bytes", "a_bytes", "max_rank", "limit"}`` of these operands for :func:`fits`,
    :func:`configs_for` and :func:`default_config` (limit: :func:`shared_memory_limit`)."""
    return {"x_bytes": x.element_size(), "a_bytes": 0 if a is None else a.element_size(),
            "max_rank": max(ranks) if a is not None and ranks else 0,
            "limit": shared_memory_limit(x.device)}


def fits(cfg: Config, m: int, x_bytes: int = 2, a_bytes: int = 0, max_rank: int = 0,
         limit: int | None = None) -> bool:
    """Whether ``cfg`` fits ``limit`` bytes of shared memory (:func:`smem_bytes`; None: any)."""
    return limit is None or smem_bytes(cfg, m, x_bytes, a_bytes, max_rank) <= limit


def configs_for(m: int, sizes: list[int], x_bytes: int = 2, a_bytes: int = 0, max_rank: int = 0,
                limit: int | None = None) -> list[Config]:
    """The :data:`CONFIGS` whose N tile suits ``sizes`` (:func:`block_ok`) and that fit ``limit``
    (:func:`fits`): the tuner's candidates."""
    return [c for c in CONFIGS if block_ok(sizes, c.block_n)
            and fits(c, m, x_bytes, a_bytes, max_rank, limit)]


def default_config(m: int, n: int, k: int, sizes: list[int], x_bytes: int = 2, a_bytes: int = 0,
                   max_rank: int = 0, limit: int | None = None) -> Config:
    """Untuned choice: the widest legal N tile with ~128 programs (split-K fills the rest), then
    fewer stages, a shorter K tile (down to 32) and a narrower N tile until it :func:`fits`."""
    block_n = next((b for b in (256, 128, 64, 32, 16) if block_ok(sizes, b) and n >= b), 16)
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(16, 128 // tiles, k // 256))
    cfg = Config(block_n, 128 if block_n <= 128 else 64, split)
    while not fits(cfg, m, x_bytes, a_bytes, max_rank, limit):
        if cfg.num_stages > 2:
            cfg = cfg._replace(num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = cfg._replace(block_k=cfg.block_k // 2)
        elif cfg.block_n > 16:
            cfg = cfg._replace(block_n=cfg.block_n // 2)
        else:
            break  # the smallest tiles: let Triton report the device's limit
    return cfg


def lora_gemm(x: Any, w: Any, sizes: list[int], bias: Any = None, a: Any = None,
              bs: list[Any] | None = None, ranks: list[int] | None = None,
              scaling: float = 1.0, config: Config | None = None) -> Any:
    """``x W^T (+ bias) (+ scaling * (x A^T) B^T per part)`` in one launch (module docstring).

    Shapes: ``x [M, K]``, ``w [N, K]``, ``bias [N]`` or None, ``a [R, K]`` or None (no LoRA),
    ``bs[i] [sizes[i], ranks[i]]``; returns ``y [M, N]`` in x's dtype. ``config``: default
    :func:`default_config` within the device's shared memory (an explicit ``config`` is launched
    as given: Triton raises ``OutOfResources`` if it does not fit). Raises ``ValueError`` when :func:`supported` is false or ``config``'s
    N tile straddles parts.
    """
    import torch
    if not supported(x, w, sizes, a, bs, ranks):
        raise ValueError(f"lora_gemm: unsupported operands x {tuple(x.shape)} {x.dtype}, W "
                         f"{tuple(w.shape)} {w.dtype}, parts {sizes}, ranks {ranks}; use "
                         "F.linear plus lora_shrink/lora_expand.")
    m, k = x.shape
    n = w.shape[0]
    cfg = config or default_config(m, n, k, sizes, **fit_args(x, a, ranks))
    if not block_ok(sizes, cfg.block_n):
        raise ValueError(f"lora_gemm: BLOCK_N={cfg.block_n} straddles parts {sizes}.")
    k_per = triton.cdiv(triton.cdiv(k, min(cfg.split_k, triton.cdiv(k, cfg.block_k))),
                        cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)  # no empty split
    block_m = block_m_for(m)
    lora = _lora_args(a, bs, sizes, ranks)
    tiles = triton.cdiv(n, cfg.block_n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = cnt = y
    if split > 1:
        ws = torch.zeros(block_m * n + tiles * block_m * lora["block_r"] + tiles,
                         dtype=torch.float32, device=x.device)
        cnt = ws[-tiles:].view(torch.int32)
    ptrs = [y if t is None else t for t in (lora["a"], *lora["b"], bias)]  # None: never read
    _lora_gemm[(tiles, split)](
        x, w, *ptrs, y, ws, cnt, m, n, k,
        x.stride(0), y.stride(0), *lora["ends"], *lora["roffs"], *lora["ranks"], float(scaling),
        k_per, HAS_LORA=a is not None, HAS_BIAS=bias is not None, SPLIT=split > 1,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=lora["block_r"],
        UPCAST=INTERPRETED, BF16_RNE=INTERPRETED and y.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def _lora_args(a: Any, bs: list[Any] | None, sizes: list[int], ranks: list[int] | None) -> dict:
    """Per-part kernel arguments padded to :data:`MAX_PARTS` (unused slots are never read:
    their columns start at ``2**31 - 1``)."""
    parts = len(sizes)
    big = 2 ** 31 - 1
    ends = [sum(sizes[:i + 1]) for i in range(parts)][:MAX_PARTS - 1]
    ends += [big] * (MAX_PARTS - 1 - len(ends))
    if a is None:
        return {"a": None, "b": [None] * MAX_PARTS, "ends": ends, "roffs": [0, 0],
                "ranks": [0] * MAX_PARTS, "block_r": 16}
    roffs = [sum(ranks[:i]) for i in range(1, parts)] + [0] * (MAX_PARTS - parts)
    return {"a": a, "b": list(bs) + [bs[0]] * (MAX_PARTS - parts), "ends": ends,
            "roffs": roffs[:MAX_PARTS - 1], "ranks": list(ranks) + [0] * (MAX_PARTS - parts),
            "block_r": block_r_for(ranks)}
