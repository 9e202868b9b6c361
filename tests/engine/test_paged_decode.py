"""Triton paged decode attention (``engine/kernels/paged_decode.py``) vs a dense PyTorch reference.

Runs the kernels in Triton's CPU interpreter on CPU-only hosts (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before anything imports triton), compiled on a GPU host; skipped when
triton is not installed. Tolerances: fp32 ``1e-5`` (abs/rel; the
interpreter's ``tl.dot`` is numpy fp32), bf16 ``2e-2`` abs (P is rounded to bf16 before ``P @ V``,
as in every flash kernel; outputs are ``O(1)``), both against an fp32 reference.
"""

from __future__ import annotations

import os

import pytest
import torch
from _kernels import fp32_interpreter_dots
from _tiny import random_prompts, tiny_model

pytest.importorskip("triton", reason="triton not installed (pip install triton)")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py without CUDA
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from nbhelpers.engine.kernels import paged_decode
from nbhelpers.engine.kernels.paged_decode import (
    choose_num_splits,
    paged_decode_attention,
    plan_num_splits,
)

if INTERPRET and type(paged_decode._paged_attention_stage1).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (see tests/conftest.py)",
                allow_module_level=True)
DEV = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def _interpreter_bf16_dot(monkeypatch):
    """bf16 ``tl.dot`` operands as fp32 in the CPU interpreter (``_kernels.fp32_interpreter_dots``)."""
    if DEV == "cpu":
        fp32_interpreter_dots(monkeypatch)


def reference(q, k_cache, v_cache, block_table, seq_lens, scale, page_size, window=None,
              soft_cap=None):
    """Dense softmax attention per row over the gathered pages (fp32), GQA by repeat."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    outs = []
    for b, length in enumerate(seq_lens.tolist()):
        pages = block_table[b, :-(-length // page_size)].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:length]
        k = k_cache[0][:, slots].float().repeat_interleave(heads // kv_heads, 0)  # [H, L, D]
        v = v_cache[0][:, slots].float().repeat_interleave(heads // kv_heads, 0)
        s = torch.einsum("hd,hld->hl", q[b].float(), k) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        if window:
            s[:, :max(0, length - window)] = float("-inf")
        outs.append(torch.einsum("hl,hld->hd", s.softmax(-1), v))
    return torch.stack(outs)


def make_case(lens, heads=4, kv_heads=2, dim=16, page_size=16, dtype=torch.float32, seed=0):
    """Random pool with pages handed out shuffled (non-contiguous block tables)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 3
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 = null page
    width = max(need) + 1
    block_table = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(need):
        block_table[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    shape = (1, kv_heads, num_pages * page_size, dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, block_table, torch.tensor(lens)


CASES = {  # lens, kwargs of make_case, kernel options
    "ragged_mid_page": ([5, 23, 40], {}, {"num_splits": 3}),
    "page_multiple": ([32, 16], {}, {"num_splits": 2}),
    "one_split": ([1, 33], {}, {"num_splits": 1}),
    "more_splits_than_tiles": ([3, 17], {}, {"num_splits": 4}),
    "gqa_8_to_1": ([29, 50], {"heads": 8, "kv_heads": 1}, {"num_splits": 2}),
    "block_n_spans_pages": ([45, 70], {"page_size": 8}, {"num_splits": 2, "block_n": 16}),
    "head_dim_not_pow2": ([20, 37], {"dim": 24}, {"num_splits": 2}),
    "window": ([9, 40, 61], {}, {"num_splits": 3, "sliding_window": 20}),
    "soft_cap": ([18, 47], {}, {"num_splits": 2, "soft_cap": 2.0}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_fp32(name):
    lens, case_kw, opts = CASES[name]
    q, k, v, bt, seq_lens = make_case(lens, **case_kw)
    page_size = case_kw.get("page_size", 16)
    scale = q.shape[-1] ** -0.5
    out = paged_decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), bt.to(DEV), seq_lens.to(DEV),
                                 scale, page_size, **opts)
    ref = reference(q, k, v, bt, seq_lens, scale, page_size, opts.get("sliding_window"),
                    opts.get("soft_cap"))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (24, 5.0)])
