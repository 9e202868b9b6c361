"""Fused elementwise kernels (``engine/kernels/fused_norm.py``, ``qk_rope_cache.py``) against the
torch reference (``engine/fused.py``'s functions, HF's Gemma4RMSNorm) and the engine with
``fused_elementwise="triton"`` against the default path.

On the CPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``); the ``gpu`` test runs them compiled at Qwen3-4B shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need the triton package")

from _kernels import DEV, skip_unless_runnable
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import fused
from nbhelpers.engine.kernels import fused_norm as fn
from nbhelpers.engine.kernels import qk_rope_cache as qrc

skip_unless_runnable(fn)
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype, scale=None):
    """fp32: rounding-order differences only (sum order of the mean, rsqrt vs pow) -> 1e-5.
    bf16: the torch path rounds 2-4 times per element (norm, weight product, RoPE products and
    sum); each rounding here may differ by one bf16 ulp (2^-8 to 2^-7 relative, by where the value
    sits in its binade; the interpreter truncates where torch rounds to nearest even), so 3 ulps
    at the binade's bottom (3 * 2^-7) relative plus a small absolute floor. RoPE sums two rounded
    products that can cancel, so there the floor is one ulp of the largest operand, ``scale``
    (``max |x|``), not of the result."""
    if dtype == torch.float32:
        return {"atol": 1e-5 * (1 if scale is None else max(1.0, float(scale))), "rtol": 1e-5}
    return {"atol": 2e-2 if scale is None else 2 ** -7 * float(scale), "rtol": 3 * 2 ** -7}


def _randn(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEV)


def _gemma_norm(x, w, eps):
    """HF ``Gemma4RMSNorm`` (transformers 5.17 modeling_gemma4.py lines 197-215)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    mod = Gemma4RMSNorm(x.shape[-1], eps=eps, with_scale=w is not None).to(DEV)
    if w is not None:
        mod.weight.data = w.float()
    return mod(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 96), (3, 2560)])
