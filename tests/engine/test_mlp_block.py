"""The one-launch decode MLP probe (``engine/kernels/mlp_block.py``, docs/decode_floor_plan.md
piece 1): against a torch MLP rounded as transformers rounds it, fp32 and bf16, ragged shapes
(masked intermediate columns, hidden not a multiple of the tiles), the argument checks, and
(GPU) Qwen3-4B's shape. CPU: Triton's interpreter (``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="mlp_block needs the triton package")

from _kernels import DEV, assert_compiles_for_sm90, skip_unless_runnable

from nbhelpers.engine.kernels import mlp_block as mb

skip_unless_runnable(mb)


def _operands(m, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype).to(DEV)
    wgu = (torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(DEV)
    wd = (torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(DEV)
    return x, wgu, wd


def _reference(x, wgu, wd):
    """transformers' LlamaMLP in the weights' dtype: each projection and the SiLU rounded once to
    that dtype, the product once; the down sum in fp64 (the probe leaves it in fp32)."""
    inter = wd.shape[1]
    g = (x.double() @ wgu[:inter].double().t()).to(x.dtype)
    u = (x.double() @ wgu[inter:].double().t()).to(x.dtype)
    h = (torch.nn.functional.silu(g.float()).to(x.dtype).float() * u.float()).to(x.dtype)
    return h.double() @ wd.double().t()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("m,hidden,inter", [(1, 64, 96), (4, 96, 160), (16, 128, 64)])
def test_matches_the_rounded_torch_mlp(dtype, tol, m, hidden, inter):
    x, wgu, wd = _operands(m, hidden, inter, dtype)
    got = mb.mlp_block(x, wgu, wd, block_j=32, block_k=32, block_n=32)
    ref = _reference(x, wgu, wd)
    assert got.dtype == torch.float32 and tuple(got.shape) == (m, hidden)
    err = (got.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
    assert err < tol, err


def test_accumulates_into_the_buffer_it_is_given():
    """``out`` must arrive zeroed: the kernel adds into it (two calls give twice the sum)."""
    x, wgu, wd = _operands(4, 64, 96, torch.float32)
    out = torch.zeros(4, 64, device=DEV)
    once = mb.mlp_block(x, wgu, wd, out=out, block_j=32, block_k=32, block_n=32).clone()
    mb.mlp_block(x, wgu, wd, out=out, block_j=32, block_k=32, block_n=32)
    torch.testing.assert_close(out, 2 * once, rtol=1e-6, atol=1e-6)


def test_refuses_what_it_cannot_compute():
    x, wgu, wd = _operands(4, 64, 96, torch.float32)
    with pytest.raises(ValueError, match="17 rows"):
        mb.mlp_block(torch.zeros(17, 64, device=DEV), wgu, wd)
    with pytest.raises(ValueError, match=r"need w_gate_up \[2I, H\]"):
        mb.mlp_block(x, wgu[:100], wd)
    with pytest.raises(ValueError, match="one dtype"):
        mb.mlp_block(x, wgu.bfloat16(), wd)
    with pytest.raises(ValueError, match="zeroed contiguous fp32"):
        mb.mlp_block(x, wgu, wd, out=torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV))


@pytest.mark.skipif(DEV != "cuda", reason="Qwen3-4B's MLP shape: CUDA (the interpreter is slow)")
def test_gpu_qwen3_4b_shape_matches_torch():
    x, wgu, wd = _operands(4, 2560, 9728, torch.bfloat16)
    got = mb.mlp_block(x, wgu, wd)
    ref = _reference(x, wgu, wd)
    err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, err


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import mlp_block as mb
fn = mb._mlp_block_kernel
ints = ["m", "hidden", "inter", "stride_x", "stride_gu", "stride_d", "stride_acc"]
for bj in (32, 64, 128):
    sig = {"x_ptr": "*bf16", "wgu_ptr": "*bf16", "wd_ptr": "*bf16", "acc_ptr": "*fp32",
           **dict.fromkeys(ints, "i32")}
    consts = {"BLOCK_M": 16, "BLOCK_J": bj, "BLOCK_K": 128, "BLOCK_N": 128, "UPCAST": False}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3})
    assert kern.asm["cubin"] and kern.metadata.shared <= 232448, (bj, kern.metadata.shared)
    assert "red.global" in kern.asm["ptx"] or "atom.global" in kern.asm["ptx"]
print("compiled")
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90():
    """The probe builds to sm_90 cubins at the three ``BLOCK_J`` the device A/B times (bf16 dots,
    fp32 atomics), within the H200's shared memory. No GPU needed."""
    assert_compiles_for_sm90(_AOT)
