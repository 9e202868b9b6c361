"""The one-launch decode MLP kernel (``engine/kernels/mlp_block.py``, docs/decode_floor_plan.md
piece 1): against a torch MLP rounded as transformers rounds it, fp32 and bf16, ragged shapes
(masked intermediate columns, hidden not a multiple of the tiles), with PEFT fp32 adapters in
PEFT's dtype order, the argument checks, the sm_90 build, and (GPU) Qwen3-4B's shape with and
without LoRA. CPU: Triton's interpreter (``tests/conftest.py``). The engine route:
``test_mlp_block_engine.py``."""

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
@pytest.mark.parametrize("m,hidden,inter", [(1, 64, 96), (4, 96, 160), (16, 128, 64),
                                             (33, 64, 96), (64, 32, 64)])
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
    with pytest.raises(ValueError, match="65 rows; 1-64 supported"):
        mb.mlp_block(torch.zeros(65, 64, device=DEV), wgu, wd)
    with pytest.raises(ValueError, match=r"need w_gate_up \[2I, H\]"):
        mb.mlp_block(x, wgu[:100], wd)
    with pytest.raises(ValueError, match="one dtype"):
        mb.mlp_block(x, wgu.bfloat16(), wd)
    with pytest.raises(ValueError, match="zeroed contiguous fp32"):
        mb.mlp_block(x, wgu, wd, out=torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV))


@pytest.mark.skipif(DEV != "cuda", reason="Qwen3-4B's MLP shape: CUDA (the interpreter is slow)")
@pytest.mark.parametrize("with_lora", [False, True])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_gpu_qwen3_4b_shape_matches_torch(m, with_lora):
    """Qwen3-4B's MLP (H 2560, I 9728, bf16) at the default tiles, r 32 fp32 adapters."""
    x, wgu, wd = _operands(m, 2560, 9728, torch.bfloat16)
    if with_lora:
        lora, _ = _lora(x, 9728, rank=32)
        got = mb.mlp_block(x, wgu, wd, lora=lora)
        ref, xa_d = _reference_lora(x, wgu, wd, lora)
        err_xa = (lora.xa_down - xa_d).abs().max().item() / xa_d.abs().max().item()
        assert err_xa < 2e-2, err_xa
    else:
        got = mb.mlp_block(x, wgu, wd)
        ref = _reference(x, wgu, wd)
    err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, err


def _lora(x, inter, rank=8, seed=1):
    """fp32 adapters for gate, up and down (``MlpLora``), ``xa`` from ``x`` in fp32 (PEFT)."""
    g = torch.Generator().manual_seed(seed)
    hidden = x.shape[1]
    a_gu = (torch.randn(2 * rank, hidden, generator=g) / hidden ** 0.5).to(DEV)
    b_g, b_u = ((torch.randn(inter, rank, generator=g) * 0.2).to(DEV) for _ in range(2))
    a_d = (torch.randn(rank, inter, generator=g) / inter ** 0.5).to(DEV)
    b_d = (torch.randn(hidden, rank, generator=g) * 0.2).to(DEV)
    xa = x.float() @ a_gu.t()
    xa_d = torch.zeros(x.shape[0], rank, device=DEV)
    return mb.MlpLora(xa, b_g, b_u, 2.0, a_d, xa_d), b_d


def _reference_lora(x, wgu, wd, lora):
    """PEFT's LoRA on a transformers MLP: each projection's base output rounded to the dtype,
    ``+ scaling * xa @ B^T`` in fp32, rounded once; down's ``xa = h.float() @ A_d^T``. Returns
    the down GEMM's unrounded base sum (fp64) and that ``xa``."""
    inter, dt, r = wd.shape[1], x.dtype, lora.b_gate.shape[1]
    g = (x.double() @ wgu[:inter].double().t()).to(dt).float()
    u = (x.double() @ wgu[inter:].double().t()).to(dt).float()
    g = (g + lora.scaling * (lora.xa[:, :r] @ lora.b_gate.t())).to(dt)
    u = (u + lora.scaling * (lora.xa[:, r:] @ lora.b_up.t())).to(dt)
    h = (torch.nn.functional.silu(g.float()).to(dt).float() * u.float()).to(dt)
    return h.double() @ wd.double().t(), h.float() @ lora.a_down.t()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("m,hidden,inter,rank", [(1, 64, 96, 4), (4, 96, 160, 8),
                                                 (16, 64, 64, 16)])
