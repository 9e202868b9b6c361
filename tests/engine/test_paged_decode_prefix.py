"""Shared-prefix decode attention (``engine/kernels/paged_decode_prefix.py``): the group planner,
the prefix kernel + split-KV merge against a dense PyTorch reference, and the engine option.

Kernels run in Triton's CPU interpreter on CPU-only hosts (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``), compiled on a GPU host. Tolerances as ``test_paged_decode.py``: fp32
``1e-5``, bf16 ``2e-2`` abs against an fp32 reference.
"""

from __future__ import annotations

import os

import pytest
import torch
from _kernels import fp32_interpreter_dots
from _tiny import random_prompts, tiny_model

from nbhelpers.engine.kernels.paged_decode_plan import plan_prefix_groups


# ---------------------------------------------------------------- the planner (no triton)
def test_plan_groups_rows_by_prompt_and_skips_lone_rows():
    keys = [(7, 2), (9, 1), (7, 2), None, (9, 1), (7, 2), (11, 3), (5, 0)]
    rows, lens, row_prefix = plan_prefix_groups(keys, 8, 16)
    assert rows == [[0, 2, 5], [1, 4]]
    assert lens == [32, 16]
    # row 6 is the only row of its prompt, row 7 shares no page, row 3 none: no group
    assert row_prefix == [32, 16, 32, 0, 16, 32, 0, 0]


def test_plan_splits_large_groups_into_near_equal_slots_of_two_or_more():
    rows, lens, row_prefix = plan_prefix_groups([(3, 4)] * 9, 8, 16)
    assert rows == [[0, 1, 2, 3, 4], [5, 6, 7, 8]] and lens == [64, 64]
    assert row_prefix == [64] * 9
    for n in range(2, 70):  # every slot 2..group_max rows: B // 2 slots always hold the plan
        for gmax in (4, 5, 8, 16):
            rows, _, _ = plan_prefix_groups([(1, 1)] * n, gmax, 16)
            assert all(2 <= len(r) <= gmax for r in rows), (n, gmax, rows)
            assert sorted(b for r in rows for b in r) == list(range(n))
            assert len(rows) <= n // 2


def test_plan_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="group_max >= 4"):
        plan_prefix_groups([], 2, 16)
    with pytest.raises(ValueError, match="page_size >= 1"):
        plan_prefix_groups([], 8, 0)


# ---------------------------------------------------------------- the kernels
triton = pytest.importorskip("triton", reason="triton not installed (pip install triton)")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                   reason="no GPU and TRITON_INTERPRET is not 1")
DEV = "cpu" if INTERPRET else "cuda"


@pytest.fixture
def pd():
    from nbhelpers.engine.kernels import paged_decode
    if INTERPRET and type(paged_decode._paged_attention_stage1).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py)")
    return paged_decode


@pytest.fixture(autouse=True)
def _interpreter_bf16_dot(monkeypatch):
    """bf16 ``tl.dot`` operands as fp32 in the CPU interpreter (``_kernels.fp32_interpreter_dots``)."""
    if DEV == "cpu":
        fp32_interpreter_dots(monkeypatch)


