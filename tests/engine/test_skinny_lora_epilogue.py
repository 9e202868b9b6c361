"""The skinny GEMM with LoRA B in its epilogue (``engine/kernels/skinny_lora_epilogue.py``):
results against an fp64 reference (1-3 parts of different out_i and r_i, 1-32 rows, 1/2/4
splits, bias, bf16 and fp32), every counter back at 0 after each call, two calls in a row, the
dynamic id's modulo, ``x A^T`` rounded from the kernel's fp32 sum (not the exact product),
unsupported operands, the sm_90 build with and without PDL, and (GPU) Qwen3-4B's LoRA shapes
against the default path's own ``x A^T``. Engine routing: ``test_skinny_lora_epilogue_engine.py``.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (``tests/conftest.py``), whose programs
run one after another in grid order: a wrong id mapping (a y tile before the ext tiles) would
spin forever there, so these tests finishing is the deadlock check; skipped when triton is not
importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="skinny_lora_epilogue needs the triton package")

from _kernels import DEV, assert_compiles_for_sm90, skip_unless_runnable

from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels import skinny_lora_epilogue as ep

skip_unless_runnable(ep)
BF16 = torch.bfloat16
PARTS = {  # (out_i, r_i): R > BLOCK_N (two ext tiles) in "two"; parts straddling a tile
    "one": ([128], [8]),
    "two": ([64, 128], [36, 44]),
    "three": ([128, 32, 32], [4, 8, 16]),
}
SCALING = 0.75


def _operands(m, sizes, ranks, k, dtype, bias, seed=0):
    """``x [m, k]``, ``W' [n_out + R, k]``, ``bs``, ``bias [n_out]`` or None, and the fp64
    reference ``x W^T + bias + s * round(x A^T) B^T`` (round: to ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    n_out, r_total = sum(sizes), sum(ranks)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n_out + r_total, k, generator=g) * 0.1).to(dtype)
    bs = [(torch.randn(o, r, generator=g) * 0.2).to(dtype) for o, r in zip(sizes, ranks)]
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    ref = _reference(x, w, bs, b, ranks, (x.double() @ w[n_out:].double().t()).to(dtype))
    return (x.to(DEV), w.to(DEV), [t.to(DEV) for t in bs], None if b is None else b.to(DEV),
            ref.to(DEV))


def _reference(x, w, bs, b, ranks, xa):
    """fp64 ``x W^T + b + s * xa B^T`` per part, for ``xa [m, R]``, the rounded ``x A^T``.
    From the exact product (:func:`_operands`) it can differ from the kernel's by one ulp of
    ``xa`` where ``x A^T`` lies within fp32 error of a rounding midpoint (the kernel rounds its
    fp32 sum, as the default path does): on the H200 one such element of 1024 in Qwen3-4B's
    ``down`` at 32 rows (7 fp32 half-ulps from the midpoint) failed 163 of 81920 outputs.
    :func:`test_gpu_qwen3_4b_shapes` passes the default path's own ``xa`` instead."""
    n_out = w.shape[0] - xa.shape[1]
    lora = [SCALING * xa_i @ b_i.double().t() for xa_i, b_i in zip(xa.double().split(ranks, 1), bs)]
    full = x.double() @ w[:n_out].double().t()
    return full + torch.cat(lora, 1) + (0 if b is None else b.double())


def _assert_matches(y, ref, dtype):
    """fp32: fp32 summation of the fp64 result; 16-bit: one rounding (<= 1 ulp) plus the fp32
    sums' error near zero."""
    assert y.dtype == dtype and y.is_contiguous() and y.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-3)


def _counters_zero():
    return all(not cnt.any() for _, _, cnt in ep._WORKSPACES.values())


@pytest.mark.parametrize("m", [1, 5, 16, 32, 40])
@pytest.mark.parametrize("parts", list(PARTS))
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_kernel_matches_reference_twice(m, parts, split, dtype):
    """K = 500 (not a tile multiple); bias on odd row counts; two calls give the same bits
    and every counter (ids, flag, tickets) is 0 after each."""
    sizes, ranks = PARTS[parts]
    bias = m % 2 == 1
    x, w, bs, b, ref = _operands(m, sizes, ranks, 500, dtype, bias, seed=m + split)
    cfg = sg.Config(64, 128, split)
    assert sg.launch_split(500, cfg)[0] == split
    y1 = ep.skinny_lora_gemm(x, w, sum(sizes), bs, sizes, ranks, SCALING, b, cfg)
    assert _counters_zero()
    y2 = ep.skinny_lora_gemm(x, w, sum(sizes), bs, sizes, ranks, SCALING, b, cfg)
    assert _counters_zero()
    _assert_matches(y1, ref, dtype)
    assert torch.equal(y1, y2)


