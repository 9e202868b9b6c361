"""Per-step GRPO statistics and a completion sampler for :mod:`nbhelpers.grpo.setup`.

Contract: :class:`StatisticsCallback` is a ``transformers.TrainerCallback`` that records one dict
per optimiser step (wall time, peak memory, loss, each reward function's mean, KL, grad norm,
completion length) from the trainer's step hooks and TRL's log dict; :meth:`summary` gives the
post-warm-up medians. :class:`CompletionRecorder` wraps the reward functions so the notebook can
show real completions beside the rewards they got. Both run on the CPU (tests drive them with fake
logs); nothing heavy is imported at module import time except ``transformers`` (the base class).

Run: ``pytest tests/unit/test_grpo.py``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from transformers import TrainerCallback

from nbhelpers.stats import _cuda_sync, finite_or_none, median, peak_memory_gib, reset_peak_memory

log = logging.getLogger(__name__)

# TRL 1.15.0 log keys (trl/trainer/grpo_trainer.py, ``self._metrics[mode][...]``) -> our keys.
TRL_LOG_KEYS: dict[str, str] = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "kl": "kl",
    "entropy": "entropy",
    "reward": "reward",
    "reward_std": "reward_std",
    "learning_rate": "learning_rate",
    "completions/mean_length": "completion_length_mean_tokens",
    "completions/clipped_ratio": "completion_clipped_ratio",
    "num_tokens": "num_tokens_total",  # cumulative prompt + completion tokens seen
    # importance sampling (nbhelpers.grpo.flex_rollout.IS_KEYS; TRL's own for the applied ratio)
    "sampling/importance_sampling_ratio/mean": "is_ratio_applied_mean",
    "sampling/token_is_ratio/mean": "is_token_ratio_mean",
    "sampling/token_is_ratio/outside_0.9_1.1": "is_token_outside_0.9_1.1",
    "sampling/same_support_logp_difference/mean": "same_support_logp_diff_mean",
    "sampling/token_is_ratio_filtered/mean": "is_filtered_ratio_mean",  # flex: vLLM-style
    "sampling/token_is_ratio_filtered/outside_0.9_1.1": "is_filtered_outside_0.9_1.1",
}
REWARD_PREFIX, REWARD_SUFFIX = "rewards/", "/mean"
RewardFunc = Callable[..., list[float]]


def _reward_means(logs: dict[str, Any]) -> dict[str, float | None]:
    """``rewards/<func>/mean`` entries of a TRL log dict, keys kept as TRL spells them."""
    return {k: finite_or_none(v) for k, v in logs.items()
            if k.startswith(REWARD_PREFIX) and k.endswith(REWARD_SUFFIX)}


PEAK_KEYS = ("peak_mem_allocated_gib", "peak_mem_device_gib", "peak_mem_device_max_gib")
"""Per-step memory keys a summary takes the maximum of (``peak_mem_device_max_gib`` recorded
since 2026-12-04: older records lack it)."""


class StatisticsCallback(TrainerCallback):
    """Records per optimiser step: ``wall_s`` (seconds, CUDA-synchronised),
    ``peak_mem_allocated_gib``, ``peak_mem_device_gib`` and ``peak_mem_device_max_gib`` (GiB;
    GPU: ``torch.cuda.max_memory_allocated`` since the step began, card memory in use at the
    step's end, and the card's estimated peak during the step,
    :func:`nbhelpers.stats.peak_memory_gib`; CPU: process peak RSS for all three), and from
    TRL's logs ``loss``, ``grad_norm``, ``kl`` (logged by TRL only when ``beta > 0``),
    ``reward``, each ``rewards/<func>/mean``, ``completion_length_mean_tokens``.

    With a ``timer`` (:class:`~nbhelpers.grpo.step_timing.StepTimer`, set by
    :func:`nbhelpers.grpo.trainer.train`) each record also gets its split of ``wall_s``:
    :data:`~nbhelpers.grpo.step_timing.TIME_KEYS`, and the step's Python garbage collection:
    :data:`~nbhelpers.grpo.step_timing.GC_KEYS`.

    ``records`` is a list of flat dicts, one per step, ready for ``pandas.DataFrame``.
    """

    def __init__(self, timer: Any = None) -> None:
        self.timer = timer
        self.records: list[dict[str, Any]] = []
        self._by_step: dict[int, dict[str, Any]] = {}
        self._t0: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        reset_peak_memory()
        _cuda_sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _cuda_sync()
        wall_s = time.perf_counter() - self._t0 if self._t0 is not None else None
        mem = peak_memory_gib()
        rec = self._record(state.global_step)
        rec.update(wall_s=wall_s, peak_mem_allocated_gib=mem["allocated"],
                   peak_mem_device_gib=mem["device"], peak_mem_device_max_gib=mem["device_max"])
        if self.timer is not None:
            rec.update(self.timer.split(wall_s))
            rec.update(self.timer.gc_split())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "train_runtime" in logs:  # the end-of-training summary is not a step
            return
        rec = self._record(state.global_step)
        rec.update({ours: finite_or_none(logs[trl]) for trl, ours in TRL_LOG_KEYS.items()
                    if trl in logs})
        rec.update(_reward_means(logs))

    def _record(self, step: int) -> dict[str, Any]:
        if step not in self._by_step:
            self._by_step[step] = {"step": step}
            self.records.append(self._by_step[step])
        return self._by_step[step]

    @property
    def reward_keys(self) -> list[str]:
        """The ``rewards/<func>/mean`` keys seen so far, in first-seen order."""
        keys: dict[str, None] = {}
        for rec in self.records:
            keys.update({k: None for k in rec if k.startswith(REWARD_PREFIX)})
        return list(keys)

    def summary(self, skip_first: int = 3) -> dict[str, Any]:
        """Post-warm-up medians over steps ``skip_first+1 ..`` (the reference's "median over steps
        4..N", results/grpo_equivalence.md of Unsloth PR #5108).

        With ``skip_first`` or fewer steps recorded, all steps are used and ``note`` says so.
        ``peak_mem_*_gib`` are maxima over all steps, not medians. Returns ``None`` for metrics
        that were never logged (``kl`` with ``beta == 0``).

        Raises:
            ValueError: ``skip_first < 0``.
        """
        if skip_first < 0:
            raise ValueError(f"skip_first={skip_first}: must be >= 0 (3 skips the warm-up steps).")
        recs, note = self.records[skip_first:], None
        if not recs:
            recs = self.records
            note = (f"only {len(recs)} step(s) recorded, not more than skip_first={skip_first}: "
                    "medians use all steps (warm-up included)")
            log.warning(note)
        out: dict[str, Any] = {"n_steps": len(self.records), "n_steps_in_median": len(recs),
                               "skip_first": skip_first if note is None else 0, "note": note}
        out["step_time_s_median"] = median([r.get("wall_s") for r in recs])
        for key in ("loss", "grad_norm", "kl", "reward", "completion_length_mean_tokens",
                    *self.reward_keys):
            out[f"{key}_median"] = median([r[key] for r in recs if r.get(key) is not None])
        for key in PEAK_KEYS:
            vals = [r[key] for r in self.records if r.get(key) is not None]
            out[key] = max(vals) if vals else None
        return out


def _completion_text(completion: Any) -> str:
    """Text of a TRL completion: a string, or a conversational ``[{"role", "content"}]`` list."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion if isinstance(m, dict))


def _prompt_text(prompt: Any) -> str:
    """The last user message of a conversational prompt, or the prompt string itself."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return users[-1] if users else _completion_text(prompt)


class CompletionRecorder(TrainerCallback):
    """Keeps (step, question, completion, answer, reward per function) rows, ``max_rows`` at most.

    Use :meth:`wrap` on the reward functions before handing them to ``GRPOTrainer``: each wrapper
    keeps the function's ``__name__`` (TRL logs ``rewards/<__name__>/mean``) and returns its scores
    unchanged. As a callback it tags rows with the optimiser step being computed.
    """

    def __init__(self, max_rows: int = 256) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows}: must be >= 1.")
        self.max_rows = max_rows
        self.rows: list[dict[str, Any]] = []
        self.step = 0
        self._batch_rows: dict[tuple[int, str], list[dict[str, Any]]] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def wrap(self, funcs: Sequence[RewardFunc]) -> list[RewardFunc]:
        """Wrapped copies of TRL-signature reward functions ``f(prompts, completions, **kw)``."""
        return [self._wrap_one(f) for f in funcs]

    def _wrap_one(self, func: Callable[..., list[float]]) -> Callable[..., list[float]]:
        @functools.wraps(func)
        def recorded(prompts=None, completions=None, **kwargs):
            scores = func(prompts=prompts, completions=completions, **kwargs)
            self._add(func.__name__, prompts, completions, kwargs.get("answer"), scores)
            return scores
        return recorded

    def _add(self, name: str, prompts, completions, answers, scores) -> None:
        key = (self.step, _completion_text(completions[0]) if completions else "")
        rows = self._batch_rows.get(key)
        if rows is None:
            if len(self.rows) + len(completions) > self.max_rows:
                return
            answers = answers if answers is not None else [None] * len(completions)
            rows = [{"step": self.step, "question": _prompt_text(p),
                     "completion": _completion_text(c), "answer": a}
                    for p, c, a in zip(prompts, completions, answers)]
            self._batch_rows[key] = rows
            self.rows.extend(rows)
        for row, score in zip(rows, scores):
            row[name] = finite_or_none(score)
