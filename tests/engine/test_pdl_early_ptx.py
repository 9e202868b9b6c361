"""``pdl="early"`` does the arithmetic of ``pdl="on"`` in the sm_90 build, not only in the
interpreter (``test_pdl_early.py``): each ``PREWAIT`` kernel compiled with ``USE_GDC=True`` and
``PREWAIT`` False and True, at the tiny engine's decode shapes (``test_pdl_builds.py``'s
``test_gpu_pdl_early_matches_on``: hidden 64, head_dim 16, LoRA r 4) for bf16 activations with
fp32 adapters (``lora_dtype="adapter"``: fp32 ``xa`` and B), bf16 adapters and fp32, and its PTX
compared with :mod:`_ptx_arith` (load positions excluded); plus Qwen3-4B's head_dim 128 / r 32 /
hidden 2560 for the LoRA consumers. Straight-line kernels: every stored
value is the same tree of PTX ops (:func:`_ptx_arith.stores`). Kernels whose ``PREWAIT`` build
peels a loop's first iteration (``lora_expand``'s rank loop, add+RMSNorm's LoRA prologue): the
loop body is unchanged and the extra ops are the body's own, one iteration's worth.

The regression: the H200 (step ``n16a``, 2026-12-02) gave bf16 logprobs up to 1.9e-3 apart
between ``"early"`` and ``"on"``: ``qk_rope_cache``'s RoPE sums ``rnd(a*b) + rnd(c*d)`` were
shrunk by LLVM to bf16 and contracted into one ``fma.rn.bf16``, fusing ``x1 * sin2`` in one
build and ``x2 * cos2`` in the other (fixed: ``qk_rope_cache.FP_FUSION``). And at head_dim 128
with LoRA (not the tiny model) the early build summed the q/k norm's squares in another
layout, another fp32 reduction order (fixed: the B tiles load at the top in every build).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the PDL kernels need the triton package")

from _ptx_arith import arith_ops, loop_body, stores

_AOT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import fused_norm as fn, lora_act_mul as lam, lora_expand as le
from nbhelpers.engine.kernels import qk_rope_cache as qrc
act, ada = sys.argv[1], sys.argv[2]  # activation dtype, adapter (xa, B) dtype
A, L = "*" + act, "*" + ada
NO, LO = dict(HAS_LORA=False, LORA_K=4, LORA_RNE=False), dict(HAS_LORA=True, LORA_K=4,
                                                              LORA_RNE=False)
NORM = dict(HAS_X=True, D_STYLE=0, D_W=False, HAS_SCALE=False, STORE_RES=True, O_STYLE=1,
            O_W=True, BLOCK=64)
QK = dict(QK_STYLE=1, QK_W=True, V_STYLE=0, BLOCK_H=8)
FP32_DOT = ada == "fp32"
LB = {"xa_ptr": L, "b_ptr": L, "b0_ptr": L, "b1_ptr": L, "b2_ptr": L, "bq_ptr": L, "bk_ptr": L,
      "bv_ptr": L, "bg_ptr": L, "bu_ptr": L, "slot_ptr": "*i64"}
QF = qrc.FP_FUSION  # what qk_norm_rope_cache launches with
CASES = {  # name: (kernel, constexprs, num_warps, enable_fp_fusion): the launchers' values
    "add_norm": (fn._add_norm_kernel, dict(**NORM, **NO), 4, True),
    "add_norm_first": (fn._add_norm_kernel, dict(NORM, HAS_X=False, STORE_RES=False, **NO), 4,
                       True),
    "qk_rope_cache": (qrc._qk_rope_cache_kernel, dict(**QK, **NO), 1, QF),
    "qk_rope_cache_lora": (qrc._qk_rope_cache_kernel, dict(**QK, **LO), 1, QF),
    "qk_rope_cache_fused": (qrc._qk_rope_cache_kernel, dict(**QK, **NO), 1, True),  # the bug
    "qk_rope_cache_lora_d128": (qrc._qk_rope_cache_kernel,  # Qwen3-4B: head_dim 128, r 32
                                dict(QK, BLOCK_H=64, **{**LO, "LORA_K": 32}), 2, QF),
    "act_mul_lora": (lam._act_mul_lora_kernel, dict(ACT=0, BLOCK_M=16, BLOCK_N=64, BLOCK_R=16,
                                                    DOT_FP32=FP32_DOT, RNE=False), 4, True),
    "act_mul_lora_r32": (lam._act_mul_lora_kernel, dict(ACT=0, BLOCK_M=16, BLOCK_N=64,
                                                        BLOCK_R=32, DOT_FP32=FP32_DOT,
                                                        RNE=False), 4, True),  # Qwen3-4B r 32
    "add_norm_lora": (fn._add_norm_kernel, dict(**NORM, **LO), 4, True),
    "add_norm_lora_2560": (fn._add_norm_kernel, dict(NORM, BLOCK=4096, **LO), 8, True),
    "lora_expand_qkv": (le._lora_expand_gemm, dict(NUM_PARTS=3, BLOCK_M=16, BLOCK_OUT=32,
                                                   BLOCK_R=16, DOT_FP32=FP32_DOT,
                                                   BF16_RNE=False), 4, True),
    "lora_expand_o": (le._lora_expand_gemm, dict(NUM_PARTS=1, BLOCK_M=16, BLOCK_OUT=64,
                                                 BLOCK_R=16, DOT_FP32=FP32_DOT,
                                                 BF16_RNE=False), 4, True),
}
out = {}
for name, (kern, consts, warps, fusion) in CASES.items():
    for pre in (False, True):
        c = {**consts, "USE_GDC": True, "PREWAIT": pre}
        c.update({a: False for a in ("EARLY_TRIGGER",) if a in kern.arg_names})  # prefetch mode
        # every other defaulted constexpr at its default (e.g. mlp_block's ROUND_TO, D_ROUND)
        c = {**{p.name: p.default for p in kern.params if p.is_constexpr and p.has_default}, **c}
        sig = {a: "constexpr" if a in c else LB.get(a) or (
            "fp32" if a == "scaling" or a.startswith("eps") else
            A if a.endswith("_ptr") else "i32") for a in kern.arg_names}
        src = ASTSource(kern, signature=sig,
                        constexprs={(kern.arg_names.index(k),): v for k, v in c.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps,
                                                                  "enable_fp_fusion": fusion})
        out[f"{name}/{int(pre)}"] = k.asm["ptx"]
json.dump(out, open(sys.argv[3], "w"))
print("compiled")
"""

