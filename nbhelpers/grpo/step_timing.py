"""Where a GRPO step's wall time goes: trainer-side and flex-engine-side splits (issue 13).

Contract: :class:`StepTimer` times, per optimiser step and for every backend, three parts of
TRL 1.15's step (seconds, summed over the step's micro-batches; CUDA-synchronised when the policy
is on a CUDA device, plain wall time on the CPU):

* ``time/generate_and_score_s``: ``GRPOTrainer._generate_and_score_completions`` as a whole
  (rollout, reward functions, old/ref logprobs, advantages, TRL's bookkeeping). It runs inside
  ``training_step`` (``_prepare_inputs``), once per generation batch.
* ``time/loss_fwd_bwd_s``: ``training_step`` minus the part above, i.e. the loss forward and
  ``accelerator.backward`` (transformers 5.17 ``Trainer.training_step``; TRL's override only
  adds its own ``step_time`` clock) plus slicing the buffered generation batch.
* ``time/optimizer_s``: ``on_pre_optimizer_step`` to ``on_optimizer_step`` (``optimizer.step()``;
  the grad clip before it and ``zero_grad`` / the LR scheduler after it are in ``other``).
* ``time/other_s``: the step wall (:class:`~nbhelpers.grpo.callbacks.StatisticsCallback`'s
  ``wall_s``) minus the three, clipped at 0: data loading, grad clip, scheduler, callbacks.

Beside the split (:meth:`StepTimer.gc_split`, :data:`GC_KEYS`; inside the parts above, not
added to them): ``time/gc_s``, the seconds CPython's cyclic garbage collector ran during the
step (``gc.callbacks``, :class:`nbhelpers.engine.gc_watch.GcWatch`), ``gc/collections`` and
``gc/gen2`` (full collections). Why: a full collection walks every tracked object of the
process, 0.19 s for the ~402,000 of torch + transformers + trl + SmolLM2 on the CPU host and
0.32-0.48 s inside single timed rounds of the H100 benchmark process (2026-12-07,
``engine/gc_watch.py``); vLLM freezes that heap at engine start, so its runs pay less.

:func:`engine_split` turns the flex engine's ``LLM.last_stats`` (:meth:`nbhelpers.engine.llm.LLM.
generate`) and the rollout's own clocks into the ``flex/*`` keys that
:class:`~nbhelpers.grpo.flex_rollout.FlexRollout` logs per rollout. Costs: two synchronises per
timed call (about six per step); nothing else.

Run: ``pytest tests/unit/test_step_timing.py``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from transformers import TrainerCallback

TIME_KEYS = ("time/generate_and_score_s", "time/loss_fwd_bwd_s", "time/optimizer_s",
             "time/other_s")
"""Step-row keys of :meth:`StepTimer.split` (seconds per optimiser step)."""
GC_KEYS = ("time/gc_s", "gc/collections", "gc/gen2")
"""Step-row keys of :meth:`StepTimer.gc_split`: GC seconds, collections, full collections."""
FLEX_KEYS = ("flex/rollout_s", "flex/generate_wall_s", "flex/prefill_s", "flex/decode_s",
             "flex/host_s", "flex/other_s", "flex/decode_steps", "flex/decode_ms_per_step")
"""Step-row keys of :func:`engine_split` (seconds unless named otherwise)."""


def on_cuda(model: Any) -> bool:
    """True when CUDA is available and ``model``'s first parameter lives on a CUDA device."""
    import torch
    if not torch.cuda.is_available():
        return False
    try:
        return next(model.parameters()).is_cuda
    except (StopIteration, AttributeError):
        return False


