"""Python GC time inside ``LLM.generate`` (``engine/gc_watch.py``) and the ``pause_gc`` option.

The counters are what tells a garbage-collection stall from a graph re-capture in one slow timed
round (the 0.2-0.3 s rounds of the H200 run of 2026-12-07); ``pause_gc`` turns automatic
collection off for the scheduling loop only and always restores it. CPU, a tiny fp32 Qwen3.
"""

from __future__ import annotations

import gc

import pytest
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.gc_watch import GcWatch
from nbhelpers.engine.runner_options import RunnerOptions

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def _gc_enabled_after():
    """Every test leaves automatic collection as it found it (on)."""
    assert gc.isenabled()
    yield
    assert gc.isenabled(), "a test left the garbage collector disabled"


def test_watch_counts_collections_and_their_time():
    watch = GcWatch()
    with watch:
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
    st = watch.stats()
    assert st["gc_collections"] == 2 and st["gc_gen2"] == 1 and st["gc_s"] > 0.0
    assert st["gc_paused"] is False
    assert watch._callback not in gc.callbacks  # removed on exit
    gc.collect()
    assert watch.stats()["gc_collections"] == 2  # nothing counted after the block


def test_pause_turns_automatic_collection_off_inside_and_restores_it():
    with GcWatch(pause=True) as watch:
        assert not gc.isenabled()
        gc.collect()  # an explicit collection still runs and is counted
    assert gc.isenabled() and watch.stats()["gc_collections"] == 1
    with pytest.raises(RuntimeError), GcWatch(pause=True):
        raise RuntimeError("a failing step")
    assert gc.isenabled()  # restored on an exception too
    gc.disable()
    try:  # a collector the caller had off stays off
        with GcWatch(pause=True):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("pause", [False, True])
def test_generate_reports_gc_and_pauses_only_its_loop(monkeypatch, pause):
    """``last_stats`` carries the loop's collections; with ``pause_gc`` automatic collection is
    off in every scheduler step and back on after ``generate``; the tokens do not change."""
    model = tiny_model("qwen3", seed=1)
    prompts = random_prompts(2, 4, 8, seed=3)
    want = [o.token_ids for o in LLM(model, page_size=16, num_pages=8, max_model_len=64,
                                     use_cuda_graphs=False).generate(prompts, GREEDY)]
    llm = LLM(model, page_size=16, num_pages=8, max_model_len=64, use_cuda_graphs=False,
              pause_gc=pause)
    seen, real_step = [], llm._step

    def step(*args):
        seen.append(gc.isenabled())
        gc.collect(0)  # one young collection per step, counted by the watch
        return real_step(*args)

    monkeypatch.setattr(llm, "_step", step)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    st = llm.last_stats
    assert got == want
    assert seen and all(enabled is not pause for enabled in seen)
    assert st["gc_paused"] is pause and st["gc_collections"] >= len(seen)
    assert st["gc_s"] > 0.0 and st["gc_gen2"] >= 0
    assert gc.isenabled()


def test_pause_gc_option_is_checked():
    assert RunnerOptions().pause_gc is False  # measured first (issue 12), then maybe on
    with pytest.raises(TypeError, match="pause_gc='yes': pass True or False"):
        RunnerOptions(pause_gc="yes")  # a string would count as True


