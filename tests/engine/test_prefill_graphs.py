"""CUDA-graph prefill (``prefill_graphs="on"``, ``engine/prefill_graphs.py``).

CPU: option checks, bucket keys, the static buffers against the eager path's tensors and masks,
and the runner's control flow with a stand-in graph whose ``replay()`` reruns the captured body
(``decode_graphs.capture_graph`` monkeypatched: same warm-up calls, no CUDA), whose tokens must
equal the eager engine's; a capture that raises gives a warning and eager tokens. GPU (the H200
host): real graphs against ``"off"``, tiny fp32 model and PEFT adapters updated in place.
"""

from __future__ import annotations

import pytest
import torch
from _kernels import inplace_lora_step, peft_tiny
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM, model_runner, prefill_graphs
from nbhelpers.engine import llm as llm_module
from nbhelpers.engine.decode_graphs import WARMUP_STEPS
from nbhelpers.engine.runner_batches import (
    flex_prefill_tensors,
    pack_prefill,
    prefill_attention_batch,
)
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_prefill_graphs
from nbhelpers.engine.scheduler import Sequence
from nbhelpers.engine.tuner_tables import resolved_kernels

GPU = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: run on the H200 host (python3 scripts/device/suite.py)")
CPU_KW = {"page_size": 16, "num_pages": 24, "max_model_len": 96, "prefill_pad": 32,
          "compile_layers": False, "decode_attention": "flex", "prefill_attention": "flex"}
SAMPLED = SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=5, ignore_eos=True,
                         seed=3, n=2)


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on the CPU: ``replay()`` reruns the step."""

    def __init__(self, step):
        self.step = step

    def replay(self):
        with torch.inference_mode():
            self.step()

    def pool(self):
        return None


def fake_capture(step, reset, pool=None):
    """``capture_graph``'s warm-up calls, then a :class:`FakeGraph` in place of the capture."""
    with torch.inference_mode():
        for _ in range(WARMUP_STEPS):
            step()
            reset()
    return FakeGraph(step)


def guarded_capture(step, reset, pool=None):
    """:func:`fake_capture` whose captured call fails on what CUDA-graph capture refuses and a
    CPU run cannot see: a tensor built from Python data (``torch.tensor``/``torch.as_tensor``:
    on CUDA a pageable host-to-device copy, "Cannot copy between CPU and CUDA tensors during
    CUDA graph capture") or read back to the host (``.item()``, ``.tolist()``)."""
    with torch.inference_mode():
        for _ in range(WARMUP_STEPS):
            step()
            reset()

    def refuse(name):
        def fail(*args, **kwargs):
            raise RuntimeError(f"{name} during capture (a host copy CUDA graphs refuse)")
        return fail
    with pytest.MonkeyPatch.context() as mp:
        for name in ("tensor", "as_tensor"):
            mp.setattr(torch, name, refuse(f"torch.{name}"))
        for name in ("item", "tolist"):
            mp.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        with torch.inference_mode():
            step()
    return FakeGraph(step)


def _cpu_graphs(monkeypatch, model, capture=fake_capture) -> LLM:
    monkeypatch.setattr(prefill_graphs, "capture_graph", capture)
    monkeypatch.setattr(model_runner, "capture_graph", fake_capture)  # decode: same stand-in
    monkeypatch.setattr(llm_module, "check_cuda_graphs", lambda *args: None)
    return LLM(model, use_cuda_graphs=True, prefill_graphs="on", **CPU_KW)


def _same(got, want) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    torch.testing.assert_close([o.logprobs for o in got], [o.logprobs for o in want],
                               atol=1e-5, rtol=0)


# ---------------------------------------------------------------- options and buckets
def test_option_values_are_checked():
    assert RunnerOptions().prefill_graphs == "auto"
    assert RunnerOptions().prefill_graph_max_tokens == 4096
    for bad in (0, -1, 2.5, "4096", True):
        with pytest.raises(ValueError, match=r"prefill_graph_max_tokens=.*int >= 1"):
            RunnerOptions(prefill_graph_max_tokens=bad)
    with pytest.raises(ValueError, match=r"max_tokens=16 < prefill_pad=32.*capture nothing"):
        RunnerOptions(prefill_graphs="on", prefill_graph_max_tokens=16, prefill_pad=32)
    RunnerOptions(prefill_graph_max_tokens=16, prefill_pad=32)  # auto: a cap, nothing captured
    with pytest.raises(ValueError, match=r"prefill_graphs='yes'.*\('off', 'on', 'auto'\)"):
        RunnerOptions(prefill_graphs="yes")
    with pytest.raises(ValueError, match=r"quote the word.*prefill_graphs: 'on'"):
        RunnerOptions(prefill_graphs=True)  # YAML's unquoted on


