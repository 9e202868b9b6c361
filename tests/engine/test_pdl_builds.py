"""Programmatic Dependent Launch builds (runner option ``pdl``, ``engine/kernels/pdl.py``): the sm_90
PTX of every decode kernel with ``USE_GDC`` on (one ``griddepcontrol.wait`` before any global
store or activation load, ``launch_dependents`` after it) and off (neither), and on a Hopper GPU
the PDL skinny GEMM and greedy parity of ``pdl="on"`` against ``"off"`` under CUDA graphs with
every decode kernel launched with ``launch_pdl``, and of ``pdl="early"`` against ``"on"``
(weights before the wait, ``PREWAIT``). Options and the interpreter: ``test_pdl.py``,
``test_pdl_early.py``.

The PTX checks build in a compiled-mode subprocess with triton's bundled ptxas (no GPU needed).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the PDL kernels need the triton package")

from _kernels import assert_compiles_for_sm90, peft_tiny
from _tiny import random_prompts
from test_pdl import (
    GREEDY,
    KERNEL_OPTS,
    _force_skinny,
    _spy,
    assert_same_greedy,
    greedy_per_mode,
)

from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import pdl

_AOT = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import fused_norm as fn, lora_expand as le, lora_shrink as ls
from nbhelpers.engine.kernels import lora_act_mul as lam
from nbhelpers.engine.kernels import paged_decode_kernel as pk, qk_rope_cache as qrc
from nbhelpers.engine.kernels import paged_decode_prefix as pp
from nbhelpers.engine.kernels import skinny_gemm as sg
NO, LORA = dict(HAS_LORA=False, LORA_K=4, LORA_RNE=False), dict(HAS_LORA=True, LORA_K=4,
                                                                 LORA_RNE=False)
SK = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, UPCAST=False, BF16_RNE=False)
ST1 = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, PAGE_SIZE=128,
           USE_WINDOW=False, USE_SOFT_CAP=False, DOT_PRECISION="tf32")
I64, F32 = {"slot_ptr": "*i64", "BlockTable": "*i64", "SeqLens": "*i64"}, "*fp32"
PRE = {**I64, "RowPrefix": "*i32", "PreO": F32, "PreLse": F32}  # shared-prefix operands
# name: (kernel, constexprs, pointer dtypes besides bf16, launches dependents, W before wait,
#        W before wait with PREWAIT or None: the kernel takes no PREWAIT)
CASES = {
    "skinny_split": (sg._skinny_gemm, dict(HAS_BIAS=False, SPLIT=True, **SK),
                     {"ws_ptr": F32, "cnt_ptr": "*i32"}, True, True, None),
    "skinny_bias": (sg._skinny_gemm, dict(HAS_BIAS=True, SPLIT=False, **SK),
                    {"ws_ptr": F32, "cnt_ptr": "*i32"}, True, True, None),
    "lora_expand": (le._lora_expand_gemm, dict(NUM_PARTS=3, BLOCK_M=16, BLOCK_OUT=64,
                                               BLOCK_R=32, DOT_FP32=False, BF16_RNE=False),
                    {}, True, False, True),
    "lora_expand_fp32": (le._lora_expand_gemm, dict(NUM_PARTS=1, BLOCK_M=16, BLOCK_OUT=64,
                                                    BLOCK_R=64, DOT_FP32=True, BF16_RNE=False),
                         {"xa_ptr": F32, "b0_ptr": F32, "b1_ptr": F32, "b2_ptr": F32}, True,
                         False, True),
    "lora_shrink": (ls._lora_shrink_gemm, dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, SPLIT_K=8),
                    {"a_ptr": F32, "xa_ptr": F32}, True, False, None),
    "add_norm_lora": (fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=0, D_W=False,
                                                HAS_SCALE=False, STORE_RES=True, O_STYLE=1,
                                                O_W=True, BLOCK=4096, **LORA), {}, True, False,
                      True),
    "add_norm_gemma": (fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=2, D_W=True,
                                                 HAS_SCALE=True, STORE_RES=True, O_STYLE=2,
                                                 O_W=True, BLOCK=2048, **NO), {}, True, False,
                       True),
    "add_norm_no_weights": (fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=0, D_W=False,
                                                      HAS_SCALE=False, STORE_RES=True,
                                                      O_STYLE=2, O_W=False, BLOCK=2048, **NO),
                            {}, True, False, False),  # dummy weight pointers: never read early
    "act_mul": (fn._act_mul_kernel, dict(ACT=0, BLOCK=1024), {}, True, False, None),
    "act_mul_lora": (lam._act_mul_lora_kernel, dict(ACT=0, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32,
                                                    DOT_FP32=False, RNE=False), {}, True, False,
                     True),
    "qk_rope_cache": (qrc._qk_rope_cache_kernel, dict(QK_STYLE=1, QK_W=True, V_STYLE=0,
                                                      BLOCK_H=64, **NO), I64, True, False, True),
    "qk_rope_cache_lora": (qrc._qk_rope_cache_kernel, dict(QK_STYLE=1, QK_W=True, V_STYLE=0,
                                                           BLOCK_H=64, **{**LORA, "LORA_K": 32}),
                           {**I64, "xa_ptr": F32, "bq_ptr": F32, "bk_ptr": F32, "bv_ptr": F32},
                           True, False, True),
    "qk_rope_cache_llama": (qrc._qk_rope_cache_kernel, dict(QK_STYLE=0, QK_W=False, V_STYLE=0,
                                                            BLOCK_H=64, **NO), I64, True, False,
                            False),  # no norm weights, no LoRA: nothing to load early
    "stage1": (pk._paged_attention_stage1, dict(NUM_SPLITS=4, MIN_SPLIT_TILES=0, DIRECT=False,
                                                **ST1), {**I64, "MidO": F32, "MidLse": F32},
               True, False, None),
    "stage1_direct": (pk._paged_attention_stage1, dict(NUM_SPLITS=1, MIN_SPLIT_TILES=4,
                                                       DIRECT=True, **ST1), I64, True, False,
                      None),
    "stage2": (pk._paged_attention_stage2, dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4,
                                                BLOCK_S=4), {"MidO": F32, "MidLse": F32},
               True, False, None),
    "stage1_direct_prefix": (pk._paged_attention_stage1, dict(NUM_SPLITS=1, MIN_SPLIT_TILES=4,
                                                              DIRECT=True, HAS_PREFIX=True,
                                                              **ST1), PRE, True, True, None),
    "stage2_prefix": (pk._paged_attention_stage2, dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4,
                                                       BLOCK_S=4, HAS_PREFIX=True),
                      {"MidO": F32, "MidLse": F32, **PRE}, True, False, None),
    "prefix": (pp._paged_attention_prefix, dict(GROUP=4, GMAX=8, BLOCK_H=32, HEAD_DIM=128,
                                                BLOCK_D=128, BLOCK_N=64, PAGE_SIZE=64,
                                                USE_SOFT_CAP=False, DOT_PRECISION="tf32"),
               {**PRE, "BlockTable": "*i64", "GroupRows": "*i32", "GroupLen": "*i32"}, True,
               False, None),
}
FLOATS = {"scale", "soft_cap", "scaling"}
GLOBAL_WRITE = re.compile(r"\\b(st|atom|red)\\.global|\\bcp\\.async")
GLOBAL_LOAD = re.compile(r"\\bld\\.global")
BUILDS = ((True, False), (False, False), (True, True))  # (USE_GDC, PREWAIT): on, off, early
for name, (kern, consts, ptrs, launches, w_first, w_early) in CASES.items():
    for gdc, pre in BUILDS if w_early is not None else BUILDS[:2]:
        c = {**consts, "USE_GDC": gdc, **({"PREWAIT": pre} if w_early is not None else {})}
        # pdl="prefetch" builds (EARLY_TRIGGER, PREFETCH): test_pdl_prefetch.py
        c.update({a: 0 for a in ("EARLY_TRIGGER", "PREFETCH") if a in kern.arg_names})
        # every other defaulted constexpr at its default (e.g. mlp_block's ROUND_TO, D_ROUND)
        c = {**{p.name: p.default for p in kern.params if p.is_constexpr and p.has_default}, **c}
        if "HAS_PREFIX" in kern.arg_names:  # the shared-prefix builds are cases of their own
            c.setdefault("HAS_PREFIX", False)
        sig = {a: "constexpr" if a in c else ptrs.get(a) or (
            "fp32" if a in FLOATS or a.startswith("eps") else
            "*bf16" if a.endswith("_ptr") or a[0].isupper() else "i32") for a in kern.arg_names}
        src = ASTSource(kern, signature=sig,
                        constexprs={(kern.arg_names.index(k),): v for k, v in c.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4}).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        launch = ptx.find("griddepcontrol.launch_dependents")
        if not gdc:
            assert "griddepcontrol" not in ptx, name
            continue
        assert wait >= 0 and ptx.count("griddepcontrol.wait") == 1, name
        assert (launch > wait) if launches else launch < 0, name
        before = ptx[:wait]  # the entry block up to the wait: runs before it
        assert not GLOBAL_WRITE.search(before), (name, GLOBAL_WRITE.findall(before))
        # on: only the skinny GEMM's first W tile; early: the kernel's weights, when it has any
        assert bool(GLOBAL_LOAD.search(before)) == (w_early if pre else w_first), (name, pre)
print("compiled")
"""


