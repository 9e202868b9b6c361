"""Scheduler: waiting/running queues, admission by free pages, preemption and resumption.

Contract (after nano-vllm's ``engine/scheduler.py``): requests wait in FIFO groups (the ``n``
samples of one prompt form one group so the prompt is prefilled once and its pages are shared).
A group is admitted when the pool has pages for its prompt plus one page per sample and the
running set has room (``max_num_seqs``) and the prefill token budget allows it. Before each decode
window the scheduler reserves pages for the next ``k`` tokens of every running sequence; when the
pool runs out it preempts the most recently admitted sequence (frees its pages, puts it first in
the waiting queue); a resumed sequence re-prefills its prompt plus the tokens it already generated
and continues with the same seed stream, so its tokens do not change. A request that cannot fit
even alone raises ``ValueError`` naming the fix: never a crash mid-run, never a silent truncation.

Run: ``pytest tests/engine/test_scheduler.py``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nbhelpers.engine.kv_cache import OutOfPages, PagePool


@dataclass
class Sequence:
    """One sample being generated. ``block_table`` lists its physical pages (logical order)."""

    seq_id: int
    prompt_ids: list[int]
    seed: int
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    out_ids: list[int] = field(default_factory=list)
    # per token: the logprob under the filtered distribution sampled from, and under the full
    # softmax (sampler.sample's two columns); two flat float lists, not a [filtered, full] pair
    # per token: a pair list is a GC-tracked object, so b32 x 512 tokens made 16k of them a call
    # and, in a trainer's large heap, the occasional 0.3-0.5 s full collection inside a rollout
    # (H100 A/B of 2026-12-07, docs/results_history.md); floats are not tracked
    out_logprobs: list[float] = field(default_factory=list)
    out_full_logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # leading pages of block_table shared with the other samples of its prompt (0: none); the
    # decode kernel's shared_prefix option reads them once per group (paged_decode_prefix.py)
    shared_pages: int = 0
    num_cached: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.out_ids

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.out_ids)

    def append(self, token: int, logprob: float, full_logprob: float) -> bool:
        """Record a sampled token and its two logprobs (filtered, full softmax); returns True when
        the sequence just finished."""
        self.out_ids.append(token)
        self.out_logprobs.append(logprob)
        self.out_full_logprobs.append(full_logprob)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.remaining <= 0:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def extend(self, tokens: list[int], logprobs: list[float],
               full_logprobs: list[float]) -> bool:
        """Record a decode window's tokens up to and including the first that finishes the
        sequence, what :meth:`append` one at a time would record and decide (at least one
        token; a stop id wins over the length limit on the same token); returns True when the
        sequence finished. One call per row and window instead of one per token: the batch-64 x
        512-token rollout made 32,768 ``append`` calls with the GPU idle."""
        n = min(len(tokens), max(self.remaining, 1))
        reason = "length" if n >= self.remaining else None
        if self.stop_ids:
            hit = next((i for i, t in enumerate(tokens[:n]) if t in self.stop_ids), None)
            if hit is not None:
                n, reason = hit + 1, "stop"
        self.out_ids.extend(tokens[:n])
        self.out_logprobs.extend(logprobs[:n])
        self.out_full_logprobs.extend(full_logprobs[:n])
        if reason is not None:
            self.finish_reason = reason
        return reason is not None


class Scheduler:
    """Queues and page bookkeeping; the model runner does the compute.

    Raises:
        ValueError: a request needs more pages than the whole pool (message: raise num_pages).
    """

    def __init__(self, pool: PagePool, max_num_seqs: int, max_prefill_tokens: int):
        self.pool = pool
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add_group(self, group: list[Sequence]) -> None:
        if len(group) > self.max_num_seqs:
            raise ValueError(f"a request group has n={len(group)} samples > max_num_seqs="
                             f"{self.max_num_seqs}: raise max_num_seqs or lower n.")
        usable, page = self.pool.num_pages - 1, self.pool.page_size
        need = self._group_pages(group) + len(group)
        lead = group[0]
        # one sample's pages at its last token (KV for prompt + max_new_tokens - 1 positions):
        # refused here, before any work, not mid-decode where finished completions would be lost
        longest = self.pool.pages_for(len(lead.prompt_ids) + lead.max_new_tokens - 1)
        want = max(need, longest) + 1  # one fix that clears both checks (+1: the null page)
        if need > usable:
            raise ValueError(f"a request group needs {need} pages (its prompt's plus one per "
                             f"sample), the pool has {self.pool.num_pages - 1} usable: "
                             f"num_pages={self.pool.num_pages} counts page 0, the null page "
                             "that unused block-table slots point at; raise num_pages to >= "
                             f"{want}{self._longest_note(longest, need, lead)} (or lower n / "
                             "max_new_tokens / prompt length).")
        if longest > usable:
            raise ValueError(f"a {len(lead.prompt_ids)}-token prompt + max_new_tokens="
                             f"{lead.max_new_tokens} needs {longest} pages of {page} tokens; the "
                             f"pool has {usable} usable (num_pages={self.pool.num_pages} counts "
                             f"page 0, the null page): raise num_pages to >= {want} (or "
                             "lower max_new_tokens / the prompt length).")
        self.waiting.append(group)

    def _longest_note(self, longest: int, need: int, lead: Sequence) -> str:
        """Why the suggested ``num_pages`` is above ``need + 1``: a sample's own pages by its
        last token (``prompt + max_new_tokens - 1`` KV positions), when that is larger."""
        if longest <= need:
            return ""
        return (f" (each sample alone needs {longest} pages of {self.pool.page_size} tokens by "
                f"its last token: {len(lead.prompt_ids)} prompt + {lead.max_new_tokens} new)")

    @property
    def is_done(self) -> bool:
        return not self.waiting and not self.running

    def _group_pages(self, group: list[Sequence]) -> int:
        lead = group[0]
        n_full, partial = divmod(lead.num_tokens, self.pool.page_size)
        return n_full + (len(group) if partial else 0)

    def schedule_prefill(self) -> list[list[Sequence]]:
        """Admit waiting groups (FIFO) while pages, seats and the token budget allow."""
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting:
            group = self.waiting[0]
            tokens = group[0].num_tokens
            seats = len(self.running) + sum(map(len, admitted)) + len(group)
            pages = self._group_pages(group) + len(group)
            if seats > self.max_num_seqs or pages > self.pool.num_free or (
                    admitted and tokens > budget):
                break
            self.waiting.popleft()
            self._allocate_group(group)
            admitted.append(group)
            budget -= tokens
        return admitted

    def _allocate_group(self, group: list[Sequence]) -> None:
        """Leader gets pages for all its tokens; followers share the full pages and get their
        own copy target for a partly filled last page (copy-on-write done by the runner)."""
        lead = group[0]
        lead.block_table = self.pool.allocate(self.pool.pages_for(lead.num_tokens))
        n_full = lead.num_tokens // self.pool.page_size
        for seq in group[1:]:
            self.pool.share(lead.block_table[:n_full])
            own = self.pool.allocate(len(lead.block_table) - n_full)
            seq.block_table = lead.block_table[:n_full] + own
        for seq in group:
            seq.shared_pages = n_full if len(group) > 1 else 0

    def start_running(self, group: list[Sequence]) -> None:
        for seq in group:
            seq.num_cached = seq.num_tokens - 1  # the last sampled token is not in the cache yet
            if seq.finish_reason is None:
                self.running.append(seq)
            else:
                self.free(seq)

    def reserve_decode(self, steps: int) -> None:
        """Pages for positions ``num_tokens - 1 .. + steps - 1`` of every running sequence,
        preempting the newest sequences when the pool runs out."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            need = self.pool.pages_for(seq.num_tokens - 1 + steps) - len(seq.block_table)
            try:
                seq.block_table += self.pool.allocate(max(0, need))
                i += 1
            except OutOfPages:
                victim = self.running[-1]
                if victim is seq and i == 0:
                    raise ValueError(f"one sequence needs more than the {self.pool.num_pages - 1}"
                                     " pages of the pool: raise num_pages.") from None
                self.preempt(victim)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages; it resumes later by re-prefilling prompt + generated tokens."""
        self.running.remove(seq)
        self.free(seq)
        seq.num_cached = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft([seq])

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.shared_pages = 0

    def retire_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finish_reason is not None]
        for seq in done:
            self.running.remove(seq)
            self.free(seq)
        return done
