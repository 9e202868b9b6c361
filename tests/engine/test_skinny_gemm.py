"""The split-K skinny decode GEMM (``engine/kernels/skinny_gemm.py``) and its tuner
(``engine/kernels/skinny_gemm_tune.py``): results against an fp64 reference, the ticket counter's
reset, strided inputs, unsupported operands, the cache file's round trip, and (GPU) Qwen3-4B's
decode shapes. Engine-level tests: ``test_skinny_gemm_engine.py``.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); skipped when
triton is not importable.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton", reason="skinny_gemm needs the triton package")

from _kernels import DEV, assert_compiles_for_sm90, skip_unless_runnable

from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels import skinny_gemm_tune as tune

skip_unless_runnable(sg)
BF16 = torch.bfloat16


def _operands(m, n, k, dtype, bias, seed=0, row_pad=0):
    """``x [m, k]`` (a column slice of ``[m, k + row_pad]`` when ``row_pad``: row stride > k),
    ``W [n, k]``, ``bias [n]`` or None, and the fp64 reference ``x W^T + bias``."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(m, k + row_pad, generator=g).to(dtype).to(DEV)
    x = full[:, row_pad:]
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if bias else None
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    return x, w, b, ref


def _assert_matches(y, ref, dtype):
    """fp32: the fp64 result to fp32 summation; 16-bit: one rounding of an fp32 sum (<= 1 ulp,
    plus fp32 summation error near zero)."""
    assert y.dtype == dtype and y.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("m", [1, 3, 4, 16])