def test_resolution():
    assert resolve_prefill_graphs(RunnerOptions(prefill_graphs="off"), True, "flex") is False
    auto = RunnerOptions()  # the default: on wherever it can run, never an error
    assert resolve_prefill_graphs(auto, True, "flex") is True
    assert resolve_prefill_graphs(auto, False, "flex") is False  # no CUDA graphs (the CPU)
    assert resolve_prefill_graphs(auto, True, "sdpa") is False
    assert resolve_prefill_graphs(auto, True, "fa4") is False
    assert resolve_prefill_graphs(auto, True, "flex", compiled=False) is False  # eager flex
    on_eager = RunnerOptions(prefill_graphs="on")  # "on" tries anyway (a failed capture warns)
    assert resolve_prefill_graphs(on_eager, True, "flex", compiled=False) is True
    assert LLM(tiny_model(), **CPU_KW).runner.prefill_graphs is None  # CPU model: auto is off
    on = RunnerOptions(prefill_graphs="on")
    assert resolve_prefill_graphs(on, True, "flex") is True
    with pytest.raises(ValueError, match=r"needs CUDA graphs.*prefill_graphs='off'"):
        resolve_prefill_graphs(on, False, "flex")
    with pytest.raises(ValueError, match=r"'sdpa'.*set prefill_attention='flex'"):
        resolve_prefill_graphs(on, True, "sdpa")
    with pytest.raises(ValueError, match="needs CUDA graphs"):  # CPU model: graphs resolve off
        LLM(tiny_model(), prefill_graphs="on", **{**CPU_KW, "prefill_attention": "auto"})


def test_bucket_key():
    assert prefill_graphs.bucket_key(128, 3, "flex") == (128, 3, "flex")
    with pytest.raises(ValueError, match="prefill_attention='flex'"):
        prefill_graphs.bucket_key(128, 3, "fa4")
    with pytest.raises(ValueError, match="empty prefill"):
        prefill_graphs.bucket_key(0, 1, "flex")


