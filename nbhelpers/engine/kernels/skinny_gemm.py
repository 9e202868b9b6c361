"""Skinny decode GEMM ``y = x W^T (+ bias)`` as one split-K Triton launch (``skinny_gemm``).

Contract: :func:`skinny_gemm` returns ``y [M, N]`` in x's dtype for ``x [M, K]`` (``M <=
MAX_ROWS = 64``, unit column stride, any row stride) and ``W [N, K]`` (nn.Linear layout, unit
column stride; a LiveGroup's fused buffer, its ``ext`` rows of LoRA A included, or ``lm_head.weight``),
optional ``bias [N]``. fp32 accumulation (IEEE fp32 dot for fp32 operands, no TF32), one rounding
to the output dtype. Works on CUDA and under ``TRITON_INTERPRET=1``.

Design (grid ``(cdiv(N, BLOCK_N), SPLIT)``; rows padded to ``BLOCK_M`` (:func:`block_m`: 16, the
smallest ``tl.dot`` tile, for ``M <= 16``; 32 for 17-32 rows; 64 for 33-64 rows; one launch
either way; the engine routes up to 32 rows by default, ``skinny_gemm_max_rows=32``, and 33-64
with ``skinny_gemm_max_rows=64``, opt-in until measured). Each program owns one N tile and one K chunk. With ``SPLIT > 1`` it stores its
fp32 partial into its own slice of a workspace ``[SPLIT, BLOCK_M, N]`` (plain stores: no memset
needed), then ``tl.debug_barrier()`` (every thread's stores issued) and takes a ticket with
``tl.atomic_add(counter + tile, 1, sem="acq_rel")``; the program that draws the last ticket
reads the ``SPLIT`` partials in fixed split order (deterministic, unlike ``atomic_add`` into the
output), adds the bias, writes ``y`` and resets the counter to 0 for the next call. One launch
per GEMM, no host sync, no allocation but ``y``: the workspace and counters are allocated once per
(device, N, split, BLOCK_M) (:func:`workspace`) and reused, so the launch is CUDA-graph capturable. Calls
must be stream-ordered (one stream: the engine's). This is CUTLASS's "serial split-K" (the
``Semaphore`` of ``cutlass/gemm/kernel/gemm.h``, ``SplitKSerial``) and the fix-up step of
Stream-K (Osama et al., arXiv:2301.03598), without the memset of :mod:`.lora_gemm`'s variant.
The interpreter runs programs one after another, so the last ticket is drawn by the last split
and the pattern is exact there too (tested).

PDL (runner option ``pdl``, :mod:`.pdl`; ``USE_GDC``): each program loads its first W tile, then
``gdc_wait()``, then everything else (x, the partial stores, the ticket, the counter reset, y),
so W's first HBM round trip overlaps the previous kernel's tail, as CUTLASS example 63
prefetches weights before the wait. Sound because no kernel of a decode step writes W: the
``ext`` rows and bf16 shadows are refreshed by torch copies before the step
(``ModelRunner.refresh_weights``), and a PDL launch can only overlap the kernel right before
it. ``gdc_launch_dependents()`` follows the K loop (what remains is the epilogue and, for
``SPLIT``, the fix-up of the tile's last program). With ``USE_GDC=False`` the peeled branch is
pruned and the kernel is the plain loop. With ``PREFETCH > 0`` (``pdl="prefetch"``, :mod:`.pdl`'s
last section; :func:`prefetch_tiles`) each program also issues ``prefetch.global.L2`` for the
next ``PREFETCH`` K tiles of its slice (one per 128-byte line, inline PTX; out-of-range lines
are pointed at W's first element) before the wait: HBM streams them into L2 while the previous
kernel runs, and the loop after the wait reads them from there. Same loads, same arithmetic:
the result is bit-identical to ``PREFETCH=0``. Opt-in: on the H200 it made the decode step
slower (3.31 -> 3.34-3.53 ms at Qwen3-4B batch 4; :mod:`.pdl` has the A/B).

Why: cuBLAS reads cold decode weights at 1.9-3.8 TB/s for Qwen3-4B's o/qkv/down/gate_up shapes
at M=4 on the H200 (4.28 TB/s peak); a split-K Triton sweep was 2.42 ms against 2.66 ms for the
36 layers + lm_head (``/work/shared/tools/gemv_roofline.py``, DESIGN.md's floors); at M=32
(``BLOCK_M = 32``) 2.65 ms against cuBLAS's 2.79 ms (same tool, 2026-12-01), hence the opt-in
32-row tile. The tuner (:mod:`.skinny_gemm_tune`) keeps cuBLAS where it wins.

Tests: ``tests/engine/test_skinny_gemm.py``, ``tests/engine/test_skinny_gemm_rows32.py``;
the prefetch: ``tests/engine/test_pdl_prefetch.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels.lora_expand import _bf16_rne

MAX_ROWS = 64
"""Rows served (one 16-, 32- or 64-row tile); more rows keep cuBLAS. The 64-row tile (2026-12-07)
is for batch 33-64 decode, where the H200 profile of Qwen3-4B at batch 64 has cuBLAS's o_proj at
9.8 us and down_proj at 16.8 + 2.3 us (split-K reduce) a layer against 5.0 and 11.9 us of weight
bytes (``executed/phase3_flex/33_flex_vs_baselines/20261207T131901Z_h200_2052410.json``); the
tuner keeps cuBLAS where it stays faster."""
BLOCK_M = 16
"""The row tile for ``M <= 16``; the default of :func:`shared_memory_bytes` and :func:`fits`."""
BLOCK_MS = (16, 32, 64)
INTERPRETED = bool(triton.knobs.runtime.interpret)


class Config(NamedTuple):
    """One launch configuration: N tile, K tile, K splits (clamped: :func:`launch_split`),
    warps, pipeline stages."""
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3


CONFIGS = (Config(64, 128, 1), Config(64, 256, 1), Config(128, 128, 1), Config(128, 256, 1, 8),
           Config(64, 128, 2), Config(64, 256, 2), Config(128, 128, 2, 4, 4),
           Config(64, 128, 4), Config(64, 256, 4), Config(128, 128, 4, 4, 4),
           Config(32, 256, 4), Config(64, 128, 8), Config(32, 128, 8, 4, 4), Config(64, 256, 8))
"""The tuner's candidates (:mod:`.skinny_gemm_tune`), from the sweep space of
``gemv_roofline.py`` (BLOCK_N 64/128, BLOCK_K 128/256, split 1-4, 4/8 warps, 3/4 stages) plus
narrower tiles with more splits for the small o/down shapes."""
SMALL_N_CONFIGS = (
    Config(32, 128, 8, 4, 3),   # o 648 programs (4.9/SM), 4 K tiles; down 10 tiles; 16 KB/prog
    Config(32, 128, 16, 4, 3),  # down 1296 programs (9.8/SM), 5 K tiles; 16 KB/prog
    Config(32, 128, 16, 4, 4),  # down as above, one stage deeper: 24 KB/prog
    Config(32, 256, 8, 4, 3),   # down 648 programs, 5 K tiles of 256; 32 KB/prog
    Config(32, 256, 8, 4, 4),   # down as above, 48 KB/prog
    Config(32, 256, 4, 4, 4),   # o 324 programs (2.5/SM), 4 K tiles; down 10 tiles; 48 KB/prog
    Config(32, 128, 4, 4, 4),   # o 324 programs, 8 K tiles; down 19 tiles; 24 KB/prog
    Config(64, 128, 8, 4, 4))   # o 328 programs (2.5/SM), 4 K tiles; down 10 tiles; 48 KB/prog
"""Extra candidates for small-N, large-K GEMMs (:func:`small_n_configs`: ``N <=``
:data:`SMALL_N_MAX_N`, ``K >=`` :data:`SMALL_N_MIN_K`; Qwen3-4B's o_proj ``[2592, 4096]`` and
down_proj ``[2592, 9728]`` with LoRA r32's ``ext`` rows), where cuBLAS won the H200 profile of
2026-12-02 (o_proj 1.9 TB/s, down_proj 2.8 TB/s against ~3.3 TB/s for this kernel's other
shapes). Why these: by Little's law the H200 needs ~4 TB/s x ~1 us / 132 SMs ~ 30 KB of loads in
flight per SM; a program keeps ``(num_stages - 1) x BLOCK_N x BLOCK_K x 2`` B of W in flight
(bf16; the KB/prog of each line), so 2.5-10 programs per SM put ~60-240 KB in flight where they
are resident at once (>= 2x the need: latency under load exceeds 1 us), while >= 4 K tiles per
split let the pipeline reach its steady state. Each line gives the
o_proj / down_proj launch (programs = ``cdiv(N, BLOCK_N) x split``, K tiles per split after
:func:`launch_split`); a config is offered for a shape only where it keeps >= 2 programs per SM
and >= 4 K tiles a split (o_proj: 4 of these, down_proj: 8). BLOCK_N 32 at the 32-row tile
reads as many x bytes (from L2) as W bytes per program; the tuner decides whether that pays.
Tuner cost: Qwen3-4B's five decode shapes per M bucket time 15 + 19 + 15 + 23 + 15 = 87
candidates instead of 75 (+16 %), plus 8 new kernel builds per row tile (the build is shared
across shapes: N and K are runtime arguments)."""
SMALL_N_MAX_N = 3072
SMALL_N_MIN_K = 4096
NUM_SMS = 132
"""The H200's SM count, the target of :func:`small_n_configs`' >= 2 programs per SM."""


def block_m(m: int) -> int:
    """The row tile for ``m`` rows: 16 for ``m <= 16``, 32 for 17-32, 64 for 33-64. Raises
    ``ValueError`` beyond :data:`MAX_ROWS` (keep ``F.linear`` there)."""
    for bm in BLOCK_MS:
        if m <= bm:
            return bm
    raise ValueError(f"skinny_gemm: {m} rows > MAX_ROWS={MAX_ROWS}; use F.linear.")


def shared_memory_bytes(cfg: Config, elem_size: int, block_m: int = BLOCK_M) -> int:
    """Shared memory the pipelined K loop asks for, in bytes: ``num_stages - 1`` buffers of the
    ``[block_m, BLOCK_K]`` x tile and the ``[BLOCK_N, BLOCK_K]`` W tile, ``num_stages`` buffers
    at the 64-row tile. Matches the 294,912 B Triton 3.6 reported for ``Config(128, 256, 1, 8,
    3)`` in fp32 at ``block_m=16`` (H200, 2026-12-01) and the 294,912 B it reported for the
    same config in bf16 at ``block_m=64`` (H100, 2026-12-07, ``tests/engine/test_skinny_gemm.py``
    at 64 rows, which the ``num_stages - 1`` count put at 196,608 B)."""
    buffers = cfg.num_stages if block_m >= 64 else cfg.num_stages - 1
    return buffers * (block_m + cfg.block_n) * cfg.block_k * elem_size


def fits(cfg: Config, elem_size: int, limit_bytes: int, block_m: int = BLOCK_M) -> bool:
    """Whether ``cfg`` fits a device with ``limit_bytes`` of shared memory per block at row
    tile ``block_m`` (the tuner leaves out the configs that cannot launch, e.g. fp32 with
    128 x 256 tiles and 3 stages on the H200's 232,448 B, instead of warning about each
    shape)."""
    return shared_memory_bytes(cfg, elem_size, block_m) <= limit_bytes


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b``: IEEE fp32 for fp32 operands (no TF32) and under the interpreter (its
    16-bit dot is unreliable, see :mod:`.lora_expand`)."""
    if UPCAST or a.dtype == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2 [p]`` for every address of ``ptrs`` (a cache hint: no register
    result, no value; PTX ISA "prefetch, prefetchu"). The dummy ``mov`` gives the asm the output
    ``inline_asm_elementwise`` needs; ``is_pure=False`` keeps it from being removed."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["m"])
def _skinny_gemm(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, m, n, k, stride_x, stride_w,
                 stride_y, k_per_split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, BF16_RNE: tl.constexpr, USE_GDC: tl.constexpr,
                 PREFETCH: tl.constexpr = 0):
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = k_lo
    if USE_GDC:  # PDL (pdl.py): the first K tile peeled, its W load before the wait
        kk0 = k_lo + tl.arange(0, BLOCK_K)  # own names: nothing new is loop-carried below
        k0_ok = kk0 < k_hi
        w0 = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + kk0[None, :],
                     mask=col_ok[:, None] & k0_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if PREFETCH > 0:  # pdl="prefetch": the next PREFETCH W tiles into L2 (module docstring)
            LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # per 128 B
            lines = tl.arange(0, BLOCK_K // LINE) * LINE
            for t in tl.static_range(1, PREFETCH + 1):
                kp = k_lo + t * BLOCK_K + lines
                p_ok = col_ok[:, None] & (kp < k_hi)[None, :]
                _prefetch_l2(tl.where(p_ok, w_ptr + cols[:, None].to(tl.int64) * stride_w
                                      + kp[None, :], w_ptr))
        tl.extra.cuda.gdc_wait()  # x, y, ws and the counters only after the previous kernel
        x0 = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + kk0[None, :],
                     mask=row_ok[:, None] & k0_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        acc = _dot(x0, tl.trans(w0), acc, UPCAST)
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = _dot(x, tl.trans(w), acc, UPCAST)
    if USE_GDC:  # K loop done: the next kernel may start its prologue (the epilogue is short)
        tl.extra.cuda.gdc_launch_dependents()
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:  # serial split-K: publish the partial, the tile's last ticket sums them in order
        ws = ws_ptr + rows[:, None] * n + cols[None, :]  # this split's slice is added below
        tl.store(ws + tl.program_id(1).to(tl.int64) * BLOCK_M * n, acc, mask=out_ok)
        tl.debug_barrier()  # all threads' stores precede the release (CUTLASS Semaphore)
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == tl.num_programs(1) - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(tl.num_programs(1)):  # fixed order: deterministic sums
                acc += tl.load(ws + s * BLOCK_M * n, mask=out_ok, other=0.0,
                               cache_modifier=".cg")
            _epilogue(acc, bias_ptr, y_ptr, stride_y, rows, cols, out_ok, col_ok, HAS_BIAS,
                      BF16_RNE)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (graph replays too)
    else:
        _epilogue(acc, bias_ptr, y_ptr, stride_y, rows, cols, out_ok, col_ok, HAS_BIAS, BF16_RNE)


@triton.jit
def _epilogue(acc, bias_ptr, y_ptr, stride_y, rows, cols, out_ok, col_ok,
              HAS_BIAS: tl.constexpr, BF16_RNE: tl.constexpr):
    """``y = acc (+ bias)`` in fp32, rounded once to y's dtype."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    if BF16_RNE:
        tl.store(y_ptrs, _bf16_rne(acc), mask=out_ok)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


def supported(x: Any, w: Any, bias: Any = None) -> bool:
    """Whether :func:`skinny_gemm` serves these operands (else the caller keeps ``F.linear``):
    ``x [M, K]`` with ``1 <= M <= MAX_ROWS`` and unit column stride, ``W [N, K]`` in x's dtype
    with unit column stride, bf16/fp16/fp32, ``bias [N]`` contiguous in x's dtype or ``None``,
    one CUDA device (or the interpreter)."""
    import torch
    ok = (x.dim() == 2 and w.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] > 0
          and x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == x.shape[1]
          and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.dtype == x.dtype
          and w.device == x.device and (x.is_cuda or INTERPRETED))
    if not ok or bias is None:
        return ok
    return (bias.dim() == 1 and bias.shape[0] == w.shape[0] and bias.dtype == x.dtype
            and bias.is_contiguous() and bias.device == x.device)


def launch_split(k: int, cfg: Config) -> tuple[int, int]:
    """``(split, k_per_split)``: ``cfg.split`` clamped so every split has at least one K tile
    and K chunks are whole ``block_k`` multiples (no empty split)."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    k_per = triton.cdiv(k_tiles, max(1, min(cfg.split, k_tiles))) * cfg.block_k
    return triton.cdiv(k, k_per), k_per


def small_n_configs(n: int, k: int, num_sms: int = NUM_SMS) -> tuple[Config, ...]:
    """The :data:`SMALL_N_CONFIGS` offered for an ``[*, K] x [N, K]^T`` GEMM: none unless ``N <=
    SMALL_N_MAX_N`` and ``K >= SMALL_N_MIN_K``; then those with ``cdiv(N, BLOCK_N) x split >= 2 x
    num_sms`` programs and >= 4 K tiles per split (:func:`launch_split`)."""
    if n > SMALL_N_MAX_N or k < SMALL_N_MIN_K:
        return ()
    out = []
    for cfg in SMALL_N_CONFIGS:
        split, k_per = launch_split(k, cfg)
        if triton.cdiv(n, cfg.block_n) * split >= 2 * num_sms and k_per // cfg.block_k >= 4:
            out.append(cfg)
    return tuple(out)


MAX_PREFETCH_TILES = 8
"""Most K tiles one program prefetches (the ``static_range`` is unrolled)."""
LINE_BYTES = 128
"""One ``prefetch.global.L2`` per this many bytes of a W row (the L2 line); a K tile narrower
than a line (``BLOCK_K x elem_size < 128``) is not prefetched."""
INTERPRETER_PREFETCH = False
"""Whether :func:`skinny_gemm` computes ``PREFETCH`` from the budget under the interpreter too.
Off: the interpreter has no inline PTX, so ``_prefetch_l2`` cannot run there; the CPU tests set
it with ``_prefetch_l2`` replaced by a Python stand-in (``tests/engine/test_pdl_prefetch.py``)."""


def prefetch_tiles(n: int, k: int, cfg: Config, elem_size: int, budget_bytes: int) -> int:
    """K tiles after the first that each program of this launch prefetches into L2 before its
    PDL wait (``PREFETCH``): ``budget_bytes`` (bytes, :func:`.pdl.prefetch_bytes`) split evenly
    over the launch's ``cdiv(N, BLOCK_N) x split`` programs in whole ``BLOCK_N x BLOCK_K``
    tiles, at most the split's other K tiles and :data:`MAX_PREFETCH_TILES`; 0 for a budget of
    0 and for a K tile narrower than :data:`LINE_BYTES`. E.g. Qwen3-4B's o_proj at batch 4
    (``N=2592, K=4096``, ``Config(128, 128, 4)``: 84 programs of 8 K tiles, 32 KiB a tile) with
    16 MiB: 6 tiles a program (16.5 MB of W's 21.2 MB; with the first tile, loaded before the
    wait anyway, 7 of its 8).

    Raises:
        ValueError: ``n``, ``k`` or ``elem_size`` not an int >= 1, or ``budget_bytes`` not an
            int >= 0.
    """
    for name, v, lo in (("n", n, 1), ("k", k, 1), ("elem_size", elem_size, 1),
                        ("budget_bytes", budget_bytes, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"prefetch_tiles: {name}={v!r} must be an int >= {lo}.")
    if budget_bytes == 0 or cfg.block_k * elem_size < LINE_BYTES:
        return 0
    split, k_per = launch_split(k, cfg)
    programs = triton.cdiv(n, cfg.block_n) * split
    per_program = budget_bytes // (programs * cfg.block_n * cfg.block_k * elem_size)
    return int(max(0, min(k_per // cfg.block_k - 1, per_program, MAX_PREFETCH_TILES)))


def default_config(n: int, k: int) -> Config:
    """Untuned choice (CPU / interpreter, or before tuning): BLOCK_N 64, BLOCK_K 128, and enough
    splits for ~256 programs (two per H200 SM) while each split keeps >= 4 K tiles."""
    tiles = triton.cdiv(n, 64)
    split = max(1, min(16, triton.cdiv(256, tiles), k // (4 * 128)))
    return Config(64, 128, split)


_WORKSPACES: dict[tuple, tuple[Any, Any]] = {}


def workspace(device: Any, n: int, split: int, block_m: int = BLOCK_M) -> tuple[Any, Any]:
    """``(ws [split * block_m * n] fp32, counters [cdiv(n, 16)] int32 zeros)`` for this
    (device, N, split, block_m), allocated at the first call and reused (the kernel leaves the
    counters at 0)."""
    import torch
    key = (str(device), n, split, block_m)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.empty(split * block_m * n, dtype=torch.float32, device=device),
                            torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def skinny_gemm(x: Any, w: Any, bias: Any = None, config: Config | None = None,
                prefetch_k_tiles: int | None = None) -> Any:
    """``x W^T (+ bias)`` in one launch (module docstring). Shapes: ``x [M, K]``, ``w [N, K]``,
    ``bias [N]`` or ``None``; returns a new contiguous ``y [M, N]`` in x's dtype, rows padded
    to :func:`block_m` inside the kernel. ``config``: default :func:`default_config`.
    ``prefetch_k_tiles``: K tiles (not bytes) each program prefetches into L2 before its PDL
    wait (``PREFETCH``; only with PDL on, else ignored), an int in [0,
    :data:`MAX_PREFETCH_TILES`]; ``None`` (the engine's calls): :func:`prefetch_tiles` of
    :func:`.pdl.prefetch_bytes`, 0 under the interpreter unless :data:`INTERPRETER_PREFETCH`.

    Raises:
        ValueError: :func:`supported` is false, or ``prefetch_k_tiles`` is not an int in [0,
            MAX_PREFETCH_TILES], or is > 0 with a K tile narrower than :data:`LINE_BYTES`.
    """
    import torch
    if not supported(x, w, bias):
        raise ValueError(f"skinny_gemm: unsupported operands x {tuple(x.shape)} {x.dtype} "
                         f"strides {x.stride()}, W {tuple(w.shape)} {w.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)}; use F.linear.")
    m, k = x.shape
    n = w.shape[0]
    cfg = config or default_config(n, k)
    prefetch = prefetch_k_tiles
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                 or not 0 <= prefetch <= MAX_PREFETCH_TILES
                                 or (prefetch and cfg.block_k * w.element_size() < LINE_BYTES)):
        raise ValueError(f"skinny_gemm: prefetch_k_tiles={prefetch!r} must be an int in [0, "
                         f"{MAX_PREFETCH_TILES}] (K tiles, not bytes), and 0 when BLOCK_K x "
                         f"element size ({cfg.block_k} x {w.element_size()} B) is below one "
                         f"{LINE_BYTES}-byte line; or None for the engine's budget.")
    split, k_per = launch_split(k, cfg)
    bm = block_m(m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws, cnt = workspace(x.device, n, split, bm) if split > 1 else (y, y)
    gdc = pdl.launch_kwargs()
    if prefetch is None:
        budget = (pdl.prefetch_bytes()
                  if gdc["USE_GDC"] and (INTERPRETER_PREFETCH or not INTERPRETED) else 0)
        prefetch = prefetch_tiles(n, k, cfg, w.element_size(), budget)
    _skinny_gemm[(triton.cdiv(n, cfg.block_n), split)](
        x, w, y if bias is None else bias, y, ws, cnt, m, n, k, x.stride(0), w.stride(0),
        y.stride(0), k_per, HAS_BIAS=bias is not None, SPLIT=split > 1, BLOCK_M=bm,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=INTERPRETED,
        BF16_RNE=INTERPRETED and y.dtype == torch.bfloat16, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, PREFETCH=prefetch if gdc["USE_GDC"] else 0, **gdc)
    return y