def test_kernels_ptx_wait_and_launch_for_sm90():
    """Every PDL kernel built for sm_90: with ``USE_GDC=True`` one ``griddepcontrol.wait`` with
    no global store, atomic or async copy before it and no global load before it except the
    skinny GEMM's first W tile (weights) and the shared-prefix stage 1's q and KV (complete
    before its grid launches: ``paged_decode_prefix``), then ``griddepcontrol.launch_dependents``; with
    ``USE_GDC=False`` neither instruction (the default build). The ``PREWAIT`` kernels
    (``pdl="early"``) also with ``USE_GDC=PREWAIT=True``: one wait, no store before it, and a
    global load before it exactly when the build has a weight (norm weights, LoRA B): none for
    a build whose weight slots are dummies (activation pointers)."""
    assert_compiles_for_sm90(_AOT)


# ------------------------------------------------------------------------------ GPU

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _pdl_launched(kernel) -> bool:
    """Whether Triton compiled ``kernel`` (a JITFunction) for a ``launch_pdl=True`` launch."""
    return any(k.metadata.launch_pdl for cache in kernel.device_caches.values()
               for k in cache[0].values())


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9 "
                    "(H100/H200); run on the H200 host")
def test_gpu_skinny_gemm_pdl_matches_off():
    """The PDL skinny GEMM (first W tile before the wait, the rest after) at Qwen3-4B's o_proj
    and down_proj shapes, batch 4 bf16, every candidate config: bit-identical to the plain
    launch, twice (the split-K counters are left at 0 for the next call)."""
    from nbhelpers.engine.kernels import skinny_gemm as sg
    torch.manual_seed(0)
    for n, k in ((2560, 4096), (2560, 9728)):
        x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for cfg in (sg.default_config(n, k), *sg.CONFIGS):
            if not sg.fits(cfg, 2, 232448):
                continue
            want = sg.skinny_gemm(x, w, None, cfg)
            with pdl.scope(True):
                got = [sg.skinny_gemm(x, w, None, cfg) for _ in range(2)]
            assert all(torch.equal(g, want) for g in got), (n, k, cfg)