def test_fp32_lora_matches_peft_order(dtype, tol, m, hidden, inter, rank):
    """gate/up LoRA B in the activation's prologue and down's LoRA A accumulated into
    ``xa_down``: PEFT's dtype order (fp32 adapters on a ``dtype`` base) within fp32 summation
    order (bf16: a flipped rounding of g or u moves an output by an ulp)."""
    x, wgu, wd = _operands(m, hidden, inter, dtype, seed=3)
    lora, _ = _lora(x, inter, rank)
    got = mb.mlp_block(x, wgu, wd, lora=lora, block_j=32, block_k=32, block_n=32)
    ref, xa_d = _reference_lora(x, wgu, wd, lora)
    err = (got.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
    assert err < tol, err
    err_xa = (lora.xa_down - xa_d).abs().max().item() / max(1.0, xa_d.abs().max().item())
    assert err_xa < tol, err_xa
    assert not torch.allclose(got.double(), _reference(x, wgu, wd), rtol=1e-3, atol=1e-3)


def test_16bit_adapters_round_xa_as_peft():
    """bf16 adapters (or the engine's bf16 shadows of fp32 ones) on a bf16 base: ``xa`` and B in
    bf16, their products summed in fp32 and added to the rounded base output; ``xa_down`` stays
    the unrounded fp32 sum ``h @ A_d^T`` (the expand rounds it to B's dtype)."""
    x, wgu, wd = _operands(4, 96, 160, torch.bfloat16, seed=5)
    lora, _ = _lora(x, 160, 8)
    lo16 = lora._replace(xa=lora.xa.bfloat16(), b_gate=lora.b_gate.bfloat16(),
                         b_up=lora.b_up.bfloat16(), a_down=lora.a_down.bfloat16())
    got = mb.mlp_block(x, wgu, wd, lora=lo16, block_j=32, block_k=32, block_n=32)
    ref16 = lo16._replace(xa=lo16.xa.float(), b_gate=lo16.b_gate.float(),
                          b_up=lo16.b_up.float(), a_down=lo16.a_down.float(),
                          xa_down=torch.zeros_like(lora.xa_down))
    ref, xa_d = _reference_lora(x, wgu, wd, ref16)
    err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, err
    err_xa = (lo16.xa_down - xa_d).abs().max().item() / xa_d.abs().max().item()
    assert err_xa < 2e-2 and lo16.xa_down.dtype == torch.float32, err_xa


def test_default_config_fits_each_dtype():
    """16-bit weights get the H100 probe's fastest tiles up to 16 rows, narrower column
    blocks in 8 warps above; fp32 ones half-size tiles."""
    assert mb.default_config(torch.bfloat16) == (128, 128, 128, 4, 3)
    assert mb.default_config(torch.bfloat16, 64) == (64, 128, 128, 8, 3)
    assert mb.default_config(torch.float32) == mb.default_config(torch.float32, 64) == (
        64, 64, 64, 4, 2)


def test_refuses_inputs_it_cannot_compute_with_a_named_fix():
    """helper-26's trial: non-float or 1-D inputs, tensors on two devices, a tile that is not a
    power of 2, a tuple for ``lora``, a NaN / string scaling: each refused by name."""
    x, wgu, wd = _operands(4, 64, 96, torch.float32)
    with pytest.raises(ValueError, match="x must be a 2-D bf16 / fp16 / fp32 tensor"):
        mb.mlp_block(x.to(torch.int32), wgu.to(torch.int32), wd.to(torch.int32))
    with pytest.raises(ValueError, match="x must be a 2-D"):
        mb.mlp_block(x[0], wgu, wd)
    with pytest.raises(ValueError, match="w_down must be a 2-D"):
        mb.mlp_block(x, wgu, wd.double())
    with pytest.raises(ValueError, match="one device for all"):
        mb.mlp_block(x, wgu, wd, out=torch.zeros(4, 64, device="meta"))
    with pytest.raises(ValueError, match="block_j=48: a power of 2"):
        mb.mlp_block(x, wgu, wd, block_j=48)
    lora, _ = _lora(x, 96)
    with pytest.raises(TypeError, match="pass kernels.mlp_block.MlpLora"):
        mb.mlp_block(x, wgu, wd, lora=tuple(lora))
    for bad in (float("nan"), "0.5", None):
        with pytest.raises(ValueError, match="scaling=.*a finite number"):
            mb.mlp_block(x, wgu, wd, lora=lora._replace(scaling=bad))
    with pytest.raises(ValueError, match=r"lora\.b_gate must be a 2-D torch tensor"):
        mb.mlp_block(x, wgu, wd, lora=lora._replace(b_gate=lora.b_gate[:, 0]))


def test_refuses_lora_it_cannot_compute():
    x, wgu, wd = _operands(4, 64, 96, torch.bfloat16)
    lora, _ = _lora(x, 96)
    with pytest.raises(ValueError, match=r"lora\.b_gate .*torch\.bfloat16.*xa and the B of "
                       r"gate/up share one dtype"):
        mb.mlp_block(x, wgu, wd, lora=lora._replace(b_gate=lora.b_gate.bfloat16()))
    with pytest.raises(ValueError, match=r"lora\.xa_down \(3, 8\)"):
        mb.mlp_block(x, wgu, wd, lora=lora._replace(xa_down=lora.xa_down[:3]))
    big = lora._replace(xa=torch.zeros(4, 130, device=DEV), b_gate=torch.zeros(96, 65, device=DEV),
                        b_up=torch.zeros(96, 65, device=DEV))
    with pytest.raises(ValueError, match=r"ranks \(65, 65, 8\): 1-64"):
        mb.mlp_block(x, wgu, wd, lora=big)


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import mlp_block as mb
fn = mb._mlp_block_kernel
ptrs = ["x_ptr", "wgu_ptr", "wd_ptr", "acc_ptr", "xa_ptr", "bg_ptr", "bu_ptr", "ad_ptr", "xad_ptr"]
ints = ["m", "hidden", "inter", "stride_x", "stride_gu", "stride_d", "stride_acc", "stride_xa",
        "stride_xad", "r_g", "r_u", "r_d"]
for bj, lora, gdc, bm, warps in ((32, False, False, 16, 4), (64, False, False, 16, 4),
                                 (128, False, True, 16, 4), (128, True, True, 16, 4),
                                 (64, True, True, 64, 8)):
    sig = {p: ("*bf16" if p in ("x_ptr", "wgu_ptr", "wd_ptr") else "*fp32") for p in ptrs}
    sig.update(dict.fromkeys(ints, "i32"))
    sig["scaling"] = "fp32"
    consts = {"BLOCK_M": bm, "BLOCK_J": bj, "BLOCK_K": 128, "BLOCK_N": 128, "UPCAST": False,
              "HAS_LORA": lora, "BLOCK_R": 32, "RNE": False, "USE_GDC": gdc}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 3})
    ptx = kern.asm["ptx"]
    assert kern.asm["cubin"] and kern.metadata.shared <= 232448, (bj, kern.metadata.shared)
    assert "red.global" in ptx or "atom.global" in ptx
    assert ("griddepcontrol.wait" in ptx) == gdc and ("griddepcontrol.launch" in ptx) == gdc
print("compiled")
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90():
    """The kernel builds to sm_90 cubins at the three ``BLOCK_J`` the device A/B times (bf16
    dots, fp32 atomics), within the H200's shared memory, with LoRA and PDL (the
    ``griddepcontrol`` wait and trigger only when ``USE_GDC``), and at 64 rows in 8 warps (the
    default above 16 rows). No GPU needed."""
    assert_compiles_for_sm90(_AOT)
