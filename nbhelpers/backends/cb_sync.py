"""``cb_sync``: transformers continuous batching driven on the main thread, no background thread.

Contract (DESIGN.md "Backend contract"): same model, adapter, sizing and options as ``hf_cb``
(:mod:`nbhelpers.backends.hf_cb`); ``generate`` runs scheduler + model steps in a loop on the
calling thread: ``prepare_next_batch`` -> ``_generation_step`` -> ``update_batch``, reading
finished requests from the manager's output queue. CUDA graphs (decode and varlen) come from
transformers' ``ModelRunner``, pre-captured by ``warmup`` at the largest padded sizes.

Two faults of the reference experiment's driver (unslothai/unsloth PR #5108,
``scripts/benchmarks/cb_sync_driver.py``) and what this file does instead:

1. *It exited at start-up.* Its loop was ``while batch_processor.has_pending_requests()``, but
   ``add_request`` only puts requests on the manager's ``input_queue``; the scheduler sees them only
   after ``prepare_next_batch`` drains that queue. The first check was False, the loop never ran
   and it returned no results. Here the loop always drains first and stops only when the input
   queue is empty *and* the scheduler has nothing pending (:func:`is_finished`).
2. *It hung in CUDA-graph capture.* Diagnosis from reading its code against transformers 4.57
   (not reproduced here: no GPU on the authoring machine): it captured
   ``manager._generation_step`` -- a whole step with host work in it (building the batch tensors,
   host-side reads of data-dependent sizes such as ``next_tokens.size(1)`` before copying the
   sampled tokens, which the PR's results file names as the likely cause) -- in the default
   global capture mode, and would have replayed one graph for every decode step although the
   batch and KV lengths change. A host synchronisation inside stream capture is illegal, and a
   blocking wait on a capturing stream never returns. The kind of fault: host-device
   synchronisation (or host-dependent control flow) inside a captured region. Here only device work is captured
   (``ModelRunner._forward_process_and_sample`` on static, padded buffers; one graph per padded
   (q, kv) shape; ``capture_error_mode="thread_local"``; an eager pass before each capture), the
   device-to-host copy of the tokens happens after the graph, and a watchdog
   (``faulthandler.dump_traceback_later``) turns any remaining hang into a traceback and exit,
   which the benchmark harness records in the sidecar.

Engine options: those of ``hf_cb`` plus ``watchdog_s`` (default 600; 0 disables it).
"""

from __future__ import annotations

import faulthandler
import queue
import sys
from typing import Any

from nbhelpers.backends import _common
from nbhelpers.backends.hf_cb import HFCBBackend, check_cb_options
from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams


def is_finished(input_queue: queue.Queue, processor: Any, scheduled: bool) -> bool:
    """True once nothing is queued, nothing is pending in the scheduler and no batch ran."""
    return not scheduled and input_queue.empty() and not processor.has_pending_requests()


class SyncCBDriver:
    """Owns one ``ContinuousBatchingManager`` (never started) and its batch processor."""

    def __init__(self, model: Any, gen_cfg: Any, cb_cfg: Any, watchdog_s: float = 600.0) -> None:
        self.model = model
        self.watchdog_s = watchdog_s
        self.manager = model.init_continuous_batching(generation_config=gen_cfg,
                                                      continuous_batching_config=cb_cfg)
        self.processor = self.manager._create_batch_processor()
        self.manager.batch_processor = self.processor
        with self._watchdog():
            self.processor.warmup(model)  # pre-captures the graphs (no-op without graphs)
        self.num_steps = 0

    def _watchdog(self) -> Any:
        driver = self

        class _Guard:
            def __enter__(self) -> None:
                if driver.watchdog_s > 0:
                    faulthandler.dump_traceback_later(driver.watchdog_s, exit=True,
                                                      file=sys.stderr)

            def __exit__(self, *exc: object) -> None:
                faulthandler.cancel_dump_traceback_later()

        return _Guard()

    def run(self, rows: list[list[int]], max_new_tokens: int) -> list[Any]:
        """Generate every row to completion; ``GenerationOutput``s in row order.

        Raises:
            RuntimeError: the scheduler stalls (pending requests but no batch) or the step budget
                (sum of prompt and new tokens + 1 per row) runs out.
        """
        import torch

        ids = self.manager.add_requests(rows, max_new_tokens=max_new_tokens)
        results: dict[str, Any] = {}
        budget, steps = sum(len(r) + max_new_tokens + 1 for r in rows), 0
        with self._watchdog(), torch.no_grad():
            while True:
                scheduled = self.processor.prepare_next_batch()  # drains input_queue first
                if scheduled:
                    self.processor._generation_step(self.model)
                    self.processor.update_batch()
                    self.num_steps += 1
                    steps += 1
                self._collect(results)
                if is_finished(self.manager.input_queue, self.processor, scheduled):
                    break
                if not scheduled or steps > budget:
                    raise RuntimeError(f"cb_sync stalled after {steps} steps with "
                                       f"{len(results)}/{len(rows)} requests done: enlarge "
                                       "num_blocks / max_batch_tokens.")
        return [results[i] for i in ids if i in results]

    def _collect(self, results: dict[str, Any]) -> None:
        out_q = self.manager.output_router.output_queue
        while True:
            try:
                res = out_q.get_nowait()
            except queue.Empty:
                return
            if res.is_finished():
                results[res.request_id] = res

    def close(self) -> None:
        self.processor = None
        self.manager.batch_processor = None
        self.manager.destroy()


class CBSyncBackend(HFCBBackend):
    """Main-thread continuous batching (see the module docstring for why and how)."""

    name = "cb_sync"

    def __init__(self) -> None:
        super().__init__()
        self.driver: SyncCBDriver | None = None

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None:
        device = engine_options.get("device") or _common.default_device()
        check_cb_options(engine_options, self.name, extra=frozenset({"watchdog_s"}),
                         cuda=device.startswith("cuda"))
        self.watchdog_s = float(engine_options.pop("watchdog_s", 600.0))
        super().load(model, lora, **engine_options)

    def _ensure_manager(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        key = self._manager_key(prompts, sampling)
        if self.driver is not None and key == self._cached_key:
            return
        if self.driver is not None:
            self.driver.close()
        cb_cfg = self.cb_config(sampling)
        cb_cfg.use_async_batching = False  # one IO pair: update right after each step
        gen_cfg = _common.generation_config(sampling, self.eos, self.pad_id)
        self.driver = SyncCBDriver(self.model, gen_cfg, cb_cfg, self.watchdog_s)
        self._cached_key = key

    def _run_rows(self, rows: list[list[int]], sampling: SamplingParams) -> list[Any]:
        """``GenerationOutput`` per row from the main-thread driver (no ``generate_batch``)."""
        outputs = self.driver.run(rows, sampling.max_new_tokens)
        self.info = {**self._common_info(), "num_steps_total": self.driver.num_steps}
        return outputs

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
        self.driver = None
        self.model = None
        _common.free_device_memory()
