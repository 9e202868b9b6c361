"""LoRA B as one Triton kernel per projection group (``engine/lora_expand.py``).

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (set here before the kernel module is
imported); skipped when triton is not importable.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="lora_expand='triton' needs the triton package")

from nbhelpers.engine import lora_expand as le

if not (le.INTERPRETED or torch.cuda.is_available()):
    pytest.skip("triton imported without TRITON_INTERPRET=1 and no CUDA device",
                allow_module_level=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(sizes, ranks, n_rows, y_dtype, b_dtype, seed=0):
    """``y`` as the first ``sum(sizes)`` columns of ``[N, sum(sizes) + sum(ranks)]`` (LiveGroup's
    ``ext`` layout, row stride > width), ``xa``, one contiguous ``B_i [out_i, r_i]`` per part."""
    g = torch.Generator().manual_seed(seed)
    n, r = sum(sizes), sum(ranks)
    full = torch.randn(n_rows, n + r, generator=g).to(y_dtype).to(DEV)
    xa = torch.randn(n_rows, r, generator=g).to(b_dtype).to(DEV)
    bs = [torch.randn(o, k, generator=g).to(b_dtype).to(DEV) for o, k in zip(sizes, ranks)]
    return full, full[:, :n], xa, bs


def _addmm_path(y, xa, bs, sizes, ranks, s):
    """LiveGroup's per-part path: ``addmm_`` in B's dtype, cast back once."""
    acc = y.clone() if bs[0].dtype == y.dtype else y.to(bs[0].dtype)
    for y_i, xa_i, b_i in zip(acc.split(sizes, -1), xa.split(ranks, -1), bs):
        y_i.addmm_(xa_i, b_i.t(), alpha=s)
    return acc.to(y.dtype)


def _exact(y, xa, bs, sizes, ranks, s):
    """fp64 result rounded once to ``y``'s dtype."""
    out = y.double()
    for y_i, xa_i, b_i in zip(out.split(sizes, -1), xa.split(ranks, -1), bs):
        y_i += s * (xa_i.double() @ b_i.double().t())
    return out.to(y.dtype)


@pytest.mark.parametrize("sizes,ranks", [([64, 16, 16], [4, 4, 4]), ([128, 128], [8, 8]),
                                         ([64, 32, 32], [8, 4, 2]), ([32], [80])],
                         ids=["qkv_unequal", "gate_up_equal", "ranks_differ", "one_part_r80"])
@pytest.mark.parametrize("y_dtype,b_dtype", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "bf16_base_fp32_lora"])
@pytest.mark.parametrize("n_rows", [1, 70])
def test_kernel_matches_addmm(sizes, ranks, y_dtype, b_dtype, n_rows):
    full, y, xa, bs = _operands(sizes, ranks, n_rows, y_dtype, b_dtype)
    tail = full[:, sum(sizes):].clone()
    want, exact = _addmm_path(y, xa, bs, sizes, ranks, 2.0), _exact(y, xa, bs, sizes, ranks, 2.0)
    assert le.supported(y, xa, bs, sizes, ranks)
    le.lora_expand(y, xa, bs, sizes, ranks, 2.0)
    assert torch.equal(full[:, sum(sizes):], tail)  # columns past the view untouched
    if y_dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the fp32 sum (the CPU's bf16 addmm_ may round twice): at most
        # 1 ulp from the fp64 result rounded once, and that only on rare rounding ties
        torch.testing.assert_close(y, exact, rtol=2 ** -7, atol=0)
        assert (y != exact).float().mean() < 0.01
        torch.testing.assert_close(y, want)


def test_unsupported_shapes_fall_back_or_raise():
    _, y, xa, bs = _operands([24, 8], [4, 4], 3, torch.float32, torch.float32)
    assert le.block_out([24, 8]) is None  # no tile divides both: the caller keeps addmm_
    assert not le.supported(y, xa, bs, [24, 8], [4, 4])
    with pytest.raises(ValueError, match="unsupported operands"):
        le.lora_expand(y, xa, bs, [24, 8], [4, 4], 1.0)
    _, y, xa, bs = _operands([16] * 4, [4] * 4, 3, torch.float32, torch.float32)
    assert not le.supported(y, xa, bs, [16] * 4, [4] * 4)  # more than MAX_PARTS
    _, y, xa, bs = _operands([16, 16], [4, 4], 3, torch.float32, torch.float32)
    assert not le.supported(y, xa, [bs[0], bs[1].t().contiguous().t()], [16, 16], [4, 4])


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine import lora_expand as le
fn = le._expand_kernel
ints = ["n_rows", "stride_xa", "stride_y", "end0", "end1", "roff1", "roff2", "r0", "r1", "r2"]
for y, b, parts, dot32 in (("bf16", "bf16", 3, False), ("bf16", "fp32", 2, True),
                           ("fp32", "fp32", 1, True)):
    sig = {"xa_ptr": "*" + b, "y_ptr": "*" + y, "b0_ptr": "*" + b, "b1_ptr": "*" + b,
           "b2_ptr": "*" + b, **dict.fromkeys(ints, "i32"), "scaling": "fp32"}
    consts = {"NUM_PARTS": parts, "BLOCK_M": 32, "BLOCK_OUT": 64, "BLOCK_R": 32,
              "DOT_FP32": dot32, "BF16_RNE": False}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm["cubin"], (y, b, parts)
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """The compiled (non-interpreted) kernel builds to an sm_90 cubin with triton's bundled
    ptxas, no GPU needed: bf16 ``tl.dot``, the part-pointer selection, mixed dtypes."""
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True,
                          check=False, timeout=120)
    if proc.returncode and "ptxas" in proc.stderr:
        pytest.skip(f"no usable ptxas: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