def test_a_failing_generate_restores_the_collector(monkeypatch):
    llm = LLM(tiny_model("qwen3"), page_size=16, num_pages=8, max_model_len=64,
              use_cuda_graphs=False, pause_gc=True)

    def boom(*args):
        raise RuntimeError("step failed")

    monkeypatch.setattr(llm, "_step", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate(random_prompts(1, 4, 4), GREEDY)
    assert gc.isenabled()
    monkeypatch.undo()  # the same engine generates again, with the collector paused again
    assert len(llm.generate(random_prompts(1, 4, 4), GREEDY)[0].token_ids) == 4
    assert llm.last_stats["gc_paused"] is True and gc.isenabled()


def test_bench_rounds_record_what_can_stall_a_round():
    """Each timed round's row of the flex benchmark (``flex_sweep.time_rounds``, what notebook 33
    and ``scripts/bench_flex.py`` archive) carries the round's decode-graph captures and GC
    counters, so a slow round in a sidecar names its cause."""
    from nbhelpers.bench import flex_sweep
    llm = LLM(tiny_model("qwen3"), page_size=16, num_pages=8, max_model_len=64,
              use_cuda_graphs=False, pause_gc=True)
    rows, _ = flex_sweep.time_rounds(llm, random_prompts(2, 4, 8), GREEDY, rounds=2, warmup=0)
    assert len(rows) == 2
    for row in rows:
        assert set(flex_sweep.ROUND_STALL_KEYS) <= row.keys()
        assert row["graph_captures"] == 0 and row["gc_paused"] is True  # no graphs on the CPU
        assert row["gc_s"] >= 0.0 and row["gc_collections"] >= row["gc_gen2"] >= 0


@pytest.fixture
def _unfreeze_after():
    """A frozen heap is process-wide: give later tests of this worker the collector as before."""
    before = gc.get_freeze_count()
    yield
    gc.unfreeze()
    assert gc.get_freeze_count() == 0 or before > 0


def test_freeze_gc_heap_is_vllms_collect_then_freeze(_unfreeze_after):
    """Every generation collected first (cyclic garbage is not frozen), then every tracked
    object moved to the permanent generation: a full collection afterwards walks none of
    them, so it finds nothing to free among them."""
    from nbhelpers.engine.gc_watch import freeze_gc_heap

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle, garbage once the names go
    del a, b
    st = freeze_gc_heap()
    assert st["gc_frozen"] >= gc.get_freeze_count() > 1000 and st["gc_freeze_s"] > 0.0
    assert not any(type(o).__name__ == "Node" for o in gc.get_objects())  # collected, not frozen
    assert gc.get_objects() == [] or len(gc.get_objects()) < st["gc_frozen"] // 10
    watch = GcWatch()
    with watch:
        gc.collect()
    assert watch.stats()["gc_gen2"] == 1


def test_freeze_gc_option_freezes_once_after_the_first_generate(_unfreeze_after):
    """``freeze_gc=True``: the first ``generate`` (the warm-up) ends with the freeze and reports
    it; later calls do not freeze again; the tokens are those of an engine without it."""
    model = tiny_model("qwen3", seed=1)
    prompts = random_prompts(2, 4, 8, seed=3)
    kw = dict(page_size=16, num_pages=8, max_model_len=64, use_cuda_graphs=False)
    want = [o.token_ids for o in LLM(model, **kw).generate(prompts, GREEDY)]
    assert gc.get_freeze_count() == 0  # the default engine freezes nothing
    llm = LLM(model, freeze_gc=True, **kw)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    first = llm.last_stats
    # frozen objects still die by reference count: the count can only have fallen since
    assert first["gc_frozen"] >= gc.get_freeze_count() > 1000 and first["gc_freeze_s"] > 0.0
    gc.unfreeze()  # a second call must not freeze again
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert "gc_frozen" not in llm.last_stats and gc.get_freeze_count() == 0


def test_freeze_gc_option_is_checked():
    assert RunnerOptions().freeze_gc is False  # measured first on the H200 (step n24g)
    with pytest.raises(TypeError, match="freeze_gc='on': pass True or False"):
        RunnerOptions(freeze_gc="on")


def test_generate_keeps_no_gc_tracked_object_per_token():
    """The per-token logprobs live in flat float lists (``Sequence.out_logprobs`` /
    ``out_full_logprobs``), not one ``[filtered, full]`` list per token: with the first
    generation's threshold at 100, 16 x 100 sampled tokens triggered 16 collections a call
    before (one per ~100 pair lists) and trigger none now. In a trainer's heap those lists were
    what aged into generation 2 and set off full collections inside rollouts."""
    llm = LLM(tiny_model("qwen3"), page_size=16, num_pages=256, max_model_len=256)
    prompts = random_prompts(16, 8, 12, seed=1)
    sp = SamplingParams(temperature=1.0, min_p=0.1, max_new_tokens=100, ignore_eos=True, seed=3)
    llm.generate(prompts, sp)  # warm-up: first-call allocations
    old = gc.get_threshold()
    gc.set_threshold(100, 10, 10)
    try:
        outs = llm.generate(prompts, sp)
    finally:
        gc.set_threshold(*old)
    assert sum(len(o.token_ids) for o in outs) == 1600
    assert llm.last_stats["gc_collections"] == 0
    assert all(len(o.logprobs) == len(o.full_logprobs) == 100 for o in outs)
    assert all(isinstance(v, float) for o in outs for v in (*o.logprobs, *o.full_logprobs))
