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

    from nbhelpers.engine import LLM
    llm = LLM(hf_model, page_size=16, num_pages=64)
    outs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=8))
"""

from __future__ import annotations

import difflib
import numbers
import time
from typing import Any

from nbhelpers.config import Completion, SamplingParams
from nbhelpers.engine.kv_cache import PagePool
from nbhelpers.engine.model_runner import BUCKETS, ModelRunner, RunnerOptions
from nbhelpers.engine.runner_options import option_names
from nbhelpers.engine.scheduler import Scheduler, Sequence


def normalize_prompts(prompts: Any) -> list[list[int]]:
    """``prompts`` as a list of token-id lists: any iterable of sequences of ints (a generator is
    read once; 1-D tensors/arrays become lists).

    Raises:
        TypeError: a string, a flat list of ints, or ids that are not ints (the message says what
            to pass instead).
    """
    if isinstance(prompts, (str, bytes)):
        raise TypeError("LLM.generate takes token ids, not text: pass "
                        "[tokenizer(text).input_ids, ...].")
    try:
        rows = list(prompts)
    except TypeError as exc:
        raise TypeError(f"LLM.generate(prompts): a list of token-id lists is expected, got "
                        f"{type(prompts).__name__}.") from exc
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, (int, float)) and not isinstance(row, bool):
            raise TypeError("LLM.generate(prompts) got a flat list of ids: wrap one prompt as "
                            "[prompt_ids].")
        if isinstance(row, (str, bytes)):
            raise TypeError(f"prompt {i} is text: pass tokenizer(text).input_ids.")
        row = row.tolist() if hasattr(row, "tolist") else list(row)
        bad = next((t for t in row if isinstance(t, bool)
                    or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise TypeError(f"prompt {i}: token ids must be ints, got {type(bad).__name__} "
                            f"{bad!r}.")
        out.append([int(t) for t in row])
    return out


def check_options(options: dict[str, Any]) -> None:
    """Raise ``TypeError`` for an ``LLM(**options)`` name that is no RunnerOptions field (the
    message names the closest field and lists them all)."""
    known = option_names()
    if unknown := sorted(set(options) - known):
        close = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
        hint = "; ".join(f"{u!r}: did you mean {c[0]!r}?" for u, c in close.items() if c)
        raise TypeError(f"LLM: unknown option(s) {unknown}{' (' + hint + ')' if hint else ''}"
                        f". Options: max_num_seqs, max_prefill_tokens, share_prefix and the "
                        f"RunnerOptions fields {sorted(known)}.")


def check_limits(max_num_seqs: Any, max_prefill_tokens: Any) -> None:
    """Raise ``ValueError`` unless ``max_num_seqs`` is an int in ``[1, BUCKETS[-1]]`` (sequences
    decoding at once; the largest decode batch bucket is 512) and ``max_prefill_tokens`` an
    int >= 1 (tokens per prefill step; a longer prompt still prefills alone)."""
    for name, value, high, what in (
            ("max_num_seqs", max_num_seqs, BUCKETS[-1],
             f"sequences decoding at once; {BUCKETS[-1]} is the largest decode batch"),
            ("max_prefill_tokens", max_prefill_tokens, None, "prompt tokens per prefill step")):
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
        if not ok or (high is not None and value > high):
            span = f"in [1, {high}]" if high is not None else ">= 1"
            raise ValueError(f"LLM({name}={value!r}): pass an int {span} ({what}).")


def check_cuda_graphs(model: Any, use_cuda_graphs: Any) -> None:
    """Raise ``ValueError`` for ``use_cuda_graphs=True`` when ``model``'s parameters are not on a
    CUDA device (graphs cannot be captured there; ``None`` already means on iff CUDA)."""
    if use_cuda_graphs is not True:
        return
    param = next(iter(model.parameters()), None)
    if param is None or not param.is_cuda:
        where = "no parameters" if param is None else f"parameters on {param.device}"
        raise ValueError(f"LLM(use_cuda_graphs=True): CUDA graphs need the model on a CUDA "
                         f"device, this one has {where}: leave use_cuda_graphs=None (on iff "
                         "CUDA) or pass use_cuda_graphs=False on the CPU, or move the model to "
                         "CUDA first (model.to('cuda')).")


class LLM:
    """Flex engine over an HF causal LM (see module docstring).

    Args:
        model: a ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` (optionally PEFT-wrapped), on its device.
        eos_token_id: ends a sequence unless ``ignore_eos``; default ``model.config.eos_token_id``.
        max_num_seqs: most sequences decoding at once, 1..512; max_prefill_tokens: prompt tokens
            per prefill step, >= 1 (the first waiting group is admitted even when longer).
        share_prefix: prefill the ``n`` samples of a prompt once (GRPO group prefix sharing).
        **options: :class:`~nbhelpers.engine.model_runner.RunnerOptions` fields.
    Raises:
        TypeError: ``model`` is not a loaded HF model, or an unknown option (the message names
            the closest valid one).
        ValueError: unsupported architecture, bad options (e.g. a ``page_size`` the CUDA kernels
            cannot serve: :func:`~nbhelpers.engine.kv_cache.check_page_size` names the valid
            sizes), ``max_num_seqs`` not an int in [1, 512] (the largest decode batch),
            ``max_prefill_tokens`` not an int >= 1, ``use_cuda_graphs=True`` for a model that is
            not on a CUDA device (all checked at construction), or, at ``generate``, a prompt
            longer than max_model_len.
    """

    def __init__(self, model: Any, eos_token_id: int | list[int] | None = None,
                 max_num_seqs: int = 256, max_prefill_tokens: int = 8192,
                 share_prefix: bool = True, **options: Any):
        if not hasattr(model, "parameters") or not hasattr(model, "config"):
            raise TypeError(f"LLM(model) takes a loaded HF causal LM, got {type(model).__name__}: "
                            "e.g. nbhelpers.models.load_model(name)[0].")
        check_options(options)
        check_limits(max_num_seqs, max_prefill_tokens)
        check_cuda_graphs(model, options.get("use_cuda_graphs"))
        self.runner = ModelRunner(model, RunnerOptions(**options))
        self.opt = self.runner.opt
        eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.share_prefix = share_prefix
        self.last_stats: dict[str, Any] = {}
        self.trace: list[dict[str, Any]] | None = None  # set to [] to record the schedule
        self._next_id = 0

    # ---------------------------------------------------------------- public API
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None, *,
                 sampling_params: SamplingParams | None = None) -> list[Completion]:
        """Generate ``sampling.n`` completions per prompt; see the module docstring.

        ``sampling_params=`` is vLLM's name for ``sampling`` and is accepted as an alias.

        Raises:
            TypeError: both or neither of ``sampling`` / ``sampling_params`` given, or not a
                ``SamplingParams``.
        """
        if (sampling is None) == (sampling_params is None):
            raise TypeError("LLM.generate(prompts, sampling): pass the SamplingParams once, as the "
                            "second argument `sampling` (vLLM's sampling_params= also works).")
        sampling = sampling if sampling is not None else sampling_params
        prompts = normalize_prompts(prompts)
        self._check(prompts, sampling)
        if self.runner.kv is None:
            raise RuntimeError("LLM.generate after sleep(): call wake_up() first.")
        sched = Scheduler(PagePool(self.opt.num_pages, self.opt.page_size), self.max_num_seqs,
                          self.max_prefill_tokens)
        seqs = self._make_seqs(prompts, sampling, sched)
        t0 = time.perf_counter()
        while not sched.is_done:
            self._step(sched, sampling)
        self.last_stats = {"wall_s": time.perf_counter() - t0,
                           "num_preemptions": sched.num_preemptions, **self.runner.timings}
        return [Completion(list(s.prompt_ids), list(s.out_ids), [lp[0] for lp in s.out_logprobs],
                           s.finish_reason or "length",
                           full_logprobs=[lp[1] for lp in s.out_logprobs]) for s in seqs]

    def sleep(self) -> None:
        """Free the KV pool and the CUDA graphs (weights stay: they are the trainer's)."""
        self.runner.free_kv()
        _empty_cache()

    def wake_up(self) -> None:
        """Re-allocate the KV pool (graphs are re-captured on the next decode)."""
        if self.runner.kv is None:
            self.runner.allocate_kv()

    def reset_timings(self) -> None:
        for k in self.runner.timings:
            self.runner.timings[k] = 0 if isinstance(self.runner.timings[k], int) else 0.0

    # ---------------------------------------------------------------- internals
    def _check(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError("LLM.generate(sampling=...) takes nbhelpers.config.SamplingParams.")
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