GPU_CASES = {  # (model dtype, fp32 adapters, options, kernels expected to run)
    "fp32": (torch.float32, False, {}, ("_skinny_gemm", "_lora_expand_gemm")),
    "bf16_fp32_adapters": (torch.bfloat16, True, {"lora_dtype": "adapter"},
                           ("_skinny_gemm", "_lora_shrink_gemm", "_lora_expand_gemm")),
}
COMMON_KERNELS = ("_add_norm_kernel", "_act_mul_kernel", "_qk_rope_cache_kernel",
                  "_paged_attention_stage1", "_paged_attention_stage2")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9 "
                    "(H100/H200); run on the H200 host")
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_pdl_on_matches_off(monkeypatch, tmp_path, case):
    """Tiny Qwen3 with LoRA r=4: greedy tokens and logprobs of ``pdl="on"`` equal ``"off"``
    under CUDA graphs; decode launches are PDL launches, prefill's are not, and every decode
    kernel was compiled for ``launch_pdl=True``."""
    from nbhelpers.engine.kernels import (
        fused_norm,
        lora_expand,
        lora_shrink,
        paged_decode_kernel,
        qk_rope_cache,
        skinny_gemm,
    )
    dtype, autocast, opts, kernels = GPU_CASES[case]
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    _force_skinny(monkeypatch)
    model = peft_tiny(dtype, autocast)
    prompts = random_prompts(3, 5, 12, seed=2)
    outs = {}
    for mode in ("off", "on"):
        seen = _spy(monkeypatch) if mode == "on" else []
        llm = LLM(model, pdl=mode, **KERNEL_OPTS, **opts)
        assert llm.runner.pdl is (mode == "on")
        outs[mode] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)]
        assert llm.runner.timings["graph_captures"] > 0
    assert any(seen) and not all(seen)  # decode on, prefill off
    for (t_on, lp_on), (t_off, lp_off) in zip(outs["on"], outs["off"]):
        assert t_on == t_off
        torch.testing.assert_close(torch.tensor(lp_on), torch.tensor(lp_off), rtol=0, atol=1e-6)
    mods = (skinny_gemm, lora_expand, lora_shrink, fused_norm, qk_rope_cache, paged_decode_kernel)
    for name in (*kernels, *COMMON_KERNELS):
        kernel = next(getattr(m, name) for m in mods if hasattr(m, name))
        assert _pdl_launched(kernel), name