def test_matches_reference_bf16(window, soft_cap):
    q, k, v, bt, seq_lens = make_case([7, 32, 55], heads=8, kv_heads=2, dim=32,
                                      dtype=torch.bfloat16, seed=1)
    out = paged_decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), bt.to(DEV), seq_lens.to(DEV),
                                 0.2, 16, num_splits=2, sliding_window=window, soft_cap=soft_cap)
    assert out.dtype == torch.bfloat16
    ref = reference(q, k, v, bt, seq_lens, 0.2, 16, window, soft_cap)
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=0)


def test_strided_q_as_the_engine_passes_it():
    """The engine hands ``q[0].transpose(0, 1)`` of ``[1, H, B, D]``: strides (D, B*D, 1)."""
    q, k, v, bt, seq_lens = make_case([12, 30])
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    out = paged_decode_attention(strided.to(DEV), k.to(DEV), v.to(DEV), bt.to(DEV),
                                 seq_lens.to(DEV), 0.25, 16, num_splits=2)
    ref = reference(q, k, v, bt, seq_lens, 0.25, 16)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_value_errors():
    q, k, v, bt, seq_lens = make_case([4])
    with pytest.raises(ValueError, match="H % H_kv"):
        paged_decode_attention(q[:, :3], k, v, bt, seq_lens, 1.0, 16, num_splits=1)
    with pytest.raises(ValueError, match="BLOCK_N=24"):
        paged_decode_attention(q, k, v, bt, seq_lens, 1.0, 16, num_splits=1, block_n=24)


def test_split_heuristic():
    assert choose_num_splits(32, 8, 726, num_sms=132) == 3  # Qwen3-4B, workload W, H200
    assert choose_num_splits(1, 8, 1024, num_sms=132) == 16  # capped by MAX_SPLITS
    assert choose_num_splits(1, 8, 100, num_sms=132) == 2  # no split under 64 tokens
    assert choose_num_splits(512, 8, 4096, num_sms=132) == 1


def test_v2_split_plan_fills_two_waves_of_sms():
    """``B * H_kv * S >= 2 * 132`` programs, capped by MAX_SPLITS and 128-token splits."""
    assert plan_num_splits(32, 8, 1024, num_sms=132) == 2  # Qwen3-4B batch 32: 512 programs
    assert plan_num_splits(64, 8, 1024, num_sms=132) == 1  # 512 programs: no stage 2
    assert plan_num_splits(4, 8, 1024, num_sms=132) == 8  # 9 wanted; 1024 / 128 tokens caps it
    assert plan_num_splits(4, 8, 2048, num_sms=132) == 9  # 288 programs
    assert plan_num_splits(32, 1, 1024, num_sms=132) == 8  # Gemma-4 E2B, 1 KV head
    assert plan_num_splits(1, 1, 8192, num_sms=132) == 16  # MAX_SPLITS
    assert plan_num_splits(1, 1, 300, num_sms=132) == 3  # ceil(300 / 128)
    assert plan_num_splits(8, 8, 2048, num_sms=132, waves=4) == 9
    for b, h, n in [(1, 1, 1), (3, 2, 50), (200, 8, 4096), (16, 4, 700)]:
        s = plan_num_splits(b, h, n, num_sms=132)
        assert 1 <= s <= 16 and (b * h * s >= 264 or s == min(16, -(-n // 128)))
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_num_splits(0, 8, 1024, num_sms=132)


V2_CASES = [  # (heads, kv_heads, dim, lens, num_splits, extra kwargs): GQA 1/4/8, D 64..512
    (2, 2, 64, [5, 37, 70], 3, {}),
    (8, 2, 64, [16, 49], 2, {"sliding_window": 20}),
    (8, 1, 128, [1, 33, 64], 4, {"min_split_tokens": 16}),
    (4, 1, 128, [23, 80], 1, {}),  # one split: stage 1 writes the output
    (4, 4, 256, [17, 41], 2, {"sliding_window": 24, "min_split_tokens": 16}),
    (8, 1, 256, [9, 50], 3, {"soft_cap": 3.0}),
    (2, 1, 512, [3, 35], 2, {"sliding_window": 16}),
]


@pytest.mark.parametrize("case", range(len(V2_CASES)))
@pytest.mark.parametrize("kernel", ["v1", "v2"])
def test_kernels_match_reference_over_gqa_and_head_dims(case, kernel):
    """fp32, shuffled pages, lengths off the page; v2 with few tokens per split (more empty
    splits) and the one-launch path. Both kernels at every head dim Gemma-4 / Qwen3 use."""
    heads, kv_heads, dim, lens, splits, kw = V2_CASES[case]
    if kernel == "v1":
        kw = {k: v for k, v in kw.items() if k != "min_split_tokens"}
    q, k, v, bt, seq_lens = make_case(lens, heads=heads, kv_heads=kv_heads, dim=dim, seed=case)
    out = paged_decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), bt.to(DEV), seq_lens.to(DEV),
                                 dim ** -0.5, 16, splits, kernel=kernel, **kw)
    ref = reference(q, k, v, bt, seq_lens, dim ** -0.5, 16, kw.get("sliding_window"),
                    kw.get("soft_cap"))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_v2_bf16_gqa4_window(splits):
    q, k, v, bt, seq_lens = make_case([7, 40, 66], heads=8, kv_heads=2, dim=64,
                                      dtype=torch.bfloat16, seed=5)
    out = paged_decode_attention(q.to(DEV), k.to(DEV), v.to(DEV), bt.to(DEV), seq_lens.to(DEV),
                                 0.125, 16, splits, sliding_window=30, kernel="v2",
                                 min_split_tokens=16)
    assert out.dtype == torch.bfloat16
    ref = reference(q, k, v, bt, seq_lens, 0.125, 16, 30)
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=0)


