"""The flex engine's facade: ``LLM(model).generate(prompts, SamplingParams) -> list[Completion]``.

Contract (vLLM-like): prompts are token-id lists; ``sampling.n`` samples per prompt come back
prompt-major (``[p0s0, p0s1, ..., p1s0, ...]``); each :class:`~nbhelpers.config.Completion`
carries the generated ids, the sampled tokens' logprobs (``logprobs``: under the filtered
distribution sampled from; ``full_logprobs``: under the full softmax at the same temperature, see
:mod:`nbhelpers.engine.sampler`) and ``finish_reason`` (``stop`` on EOS /
``stop_token_ids``, else ``length``). The engine runs on the HF model's own parameters (PEFT LoRA
live, see :mod:`nbhelpers.engine.lora`); ``sleep()`` frees the KV pool and the CUDA graphs,
``wake_up()`` restores them. Seeds: ``sampling.seed`` + sample index (``seed=None``: drawn from
torch's global RNG, so ``torch.manual_seed`` makes runs reproducible).

Run::

    from nbhelpers.config import SamplingParams
    from nbhelpers.engine import LLM
    llm = LLM(hf_model, page_size=16, num_pages=64)
    outs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=8))
"""

from __future__ import annotations

import time
from typing import Any

from nbhelpers.config import Completion, SamplingParams, resolve_sampling
from nbhelpers.engine.gc_watch import GcWatch, freeze_gc_heap
from nbhelpers.engine.kv_cache import PagePool
from nbhelpers.engine.llm_checks import (
    check_causal_lm,
    check_cuda_graphs,
    check_flag,
    check_generate_kwargs,
    check_limits,
    check_options,
    eos_ids,
    fit_max_model_len,
    normalize_prompts,
)
from nbhelpers.engine.model_runner import ModelRunner, RunnerOptions
from nbhelpers.engine.scheduler import Scheduler, Sequence

__all__ = ["LLM", "check_cuda_graphs", "normalize_prompts"]