EARLY_KERNELS = {"triton": ("_lora_expand_gemm", "_add_norm_kernel", "_qk_rope_cache_kernel"),
                 "consumer": ("_act_mul_lora_kernel", "_add_norm_kernel",
                              "_qk_rope_cache_kernel")}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9 "
                    "(H100/H200); run on the H200 host")
@pytest.mark.parametrize("expand", list(EARLY_KERNELS))
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_pdl_early_matches_on(monkeypatch, tmp_path, case, expand):
    """Tiny Qwen3 with LoRA r=4: greedy tokens and logprobs of ``pdl="early"`` (weights before
    the wait) equal ``"on"`` under CUDA graphs, with the separate expand and with LoRA B in the
    consumers (``lora_expand="consumer"``); the decode launches of the ``PREWAIT`` kernels ask
    for it, prefill's do not, and each of them was compiled for ``launch_pdl=True``."""
    from test_pdl_early import _prewait_spy

    from nbhelpers.engine.kernels import fused_norm, lora_act_mul, lora_expand, qk_rope_cache
    dtype, autocast, opts, _ = GPU_CASES[case]
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    _force_skinny(monkeypatch)
    prewait = {}  # mode -> PREWAIT of each launch asking for it, from that mode's run on
    outs = greedy_per_mode(peft_tiny(dtype, autocast), ("on", "early"),
                           {**KERNEL_OPTS, "lora_expand": expand, **opts},
                           lambda mode: prewait.setdefault(mode, _prewait_spy(monkeypatch)))
    assert any(prewait["early"]) and not all(prewait["early"])  # decode early, prefill not
    # identical for fp32 and bf16: the H200 (n16a, 2026-12-02) gave bf16 logprobs up to 1.9e-3
    # apart while qk_rope_cache contracted its RoPE sums into an fma whose fused product
    # followed the load order (qk_rope_cache.FP_FUSION; the PTX: test_pdl_early_ptx.py)
    assert_same_greedy(outs["early"], outs["on"])
    mods = (lora_expand, lora_act_mul, fused_norm, qk_rope_cache)
    for name in EARLY_KERNELS[expand]:
        kernel = next(getattr(m, name) for m in mods if hasattr(m, name))
        assert _pdl_launched(kernel), name