def test_auto_kernel_picks_v1_for_small_batches_and_v2_from_16():
    """``kernel="auto"`` (the default): v1 under ``V2_MIN_BATCH`` rows, v2 from there, and the
    split count of a bucket follows the kernel it picked."""
    from types import SimpleNamespace

    from nbhelpers.engine.kernels.paged_decode import V2_MIN_BATCH, PagedDecode, pick_kernel
    assert paged_decode.DEFAULT_KERNEL == "auto" and V2_MIN_BATCH == 16
    assert [pick_kernel("auto", b) for b in (1, 4, 15, 16, 64)] == ["v1"] * 3 + ["v2"] * 2
    assert pick_kernel("v1", 64) == "v1" and pick_kernel("v2", 1) == "v2"
    with pytest.raises(ValueError, match=r"\['kernel'\]='v3'.*'auto'"):
        pick_kernel("v3", 4)
    spec = SimpleNamespace(mask_for_layer=lambda i: None, attn_score_mod=None)
    pd = PagedDecode(spec, 1, 8, 64, 1024, "cpu", {"kernel": "auto"})
    pd.num_sms = 132  # the H200's SM count, so the planners give their documented numbers
    assert pd.splits_for(4) == choose_num_splits(4, 8, 1024, num_sms=132)
    assert pd.splits_for(32) == plan_num_splits(32, 8, 1024, num_sms=132)
    with pytest.raises(ValueError, match=r"\['kernel'\]='v9'"):
        PagedDecode(spec, 1, 8, 64, 1024, "cpu", {"kernel": "v9"})


def test_unknown_kernel_is_a_value_error():
    q, k, v, bt, seq_lens = make_case([4])
    with pytest.raises(ValueError, match="kernel='v3'"):
        paged_decode_attention(q, k, v, bt, seq_lens, 1.0, 16, 1, kernel="v3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")
