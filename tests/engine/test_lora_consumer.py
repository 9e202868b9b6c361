"""LoRA B inside the consumer kernels (``lora_expand="consumer"``, ``engine/lora_pending.py``,
``engine/kernels/lora_prologue.py``): each consumer against torch (the group's own B step, then the
torch twin of the consumer), their fallbacks and their sm_90 build. The engine:
``test_lora_consumer_engine.py``.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); the ``gpu`` test
runs them compiled at Qwen3-4B shapes; skipped when triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="lora_expand='consumer' needs the triton package")

from _kernels import DEV, skip_unless_runnable

from nbhelpers.engine import fused
from nbhelpers.engine.kernels import fused_norm as fn
from nbhelpers.engine.kernels import lora_expand as le
from nbhelpers.engine.kernels import lora_prologue as lp
from nbhelpers.engine.lora_pending import PendingLora, add_lora_b

skip_unless_runnable(fn)
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32)]
DTYPE_IDS = ["fp32", "bf16", "bf16_base_fp32_lora"]


def _tol(dtype):
    """fp32: summation order only. bf16: the consumer's roundings (norm, weight product) may
    each differ by one ulp from torch's (``test_fused_kernels._tol``), plus one on the LoRA add."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2,
                                                                       "rtol": 4 * 2 ** -7}


def _pending(sizes, ranks, n_rows, y_dtype, b_dtype, seed=0, s=2.0):
    """A :class:`PendingLora` in LiveGroup's ``ext`` layout when B has ``y``'s dtype (``y`` and
    ``xa`` views of one ``[N, sum(out) + sum(r)]`` GEMM output), else an fp32 ``xa`` of its own
    (fp32 adapters on a 16-bit base); values ~N(0, 1), B ~N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    n, r = sum(sizes), sum(ranks)
    full = torch.randn(n_rows, n + r, generator=g).to(y_dtype).to(DEV)
    xa = full[:, n:] if b_dtype == y_dtype else torch.randn(n_rows, r, generator=g).to(DEV)
    bs = [(0.3 * torch.randn(o, k, generator=g)).to(b_dtype).to(DEV)
          for o, k in zip(sizes, ranks)]
    return PendingLora(full[:, :n], xa, bs, list(sizes), list(ranks), s, le)


def _with_lora(p: PendingLora):
    """``y`` with LoRA B added by the group's own step (``add_lora_b``, torch ``addmm_``), a copy."""
    return add_lora_b(p.y.clone(), p.xa, p.bs, p.sizes, p.ranks, p.scaling)


# ----------------------------------------------------------------- stage 1: o_proj, down_proj


@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n,r", [(1, 64, 4), (5, 64, 8), (3, 2560, 32), (4, 96, 64)],
                         ids=["tiny_o_r4", "tiny_r8", "qwen3_4b_hidden_r32", "r64"])
def test_add_rms_norm_with_lora_matches_torch(y_dtype, b_dtype, rows, n, r):
    p = _pending([n], [r], rows, y_dtype, b_dtype)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(5)).to(y_dtype).to(DEV)
    w = (1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(6))).to(y_dtype).to(DEV)
    delta = p.y.view(1, rows, n)  # how layers.py hands o_proj's output over
    ref_x, ref_h = fused.add_rms_norm(x.view(1, rows, n), _with_lora(p).view(1, rows, n), w, 1e-6)
    y_before = p.y.clone()
    assert fn.lora_supported(p, 1, delta)
    got_x, got_h = fused.triton_add_rms_norm(x.view(1, rows, n), delta, w, 1e-6, lora=p)
    assert torch.equal(p.y, y_before)  # the base output is read, not written
    torch.testing.assert_close(got_x, ref_x, **_tol(y_dtype))
    torch.testing.assert_close(got_h, ref_h, **_tol(y_dtype))