@pytest.mark.parametrize("n,k", [(100, 300), (130, 700)], ids=["n100_k300", "n130_k700"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("split", [1, 3])
def test_kernel_matches_reference_twice(m, n, k, dtype, bias, split):
    """N, K not multiples of the tiles; two calls in a row give the same bits (the last ticket
    reset the counters) and leave every counter at 0."""
    x, w, b, ref = _operands(m, n, k, dtype, bias)
    cfg = sg.Config(64, 128, split)
    got = sg.launch_split(k, cfg)[0]
    assert got == split  # k >= 300: three K tiles at least
    y1 = sg.skinny_gemm(x, w, b, cfg)
    y2 = sg.skinny_gemm(x, w, b, cfg)
    _assert_matches(y1, ref, dtype)
    assert torch.equal(y1, y2)
    if split > 1:
        assert not sg.workspace(x.device, n, split)[1].any()


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_strided_x_and_default_config(dtype):
    """x with row stride > K (a column slice), the default config (split > 1 for this K)."""
    x, w, b, ref = _operands(4, 96, 2048, dtype, True, seed=1, row_pad=40)
    assert x.stride() == (2088, 1)
    cfg = sg.default_config(96, 2048)
    assert sg.launch_split(2048, cfg)[0] > 1
    _assert_matches(sg.skinny_gemm(x, w, b), ref, dtype)


def test_splits_share_workspace_across_k():
    """Two GEMMs with one N and split but different K (o_proj / down_proj) reuse one workspace
    and counter array in turn, each correct."""
    for k in (512, 1152):
        x, w, _, ref = _operands(2, 80, k, torch.float32, False, seed=k)
        _assert_matches(sg.skinny_gemm(x, w, None, sg.Config(32, 128, 4)), ref, torch.float32)


def test_launch_split_never_empty():
    for k in (1, 64, 127, 128, 129, 300, 2560, 4096, 9728):
        for cfg in (*sg.CONFIGS, *sg.SMALL_N_CONFIGS):
            split, k_per = sg.launch_split(k, cfg)
            assert k_per % cfg.block_k == 0 and 1 <= split <= cfg.split
            assert (split - 1) * k_per < k <= split * k_per  # every split has work


def test_unsupported_operands():
    x, w, _, _ = _operands(65, 32, 64, torch.float32, False)
    assert not sg.supported(x, w)  # more than MAX_ROWS (64) rows: cuBLAS
    with pytest.raises(ValueError, match="use F.linear"):
        sg.skinny_gemm(x, w)
    x, w, _, _ = _operands(4, 32, 64, torch.float32, False)
    assert sg.supported(x, w)
    assert not sg.supported(x.t().contiguous().t(), w)  # column stride != 1
    assert not sg.supported(x, w.to(BF16))  # mixed dtypes
    assert not sg.supported(x.double(), w.double())
    assert not sg.supported(x, w, torch.zeros(31, device=DEV))


# ---------------------------------------------------------------------- the tuner


def test_shared_memory_estimate_prunes_what_cannot_launch():
    """The H200 run of 2026-12-01: Triton asked 294,912 B for n128/k256/3 stages in fp32 (limit
    232,448) and the tuner warned for every fp32 shape; such configs are now left out."""
    big = sg.Config(128, 256, 1, 8, 3)
    assert sg.shared_memory_bytes(big, 4) == 294912
    assert not sg.fits(big, 4, 232448) and sg.fits(big, 2, 232448)
    assert all(sg.fits(c, 2, 232448) for c in sg.CONFIGS)  # bf16: every candidate on the H200
    assert sg.fits(sg.default_config(2560, 9728), 4, 232448)  # the untuned default always runs


def test_shape_key_names_device_bucket_and_shape():
    key = tune.shape_key("cpu", 3, 6144, 2560, BF16, False)
    assert key.startswith(tune.device_name("cpu") + "|skinny|")
    assert key.endswith("|M4|N6144|K2560|bfloat16|bias0")
    assert [tune.m_bucket(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert tune.config_name(sg.Config(64, 128, 4)) == "n64_k128_s4_w4_st3"


def test_cache_round_trip(tmp_path, monkeypatch):
    """Times are stored per GEMM (``per_call``), the winner is served from the file in a new
    tuner without timing, and keys for two device names are kept apart."""
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    assert tune.cache_path() == tmp_path / "skinny_gemm.json"
    ms = {"cublas": 8.0, "n64_k128_s4_w4_st3": 6.0, "n128_k128_s1_w4_st3": 10.0}
    t = tune.SkinnyTuner(timer=lambda fn: ms[fn()])
    cands = {name: (lambda name=name: name) for name in ms}
    key_a, key_b = "H200|triton 3.6|skinny|M4|...", "NVIDIA A100|triton 3.6|skinny|M4|..."
    assert t.choose(key_a, cands, per_call=2) == "n64_k128_s4_w4_st3"
    table = json.loads(tune.cache_path().read_text())
    assert table[key_a] == {"choice": "n64_k128_s4_w4_st3",
                            "ms": {name: v / 2 for name, v in ms.items()}}

    def never(fn):
        raise AssertionError("a cached key was timed again")
    again = tune.SkinnyTuner(timer=never)
    assert again.choose(key_a, cands) == "n64_k128_s4_w4_st3"
    ms["cublas"] = 1.0  # another device: its own entry, its own winner
    assert tune.SkinnyTuner(timer=lambda fn: ms[fn()]).choose(key_b, cands) == "cublas"
    assert set(json.loads(tune.cache_path().read_text())) == {key_a, key_b}


def test_failed_candidate_is_never_chosen(tmp_path):
    def timer(fn):
        return fn()
    t = tune.SkinnyTuner(tmp_path / "c.json", timer)

    def broken():
        raise RuntimeError("out of resources")
    assert t.choose("k", {"cublas": lambda: 5.0, "bad": broken}) == "cublas"
    assert t.table["k"]["ms"]["bad"] == float("inf")


def test_corrupt_cache_is_replaced_with_a_warning(tmp_path):
    path = tmp_path / "skinny_gemm.json"
    for junk in ("{not json", "[1, 2]"):
        path.write_text(junk)
        with pytest.warns(UserWarning, match="not a JSON object"):
            t = tune.SkinnyTuner(path, timer=lambda fn: 1.0)
        assert t.choose("k", {"cublas": lambda: None}) == "cublas"
        assert json.loads(path.read_text())["k"]["choice"] == "cublas"


# -------------------------------------------------------- compiled builds and the GPU

_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import skinny_gemm as sg
fn = sg._skinny_gemm
ints = ["m", "n", "k", "stride_x", "stride_w", "stride_y", "k_per_split"]
for dt, split, bias in (("bf16", True, False), ("bf16", False, True), ("fp32", True, True)):
    sig = {"x_ptr": "*" + dt, "w_ptr": "*" + dt, "bias_ptr": "*" + dt, "y_ptr": "*" + dt,
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", **dict.fromkeys(ints, "i32")}
    consts = {"HAS_BIAS": bias, "SPLIT": split, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
              "UPCAST": False, "BF16_RNE": False, "USE_GDC": False, "PREFETCH": 0}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 3})
    assert kernel.asm["cubin"], (dt, split, bias)
    assert "atom" in kernel.asm["ptx"] or not split
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """The compiled kernel builds to an sm_90 cubin (bf16 ``tl.dot``, the ticket atomics, the
    counter reset) with triton's bundled ptxas, no GPU needed."""
    assert_compiles_for_sm90(_AOT)


QWEN3_4B = {"qkv": (6144, 2560), "qkv_ext_r32": (6240, 2560), "o": (2560, 4096),
            "o_ext_r32": (2592, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
            "down_ext_r32": (2592, 9728), "lm_head": (151936, 2560)}
"""(N, K) of Qwen3-4B's decode GEMMs (``/work/shared/tools/gemv_roofline.py``), plus qkv, o and
down with LoRA r32 A rows appended (the ``ext`` layout)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Qwen3-4B shapes need a CUDA GPU "
                    "(the interpreter would take minutes a shape); run on a GPU host")
@pytest.mark.parametrize("name", list(QWEN3_4B))
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_gpu_qwen3_4b_shapes(name, m):
    """Every candidate config and the default against the fp64 reference, in bf16, twice."""
    n, k = QWEN3_4B[name]
    x, w, _, ref = _operands(m, n, k, BF16, False, seed=m)
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    assert sg.fits(sg.default_config(n, k), 2, limit, sg.block_m(m))
    for cfg in (sg.default_config(n, k), *sg.CONFIGS, *sg.small_n_configs(n, k)):
        if not sg.fits(cfg, 2, limit, sg.block_m(m)):  # the tuner leaves these out too
            continue
        y = sg.skinny_gemm(x, w, None, cfg)
        _assert_matches(y, ref, BF16)
        assert torch.equal(y, sg.skinny_gemm(x, w, None, cfg)), cfg  # deterministic


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuning times on a CUDA GPU (on the "
                    "CPU the default config is used untimed); run on a GPU host")
def test_gpu_tuner_records_choice(tmp_path, monkeypatch):
    from nbhelpers.engine.skinny_linear import SkinnyLinear
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_TUNER", None)
    x, w, _, ref = _operands(4, 2560, 4096, BF16, False)
    route = SkinnyLinear("triton")
    with route.decoding():
        _assert_matches(route(x, w), ref, BF16)
    entry = json.loads(tune.cache_path().read_text())[tune.shape_key(x.device, 4, 2560, 4096,
                                                                     BF16, False)]
    assert entry["choice"] in entry["ms"] and tune.CUBLAS in entry["ms"]
    assert torch.cuda.get_device_name() in next(iter(json.loads(
        tune.cache_path().read_text())))