STRAIGHT = ("add_norm", "add_norm_first", "qk_rope_cache", "qk_rope_cache_lora",
            "qk_rope_cache_lora_d128", "act_mul_lora", "act_mul_lora_r32")
PEELED = ("add_norm_lora", "add_norm_lora_2560", "lora_expand_qkv", "lora_expand_o")
CONFIGS = {"bf16_fp32_adapters": ("bf16", "fp32"), "bf16": ("bf16", "bf16"),
           "fp32": ("fp32", "fp32")}


@pytest.fixture(scope="module", params=list(CONFIGS))
def builds(request, tmp_path_factory) -> dict[str, str]:
    """PTX of every case, ``{"name/0": off, "name/1": early}`` (``PREWAIT`` False / True), built
    in a compiled-mode subprocess with triton's bundled ptxas (no GPU needed)."""
    act, ada = CONFIGS[request.param]
    path = tmp_path_factory.mktemp("ptx") / "ptx.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           # the repo first, then the caller's path (a shadowing triton, e.g. the H200 image's)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _AOT, act, ada, str(path)], env=env,
                          capture_output=True, text=True, check=False, timeout=1200)
    if proc.returncode and "ptxas" in proc.stderr:
        pytest.skip(f"no usable ptxas: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
    return json.loads(path.read_text())


def test_prewait_builds_store_the_same_arithmetic(builds):
    """Straight-line ``PREWAIT`` kernels (add+RMSNorm without LoRA, q/k norm + RoPE + cache
    with and without LoRA, the gate_up consumer): every stored value of the early build is the
    off build's tree of PTX arithmetic over the same loads (FMA contractions, rounding
    modifiers, shuffle reduction tree, ``mma`` operands)."""
    for name in STRAIGHT:
        off, early = stores(builds[f"{name}/0"]), stores(builds[f"{name}/1"])
        assert off and early == off, (name, len(off - early), len(early - off))


def test_prewait_peel_repeats_the_loop_body(builds):
    """``PREWAIT`` kernels that peel their first loop iteration (``lora_expand``'s rank loop,
    add+RMSNorm's LoRA prologue, ``STEPS=0``): the loop body's arithmetic ops are those of the
    off build, in order, and the early build has exactly one body's worth more of each op (the
    peeled iteration)."""
    for name in PEELED:
        off, early = builds[f"{name}/0"], builds[f"{name}/1"]
        body_off, body_early = arith_ops(loop_body(off)), arith_ops(loop_body(early))
        assert body_off and body_early == body_off, name
        assert Counter(arith_ops(early)) == Counter(arith_ops(off)) + Counter(body_off), name


def test_contraction_made_the_gap(builds):
    """The cause, kept visible: ``qk_rope_cache`` built with FMA contraction on (Triton's
    default before 3.10, what ran on the H200 in ``n16a``) stores different arithmetic with
    ``PREWAIT`` (one RoPE product fused into an ``fma`` in place of the other) although the two
    builds have the same sequence of arithmetic opcodes; the launcher's
    ``qk_rope_cache.FP_FUSION`` (off) is what makes them agree."""
    off, early = builds["qk_rope_cache_fused/0"], builds["qk_rope_cache_fused/1"]
    assert arith_ops(off) == arith_ops(early) and stores(off) != stores(early)
    assert "fma.rn" not in builds["qk_rope_cache/0"]


def test_fingerprint_sees_a_swapped_contraction():
    """The comparison catches what the H200 saw: two PTX fragments with the same op sequence
    whose ``fma.rn.bf16`` fuses a different product (``x1 * s`` vs ``x2 * c``) differ."""
    tmpl = """
    .loc 1 10 5
    ld.global.b16 {{ %rs1 }}, [ %rd1 + 0 ];
    ld.global.b16 {{ %rs2 }}, [ %rd1 + 2 ];
    .loc 1 11 5
    ld.global.b16 {{ %rs3 }}, [ %rd2 + 0 ];
    ld.global.b16 {{ %rs4 }}, [ %rd2 + 2 ];
    mul.bf16 %rs5, {m};
    fma.rn.bf16 %rs6, {f}, %rs5;
    st.global.b16 [ %rd3 + 0 ], {{ %rs6 }};
    """
    a = tmpl.format(m="%rs2, %rs3", f="%rs1, %rs4")
    b = tmpl.format(m="%rs1, %rs4", f="%rs2, %rs3")
    assert arith_ops(a) == arith_ops(b) and stores(a) != stores(b)
    assert stores(a) == stores(tmpl.format(m="%rs3, %rs2", f="%rs4, %rs1"))  # commuted: same


def test_fingerprint_ignores_packing_and_shared_layout():
    """What the Triton 3.6 builds differ in and does not change a stored value: a pair of bf16
    products done as one ``mul.rn.bf16x2`` or as two ``mul.rn.bf16``, and a tile staged
    through shared memory at another offset. A changed operand still counts."""
    loads = """
    .loc 1 10 5
    ld.global.b16 { %rs1 }, [ %rd1 + 0 ];
    ld.global.b16 { %rs2 }, [ %rd1 + 2 ];
    ld.global.b16 { %rs3 }, [ %rd2 + 0 ];
    ld.global.b16 { %rs4 }, [ %rd2 + 2 ];
    """
    packed = """
    mov.b32 %r1, {{ %rs1, %rs2 }};
    mov.b32 %r2, {{ %rs3, %rs4 }};
    mul.rn.bf16x2 %r3, %r1, %r2;
    mov.b32 {{ %rs5, %rs6 }}, %r3;
    add.rn.bf16 %rs7, %rs5, {last};
    st.global.b16 [ %rd3 + 0 ], {{ %rs7 }};
    """
    scalar = loads + """
    mul.rn.bf16 %rs5, %rs1, %rs3;
    mul.rn.bf16 %rs6, %rs2, %rs4;
    add.rn.bf16 %rs7, %rs5, %rs6;
    st.global.b16 [ %rd3 + 0 ], { %rs7 };
    """
    assert stores(loads + packed.format(last="%rs6")) == stores(scalar)
    assert stores(loads + packed.format(last="%rs5")) != stores(scalar)  # x1*y1 + x1*y1: another value
    staged = """
    .loc 1 20 5
    ld.global.b32 {{ %r1 }}, [ %rd1 + 0 ];
    st.shared.b32 [ %r9 + {base} ], %r1;
    .loc 1 21 5
    ld.shared.b32 %r2, [ %r8 + {base} ];
    mul.rn.f32 %r3, %r2, %r2;
    st.global.b32 [ %rd3 + 0 ], {{ %r3 }};
    """
    assert stores(staged.format(base=0)) == stores(staged.format(base=4096))