@pytest.mark.parametrize("kernel", ["v1", "v2"])
@pytest.mark.parametrize("shape", [(32, 8, 128, None), (32, 1, 256, 512), (32, 1, 512, None)])
def test_gpu_model_shapes_match_torch(kernel, shape):
    """Qwen3-4B (32 q / 8 kv heads, D 128) and Gemma-4 E2B sliding / full layers (8 q / 1 kv
    head, D 256 window 512 / D 512), batch 32, ragged contexts ~400-1000, page 64, bf16."""
    heads, kv_heads, dim, window = shape
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(380, 1000, (32,), generator=g).tolist()
    q, k, v, bt, seq_lens = make_case(lens, heads=heads, kv_heads=kv_heads, dim=dim,
                                      page_size=64, dtype=torch.bfloat16)
    splits = (plan_num_splits(32, kv_heads, 1024, 132) if kernel == "v2"
              else choose_num_splits(32, kv_heads, 1024, 132))
    out = paged_decode_attention(q.cuda(), k.cuda(), v.cuda(), bt.cuda(), seq_lens.cuda(),
                                 dim ** -0.5, 64, splits, sliding_window=window, kernel=kernel)
    ref = reference(q, k, v, bt, seq_lens, dim ** -0.5, 64, window)
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=0)


# ---------------------------------------------------------------- the engine option
# The tiny engine models live on the CPU; on a GPU host bench_flex.py's parity stage
# (``--decode-attention triton``) checks the engine with the compiled kernel and CUDA graphs.
engine_on_cpu = pytest.mark.skipif(not INTERPRET, reason="CPU engine tests need the interpreter")


def _greedy(model, n_new=10, **options):
    """``(uses_triton_kernel, completions)`` of the engine on three ragged prompts."""
    from nbhelpers.config import SamplingParams
    from nbhelpers.engine import LLM
    prompts = random_prompts(3, 5, 40, seed=3)  # ends mid-page and crosses pages (page 16)
    llm = LLM(model, page_size=16, num_pages=64, max_model_len=128, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n_new,
                                                ignore_eos=True))
    return llm.runner.paged_decode is not None, outs


@engine_on_cpu
@pytest.mark.parametrize("kernel_options", [None, {"num_splits": 3, "BLOCK_N": 16}])
def test_engine_triton_greedy_matches_flex(kernel_options):
    """Same greedy tokens; logprobs within 1e-4 (fp32 tiny Qwen3, 2 layers, GQA 4/2, D 16)."""
    model = tiny_model("qwen3")
    _, flex = _greedy(model)
    used, tri = _greedy(model, decode_attention="triton", decode_kernel_options=kernel_options)
    assert used
    for a, b in zip(flex, tri):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@engine_on_cpu
def test_engine_triton_sliding_window_matches_flex():
    """Qwen3 with a sliding layer (window 8) and a full one: the window reaches the kernel.

    The tiny model's greedy tokens do not change with the window, its logprobs do (by 0.18
    measured): so logprobs are compared too."""
    from nbhelpers.engine.model_runner import ModelRunner, RunnerOptions
    model = tiny_model("qwen3")
    model.config.sliding_window = 8
    model.config.layer_types = ["sliding_attention", "full_attention"]
    runner = ModelRunner(model, RunnerOptions(page_size=16, num_pages=8, max_model_len=64,
                                              decode_attention="triton"))
    assert runner.paged_decode.windows == [8, None]
    _, flex = _greedy(model, n_new=12)
    _, tri = _greedy(model, n_new=12, decode_attention="triton")
    for a, b in zip(flex, tri):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@engine_on_cpu
@pytest.mark.parametrize("kernel", ["v1", "v2"])
def test_gemma4_triton_greedy_matches_flex(kernel):
    """Tiny Gemma-4 (sliding window 16, head dims 16 / 32, layers 2-3 read layers 0-1's KV,
    PLE, soft-capped logits): same greedy tokens as flex, logprobs within 1e-4 (fp32)."""
    from test_gemma4 import tiny_gemma4
    model = tiny_gemma4()
    _, flex = _greedy(model, n_new=8)
    used, tri = _greedy(model, n_new=8, decode_attention="triton",
                        decode_kernel_options={"kernel": kernel, "min_split_tokens": 16})
    assert used
    for a, b in zip(flex, tri):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@engine_on_cpu
def test_engine_unknown_triton_kernel_option_is_a_value_error():
    from nbhelpers.engine import LLM
    with pytest.raises(ValueError, match="unknown decode_kernel_options.*num_splits"):
        LLM(tiny_model("qwen3"), page_size=16, num_pages=8, max_model_len=32,
            decode_attention="triton", decode_kernel_options={"SPLIT_KV": 4})