class LLM:
    """Flex engine over an HF causal LM (see module docstring).

    Args:
        model: a ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` (optionally PEFT-wrapped), on its device.
        eos_token_id: an int or a sequence of ints that ends a sequence unless ``ignore_eos``;
            default ``model.config.eos_token_id``.
        max_num_seqs: most sequences decoding at once, 1..512; max_prefill_tokens: prompt tokens
            per prefill step, >= 1 (the first waiting group is admitted even when longer).
        share_prefix: ``True`` / ``False``: prefill the ``n`` samples of a prompt once (GRPO
            group prefix sharing).
        allow_long_max_model_len: ``True`` lets an explicit ``max_model_len`` exceed the model's
            context (``config.max_position_embeddings``; vLLM's
            ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``). Without ``max_model_len`` the engine takes the
            smaller of 2048 and that context.
        **options: :class:`~nbhelpers.engine.model_runner.RunnerOptions` fields.

    Attributes:
        last_stats: numbers of the latest ``generate`` call (see :meth:`generate`).

    Raises:
        TypeError: ``model`` is not a loaded HF causal LM (a base ``LlamaModel`` without
            ``lm_head``: pass the ``*ForCausalLM``), an unknown option (the message names
            the closest valid one), ``share_prefix`` / ``allow_long_max_model_len`` not a bool,
            or an ``eos_token_id`` that is not int ids
            (:class:`~nbhelpers.token_ids.TokenIdsError`).
        ValueError: unsupported architecture, bad options (e.g. a ``page_size`` the CUDA kernels
            cannot serve: :func:`~nbhelpers.engine.kv_cache.check_page_size` names the valid
            sizes), ``max_num_seqs`` not an int in [1, 512] (the largest decode batch),
            ``max_prefill_tokens`` not an int >= 1, an EOS id outside ``[0, vocab_size)``, ``use_cuda_graphs=True`` for a model that is
            not on a CUDA device, ``max_model_len`` above the model's context (all checked at
            construction, before the engine is built), or, at ``generate``, a prompt longer than
            max_model_len.
    """

    def __init__(self, model: Any, eos_token_id: int | list[int] | None = None,
                 max_num_seqs: int = 256, max_prefill_tokens: int = 8192,
                 share_prefix: bool = True, allow_long_max_model_len: bool = False,
                 **options: Any):
        check_causal_lm(model)
        check_options(options)
        check_limits(max_num_seqs, max_prefill_tokens)
        check_flag("share_prefix", share_prefix, "prefill the n samples of a prompt once")
        check_cuda_graphs(model, options.get("use_cuda_graphs"))
        self.eos_ids = eos_ids(model.config, eos_token_id)
        options = fit_max_model_len(model.config, options, allow_long_max_model_len)
        self.runner = ModelRunner(model, RunnerOptions(**options))
        self.opt = self.runner.opt
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.share_prefix = share_prefix
        self.last_stats: dict[str, Any] = {}
        self.trace: list[dict[str, Any]] | None = None  # set to [] to record the schedule
        self._next_id = 0
        self._gc_frozen = False  # RunnerOptions.freeze_gc: done after the first generate

    # ---------------------------------------------------------------- public API
    def generate(self, prompts: list[list[int]] | list[dict[str, list[int]]],
                 sampling: SamplingParams | None = None, *,
                 sampling_params: SamplingParams | None = None,
                 **unsupported: Any) -> list[Completion]:
        """Generate ``sampling.n`` completions per prompt; see the module docstring.

        ``sampling_params=`` is vLLM's name for ``sampling`` and is accepted as an alias (as in
        every rollout backend, :func:`nbhelpers.config.resolve_sampling`). A prompt is a list of
        token ids or vLLM's ``TokensPrompt`` dict ``{"prompt_token_ids": ids}``; any other
        keyword (``max_tokens=``, ``temperature=``, ``use_tqdm=``...) raises ``TypeError`` naming
        where it belongs (:func:`~nbhelpers.engine.llm_checks.check_generate_kwargs`).

        Sets :attr:`last_stats`. Per call (this ``generate`` only): ``wall_s`` (seconds of the
        scheduling loop, prompt checks excluded), ``num_preemptions``, and the runner's counters
        ``prefill_s``, ``decode_s``, ``host_s`` (seconds; see
        :mod:`nbhelpers.engine.model_runner`), ``decode_steps``, ``prefill_tokens`` (tokens
        actually prefilled: shared prefixes once), ``graph_captures`` (decode),
        ``prefill_graph_captures`` and ``prefill_graph_replays`` (``prefill_graphs`` resolved on),
        and the Python garbage collections inside the scheduling loop: ``gc_s`` (seconds),
        ``gc_collections``, ``gc_gen2`` (full collections), ``gc_paused`` (the ``pause_gc``
        option: automatic collection off for the loop; :mod:`nbhelpers.engine.gc_watch`); with
        the ``freeze_gc`` option, the first call also gets ``gc_frozen`` and ``gc_freeze_s``
        (the heap freeze that follows its loop, not counted in ``wall_s``).
        Cumulative (since the engine was built or :meth:`reset_timings`): the same counters as
        ``total_<key>`` (``total_decode_s``...), which is what ``runner.timings`` holds. Before 2026-12-01 the
        unprefixed counters were the cumulative ones; every reader in the repo either called
        :meth:`reset_timings` first or made one call, for which both agree.

        Raises:
            TypeError: both or neither of ``sampling`` / ``sampling_params`` given, or not a
                ``SamplingParams``; prompts that are not token-id lists (a tokenizer's
                ``BatchEncoding``: pass its ``.input_ids``); a keyword ``generate`` lacks.
            ValueError: an empty prompt, prompt or stop ids outside the vocabulary, or prompt +
                ``max_new_tokens`` above ``max_model_len``.
            RuntimeError: called after :meth:`sleep` without :meth:`wake_up`.
        """
        check_generate_kwargs(unsupported)
        sampling = resolve_sampling("LLM", sampling, sampling_params)
        prompts = normalize_prompts(prompts)
        self._check(prompts, sampling)
        if self.runner.kv is None:
            raise RuntimeError("LLM.generate after sleep(): call wake_up() first.")
        sched = Scheduler(PagePool(self.opt.num_pages, self.opt.page_size), self.max_num_seqs,
                          self.max_prefill_tokens)
        seqs = self._make_seqs(prompts, sampling, sched)
        before = dict(self.runner.timings)
        t0 = time.perf_counter()
        self.runner.begin_generate()  # the live-weights check, once for the whole call
        gc_watch = GcWatch(self.opt.pause_gc)
        try:
            with gc_watch:
                while not sched.is_done:
                    self._step(sched, sampling)
        finally:
            self.runner.end_generate()
        total = dict(self.runner.timings)
        self.last_stats = {"wall_s": time.perf_counter() - t0,
                           "num_preemptions": sched.num_preemptions,
                           **{k: v - before.get(k, 0) for k, v in total.items()},
                           **{f"total_{k}": v for k, v in total.items()},
                           **gc_watch.stats()}
        if self.opt.freeze_gc and not self._gc_frozen:  # vLLM's heap freeze, after warm-up
            self._gc_frozen = True
            self.last_stats.update(freeze_gc_heap())
        return [Completion(list(s.prompt_ids), list(s.out_ids), list(s.out_logprobs),
                           s.finish_reason or "length",
                           full_logprobs=list(s.out_full_logprobs)) for s in seqs]

    def sleep(self) -> None:
        """Free the KV pool and the CUDA graphs (weights stay: they are the trainer's)."""
        self.runner.free_kv()
        _empty_cache()

    def wake_up(self) -> None:
        """Re-allocate the KV pool (graphs are re-captured on the next decode)."""
        if self.runner.kv is None:
            self.runner.allocate_kv()

    def reset_timings(self) -> None:
        """Zero the cumulative counters (``runner.timings``, ``last_stats['total_*']``)."""
        for k in self.runner.timings:
            self.runner.timings[k] = 0 if isinstance(self.runner.timings[k], int) else 0.0

    # ---------------------------------------------------------------- internals
    def _check(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        limit, vocab = self.opt.max_model_len, self.runner.model.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs >= 1 token id (a chat "
                                 "prompt has at least the template's tokens).")
            if len(p) + sampling.max_new_tokens > limit:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens="
                                 f"{sampling.max_new_tokens} must be in [1, max_model_len="
                                 f"{limit}]: raise max_model_len or shorten it.")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i}: token ids must be in [0, vocab_size={vocab}); got "
                                 f"{min(p)}..{max(p)}: tokenize with the model's tokenizer.")
        if bad := sorted(t for t in sampling.stop_token_ids if t >= vocab):
            raise ValueError(f"SamplingParams.stop_token_ids: {bad} outside [0, vocab_size="
                             f"{vocab}): such an id is never sampled, so it never stops a "
                             "sequence; take the ids from the model's tokenizer.")

    def _make_seqs(self, prompts: list[list[int]], sampling: SamplingParams,
                   sched: Scheduler) -> list[Sequence]:
        import torch
        stop = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos
                                                      else self.eos_ids)
        out = []
        for p_idx, prompt in enumerate(prompts):
            group = []
            for s_idx in range(sampling.n):
                base = (sampling.seed if sampling.seed is not None
                        else int(torch.randint(0, 2**62, (1,)).item()))
                seed = base + p_idx * sampling.n + s_idx
                group.append(Sequence(self._next_id, list(prompt), seed, sampling.max_new_tokens,
                                      stop))
                self._next_id += 1
            for g in ([group] if self.share_prefix else [[s] for s in group]):
                sched.add_group(g)
            out += group
        return out

    def _step(self, sched: Scheduler, sampling: SamplingParams) -> None:
        groups = sched.schedule_prefill()
        if groups:
            self.runner.prefill(groups, sampling)
            for g in groups:
                sched.start_running(g)
            self._record("prefill", sched, [s.seq_id for g in groups for s in g])
            return
        if not sched.running:
            raise RuntimeError("flex engine: nothing runnable and nothing admitted; the pool "
                               "is too small for the waiting request: raise num_pages.")
        steps = min(self.opt.sync_every, min(s.remaining for s in sched.running))
        preempted = sched.num_preemptions
        sched.reserve_decode(steps)
        if sched.num_preemptions > preempted:
            self._record("preempt", sched, [])
        self.runner.decode(sched.running, steps, sampling)
        self._record("decode", sched, [s.seq_id for s in sched.running], steps)
        sched.retire_finished()

    def _record(self, kind: str, sched: Scheduler, seq_ids: list[int], steps: int = 0) -> None:
        """Append one schedule event (kind, sequences, block tables, free pages) to ``trace``."""
        if self.trace is None:
            return
        self.trace.append({
            "event": len(self.trace), "kind": kind, "seq_ids": seq_ids, "steps": steps,
            "free_pages": sched.pool.num_free, "num_waiting": sum(map(len, sched.waiting)),
            "block_tables": {s.seq_id: list(s.block_table) for s in sched.running},
            "num_tokens": {s.seq_id: s.num_tokens for s in sched.running}})


def _empty_cache() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