# ---------------------------------------------------------------- static buffers
def _seqs(lengths, first_page=1, ps=16):
    seqs, page = [], first_page
    for i, n in enumerate(lengths):
        pages = -(-n // ps)
        seqs.append(Sequence(i, list(range(7 * i + 1, 7 * i + 1 + n)), seed=i, max_new_tokens=4,
                             block_table=list(range(page, page + pages))))
        page += pages
    return seqs


def _mask_grid(block_mask, n_tokens, num_slots):
    q = torch.arange(n_tokens)[:, None]
    kv = torch.arange(num_slots)[None, :]
    return block_mask.mask_mod(torch.zeros(()), torch.zeros(()), q, kv)


def _check_bucket(runner, bucket, seqs, ids, pos, rows, slots):
    """Buffers equal the eager tensors; the bucket's masks (built once) equal the eager masks."""
    opt = runner.opt
    want = flex_prefill_tensors(opt, seqs, rows, pos, runner.max_pages, runner.device)
    last = torch.tensor([sum(s.num_tokens for s in seqs[:i + 1]) - 1 for i in range(len(seqs))])
    plain = {"ids": torch.tensor(ids), "pos": torch.tensor(pos), "slots": torch.tensor(slots),
             "last": last}
    for name, value in {**plain, **want}.items():
        got = bucket.bufs["pos" if name == "q_pos" else name]
        assert got.dtype == value.dtype and torch.equal(got, value), name
    eager = prefill_attention_batch(runner.model, opt, seqs, rows, pos, "flex",
                                    runner.max_pages, runner.kv)
    for mine, theirs in zip(bucket.attn.block_masks, eager.block_masks):
        assert torch.equal(mine.kv_num_blocks, theirs.kv_num_blocks)
        assert torch.equal(mine.kv_indices, theirs.kv_indices)
        assert mine.shape == theirs.shape
        grid = _mask_grid(theirs, len(ids), runner.kv.num_slots)
        assert grid.any() and torch.equal(_mask_grid(mine, len(ids), runner.kv.num_slots), grid)


def test_static_buffers_equal_the_eager_tensors(monkeypatch):
    llm = _cpu_graphs(monkeypatch, tiny_model())
    runner = llm.runner
    assert runner.pad_prefill  # graphs pad the packed prompts to prefill_pad multiples
    first = _seqs([5, 17, 3])  # 25 tokens -> padded to 32
    ids, pos, rows, slots = pack_prefill(first, runner.opt, True)
    assert len(ids) == 32 and rows[-7:] == [-1] * 7 and ids[-7:] == [0] * 7
    key = prefill_graphs.bucket_key(len(ids), 3, "flex")
    host = prefill_graphs.host_inputs(first, ids, pos, rows, slots, runner.opt, runner.max_pages)
    bucket = prefill_graphs.PrefillBucket(key, host, runner.device)
    bucket.attn = prefill_graphs.flex_prefill_masks(runner.model, runner.opt,
                                                    bucket.mask_tensors(), runner.kv)
    _check_bucket(runner, bucket, first, ids, pos, rows, slots)
    assert torch.equal(bucket.bufs["q_row"][-7:], torch.full((7,), 3))  # padding -> row R
    second = _seqs([20, 2, 8], first_page=5)  # other lengths and pages, same bucket
    ids2, pos2, rows2, slots2 = pack_prefill(second, runner.opt, True)
    assert prefill_graphs.bucket_key(len(ids2), 3, "flex") == key
    bucket.fill(prefill_graphs.host_inputs(second, ids2, pos2, rows2, slots2, runner.opt,
                                           runner.max_pages))
    _check_bucket(runner, bucket, second, ids2, pos2, rows2, slots2)  # same masks, new values


# ---------------------------------------------------------------- runner control flow (CPU)
def test_stand_in_graphs_give_the_eager_tokens(monkeypatch):
    model = tiny_model()
    eager = LLM(model, use_cuda_graphs=False, **CPU_KW)
    graphs = _cpu_graphs(monkeypatch, model)
    eager_runs = []
    monkeypatch.setattr(graphs.runner, "_prefill_run",
                        lambda *a: eager_runs.append(a) or pytest.fail("eager prefill"))
    batches = [random_prompts(2, 4, 9, seed=1), random_prompts(2, 6, 12, seed=2),  # 32 tokens
               random_prompts(2, 20, 28, seed=3)]  # 64 tokens: a second bucket
    for prompts in batches + batches[:1]:
        _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
    t = graphs.runner.timings
    assert sorted(graphs.runner.prefill_graphs.buckets) == [(32, 2, "flex"), (64, 2, "flex")]
    assert t["prefill_graph_captures"] == 2 and t["prefill_graph_replays"] == 4
    assert graphs.last_stats["prefill_graph_replays"] == 1  # per call, via runner.timings
    assert not eager_runs and eager.runner.timings["prefill_graph_replays"] == 0
    assert resolved_kernels(graphs.runner)["prefill_graphs"] == "on"  # what the bench records
    assert resolved_kernels(eager.runner)["prefill_graphs"] == "off"
    graphs.runner.model.signature = lambda: (-1,)  # weights moved: recapture, once
    for _ in range(2):
        _same(graphs.generate(batches[0], SAMPLED), eager.generate(batches[0], SAMPLED))
    assert t["prefill_graph_captures"] == 3 and t["prefill_graph_replays"] == 6


def test_failed_capture_prefills_eagerly_with_the_same_tokens(monkeypatch):
    model = tiny_model()
    eager = LLM(model, use_cuda_graphs=False, **CPU_KW)
    calls = []

    def fail(*args):
        calls.append(args)
        raise RuntimeError("simulated capture failure")
    graphs = _cpu_graphs(monkeypatch, model, capture=fail)
    prompts = random_prompts(3, 5, 9, seed=5)
    with pytest.warns(UserWarning, match=r"prefill bucket \(32, 3\).*prefilling this bucket"):
        got = graphs.generate(prompts, SAMPLED)
    _same(got, eager.generate(prompts, SAMPLED))
    _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
    t = graphs.runner.timings
    assert len(calls) == 1 and t["prefill_graph_captures"] == 0  # not retried: same weights
    assert t["prefill_graph_replays"] == 0
    assert resolved_kernels(graphs.runner)["prefill_graphs"] == "on_eager"  # asked on, ran eager
    graphs.runner.model.signature = lambda: (-1,)  # weights moved: one more try
    with pytest.warns(UserWarning, match="prefilling this bucket eagerly"):
        _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
    assert len(calls) == 2
    graphs.sleep()  # free_kv drops the buckets with the pool
    assert not graphs.runner.prefill_graphs.buckets


def _cpu_auto(monkeypatch, model, **kw) -> LLM:
    """``prefill_graphs="auto"`` on the CPU with CUDA graphs stood in (as :func:`_cpu_graphs`),
    resolved as for compiled flex (auto leaves uncompiled flex eager; the CPU's flex is
    uncompiled, and compiling it here would only cost time:
    :func:`test_auto_leaves_uncompiled_flex_eager_and_captures_compiled_flex_clean`)."""
    real = model_runner.resolve_prefill_graphs
    monkeypatch.setattr(model_runner, "resolve_prefill_graphs",
                        lambda opt, graphs, attention, compiled: real(opt, graphs, attention))
    monkeypatch.setattr(prefill_graphs, "capture_graph", fake_capture)
    monkeypatch.setattr(model_runner, "capture_graph", fake_capture)
    monkeypatch.setattr(llm_module, "check_cuda_graphs", lambda *args: None)
    return LLM(model, use_cuda_graphs=True, **{**CPU_KW, **kw})


def test_prefills_over_the_token_cap_run_eagerly(monkeypatch):
    model = tiny_model()
    eager = LLM(model, use_cuda_graphs=False, **CPU_KW)
    graphs = _cpu_auto(monkeypatch, model, prefill_graph_max_tokens=32)
    assert graphs.runner.prefill_graphs is not None  # auto with (stand-in) CUDA graphs: on
    runs = []
    plain = graphs.runner._prefill_run
    monkeypatch.setattr(graphs.runner, "_prefill_run", lambda *a: runs.append(1) or plain(*a))
    for prompts, n_eager in ((random_prompts(2, 4, 9, seed=1), 0),  # 32 tokens: at the cap
                             (random_prompts(2, 20, 28, seed=3), 1),  # 64 tokens: over it
                             (random_prompts(2, 4, 9, seed=4), 1)):  # 32 again: the graph
        _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
        assert len(runs) == n_eager
    assert list(graphs.runner.prefill_graphs.buckets) == [(32, 2, "flex")]  # none for 64
    t = graphs.runner.timings
    assert t["prefill_graph_captures"] == 1 and t["prefill_graph_replays"] == 2


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_sleep_turns_auto_off_and_keeps_on(monkeypatch, mode):
    model = tiny_model()
    eager = LLM(model, use_cuda_graphs=False, **CPU_KW)
    graphs = _cpu_auto(monkeypatch, model, prefill_graphs=mode)
    prompts = random_prompts(2, 4, 9, seed=1)
    _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
    graphs.sleep()
    graphs.wake_up()
    _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
    t, pg = graphs.runner.timings, graphs.runner.prefill_graphs
    if mode == "auto":  # a runner that sleeps would re-capture every rollout: eager from here
        assert pg is None and t["prefill_graph_captures"] == 1 and t["prefill_graph_replays"] == 1
        assert resolved_kernels(graphs.runner)["prefill_graphs"] == "off"
    else:  # "on" re-captures after the pool came back
        assert list(pg.buckets) == [(32, 2, "flex")]
        assert t["prefill_graph_captures"] == 2 and t["prefill_graph_replays"] == 2


def test_eager_flex_prefill_copies_from_the_host_so_its_capture_fails(monkeypatch):
    """What the H200 suite of 2026-12-03 hit (tests/unit/test_ab_flex_is.py, GRPO's
    ``flex_compile_attention="off"``): uncompiled flex_attention runs torch's math fallback,
    which builds ``torch.tensor(-inf, device=scores.device)`` on every call
    (``torch/_higher_order_ops/flex_attention.py``, ``_math_attention_inner``): a host-to-device
    copy that CUDA-graph capture refuses. ``"on"`` still tries: a warning, eager tokens."""
    model = tiny_model()
    eager = LLM(model, use_cuda_graphs=False, **CPU_KW)
    graphs = _cpu_graphs(monkeypatch, model, capture=guarded_capture)  # the CPU's flex: eager
    prompts = random_prompts(2, 4, 9, seed=1)
    # the first host copy met is torch.tensor (the -inf fill) in a fresh process; after other
    # tests in the same xdist worker it was once torch.as_tensor (CPU suite, 2026-12-03): both
    # are host copies a capture refuses
    with pytest.warns(UserWarning,
                      match=r"prefill bucket \(32, 2\).*torch\.(as_)?tensor during"):
        _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
    assert graphs.runner.timings["prefill_graph_captures"] == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_auto_leaves_uncompiled_flex_eager_and_captures_compiled_flex_clean(monkeypatch,
                                                                            compiled):
    """``"auto"`` captures only a body free of host copies (:func:`guarded_capture`): none for
    uncompiled flex (no bucket, no warning), a clean capture for compiled flex."""
    import warnings
    model = tiny_model()
    kw = {**CPU_KW, "compile_attention": compiled}
    eager = LLM(model, use_cuda_graphs=False, **kw)
    monkeypatch.setattr(prefill_graphs, "capture_graph", guarded_capture)
    monkeypatch.setattr(model_runner, "capture_graph", fake_capture)
    monkeypatch.setattr(llm_module, "check_cuda_graphs", lambda *args: None)
    graphs = LLM(model, use_cuda_graphs=True, **kw)
    prompts = random_prompts(2, 4, 9, seed=1)
    with warnings.catch_warnings():  # a capture that fails the guard warns: an error here
        warnings.filterwarnings("error", message=".*CUDA graph capture")
        _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
    assert (graphs.runner.prefill_graphs is not None) == compiled
    t = graphs.runner.timings
    assert (t["prefill_graph_captures"], t["prefill_graph_replays"]) == (int(compiled),) * 2


def test_buckets_past_the_cap_prefill_eagerly(monkeypatch):
    model = tiny_model()
    eager = LLM(model, use_cuda_graphs=False, **CPU_KW)
    monkeypatch.setattr(prefill_graphs, "MAX_BUCKETS", 1)
    graphs = _cpu_graphs(monkeypatch, model)
    runs = []
    plain = graphs.runner._prefill_run
    monkeypatch.setattr(graphs.runner, "_prefill_run", lambda *a: runs.append(1) or plain(*a))
    for prompts, n_eager in ((random_prompts(2, 4, 9, seed=1), 0),  # 32 tokens: captured
                             (random_prompts(2, 20, 28, seed=3), 1)):  # 64: past the cap
        _same(graphs.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))
        assert len(runs) == n_eager
    assert list(graphs.runner.prefill_graphs.buckets) == [(32, 2, "flex")]
    assert graphs.runner.timings["prefill_graph_replays"] == 1
    assert resolved_kernels(graphs.runner)["prefill_graphs"] == "on"  # one bucket replayed