def test_add_norm_unsupported_lora_falls_back_or_raises():
    """Rank above MAX_RANK, or a delta that is not the record's ``y``: ``fused`` adds B first
    (``apply()``, same result as the group's own step), the raw kernel raises."""
    p = _pending([64], [lp.MAX_RANK + 16], 3, torch.float32, torch.float32)
    x, w = torch.randn(1, 3, 64, device=DEV), torch.ones(64, device=DEV)
    want = fused.add_rms_norm(x, _with_lora(p).view(1, 3, 64), w, 1e-6)
    assert not fn.lora_supported(p, 1, p.y)
    with pytest.raises(ValueError, match="lora.apply"):
        fn.add_norm(p.y, x.view(3, 64), out_norm=(w, 1e-6, "llama"), lora=p)
    got = fused.triton_add_rms_norm(x, p.y.view(1, 3, 64), w, 1e-6, lora=p)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    q = _pending([64], [4], 3, torch.float32, torch.float32)
    assert not fn.lora_supported(q, 1, q.y.clone())  # another tensor than y: not read as y_base
    assert not fn.lora_supported(q, 2, q.y)  # a two-part consumer is not this one


# ----------------------------------------------------------------- stage 2: gate_up


@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inter,ranks", [(1, 128, [4, 4]), (5, 96, [8, 16]),
                                              (3, 2048, [32, 32])],
                         ids=["tiny_gate_up_r4", "ranks_differ", "wide_r32"])
def test_silu_mul_with_lora_matches_torch(y_dtype, b_dtype, rows, inter, ranks):
    """The kernel keeps ``gate``/``up`` + LoRA in fp32 and rounds once, after SiLU x up; so the
    reference does too (fp32 copies of the same operands, cast at the end). Against torch's
    16-bit path (gate rounded to bf16 before SiLU) a bf16 run at Qwen3-4B's shape differed by
    0.06 on 2 of 38,912 elements where y and the LoRA term nearly cancel (H200, 2026-12-01):
    torch's extra rounding, not the kernel's."""
    p = _pending([inter, inter], ranks, rows, y_dtype, b_dtype, seed=1)
    gate, up = p.y.view(1, rows, 2 * inter).split(inter, -1)  # LiveGroup's split views
    f32 = add_lora_b(p.y.float().clone(), p.xa.float(), [b.float() for b in p.bs], p.sizes,
                     p.ranks, p.scaling)
    ref_g, ref_u = f32.view(1, rows, 2 * inter).split(inter, -1)
    assert fn.lora_supported(p, 2, gate, up)
    got = fused.triton_silu_mul(gate, up, lora=p)
    torch.testing.assert_close(got, fused.silu_mul(ref_g, ref_u).to(y_dtype), **_tol(y_dtype))


def test_act_mul_unsupported_lora_falls_back_or_raises():
    p = _pending([64, 64], [4, lp.MAX_RANK + 1], 2, torch.float32, torch.float32)
    gate, up = p.y.split(64, -1)
    want = fused.silu_mul(*_with_lora(p).split(64, -1))
    assert not fn.lora_supported(p, 2, gate, up)
    with pytest.raises(ValueError, match="lora.apply"):
        fn.act_mul(gate, up, lora=p)
    torch.testing.assert_close(fused.triton_silu_mul(gate, up, lora=p), want, rtol=1e-5,
                               atol=1e-5)
    q = _pending([64, 64], [4, 4], 2, torch.float32, torch.float32)
    g2, u2 = q.y.split(64, -1)
    assert not fn.lora_supported(q, 2, u2, g2)  # parts swapped: not read as their y_base


# ----------------------------------------------------------------- stage 3: qkv


def _qkv_case(t, h, hkv, d, ranks, y_dtype, b_dtype):
    """A q/k/v record and test_fused_kernels' RoPE angles, slots and pool."""
    from test_fused_kernels import _rope_case
    p = _pending([h * d, hkv * d, hkv * d], ranks, t, y_dtype, b_dtype, seed=2, s=1.5)
    _, _, _, cos, sin, slots, cache = _rope_case(t, h, hkv, d, y_dtype)
    return p, cos, sin, slots, cache