def test_many_ext_tiles_and_narrow_tiles():
    """R = 100 over BLOCK_N 32 (four ext tiles, 4 splits each: 16 programs before the first y
    tile), parts of 80 and 112 columns (the tile of columns 64-95 straddles them), 3 rows."""
    sizes, ranks = [80, 112], [60, 40]
    x, w, bs, _, ref = _operands(3, sizes, ranks, 512, torch.float32, False, seed=7)
    y = ep.skinny_lora_gemm(x, w, 192, bs, sizes, ranks, SCALING, None, sg.Config(32, 128, 4))
    _assert_matches(y, ref, torch.float32)
    assert _counters_zero()


def test_dynamic_id_is_taken_modulo_the_grid():
    """The id counter left at P (a previous launch of this workspace whose last program has not
    subtracted yet: PDL overlap): ids ``counter % P`` still map every (tile, split) once, the
    result is right and the counter ends where it began."""
    sizes, ranks = [128, 64], [8, 8]
    cfg = sg.Config(64, 128, 2)
    x, w, bs, _, ref = _operands(4, sizes, ranks, 256, torch.float32, False, seed=3)
    ep.skinny_lora_gemm(x, w, 192, bs, sizes, ranks, SCALING, None, cfg)  # allocates
    cnt = ep.workspace(x.device, 208, 192, 2, 16, 64)[2]
    programs = 4 * 2  # cdiv(208, 64) tiles x 2 splits
    cnt[0] = programs
    y = ep.skinny_lora_gemm(x, w, 192, bs, sizes, ranks, SCALING, None, cfg)
    _assert_matches(y, ref, torch.float32)
    assert cnt[0].item() == programs and not cnt[1:].any()
    cnt.zero_()


def test_xa_is_rounded_from_the_fp32_sum():
    """``x A^T = 1 + 2^-8 + 2 * 2^-24`` exactly (one bf16 rounding up: ``1 + 2^-7``), in three
    K tiles: the K loop's fp32 sum ``1 + 2^-8``, then ``+ 2^-24`` twice, ties to even each time
    and stays at ``1 + 2^-8``, a bf16 tie that rounds to 1.0. The kernel rounds that sum, as the
    default path does (``skinny_gemm``'s ext columns, then the expand): ``y = s * (1.0 - 1.0) =
    0``, where the exact product's rounding gives ``s * 2^-7`` (so :func:`_operands`' reference
    can be one ``xa`` ulp off the kernel)."""
    k, n_out = 384, 64
    x = torch.zeros(1, k, dtype=BF16)
    x[0, [0, 1, 128, 256]] = 1.0
    w = torch.zeros(n_out + 2, k, dtype=BF16)
    w[n_out, [0, 1, 128, 256]] = torch.tensor([1.0, 2.0 ** -8, 2.0 ** -24, 2.0 ** -24]).to(BF16)
    w[n_out + 1, 0] = -1.0
    bs = [torch.ones(n_out, 2, dtype=BF16)]
    x, w, bs = x.to(DEV), w.to(DEV), [bs[0].to(DEV)]
    cfg = sg.Config(64, 128, 1)
    y = ep.skinny_lora_gemm(x, w, n_out, bs, [n_out], [2], SCALING, None, cfg)
    xa = sg.skinny_gemm(x, w, None, cfg)[:, n_out:]
    exact = (x.double() @ w[n_out:].double().t()).to(BF16)
    assert xa[0, 0].item() == 1.0 and exact[0, 0].item() == 1.0 + 2.0 ** -7
    _assert_matches(y, _reference(x, w, bs, None, [2], xa), BF16)
    assert not y.any()