# ---------------------------------------------------------------- GPU
GPU_KW = {"page_size": 64, "num_pages": 32, "max_model_len": 192}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2)


@GPU
@pytest.mark.parametrize("lora", [False, True])
def test_gpu_prefill_graphs_match_eager(lora):
    model = (peft_tiny(torch.float32) if lora else tiny_model()).cuda()
    off = LLM(model, prefill_graphs="off", **GPU_KW)
    on = LLM(model, **GPU_KW)  # the default ("auto") is on for a CUDA model
    assert on.runner.prefill_graphs is not None and off.runner.prefill_graphs is None
    batches = [random_prompts(2, 5, 30, seed=1), random_prompts(2, 31, 60, seed=2),  # 128
               random_prompts(2, 70, 90, seed=3)]  # 256 tokens: a second bucket
    for prompts in batches + batches[:1]:
        _same(on.generate(prompts, SAMPLED), off.generate(prompts, SAMPLED))
        _same(on.generate(prompts, GREEDY), off.generate(prompts, GREEDY))
    t = on.runner.timings
    assert t["prefill_graph_captures"] == 2 and t["prefill_graph_replays"] == 8
    if lora:  # an optimizer step in place: same storage, no recapture, the graph sees it
        before = off.generate(batches[0], GREEDY)
        inplace_lora_step(model)
        after = off.generate(batches[0], GREEDY)
        assert [o.logprobs for o in after] != [o.logprobs for o in before]
        _same(on.generate(batches[0], GREEDY), after)
        assert t["prefill_graph_captures"] == 2 and t["prefill_graph_replays"] == 9
