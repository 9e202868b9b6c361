"""The step split's pieces without a training run (issue 13): StepTimer's nesting and reset,
engine_split's arithmetic, and step_split_frame's medians after skip_first."""

import math

from nbhelpers.grpo.compare_tables import step_split_frame
from nbhelpers.grpo.step_timing import FLEX_KEYS, TIME_KEYS, StepTimer, engine_split


class FakeTrainer:
    """A trainer whose training_step calls _generate_and_score_completions, as TRL's does."""

    def __init__(self):
        import torch
        self.model = torch.nn.Linear(2, 2)
        self.callbacks, self.calls = [], []

    def _generate_and_score_completions(self, batch):
        self.calls.append("gen")
        return batch

    def training_step(self, model, inputs, n):
        self.calls.append("step")
        return self._generate_and_score_completions(inputs)

    def add_callback(self, cb):
        self.callbacks.append(cb)


def test_step_timer_nests_generation_inside_training_step_and_resets():
    trainer = FakeTrainer()
    timer = StepTimer().install(trainer)
    assert trainer.callbacks == [timer] and timer.sync is False  # CPU model: no syncs
    assert trainer.training_step(None, {"x": 1}, None) == {"x": 1}
    assert trainer.calls == ["step", "gen"]
    timer.on_pre_optimizer_step(None, None, None)
    timer.on_optimizer_step(None, None, None)
    split = timer.split(10.0)
    assert set(split) == set(TIME_KEYS) and all(v >= 0 for v in split.values())
    assert math.isclose(sum(split.values()), 10.0)
    assert timer.split(None) == dict(zip(TIME_KEYS, (0.0, 0.0, 0.0, None)))


def test_engine_split_other_is_the_wall_left_over():
    stats = {"prefill_s": 0.1, "decode_s": 0.9, "host_s": 0.05, "decode_steps": 256}
    got = engine_split(stats, generate_wall_s=1.1, rollout_s=1.2)
    assert set(got) == set(FLEX_KEYS)
    assert math.isclose(got["flex/other_s"], 0.05)
    assert math.isclose(got["flex/decode_ms_per_step"], 1000 * 0.9 / 256)
    empty = engine_split({}, generate_wall_s=0.0, rollout_s=0.0)
    assert empty["flex/decode_ms_per_step"] == 0.0 and empty["flex/other_s"] == 0.0


def test_step_split_frame_takes_medians_after_skip_first():
    rows = [{"wall_s": w, "time/optimizer_s": o} for w, o in ((9.0, 5.0), (1.0, 0.1), (3.0, 0.3),
                                                             (2.0, 0.2))]
    table = step_split_frame({"a": {"rows": rows, "summary": {"skip_first": 1}},
                              "b": {"rows": [], "summary": None}})
    assert table.loc["a", "n_steps"] == 3 and table.loc["a", "wall_s"] == 2.0
    assert table.loc["a", "time/optimizer_s"] == 0.2
    assert table.loc["a", "flex/decode_s"] is None and table.loc["b", "n_steps"] == 0


def test_step_timer_counts_the_steps_garbage_collection_and_stops_at_close():
    """``gc_split`` gives the step's GC seconds and collections (inside the split's parts, not
    added to them) and restarts from zero; after ``close`` (the end of training) the hook is
    gone from ``gc.callbacks``."""
    import gc

    from nbhelpers.grpo.step_timing import GC_KEYS
    timer = StepTimer().install(FakeTrainer())
    try:
        gc.collect()  # one full collection
        gc.collect(0)
        got = timer.gc_split()
        assert set(got) == set(GC_KEYS)
        assert got["gc/collections"] >= 2 and got["gc/gen2"] >= 1 and got["time/gc_s"] > 0.0
        again = timer.gc_split()  # nothing ran since: zero, not the running total
        assert again["gc/gen2"] == 0 and again["time/gc_s"] <= got["time/gc_s"]
        gc.collect()  # between two steps (setup, logging): not the next step's
        timer.on_step_begin(None, None, None)
        assert timer.gc_split()["gc/gen2"] == 0
    finally:
        timer.close()
    assert timer._gc._callback not in gc.callbacks
    timer.close()  # idempotent
    gc.collect()
    assert timer.gc_split()["gc/collections"] == 0