def test_live_b_is_read_at_call_time():
    """An in-place change of B (an optimizer step) shows in the next call: no copy kept."""
    sizes, ranks = [64, 64], [4, 4]
    x, w, bs, _, _ = _operands(2, sizes, ranks, 128, torch.float32, False, seed=5)
    y1 = ep.skinny_lora_gemm(x, w, 128, bs, sizes, ranks, SCALING)
    bs[1].add_(1.0)
    y2 = ep.skinny_lora_gemm(x, w, 128, bs, sizes, ranks, SCALING)
    assert torch.equal(y1[:, :64], y2[:, :64]) and not torch.equal(y1[:, 64:], y2[:, 64:])


def test_unsupported_operands():
    sizes, ranks = [64, 64], [4, 4]
    x, w, bs, _, _ = _operands(2, sizes, ranks, 128, torch.float32, False)
    assert ep.supported(x, w, 128, bs, sizes, ranks)
    assert not ep.supported(x, w, 128, bs, sizes, ranks, block_n=128 * 3)  # n_out % BLOCK_N
    assert not ep.supported(x, w, 120, bs, [60, 60], ranks)  # sum(sizes) / W' rows
    assert not ep.supported(x, w, 128, [bs[0], bs[1].t()], sizes, ranks)  # B shape / layout
    assert not ep.supported(x, w, 128, [bs[0], bs[1].double()], sizes, ranks)  # B dtype
    assert not ep.supported(x, w, 128, bs * 2, sizes * 2, ranks * 2)  # 4 parts
    x65 = torch.randn(65, 128, device=DEV)
    assert not ep.supported(x65, w, 128, bs, sizes, ranks)  # more than MAX_ROWS rows
    with pytest.raises(ValueError, match="use skinny_gemm \\+ lora_expand"):
        ep.skinny_lora_gemm(x65, w, 128, bs, sizes, ranks, SCALING)


_AOT = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels import skinny_lora_epilogue as ep
fn = ep._skinny_lora
ints = ["m", "n", "n_out", "k", "stride_x", "stride_w", "k_per_split", "splits", "end0", "end1",
        "roff1", "roff2", "r0", "r1", "r2"]
# Qwen3-4B's qkv group at 32 rows: the launch's int values, and the divisibility-by-16 hints the
# JIT gives them (every pointer; an int divisible by 16 unless do_not_specialize names it)
vals = dict(m=32, n=6240, n_out=6144, k=2560, stride_x=2560, stride_w=2560, k_per_split=896,
            splits=3, end0=4096, end1=5120, roff1=32, roff2=64, r0=32, r1=32, r2=32)
hint = [["tt.divisibility", 16]]
attrs = {(p.num,): hint for p in fn.params if p.name.endswith("_ptr")
         or (p.name in vals and vals[p.name] % 16 == 0 and not p.do_not_specialize)}
for dt, split, parts, bias, bm in (("bf16", True, 3, False, 32), ("bf16", False, 1, False, 16),
                                   ("fp32", True, 2, True, 16)):
    sig = {"x_ptr": "*" + dt, "w_ptr": "*" + dt, "bias_ptr": "*" + dt, "y_ptr": "*" + dt,
           "ws_ptr": "*fp32", "xa_ptr": "*fp32", "cnt_ptr": "*i32", "b0_ptr": "*" + dt,
           "b1_ptr": "*" + dt, "b2_ptr": "*" + dt, **dict.fromkeys(ints, "i32"),
           "scaling": "fp32"}
    consts = {"HAS_BIAS": bias, "SPLIT": split, "NUM_PARTS": parts, "BLOCK_M": bm,
              "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_R": 32, "UPCAST": False, "BF16_RNE": False,
              "USE_GDC": WITH_GDC}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"] and "atom" in ptx, (dt, split, parts)
    copies = re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global [^;]*, (0x\\w+)", ptx)
    assert copies and set(copies) == {"0x10"}, (dt, split, parts, sorted(set(copies)))
    assert not re.search(r"\\bld\\.global(?:\\.nc)?\\.b16\\b", ptx), (dt, split, parts)
    spin = ptx.find("ld.volatile.global.b32")  # then an acquire (Triton 3.6 dropped an unused one)
    assert 0 < spin < ptx.find(".acquire.", spin), (dt, split, parts)
    staged = sg.shared_memory_bytes(sg.Config(64, 128, 1), 2 if dt == "bf16" else 4, bm)
    assert kernel.metadata.shared >= staged, (dt, split, parts, kernel.metadata.shared)
    assert ptx.count("griddepcontrol.wait") == int(WITH_GDC), (dt, split, parts)
    if WITH_GDC:  # before the wait: the W tile's loads and the one write, the dynamic id
        wait = ptx.find("griddepcontrol.wait")
        assert ptx.find("griddepcontrol.launch_dependents") > wait
        before = re.findall(r"\\b(?:st|atom|red)\\.global[.\\w]*|\\bcp\\.async", ptx[:wait])
        assert before == ["atom.global.gpu.relaxed.add.u32"], before
        assert re.search(r"\\bld\\.global", ptx[:wait])