@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("t,h,hkv,d,ranks", [(1, 4, 2, 16, [4, 4, 4]), (3, 4, 2, 16, [8, 4, 16]),
                                             (2, 6, 2, 128, [32, 32, 32])],
                         ids=["tiny_qwen3_r4", "ranks_differ", "d128_r32"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_rope_cache_with_lora_matches_torch(y_dtype, b_dtype, t, h, hkv, d, ranks, qk_norm):
    from test_fused_kernels import _tol as _rope_tol
    p, cos, sin, slots, (kc, vc) = _qkv_case(t, h, hkv, d, ranks, y_dtype, b_dtype)
    g = torch.Generator().manual_seed(7)
    wq, wk = ((1 + 0.3 * torch.randn(d, generator=g)).to(y_dtype).to(DEV) for _ in range(2))
    wq, wk = (wq, wk) if qk_norm else (None, None)
    q, k, v = p.y.view(1, t, -1).split(p.sizes, -1)  # LiveGroup's split views
    rq_in, rk_in, rv_in = _with_lora(p).view(1, t, -1).split(p.sizes, -1)
    rq, rk = fused.qk_norm_rope(rq_in.view(1, t, h, d), rk_in.view(1, t, hkv, d), wq, wk, 1e-6,
                                cos, sin)
    rv = rv_in.reshape(1, t, hkv, d).transpose(1, 2)
    assert fn.lora_supported(p, 3, q.view(1, t, h, d), k.view(1, t, hkv, d), v)
    out = fused.triton_qk_rope_cache(q.view(1, t, h, d), k.view(1, t, hkv, d), v, wq, wk, 1e-6,
                                     cos, sin, (kc, vc, slots), (h, hkv, d), lora=p)
    torch.testing.assert_close(out, rq, **_rope_tol(y_dtype, rq.abs().max()))
    torch.testing.assert_close(kc[0][:, slots], rk[0], **_rope_tol(y_dtype, rk.abs().max()))
    torch.testing.assert_close(vc[0][:, slots], rv[0], **_rope_tol(y_dtype, rv.abs().max()))


def test_qk_rope_cache_unsupported_lora_falls_back_or_raises():
    from nbhelpers.engine.kernels import qk_rope_cache as qrc
    t, h, hkv, d = 2, 4, 2, 16
    p, cos, sin, slots, (kc, vc) = _qkv_case(t, h, hkv, d, [4, 4, lp.MAX_RANK + 4],
                                             torch.float32, torch.float32)
    q, k, v = p.y.view(1, t, -1).split(p.sizes, -1)
    rq_in, rk_in, rv_in = _with_lora(p).view(1, t, -1).split(p.sizes, -1)
    rq, rk = fused.qk_norm_rope(rq_in.view(1, t, h, d), rk_in.view(1, t, hkv, d), None, None,
                                1e-6, cos, sin)
    assert not fn.lora_supported(p, 3, q, k, v)
    with pytest.raises(ValueError, match="lora.apply"):
        qrc.qk_norm_rope_cache(q, k, v, h, hkv, d, cos, sin, kc, vc, slots, lora=p)
    out = fused.triton_qk_rope_cache(q, k, v, None, None, 1e-6, cos, sin, (kc, vc, slots),
                                     (h, hkv, d), lora=p)
    torch.testing.assert_close(out, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc[0][:, slots], rk[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc[0][:, slots], rv_in.reshape(1, t, hkv, d).transpose(1, 2)[0])


# ----------------------------------------------------------------- GPU, compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("y_dtype,b_dtype", DTYPES[1:], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_gpu_qwen3_4b_shapes_match_torch(y_dtype, b_dtype, rows):
    """Compiled consumers at Qwen3-4B shapes (hidden 2560, intermediate 9728, r 32) against
    torch on the device."""
    test_add_rms_norm_with_lora_matches_torch(y_dtype, b_dtype, rows, 2560, 32)
    test_silu_mul_with_lora_matches_torch(y_dtype, b_dtype, rows, 9728, [32, 32])
    for qk_norm in (True, False):  # H 32, H_kv 8, D 128
        test_qk_rope_cache_with_lora_matches_torch(y_dtype, b_dtype, rows, 32, 8, 128,
                                                   [32, 32, 32], qk_norm)


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import fused_norm as fn, lora_act_mul as lam, qk_rope_cache as qrc
LORA = dict(HAS_LORA=True, LORA_K=4, LORA_RNE=False, USE_GDC=False, PREWAIT=False)
cases = [(fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=0, D_W=False, HAS_SCALE=False,
                                    STORE_RES=True, O_STYLE=1, O_W=True, BLOCK=4096, **LORA)),
         (qrc._qk_rope_cache_kernel, dict(QK_STYLE=1, QK_W=True, V_STYLE=0, BLOCK_H=64,
                                          **{**LORA, "LORA_K": 32}))]
lora_ptrs = {"xa_ptr", "b_ptr", "bg_ptr", "bu_ptr", "bq_ptr", "bk_ptr", "bv_ptr"}
for model_dt, lora_dt in (("bf16", "fp32"), ("fp16", "fp16")):
    act = (lam._act_mul_lora_kernel, dict(ACT=0, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32,
                                          DOT_FP32=lora_dt == "fp32", RNE=False, USE_GDC=False,
                                          PREWAIT=False))
    for kern, consts in (*cases, act):
        consts = {**consts, **dict.fromkeys(  # pdl="prefetch" builds: test_pdl_prefetch.py
            [a for a in ("EARLY_TRIGGER",) if a in kern.arg_names], False)}
        consts = {**{p.name: p.default for p in kern.params  # other defaulted constexprs
                     if p.is_constexpr and p.has_default}, **consts}
        sig = {a: ("*i64" if a == "slot_ptr" else "*" + (lora_dt if a in lora_ptrs else model_dt))
               if a.endswith("_ptr") else "fp32" if a.startswith("eps") or a == "scaling"
               else "i32" for a in kern.arg_names}
        sig.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(kern, signature=sig,
                        constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert k.asm["cubin"], (kern, model_dt, lora_dt)
print("compiled")
"""


def test_consumer_kernels_compile_for_sm90():
    """The compiled consumers with LoRA B build to sm_90 cubins (triton's bundled ptxas, no
    GPU): fp32 adapters on a bf16 model (TRL's default, ``lora_dtype="adapter"``: IEEE fp32
    ``tl.dot`` in ``lora_act_mul``) and fp16 throughout (fp16 ``tl.dot``; bf16 throughout:
    ``test_fused_kernels.test_kernels_compile_for_sm90``)."""
    from _kernels import assert_compiles_for_sm90
    assert_compiles_for_sm90(_AOT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled tl.dot consumer: run on the "
                    "H200 host (python3 scripts/device/suite.py, or pytest -m gpu there)")
@pytest.mark.parametrize("rows,y_dtype,b_dtype", [(4, torch.bfloat16, torch.float32),
                                                   (32, torch.bfloat16, torch.bfloat16)],
                         ids=["b4_fp32_adapters", "b32_bf16"])
def test_gpu_act_mul_lora_matches_expand_then_act_mul(rows, y_dtype, b_dtype):
    """The two points of issue 12's A/B at Qwen3-4B's gate_up (I 9728, r 32): the consumer
    (``lora_act_mul``, B through ``tl.dot`` per column block) against what ``"triton"`` runs
    (``lora_expand`` in place, then the plain SiLU x up kernel): within one bf16 rounding of
    gate/up (the two kernels sum r in their own order) and the record's ``y`` unchanged."""
    p = _pending([9728, 9728], [32, 32], rows, y_dtype, b_dtype, seed=3)
    gate, up = p.y.view(1, rows, -1).split(9728, -1)
    y_before = p.y.clone()
    got = fn.act_mul(gate, up, lora=p)
    assert torch.equal(p.y, y_before)
    y = p.y.clone()
    le.lora_expand(y, p.xa, p.bs, p.sizes, p.ranks, p.scaling)
    want = fn.act_mul(*y.view(1, rows, -1).split(9728, -1))
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2 ** -7)