def test_add_rms_norm_matches_fused_py(dtype, rows, n):
    x, d = _randn(1, rows, n, dtype=dtype), _randn(1, rows, n, dtype=dtype, seed=1)
    w = _randn(n, dtype=dtype, seed=2, scale=0.3) + 1
    ref_x, ref_h = fused.add_rms_norm(x, d, w, 1e-6)
    res, out = fn.add_norm(d, x, out_norm=(w, 1e-6, "llama"))
    torch.testing.assert_close(res, ref_x, **_tol(dtype))
    torch.testing.assert_close(out, ref_h, **_tol(dtype))
    _, only = fn.add_norm(x, out_norm=(w, 1e-6, "llama"), store_res=False)
    torch.testing.assert_close(only, fused.rms_norm(x, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [True, False])
def test_gemma_sandwich_norms_match_hf(dtype, with_scale):
    """``(x + post(h)) * s`` then ``pre(.)``: Gemma-4's residual pattern, HF's module as reference."""
    rows, n = 4, 80
    x, h = _randn(1, rows, n, dtype=dtype), _randn(1, rows, n, dtype=dtype, seed=1, scale=3.0)
    w1 = _randn(n, dtype=dtype, seed=2) if with_scale else None
    w2 = _randn(n, dtype=dtype, seed=3)
    s = torch.tensor([0.7], dtype=dtype, device=DEV)
    ref_x = (x + _gemma_norm(h, w1, 1e-6)) * s
    ref_o = _gemma_norm(ref_x, w2, 1e-6)
    res, out = fn.add_norm(h, x, out_norm=(w2, 1e-6, "gemma"), delta_norm=(w1, 1e-6, "gemma"),
                           scale=s)
    torch.testing.assert_close(res, ref_x, **_tol(dtype))
    torch.testing.assert_close(out, ref_o, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_on_gate_up_views(dtype, act):
    """gate/up as the two halves of one ``[1, T, 2I]`` output (row stride 2I), odd I."""
    gu = _randn(1, 3, 2 * 1500, dtype=dtype, scale=3.0)
    gate, up = gu.split(1500, -1)
    if act == "silu":
        ref = fused.silu_mul(gate, up)
    else:
        ref = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(fn.act_mul(gate, up, act), ref, **_tol(dtype))


def _rope_case(t, h, hkv, d, dtype, seed=0):
    """Random q/k/v as split views of one qkv output, cos/sin from real RoPE angles at
    scattered positions, a small paged pool and distinct slots."""
    qkv = _randn(1, t, (h + 2 * hkv) * d, dtype=dtype, seed=seed, scale=2.0)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], -1)
    pos = torch.tensor([0, 7, 63, 300, 1999][:t] + list(range(1000, 1000 + max(0, t - 5))))
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)[None]
    cos, sin = ang.cos().to(dtype).to(DEV), ang.sin().to(dtype).to(DEV)
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(seed))[:t].to(DEV)
    cache = [torch.zeros(1, hkv, 8 * 16, d, dtype=dtype, device=DEV) for _ in range(2)]
    return q, k, v, cos, sin, slots, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,hkv,d", [(1, 4, 2, 16), (3, 7, 1, 32), (5, 5, 5, 64),
                                       (6, 6, 2, 128)],
                         ids=["gqa2", "odd_heads_mqa", "mha_odd", "gqa3_d128"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_norm_rope_cache_matches_fused_py(dtype, t, h, hkv, d, qk_norm):
    q, k, v, cos, sin, slots, (kc, vc) = _rope_case(t, h, hkv, d, dtype)
    wq = _randn(d, dtype=dtype, seed=5) if qk_norm else None
    wk = _randn(d, dtype=dtype, seed=6) if qk_norm else None
    rq, rk = fused.qk_norm_rope(q.view(1, t, h, d), k.view(1, t, hkv, d), wq, wk, 1e-6, cos, sin)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    ref_k[0].index_copy_(1, slots, rk[0])
    ref_v[0].index_copy_(1, slots, v.view(1, t, hkv, d).transpose(1, 2)[0])
    out = qrc.qk_norm_rope_cache(q, k, v, h, hkv, d, cos, sin, kc, vc, slots,
                                 qk_norm=(wq, wk, 1e-6, "llama") if qk_norm else None)
    torch.testing.assert_close(out, rq[0].transpose(0, 1), **_tol(dtype, rq.abs().max()))
    torch.testing.assert_close(kc, ref_k, **_tol(dtype, rk.abs().max()))
    torch.testing.assert_close(vc, ref_v, rtol=0, atol=0)  # v is copied, no math


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True], ids=["store_layer", "kv_shared_layer"])
def test_gemma_qkv_norms_match_hf(dtype, shared):
    """Gemma-4: q_norm/k_norm with weight, v_norm without, fp32-style norm; shared: q only."""
    from nbhelpers.engine.fused import rope
    t, h, hkv, d = 3, 4, 1, 32
    q, k, v, cos, sin, slots, (kc, vc) = _rope_case(t, h, hkv, d, dtype, seed=3)
    wq, wk = _randn(d, dtype=dtype, seed=5), _randn(d, dtype=dtype, seed=6)
    rq = rope(_gemma_norm(q.reshape(1, t, h, d), wq, 1e-6).transpose(1, 2), cos, sin)
    rk = rope(_gemma_norm(k.reshape(1, t, hkv, d), wk, 1e-6).transpose(1, 2), cos, sin)
    rv = _gemma_norm(v.reshape(1, t, hkv, d), None, 1e-6).transpose(1, 2)
    out = qrc.qk_norm_rope_cache(q, None if shared else k, v, h, hkv, d, cos, sin, kc, vc, slots,
                                 qk_norm=(wq, wk, 1e-6, "gemma"), v_norm=(1e-6, "gemma"))
    torch.testing.assert_close(out, rq[0].transpose(0, 1), **_tol(dtype, rq.abs().max()))
    if shared:
        assert not kc.any() and not vc.any()
    else:
        torch.testing.assert_close(kc[0][:, slots], rk[0], **_tol(dtype, rk.abs().max()))
        torch.testing.assert_close(vc[0][:, slots], rv[0], **_tol(dtype))


