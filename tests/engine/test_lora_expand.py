"""LoRA B as one Triton kernel per projection group (``lora_expand="triton"``).

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` before the
kernel module is imported); skipped when triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="lora_expand='triton' needs the triton package")

from _kernels import DEV, assert_compiles_for_sm90, peft_tiny, skip_unless_runnable
from _tiny import hf_greedy, random_prompts

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import lora_expand as le
from nbhelpers.engine.lora import LiveGroup, check_lora_expand
from nbhelpers.engine.model_runner import RunnerOptions

skip_unless_runnable(le)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


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
    elif DEV == "cpu":  # one rounding of the fp32 sum (the CPU's bf16 addmm_ may round twice):
        # at most 1 ulp from the fp64 result rounded once, and that only on rare rounding ties
        torch.testing.assert_close(y, exact, rtol=2 ** -7, atol=0)
        assert (y != exact).float().mean() < 0.01
        torch.testing.assert_close(y, want)
    else:  # GPU: the compiled kernel's tl.dot and cuBLAS's addmm_ sum and round in their own
        # order (3.4e-3 off on a near-zero output seen on the H200), so the error is bounded by
        # bf16 rounding at the magnitude of the output, not of each element: 2 ulps there
        ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().max().float())).item() - 7)
        torch.testing.assert_close(y, exact, rtol=2 ** -7, atol=2 * ulp)
        torch.testing.assert_close(y, want, rtol=2 ** -7, atol=2 * ulp)


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


def test_option_is_validated():
    assert check_lora_expand("triton") == "triton"
    with pytest.raises(ValueError, match="lora_expand='fused'"):
        check_lora_expand("fused")
    with pytest.raises(ValueError, match="lora_expand"):
        RunnerOptions(lora_expand="fused")



def _count_calls(monkeypatch):
    calls = []
    real = le.lora_expand
    monkeypatch.setattr(le, "lora_expand", lambda *a: (calls.append(1), real(*a))[1])
    return calls


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, True), (torch.bfloat16, False),
                                            (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "bf16_base_fp32_lora"])
def test_live_group_same_outputs_with_kernel(monkeypatch, dtype, autocast):
    model = peft_tiny(dtype, autocast)
    layer = model.get_base_model().model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert (attn.q_proj.lora_B["default"].weight.dtype == torch.float32) == autocast
    x = torch.randn(1, 5, 64, device=DEV).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    # PEFT in bf16 rounds B(xa), the scaling and the add apart; near zero that is ~1e-3 absolute
    tol_peft = tol or {"rtol": 1.6e-2, "atol": 1e-2}
    calls = _count_calls(monkeypatch)
    for mods in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj],
                 [attn.o_proj]):
        with torch.no_grad():
            ref = [m(x) for m in mods]  # PEFT's own forward
            plain = LiveGroup(mods)(x)
            kernel = LiveGroup(mods, lora_expand="triton")(x)
        for r, p, k in zip(ref, plain, kernel):
            assert k.dtype == p.dtype == r.dtype
            # fp32: within 1e-5, not bit-equal: the CPU BLAS picks its summation order by host
            # (bit-equal on Intel hosts, ~1 ulp apart on the AMD EPYC CI host; cuBLAS likewise)
            torch.testing.assert_close(k, p, **tol)
            torch.testing.assert_close(k, r, **tol_peft)
    assert len(calls) == 3


def test_engine_with_kernel_sees_in_place_lora_updates(monkeypatch):
    model = peft_tiny(torch.float32)
    calls = _count_calls(monkeypatch)
    prompt = random_prompts(1, 10, 10, seed=3)[0]
    # page_size 64: one the CUDA flex kernels serve too (kv_cache.check_page_size)
    llm = LLM(model, page_size=64, num_pages=4, max_model_len=32, lora_expand="triton")
    before = llm.generate([prompt], GREEDY)[0]
    assert before.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)[0]
    assert calls, "the kernel did not run"
    with torch.no_grad():  # an optimizer step: in place, same storage
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    after = llm.generate([prompt], GREEDY)[0]
    ref, ref_lp = hf_greedy(model, prompt, GREEDY.max_new_tokens)
    assert after.token_ids != before.token_ids
    assert after.token_ids == ref
    assert max(abs(a - b) for a, b in zip(after.logprobs, ref_lp)) < 1e-4


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import lora_expand as le
fn = le._lora_expand_gemm
ints = ["n_rows", "stride_xa", "stride_y", "end0", "end1", "roff1", "roff2", "r0", "r1", "r2"]
for y, b, xa, parts, dot32, round_to in (
        ("bf16", "bf16", "bf16", 3, False, 0), ("bf16", "fp32", "fp32", 2, True, 0),
        ("fp32", "fp32", "fp32", 1, True, 0), ("fp32", "fp32", "fp32", 1, True, 1),
        ("fp32", "bf16", "fp32", 1, True, 1)):
    sig = {"xa_ptr": "*" + xa, "y_ptr": "*" + y, "b0_ptr": "*" + b, "b1_ptr": "*" + b,
           "b2_ptr": "*" + b, **dict.fromkeys(ints, "i32"), "scaling": "fp32"}
    consts = {"NUM_PARTS": parts, "BLOCK_M": 32, "BLOCK_OUT": 64, "BLOCK_R": 32,
              "DOT_FP32": dot32, "BF16_RNE": False, "USE_GDC": False,
              "PREWAIT": False, "ROUND_TO": round_to,
              "XA_ROUND": 1 if xa != b and b == "bf16" else 0}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm["cubin"], (y, b, parts)
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """The compiled (non-interpreted) kernel builds to an sm_90 cubin with triton's bundled
    ptxas, no GPU needed: bf16 ``tl.dot``, the part-pointer selection, mixed dtypes, and the
    ``round_to`` builds (an fp32 ``y`` rounded to bf16, with fp32 or bf16 B: the fp32 ``xa``
    sum rounded to bf16 first, ``engine/mlp_block.py``)."""
    assert_compiles_for_sm90(_AOT)