def grpo_case(groups, lone=(), heads=4, kv_heads=2, dim=16, page_size=16,
              dtype=torch.float32, seed=0):
    """A pool as the scheduler leaves it: per group ``(prompt_len, [generated per sample])``, the
    prompt's full pages shared by its samples (the partial last page copied per sample), each
    sample's own pages after; ``lone``: context lengths of rows that share nothing. Pages
    handed out shuffled. Returns ``q, k, v, block_table, seq_lens, keys`` (the planner's)."""
    g = torch.Generator().manual_seed(seed)
    rows = []  # (pages, length, key)
    total = sum(-(-(p + n) // page_size) for p, ns in groups for n in ns) + sum(
        -(-n // page_size) for n in lone) + 2
    free = (torch.randperm(total, generator=g) + 1).tolist()  # page 0 = the null page
    for prompt, gens in groups:
        full = prompt // page_size
        shared = [free.pop() for _ in range(full)]
        for n in gens:
            need = -(-(prompt + n) // page_size)
            rows.append((shared + [free.pop() for _ in range(need - full)], prompt + n,
                         (shared[0], full) if full else None))
    for n in lone:
        rows.append(([free.pop() for _ in range(-(-n // page_size))], n, None))
    width = max(len(r[0]) for r in rows) + 1
    block_table = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (pages, _, _) in enumerate(rows):
        block_table[b, :len(pages)] = torch.tensor(pages)
    shape = (1, kv_heads, (total + 1) * page_size, dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    return q, k, v, block_table, torch.tensor([r[1] for r in rows]), [r[2] for r in rows]


CASES = {  # groups, lone rows, case kwargs, kernel options
    "v2_direct": ([(40, [5, 9, 30]), (20, [3, 17])], [33], {}, {"kernel": "v2",
                                                                 "num_splits": 1}),
    "v2_splits": ([(40, [5, 9, 30]), (20, [3, 17])], [33], {}, {"kernel": "v2",
                                                                 "num_splits": 2,
                                                                 "min_split_tokens": 16}),
    "v1_splits": ([(40, [5, 9, 30]), (20, [3, 17])], [33], {}, {"kernel": "v1",
                                                                 "num_splits": 3}),
    "prompt_page_aligned": ([(32, [1, 2, 40])], [], {}, {"kernel": "v2", "num_splits": 1}),
    "gqa_8_to_1_soft_cap": ([(50, [4, 12])], [7], {"heads": 8, "kv_heads": 1},
                            {"kernel": "v1", "num_splits": 2, "soft_cap": 2.0}),
    "block_n_spans_pages": ([(45, [6, 20, 2])], [], {"page_size": 8},
                            {"kernel": "v2", "num_splits": 1, "block_n": 16}),
    "ten_samples_two_slots": ([(34, list(range(1, 11)))], [], {},
                              {"kernel": "v2", "num_splits": 1}),
    "head_dim_not_pow2": ([(36, [3, 8])], [], {"dim": 24}, {"kernel": "v2", "num_splits": 1}),
}


def _run(pd, case, dtype=torch.float32, device=DEV):
    from test_paged_decode import reference

    from nbhelpers.engine.kernels.paged_decode_prefix import (
        GROUP_MAX,
        load_groups,
        new_prefix_groups,
    )
    groups, lone, kw, opts = case
    q, k, v, bt, lens, keys = grpo_case(groups, lone, dtype=dtype, **kw)
    page_size, dim = kw.get("page_size", 16), q.shape[-1]
    plan = plan_prefix_groups(keys, GROUP_MAX, page_size)
    assert plan[0], "the case has groups"
    table = new_prefix_groups(q.shape[0], q.shape[1], dim, device)
    load_groups(table, plan)
    opts = dict(opts)
    splits = opts.pop("num_splits")
    out = pd.paged_decode_attention(q.to(device), k.to(device), v.to(device), bt.to(device),
                                    lens.to(device), dim ** -0.5, page_size, splits,
                                    groups=table, **opts)
    ref = reference(q, k, v, bt, lens, dim ** -0.5, page_size, soft_cap=opts.get("soft_cap"))
    return out.cpu().float(), ref


@needs_kernels
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefix_groups_match_reference_fp32(pd, name):
    out, ref = _run(pd, CASES[name])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("name", ["v2_direct", "v1_splits"])
def test_prefix_groups_match_reference_bf16(pd, name):
    out, ref = _run(pd, CASES[name], dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)


@needs_kernels
def test_cleared_table_is_the_plain_kernel(pd):
    """No groups loaded: every row attends to all its keys in the split-KV kernel, bit for bit
    the output without ``groups``."""
    from nbhelpers.engine.kernels.paged_decode_prefix import new_prefix_groups
    q, k, v, bt, lens, _ = grpo_case([(40, [5, 9])], [20])
    table = new_prefix_groups(q.shape[0], q.shape[1], q.shape[2], DEV)
    args = (q.to(DEV), k.to(DEV), v.to(DEV), bt.to(DEV), lens.to(DEV), 0.25, 16, 1)
    want = pd.paged_decode_attention(*args, kernel="v2")
    got = pd.paged_decode_attention(*args, kernel="v2", groups=table)
    assert torch.equal(want, got)


@needs_kernels
def test_bad_prefix_arguments_are_value_errors(pd):
    from nbhelpers.engine.kernels.paged_decode_prefix import load_groups, new_prefix_groups
    q, k, v, bt, lens, _ = grpo_case([(40, [5, 9])], [])
    table = new_prefix_groups(q.shape[0], q.shape[1], q.shape[2], DEV)
    args = (q.to(DEV), k.to(DEV), v.to(DEV), bt.to(DEV), lens.to(DEV), 0.25, 16, 1)
    with pytest.raises(ValueError, match="not 'fused'"):
        pd.paged_decode_attention(*args, kernel="fused", groups=table)
    with pytest.raises(ValueError, match="sliding window"):
        pd.paged_decode_attention(*args, kernel="v2", groups=table, sliding_window=8)
    wrong = new_prefix_groups(4, q.shape[1], q.shape[2], DEV)
    with pytest.raises(ValueError, match="new_prefix_groups"):
        pd.paged_decode_attention(*args, kernel="v2", groups=wrong)
    with pytest.raises(ValueError, match="do not fit"):
        load_groups(table, ([[0, 1], [0, 1]], [16, 16], [16, 16]))  # 2 slots, the table has 1
    with pytest.raises(ValueError, match="group_max >= 4"):
        new_prefix_groups(8, 4, 16, DEV, group_max=2)


# ---------------------------------------------------------------- the engine option
engine_on_cpu = pytest.mark.skipif(not INTERPRET, reason="CPU engine tests need the interpreter")


def _samples(model, shared: bool, num_pages: int = 128, **sampling):
    from nbhelpers.config import SamplingParams
    from nbhelpers.engine import LLM
    llm = LLM(model, page_size=16, num_pages=num_pages, max_model_len=128, sync_every=4,
              decode_attention="triton", decode_kernel_options={"shared_prefix": shared})
    prompts = random_prompts(3, 20, 50, seed=5)  # 1-3 full pages shared per prompt
    outs = llm.generate(prompts, SamplingParams(**{"n": 4, "max_new_tokens": 12,
                                                   "ignore_eos": True, **sampling}))
    return llm, outs


@engine_on_cpu
@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 1.0, "min_p": 0.1, "seed": 1}])
def test_engine_shared_prefix_same_tokens_and_logprobs(pd, sampling):
    """Tiny fp32 Qwen3 (GQA 4/2, D 16), 3 prompts x 4 samples, decode windows of 4 steps (the
    tables made in the first window's steps are rewritten for the next): the same tokens with
    and without the option, logprobs within 1e-5; the groups were loaded (a slot a prompt)."""
    model = tiny_model("qwen3")
    _, plain = _samples(model, False, **sampling)
    llm, shared = _samples(model, True, **sampling)
    rows, lens, _ = next(iter(llm.runner.paged_decode.plans.values()))
    assert len(rows) == 3 and all(len(r) == 4 for r in rows) and min(lens) >= 16
    for a, b in zip(plain, shared):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@engine_on_cpu
def test_engine_shared_prefix_survives_preemption(pd):
    """A pool too small for all 12 samples: preempted samples resume alone (no group), the
    rest keep theirs; tokens equal the unshared run's."""
    model = tiny_model("qwen3")
    llm0, plain = _samples(model, False, num_pages=24, temperature=0.0)
    llm, shared = _samples(model, True, num_pages=24, temperature=0.0)
    assert llm.runner.paged_decode is not None
    assert llm.last_stats["num_preemptions"] > 0 and llm0.last_stats["num_preemptions"] > 0
    for a, b in zip(plain, shared):
        assert a.token_ids == b.token_ids


@engine_on_cpu
def test_engine_shared_prefix_option_errors(pd):
    from nbhelpers.engine import LLM
    with pytest.raises(ValueError, match="must be True or False"):
        LLM(tiny_model("qwen3"), page_size=16, num_pages=8, max_model_len=32,
            decode_attention="triton", decode_kernel_options={"shared_prefix": "yes"})
    with pytest.raises(ValueError, match="not 'fused'"):
        LLM(tiny_model("qwen3"), page_size=16, num_pages=8, max_model_len=32,
            decode_attention="triton",
            decode_kernel_options={"shared_prefix": True, "kernel": "fused"})


def test_shared_prefix_outside_the_triton_kernel_is_refused_or_warned():
    """helper-25's trial (2026-12-07): with ``decode_attention`` "flex" / "sdpa" the option did
    nothing, silently; typed as an engine option, the message suggested ``share_prefix``."""
    from nbhelpers.engine import LLM
    model = tiny_model("qwen3")
    for attention in ("flex", "sdpa"):
        with pytest.raises(ValueError, match="option of the Triton decode kernel"):
            LLM(model, page_size=16, num_pages=8, max_model_len=32, decode_attention=attention,
                decode_kernel_options={"shared_prefix": True})
    with pytest.raises(TypeError, match=r"decode_kernel_options=\{'shared_prefix': \.\.\.\}"):
        LLM(model, page_size=16, num_pages=8, max_model_len=32, shared_prefix=True)
    if torch.cuda.is_available():
        return  # "auto" is the Triton kernel there
    with pytest.warns(UserWarning, match="the option does nothing"):  # auto: sdpa / flex here
        llm = LLM(model, page_size=16, num_pages=8, max_model_len=32,
                  decode_kernel_options={"shared_prefix": True})
    assert llm.runner.paged_decode is None and llm.runner.flex_decode_options is None


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")
@pytest.mark.parametrize("kernel,splits", [("v2", 1), ("v2", 2), ("v1", 4)])
def test_gpu_qwen3_4b_grpo_shape_matches_torch(pd, kernel, splits):
    """Qwen3-4B heads (32 q / 8 kv, D 128), 8 prompts of ~150 tokens x 8 samples with ragged
    generated lengths 1-400, page 64 (the realistic GRPO preset's pool), bf16."""
    g = torch.Generator().manual_seed(0)
    groups = [(int(torch.randint(120, 200, (1,), generator=g)),
               torch.randint(1, 400, (8,), generator=g).tolist()) for _ in range(8)]
    case = (groups, [], {"heads": 32, "kv_heads": 8, "dim": 128, "page_size": 64},
            {"kernel": kernel, "num_splits": splits})
    out, ref = _run(pd, case, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_gpu_engine_shared_prefix_graphs_match_plain():
    """Tiny fp32 Qwen3 on the GPU with CUDA graphs, page 64 (the compiled prefill's tile),
    prompts of 70-150 tokens (1-2 shared pages), 4 x 8 samples, windows of 8 steps: greedy
    tokens equal with and without the option, logprobs within 1e-5 (the group table is device
    data the captured graph reads, rewritten each window)."""
    from nbhelpers.config import SamplingParams
    from nbhelpers.engine import LLM
    model = tiny_model("qwen3").cuda()
    outs = {}
    for shared in (False, True):
        llm = LLM(model, page_size=64, num_pages=256, max_model_len=256, sync_every=8,
                  decode_attention="triton", decode_kernel_options={"shared_prefix": shared})
        outs[shared] = llm.generate(random_prompts(4, 70, 150, seed=2),
                                    SamplingParams(n=8, temperature=0.0, max_new_tokens=40,
                                                   ignore_eos=True))
        assert llm.runner.use_graphs
    rows, _, _ = llm.runner.paged_decode.plans[32]
    assert len(rows) == 4 and all(len(r) == 8 for r in rows)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
