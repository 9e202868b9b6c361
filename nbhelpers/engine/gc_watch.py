"""Python garbage-collection time inside one ``LLM.generate`` call, an optional pause, and
vLLM's heap freeze.

Contract: ``with GcWatch(pause) as gw: ...`` counts every collection CPython runs inside the block
(``gw.collections``, by generation in ``gw.by_generation``) and the seconds they took
(``gw.seconds``, ``time.perf_counter`` between the ``"start"`` and ``"stop"`` phases of
``gc.callbacks``). With ``pause=True`` automatic collection is off inside the block
(``gc.disable()``) and restored to what it was on exit, exception or not; nothing is collected
on exit (the next automatic collection runs later, outside the rollout). An explicit
``gc.collect()`` inside the block still runs and is counted.

Why: in the H200 run of ``33_flex_vs_baselines`` at 2052410 (2026-12-07) single timed rounds took
0.2-0.3 s longer than their twin (PEFT fp32 batch 64: 2.83 then 3.03 s; 2.83 s both rounds with
bf16 adapters; the H100 run of session 21 gave fp32 batch 64 3.49 then 3.79 s), time spent
outside the decode kernels (the loop's step time minus the graph replay's: +0.31 ms a step).
A generation-2 collection walking a large heap is one candidate (vLLM freezes its heap once
warm-up is done for that reason, "to reduce GC overhead from static objects during serving
time": ``freeze_gc_heap`` in ``vllm/utils/gc_utils.py``, ``gc.collect()`` then ``gc.freeze()``;
SGLang has a ``freeze_gc`` of its own); a decode-graph re-capture is the other
(``graph_captures`` in ``LLM.last_stats``). These counters say which.

:func:`freeze_gc_heap` is vLLM's ``freeze_gc_heap`` (``vllm/utils/gc_utils.py``; called once at
the end of ``EngineCore.__init__``, ``vllm/v1/engine/core.py``, after the model, KV cache and
warm-up are built, "to reduce GC overhead from static objects during serving time"): collect
generations 0, 1 and 2, then ``gc.freeze()``, which moves every object the collector tracks into
the permanent generation that no later collection scans. Measured (H100, git 8d7b0e1,
2026-12-07, ``33_flex_vs_baselines``, step ``n23ab``): the timed rounds of one process took
3.148 then 2.837 s (PEFT fp32 adapters, batch 32) and 3.126 then 2.629 s (no LoRA, batch 32), the
slow round holding 0.318 s / 0.479 s of garbage collection (``gc_s``), the other 0.003 s; on this
project's CPU host a process with torch, transformers, trl and SmolLM2's engine tracks ~402,000
objects and one full collection took 0.19 s, 0.0 s after the freeze. Frozen objects are still
freed by reference counting; only reference cycles among them are never collected (vLLM accepts
that for its process; in a TRL colocate run its engine core freezes the trainer's heap too).

Run: ``python -c "import gc; from nbhelpers.engine.gc_watch import GcWatch; g = GcWatch();
exec('with g: gc.collect()'); print(g.stats())"``.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Self


class GcWatch:
    """Collections and their seconds inside a ``with`` block (module docstring).

    Args:
        pause: turn automatic collection off inside the block (restored on exit).
    """

    def __init__(self, pause: bool = False) -> None:
        self.pause = bool(pause)
        self.reset()
        self._t0: float | None = None
        self._was_enabled = True

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None
        self.collections += 1
        gen = int(info.get("generation", 0))
        if 0 <= gen < len(self.by_generation):
            self.by_generation[gen] += 1

    def __enter__(self) -> Self:
        self._was_enabled = gc.isenabled()
        gc.callbacks.append(self._callback)
        if self.pause:
            gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self.pause and self._was_enabled:
            gc.enable()

    def reset(self) -> None:
        """Zero the counters (the block, if entered, keeps counting from here)."""
        self.seconds, self.collections, self.by_generation = 0.0, 0, [0, 0, 0]

    def stats(self) -> dict[str, Any]:
        """``{"gc_s": seconds, "gc_collections": n, "gc_gen2": generation-2 count,
        "gc_paused": pause}`` (what ``LLM.last_stats`` carries)."""
        return {"gc_s": self.seconds, "gc_collections": self.collections,
                "gc_gen2": self.by_generation[2], "gc_paused": self.pause}


def freeze_gc_heap() -> dict[str, Any]:
    """vLLM's ``freeze_gc_heap`` (module docstring): ``gc.collect(0)``, ``gc.collect(1)``,
    ``gc.collect(2)``, then ``gc.freeze()``. Returns ``{"gc_frozen": objects in the permanent
    generation after the call (``gc.get_freeze_count()``), "gc_freeze_s": seconds the four calls
    took}``. Process-wide and cumulative: ``gc.unfreeze()`` undoes it."""
    t0 = time.perf_counter()
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    return {"gc_frozen": gc.get_freeze_count(), "gc_freeze_s": time.perf_counter() - t0}