class StepTimer(TrainerCallback):
    """Per-step clocks of ``trainer`` (module docstring); :meth:`install` once after building it.

    :class:`~nbhelpers.grpo.callbacks.StatisticsCallback` calls :meth:`split` at ``on_step_end``
    (its ``timer`` attribute), which returns the step's :data:`TIME_KEYS` and starts the next.
    """

    def __init__(self) -> None:
        from nbhelpers.engine.gc_watch import GcWatch
        self.sync = False
        self._acc = {"gen": 0.0, "loss": 0.0, "opt": 0.0}
        self._opt_t0: float | None = None
        self._gc = GcWatch()  # entered in install, left at on_train_end

    def _now(self) -> float:
        if self.sync:
            import torch
            torch.cuda.synchronize()
        return time.perf_counter()

    def install(self, trainer: Any) -> StepTimer:
        """Wrap ``trainer._generate_and_score_completions`` and ``trainer.training_step`` (as
        instance attributes: the loop calls ``self.<name>``) and add this callback."""
        self.sync = on_cuda(trainer.model)
        gen_inner, step_inner = trainer._generate_and_score_completions, trainer.training_step

        @functools.wraps(gen_inner)
        def timed_generate(*args, **kwargs):
            t0 = self._now()
            out = gen_inner(*args, **kwargs)
            self._acc["gen"] += self._now() - t0
            return out

        @functools.wraps(step_inner)
        def timed_step(*args, **kwargs):
            gen0, t0 = self._acc["gen"], self._now()
            out = step_inner(*args, **kwargs)
            self._acc["loss"] += self._now() - t0 - (self._acc["gen"] - gen0)
            return out

        trainer._generate_and_score_completions = timed_generate
        trainer.training_step = timed_step
        trainer.add_callback(self)
        self._gc.__enter__()  # counts every collection from here to on_train_end
        return self

    def on_step_begin(self, args, state, control, **kwargs):
        self._gc.reset()  # what ran between steps (setup, logging, evaluation) is no step's

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Stop counting collections (removes the ``gc.callbacks`` hook; idempotent)."""
        self._gc.__exit__(None, None, None)

    def gc_split(self) -> dict[str, float | int]:
        """This step's :data:`GC_KEYS` (collections since ``on_step_begin``); resets the
        counters."""
        st = self._gc.stats()
        self._gc.reset()
        return dict(zip(GC_KEYS, (st["gc_s"], st["gc_collections"], st["gc_gen2"])))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._opt_t0 = self._now()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._opt_t0 is not None:
            self._acc["opt"] += self._now() - self._opt_t0
            self._opt_t0 = None

    def split(self, wall_s: float | None) -> dict[str, float | None]:
        """This step's :data:`TIME_KEYS` (seconds); ``time/other_s`` is ``None`` without a wall.
        Resets the clocks for the next step."""
        gen, loss, opt = self._acc["gen"], max(0.0, self._acc["loss"]), self._acc["opt"]
        self._acc = {"gen": 0.0, "loss": 0.0, "opt": 0.0}
        other = None if wall_s is None else max(0.0, wall_s - gen - loss - opt)
        return dict(zip(TIME_KEYS, (gen, loss, opt, other)))


def engine_split(stats: dict[str, Any], generate_wall_s: float,
                 rollout_s: float) -> dict[str, float]:
    """The :data:`FLEX_KEYS` of one flex rollout.

    ``stats``: ``LLM.last_stats`` of that ``generate`` call (per-call ``prefill_s``, ``decode_s``,
    ``host_s`` seconds, ``decode_steps``; the runner's counters, :mod:`nbhelpers.engine.
    model_runner`: ``decode_s`` ends on the host copy of the tokens, so it is synchronised;
    ``prefill_s`` / ``host_s`` are only when the runner's ``profile`` is on, otherwise GPU work they
    launched may be billed to the next counter). ``generate_wall_s``: seconds of the
    ``llm.generate`` call (synchronised); ``rollout_s``: the whole ``rollout_func`` call
    (tokenising the prompts and building TRL's lists included). ``flex/other_s`` =
    ``generate_wall_s`` minus prefill, decode and host (scheduler, prompt checks, sequence objects,
    graph captures outside the counters), clipped at 0; ``flex/decode_ms_per_step`` is
    ``1000 * decode_s / decode_steps`` (0 without decode steps).
    """
    pre, dec, host = (float(stats.get(k, 0.0)) for k in ("prefill_s", "decode_s", "host_s"))
    steps = int(stats.get("decode_steps", 0))
    return {"flex/rollout_s": rollout_s, "flex/generate_wall_s": generate_wall_s,
            "flex/prefill_s": pre, "flex/decode_s": dec, "flex/host_s": host,
            "flex/other_s": max(0.0, generate_wall_s - pre - dec - host),
            "flex/decode_steps": float(steps),
            "flex/decode_ms_per_step": 1000.0 * dec / steps if steps else 0.0}


def log_metrics(trainer: Any, values: dict[str, float]) -> None:
    """Append ``values`` to TRL's ``trainer._metrics[mode]`` (as ``generate_s`` is): the mean over
    the calls of a logging interval lands in that step's log, then in its step row
    (:func:`nbhelpers.grpo.result.step_rows`). No-op for a trainer without ``_metrics``."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is not None:
        mode = "train" if trainer.model.training else "eval"
        for key, value in values.items():
            metrics[mode][key].append(value)