print("compiled")
"""


@pytest.mark.parametrize("gdc", [False, True], ids=["plain", "pdl"])
def test_kernel_compiles_for_sm90(gdc):
    """sm_90 cubins (bf16 and fp32 ``tl.dot``, the id / ticket / flag atomics, the spin loop)
    with triton's bundled ptxas, no GPU needed, built with the divisibility hints a launch of
    Qwen3-4B's qkv group gets: the K loop's W and x tiles move in 16-byte ``cp.async`` copies
    and no 2-byte scalar loads are left, and shared memory holds the ``num_stages - 1`` staged
    tiles of :func:`.skinny_gemm.shared_memory_bytes` (with ``k``, ``n`` ... in
    ``do_not_specialize`` they were 4-byte copies and ``ld.global.b16``, 16 KB of shared memory
    where 48 KB are staged, ~220 registers); the flag is spun on with ``ld.volatile``, then
    acquired. With USE_GDC one
    ``griddepcontrol.wait``,
    ``launch_dependents`` after it, and before it only W's loads and the dynamic id's relaxed
    atomic (the one exception to ``pdl.py``'s no-write rule: safe by the id's modulo, see the
    kernel's docstring); without it no ``griddepcontrol``."""
    assert_compiles_for_sm90(_AOT.replace("WITH_GDC", str(gdc)))


QWEN3_4B_R32 = {"qkv": ([4096, 1024, 1024], 2560), "o": ([2560], 4096),
                "gate_up": ([9728, 9728], 2560), "down": ([2560], 9728)}
"""Parts' out_i and K of Qwen3-4B's LoRA groups (r = 32 on every projection)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Qwen3-4B shapes need a CUDA GPU (the "
                    "interpreter would take minutes a shape); run on the H200 host")
@pytest.mark.parametrize("name", list(QWEN3_4B_R32))
@pytest.mark.parametrize("m", [1, 4, 32])
def test_gpu_qwen3_4b_shapes(name, m):
    """Every candidate config that serves the shape, bf16, against fp64 math on the default
    path's rounded ``x A^T`` (``skinny_gemm``'s ext columns, same config: :func:`_reference`),
    that ``x A^T`` within a bf16 ulp of the exact one; the same bits twice; counters at 0 (the
    real concurrency: programs spin on the ext tiles)."""
    sizes, k = QWEN3_4B_R32[name]
    ranks = [32] * len(sizes)
    x, w, bs, _, _ = _operands(m, sizes, ranks, k, BF16, False, seed=m)
    n_out = sum(sizes)
    ref_xa = x.double() @ w[n_out:].double().t()  # exact x A^T: one bf16 ulp from the kernel's
    cfgs = [c for c in (sg.default_config(n_out + sum(ranks), k), *sg.CONFIGS)
            if ep.supported(x, w, n_out, bs, sizes, ranks, None, c.block_n)]
    assert cfgs
    for cfg in cfgs:
        y = ep.skinny_lora_gemm(x, w, n_out, bs, sizes, ranks, SCALING, None, cfg)
        xa = sg.skinny_gemm(x, w, None, cfg)[:, n_out:]  # the default path's rounded x A^T
        _assert_matches(y, _reference(x, w, bs, None, ranks, xa), BF16)
        assert (xa.double() - ref_xa).abs().le(ref_xa.abs() * 2 ** -7 + 1e-3).all(), cfg
        assert torch.equal(y, ep.skinny_lora_gemm(x, w, n_out, bs, sizes, ranks, SCALING, None,
                                                  cfg)), cfg
        torch.cuda.synchronize()
        assert _counters_zero(), cfg