def _greedy(model, prompts, **options):
    from nbhelpers.engine import LLM
    # page_size 64: one the CUDA flex kernels serve too (kv_cache.check_page_size)
    llm = LLM(model, page_size=64, num_pages=16, max_model_len=256, **options)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return llm, [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_greedy_tokens_match_with_fused_kernels(arch):
    """Tiny fp32 Qwen3 / Llama: ``fused_elementwise="triton"`` (interpreter on the CPU) gives the
    default path's greedy tokens and logprobs (fp32: |dlogprob| < 1e-4), and its decode step
    counts fewer ops per layer (``bench.profile.count_decode_ops``)."""
    from nbhelpers.bench.profile import count_decode_ops
    model = tiny_model(arch).to(DEV)
    prompts = random_prompts(3, 5, 17, seed=2)
    base_llm, base = _greedy(model, prompts, fused_elementwise="off")  # auto: triton on CUDA
    fused_llm, got = _greedy(model, prompts, fused_elementwise="triton")
    assert fused_llm.runner.model.fx_decode.kind == "triton"
    for (bt, blp), (gt, glp) in zip(base, got):
        assert gt == bt
        assert max(abs(a - b) for a, b in zip(blp, glp)) < 1e-4
    before = count_decode_ops(base_llm, batch=3)["ops_per_layer"]
    after = count_decode_ops(fused_llm, batch=3)["ops_per_layer"]
    assert after < before, (before, after)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")
def test_gpu_qwen3_4b_shapes_match_torch():
    """Qwen3-4B decode shapes (hidden 2560, 32 q / 8 kv heads, D 128, I 9728), batch 32, bf16."""
    dtype, t, h, hkv, d = torch.bfloat16, 32, 32, 8, 128
    x, dl = _randn(1, t, 2560, dtype=dtype), _randn(1, t, 2560, dtype=dtype, seed=1)
    w = _randn(2560, dtype=dtype, seed=2)
    for got, ref in zip(fn.add_norm(dl, x, out_norm=(w, 1e-6, "llama")),
                        fused.add_rms_norm(x, dl, w, 1e-6)):
        torch.testing.assert_close(got, ref, **_tol(dtype))
    gate, up = _randn(1, t, 2 * 9728, dtype=dtype, scale=3.0).split(9728, -1)
    torch.testing.assert_close(fn.act_mul(gate, up), fused.silu_mul(gate, up), **_tol(dtype))
    test_qk_norm_rope_cache_matches_fused_py(dtype, t, h, hkv, d, True)


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import fused_norm as fn, lora_act_mul as lam, qk_rope_cache as qrc
NO_LORA = dict(HAS_LORA=False, LORA_K=4, LORA_RNE=False, USE_GDC=False,
               PREWAIT=False)  # PDL: test_pdl.py
LORA = dict(HAS_LORA=True, LORA_K=4, LORA_RNE=False, USE_GDC=False,
            PREWAIT=False)  # lora_expand="consumer"
cases = [
    (fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=0, D_W=False, HAS_SCALE=False, STORE_RES=True,
                               O_STYLE=1, O_W=True, BLOCK=4096, **NO_LORA)),
    (fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=0, D_W=False, HAS_SCALE=False, STORE_RES=True,
                               O_STYLE=1, O_W=True, BLOCK=4096, **LORA)),
    (fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=2, D_W=False, HAS_SCALE=True, STORE_RES=True,
                               O_STYLE=2, O_W=True, BLOCK=2048, **NO_LORA)),
    (fn._act_mul_kernel, dict(ACT=0, BLOCK=1024, USE_GDC=False)),
    (lam._act_mul_lora_kernel, dict(ACT=0, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32, DOT_FP32=False,
                                    RNE=False, USE_GDC=False, PREWAIT=False)),  # consumer
    (fn._act_mul_kernel, dict(ACT=1, BLOCK=1024, USE_GDC=False)),
    (qrc._qk_rope_cache_kernel, dict(QK_STYLE=1, QK_W=True, V_STYLE=0, BLOCK_H=64, **NO_LORA)),
    (qrc._qk_rope_cache_kernel, dict(QK_STYLE=1, QK_W=True, V_STYLE=0, BLOCK_H=64,
                                     **{**LORA, "LORA_K": 32})),
    (qrc._qk_rope_cache_kernel, dict(QK_STYLE=0, QK_W=False, V_STYLE=0, BLOCK_H=64, **NO_LORA)),
    (qrc._qk_rope_cache_kernel, dict(QK_STYLE=2, QK_W=True, V_STYLE=2, BLOCK_H=256, **NO_LORA)),
]
for dt in ("bf16", "fp32"):
    for kern, consts in cases:
        consts = {**consts, **dict.fromkeys(  # pdl="prefetch" builds: test_pdl_prefetch.py
            [a for a in ("EARLY_TRIGGER",) if a in kern.arg_names], False)}
        consts = {**{p.name: p.default for p in kern.params  # other defaulted constexprs
                     if p.is_constexpr and p.has_default}, **consts}
        sig = {a: ("*i64" if a == "slot_ptr" else "*" + dt) if a.endswith("_ptr") else
               "fp32" if a.startswith("eps") or a == "scaling" else "i32"
               for a in kern.arg_names}
        sig.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(kern, signature=sig,
                        constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert k.asm["cubin"], (kern, consts, dt)
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """The compiled (non-interpreted) kernels build to sm_90 cubins with triton's bundled ptxas,
    no GPU needed: every norm style, both activations, bf16 and fp32, with and without the
    LoRA prologue (``lora_expand="consumer"``, B of the model dtype here)."""
    from _kernels import assert_compiles_for_sm90
    assert_compiles_for_sm90(_AOT)


@pytest.mark.parametrize("variant", ["e2b_like", "no_ple_no_sharing", "k_eq_v"])
def test_gemma4_greedy_tokens_match_with_fused_kernels(variant):
    """Tiny fp32 Gemma-4 (randomised norms and layer_scalar; KV sharing, per-layer inputs, V = K
    on full layers): the fused decode (one ``add_norm`` per norm/residual pair, one q/k/v norm +
    RoPE + KV-write launch per layer) gives the module path's greedy tokens and logprobs.
    The fused run takes the Triton paged decode, as ``decode_attention="auto"`` does on CUDA
    (the H200 run: it read ``config.num_key_value_heads``, which raises for ``k_eq_v``)."""
    from test_gemma4 import tiny_gemma4
    model = tiny_gemma4(variant).to(DEV)
    prompts = random_prompts(3, 5, 17, seed=4, vocab=model.config.vocab_size)
    _, base = _greedy(model, prompts, fused_elementwise="off")  # auto: triton on CUDA
    llm, got = _greedy(model, prompts, fused_elementwise="triton", decode_attention="triton")
    engine = llm.runner.model
    assert engine.fx_decode.kind == "triton" and llm.runner.paged_decode is not None
    assert engine.kv_heads == [engine.allocate_kv(1, 64).k[i].shape[1]
                               for i in range(len(engine.layers))]
    assert llm.runner.paged_decode.num_kv_heads == max(engine.kv_heads)
    for (bt, blp), (gt, glp) in zip(base, got):
        assert gt == bt
        assert max(abs(a - b) for a, b in zip(blp, glp)) < 1e-4


def test_failed_capture_swaps_the_triton_pieces_for_eager(monkeypatch):
    """A failed graph capture with ``fused_elementwise="triton"`` retries with the eager pieces
    (``decode_graphs``: ``fx_decode.compiled`` is True for the Triton kind), then decodes without
    a graph; sampled tokens equal those of the engine it falls back to: eager pieces, flex
    decode, no graph (tiny Qwen3; on the CPU the capture is simulated, so LLM's CUDA-device
    check of ``use_cuda_graphs=True`` is lifted there)."""
    from nbhelpers.engine import LLM, model_runner
    from nbhelpers.engine import llm as llm_module
    model = tiny_model("qwen3").to(DEV)
    params = SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=6, ignore_eos=True,
                            seed=7, n=2)
    # page_size 64: one the CUDA flex kernels serve too (kv_cache.check_page_size)
    prompts, opts = random_prompts(2, 5, 12, seed=4), {"page_size": 64, "num_pages": 6,
                                                       "max_model_len": 96,
                                                       "decode_attention": "flex",
                                                       "compile_layers": False}
    want = LLM(model, use_cuda_graphs=False, fused_elementwise="off", **opts).generate(
        prompts, params)

    def fail(*args):
        raise RuntimeError("simulated capture failure")
    monkeypatch.setattr(model_runner, "capture_graph", fail)
    if DEV == "cpu":
        monkeypatch.setattr(llm_module, "check_cuda_graphs", lambda *args: None, raising=False)
    llm = LLM(model, use_cuda_graphs=True, fused_elementwise="triton", **opts)
    assert llm.runner.model.fx_decode.kind == "triton"
    with pytest.warns(UserWarning):
        got = llm.generate(prompts, params)
    assert llm.runner.model.fx_decode is llm.runner.model.fx_eager
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_auto_is_triton_on_cuda_and_bad_values_are_clear():
    """``auto`` = the Triton pieces on CUDA (H200 A/B of 2026-12-01, RunnerOptions docstring),
    elsewhere compiled pieces iff ``compile_layers``, else eager."""
    from nbhelpers.engine.runner_options import RunnerOptions
    from nbhelpers.engine.runner_resolve import resolve_fused_elementwise
    assert resolve_fused_elementwise(RunnerOptions(), compile_layers=True, on_cuda=True) == \
        "triton"
    assert resolve_fused_elementwise(RunnerOptions(), compile_layers=True) == "compile"
    assert resolve_fused_elementwise(RunnerOptions(), compile_layers=False) == "off"
    opt = RunnerOptions(fused_elementwise="compile")
    assert resolve_fused_elementwise(opt, compile_layers=True, on_cuda=True) == "compile"
    opt = RunnerOptions(fused_elementwise="triton")
    assert resolve_fused_elementwise(opt, compile_layers=False) == "triton"
    with pytest.raises(ValueError, match="fused_elementwise='fast'"):
        RunnerOptions(fused_elementwise="fast")
