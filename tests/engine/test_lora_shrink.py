"""LoRA A as one Triton kernel for fp32 adapters on a 16-bit base (``engine/kernels/lora_shrink.py``).

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` before the
kernel module is imported); skipped when triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the LoRA shrink kernel needs the triton package")

from _kernels import (
    DEV,
    assert_compiles_for_sm90,
    inplace_lora_step,
    peft_tiny,
    skip_unless_runnable,
)
from _tiny import random_prompts

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import lora_shrink as ls
from nbhelpers.engine.lora import LiveGroup

skip_unless_runnable(ls)


def _operands(n_rows, k, r, x_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(n_rows, k + 8, generator=g).to(x_dtype).to(DEV)  # row stride > width
    a = (torch.randn(r, k, generator=g) / k ** 0.5).to(DEV)
    return full[:, :k], a


@pytest.mark.parametrize("n_rows,k,r", [(1, 64, 12), (4, 300, 96), (70, 256, 32), (3, 40, 80)],
                         ids=["one_row", "qkv_like_ragged_k", "many_rows", "k_below_tile"])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_matches_fp32_linear(n_rows, k, r, splits, x_dtype):
    x, a = _operands(n_rows, k, r, x_dtype)
    assert ls.supported(x, a)
    got = ls.lora_shrink(x, a, splits)
    want = torch.nn.functional.linear(x.to(torch.float32), a)  # PEFT's lora_A(x.to(A.dtype))
    exact = (x.double() @ a.double().t()).float()
    assert got.dtype == torch.float32 and got.shape == (n_rows, r)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)


def test_split_k_fills_the_gpu_and_keeps_two_tiles_per_program():
    assert ls.split_k(4, 96, 2560, 16, 16, 128) == 10  # K / 256 caps it (128 / 6 tiles = 21)
    assert ls.split_k(4, 32, 9728, 16, 16, 128) == 38
    assert ls.split_k(256, 96, 2560, 64, 16, 128) == 5  # 24 tiles already
    assert ls.split_k(4, 96, 100, 16, 16, 128) == 1


def test_unsupported_operands_are_refused():
    x, a = _operands(3, 64, 8)
    assert not ls.supported(x.float(), a)  # fp32 input: no upcast needed, F.linear does it
    assert not ls.supported(x, a.to(torch.bfloat16))  # same-dtype A joins the base GEMM
    assert not ls.supported(x, a.t().contiguous().t())  # non-contiguous A
    assert not ls.supported(x[:, :32], a)  # K mismatch
    with pytest.raises(ValueError, match="use F.linear"):
        ls.lora_shrink(x.float(), a)


def test_live_group_uses_the_kernel_for_fp32_adapters(monkeypatch):
    model = peft_tiny(torch.bfloat16)  # PEFT default: fp32 adapters
    layer = model.get_base_model().model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    calls = []
    real = ls.lora_shrink
    monkeypatch.setattr(ls, "lora_shrink", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    x = torch.randn(1, 5, 64, device=DEV).to(torch.bfloat16)
    for mods in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj],
                 [attn.o_proj]):
        with torch.no_grad():
            plain = LiveGroup(mods)(x)  # cast + fp32 F.linear
            kernel = LiveGroup(mods, lora_expand="triton")(x)
            ref = [m(x) for m in mods]  # PEFT's own forward
        for p, k, r in zip(plain, kernel, ref):
            assert k.dtype == torch.bfloat16
            # same fp32 xa up to summation order, then the same expand: equal after bf16 rounding
            # except on rare rounding ties
            assert (k != p).float().mean() < 0.01
            torch.testing.assert_close(k, r, rtol=1.6e-2, atol=1e-2)
    assert len(calls) == 3


def test_engine_with_fp32_adapters_matches_the_torch_path_and_sees_live_updates(monkeypatch):
    """bf16 engine vs bf16 HF differ by rounding (attention, norms), so the reference is the
    same engine with LoRA A as cast + fp32 ``F.linear`` (``lora_expand="addmm"``)."""
    model = peft_tiny(torch.bfloat16)  # PEFT default: fp32 adapters
    calls = []
    real = ls.lora_shrink
    monkeypatch.setattr(ls, "lora_shrink", lambda *a: (calls.append(1), real(*a))[1])
    prompt = random_prompts(1, 10, 10, seed=3)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    # page_size 64: one the CUDA flex kernels serve too (kv_cache.check_page_size)
    kw = {"page_size": 64, "num_pages": 4, "max_model_len": 32}
    # lora_dtype="adapter": the fp32 adapters read directly (on CUDA "auto" computes them in
    # bf16 from shadow copies, tests/engine/test_lora_dtype.py, and the kernel would not run)
    kw["lora_dtype"] = "adapter"
    kernel, torch_path = LLM(model, lora_expand="triton", **kw), LLM(model, lora_expand="addmm",
                                                                      **kw)

    def both():
        k, t = kernel.generate([prompt], greedy)[0], torch_path.generate([prompt], greedy)[0]
        assert k.token_ids == t.token_ids
        assert max(abs(a - b) for a, b in zip(k.logprobs, t.logprobs)) < 0.05  # bf16 ulps
        return k.token_ids

    before = both()
    assert calls, "the kernel did not run"
    inplace_lora_step(model)  # an optimizer step on the fp32 adapters: in place, same storage
    assert both() != before


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import lora_shrink as ls
fn = ls._lora_shrink_gemm
ints = ["n_rows", "k", "r_total", "stride_x", "stride_a", "stride_xa", "k_per_split"]
for x, split in (("bf16", 1), ("bf16", 8), ("fp16", 4)):
    sig = {"x_ptr": "*" + x, "a_ptr": "*fp32", "xa_ptr": "*fp32", **dict.fromkeys(ints, "i32")}
    consts = {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 128, "SPLIT_K": split, "USE_GDC": False}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm["cubin"], (x, split)
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """The compiled kernel builds to an sm_90 cubin (fp32 IEEE ``tl.dot``, atomics), no GPU."""
    assert_compiles_for_sm90(_AOT)
