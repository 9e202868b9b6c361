"""Importance sampling for a ``rollout_func`` engine (flex) in TRL's GRPO loss: the ratio, its
report, and which forward gives the trainer's logprobs for it.

Contract: pure functions of ``[B, T]`` logprob tensors (nats per token, TRL's completion padding)
plus :func:`trl_computes_old_logps` and :class:`RowCollector`, used by
:class:`nbhelpers.grpo.flex_rollout.FlexGRPOTrainer` (its module docstring says why the ratio is
taken over one support). Facts of TRL 1.15.0 this relies on, ``trl/trainer/grpo_trainer.py``:

* ``_generate_and_score_completions`` (lines 2563-2583) runs a no-grad policy forward for
  ``old_per_token_logps`` only when ``gradient_accumulation_steps % (steps_per_generation *
  num_iterations) != 0`` (samples may predate an optimizer step) or under vLLM's IS correction.
* ``_compute_loss`` runs the policy forward first (line 2956, ``compute_entropy=True``), then
  reads ``inputs.get("old_per_token_logps")`` and, when absent, uses ``per_token_logps.detach()``
  (lines 2991-2992), and reads ``inputs["importance_sampling_ratio"]`` (line 3073; vespo:
  ``get_gamma_weights``, line 3056) after that forward. A ratio made from that forward's
  detached logprobs and written into ``inputs`` before the forward returns is the one applied.
* ``_prepare_inputs`` (lines 1480-1509) shuffles the generation batch and splits it into
  ``steps_per_generation`` micro-batches of whole rows (``shuffle_sequence_dict``,
  ``split_tensor_dict`` in ``trl/trainer/utils.py``): every ``[B, ...]`` tensor key, ours too,
  stays with its row.

So when TRL computes no old logprobs (on-policy: the policy that sampled is the one the loss
runs), the trainer builds the ratio at loss time from the loss forward, per micro-batch, and no
extra forward runs; the rollout's logprobs travel in the batch (``sampling_per_token_logps``, the
full ones, and :data:`FILTERED_KEY`). Its report (:func:`is_report`) waits in a
:class:`RowCollector` until every row of the generation batch has gone through the loss, so the
logged numbers are the whole batch's, as when they were made at generation time.

Run: ``pytest tests/unit/test_is_ratio.py tests/unit/test_flex_is_loss_time.py``.
"""

from __future__ import annotations

import math
from typing import Any

FULL_KEY = "full_logprobs"
"""The rollout's extra key: engine logprobs under the full softmax at the sampling temperature."""
FILTERED_KEY = "flex_filtered_logps"
"""Batch key (``[B, T]``) of the engine's filtered logprobs ``log q_S`` (TRL's
``sampling_per_token_logps`` before the trainer swaps in :data:`FULL_KEY`'s), carried to the loss
for :data:`FILTERED_IS_KEYS` when the ratio is made there."""
IS_KEYS = {"ratio_mean": "sampling/token_is_ratio/mean",
           "outside": "sampling/token_is_ratio/outside_0.9_1.1",
           "same_support": "sampling/same_support_logp_difference/mean"}
"""Per-step IS report: token ratio ``exp(trainer - engine)`` mean, fraction of tokens outside
[0.9, 1.1], mean |engine - trainer| logprob on one support (nats/token)."""
FILTERED_IS_KEYS = {"ratio_mean": "sampling/token_is_ratio_filtered/mean",
                    "outside": "sampling/token_is_ratio_filtered/outside_0.9_1.1"}
"""Flex only, for comparison: the same two numbers against the engine's *filtered* logprob
``log q_S`` (what TRL's vLLM path uses, not renormalised to one support); reported, not applied."""
IS_APPLIED_MEAN = "sampling/importance_sampling_ratio/mean"
"""TRL's key: mean of the ratio as the loss applies it (after its mode and clip)."""


def trl_computes_old_logps(trainer: Any) -> bool:
    """Whether TRL 1.15.0 computes ``old_per_token_logps`` itself for ``trainer``'s settings.

    Exactly TRL's test in ``GRPOTrainer._generate_and_score_completions``
    (trl/trainer/grpo_trainer.py lines 2568-2571): ``generate_every = args.steps_per_generation
    * num_iterations``; the forward runs iff ``args.gradient_accumulation_steps % generate_every
    != 0`` or ``use_vllm and vllm_importance_sampling_correction``. ``False`` is the on-policy
    case: every micro-batch of a generation batch goes through the loss before the next optimizer
    step, and TRL's loss takes its own forward's detached logprobs as the old ones.
    """
    args = trainer.args
    generate_every = args.steps_per_generation * trainer.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(
        trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def pad_rows(rows: list[list[float]], width: int, device: Any = None) -> Any:
    """``[B, width]`` fp32 tensor of ``rows`` right-padded with 0 (TRL's completion padding)."""
    import torch
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row[:width], dtype=torch.float32)
    return out.to(device)


def engine_full_logps(rows: list[dict], mask: Any) -> Any:
    """``[B, T]`` engine full-softmax logprobs (:data:`FULL_KEY` of each TRL input row), padded
    like ``mask``. Raises ``KeyError`` when a row has none (the rollout is not flex's)."""
    if any(FULL_KEY not in row for row in rows):
        raise KeyError(f"IS correction for a rollout_func needs its {FULL_KEY!r} key (flex "
                       "engine); set vllm_importance_sampling_correction=False otherwise.")
    return pad_rows([row[FULL_KEY] for row in rows], mask.shape[1], mask.device)


def is_ratio(trainer_logps: Any, sampling_logps: Any, mask: Any, mode: str = "sequence_mask",
             clip_min: float | None = None, clip_max: float | None = 3.0) -> Any:
    """TRL 1.15.0's importance-sampling ratio (``_generate_and_score_completions``, the
    ``vllm_importance_sampling_*`` block, lines 2586-2633), for any engine.

    ``exp((trainer - sampling) * mask)`` per token (``token_*``, ``[B, T]``) or summed per
    sequence (``sequence_*``, ``[B, 1]``); ``*_truncate`` clamps to ``[clip_min, clip_max]``,
    ``*_mask`` zeroes values outside it. NaN sampling logprobs give ratio 1.
    Raises ``ValueError`` for another ``mode``.
    """
    import torch
    modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    if mode not in modes:
        raise ValueError(f"importance sampling mode {mode!r}: use one of {modes}.")
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def token_is_stats(trainer_logps: Any, sampling_logps: Any, mask: Any,
                   same_support: bool = True) -> dict[str, float | None]:
    """:data:`IS_KEYS` values over ``mask`` (``[B, T]`` each): mean of the per-token ratio
    ``exp(trainer - sampling)``, fraction outside [0.9, 1.1], mean ``|trainer - sampling|``
    (``None`` unless ``same_support``: the two logprobs are on one support). NaN tokens are left
    out; an empty mask gives ``None`` everywhere."""
    import torch
    delta = (trainer_logps.detach().float() - sampling_logps.float())
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    if delta.numel() == 0:
        return dict.fromkeys(IS_KEYS.values())
    ratio = delta.exp()
    outside = ((ratio < 0.9) | (ratio > 1.1)).float().mean()
    return {IS_KEYS["ratio_mean"]: float(ratio.mean()), IS_KEYS["outside"]: float(outside),
            IS_KEYS["same_support"]: float(delta.abs().mean()) if same_support else None}


def is_report(trainer_logps: Any, sampling_logps: Any, filtered_logps: Any, mask: Any,
              ratio: Any) -> dict[str, float]:
    """Flex's IS metrics of one generation batch: :data:`IS_KEYS` (trainer vs the engine's full
    logprobs, one support), :data:`FILTERED_IS_KEYS` (vs its filtered ones; left out when
    ``filtered_logps`` is None) and :data:`IS_APPLIED_MEAN` (``ratio`` as applied: every row of
    a ``[B, 1]`` ratio, the masked tokens of a ``[B, T]`` one; 0.0 when empty). Logprobs and
    ``mask`` are ``[B, T]``; keys whose value is ``None`` (empty mask) are left out."""
    report: dict[str, float | None] = {}
    if filtered_logps is not None:
        stats = token_is_stats(trainer_logps, filtered_logps, mask, same_support=False)
        report |= {key: stats[IS_KEYS[name]] for name, key in FILTERED_IS_KEYS.items()}
    flat = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask.bool()]
    report[IS_APPLIED_MEAN] = float(flat.mean()) if flat.numel() else 0.0
    report |= token_is_stats(trainer_logps, sampling_logps, mask, same_support=True)
    return {key: value for key, value in report.items() if value is not None}


class RowCollector:
    """The loss-time IS tensors of one generation batch of ``num_rows`` rows, micro-batch by
    micro-batch, until all rows have come (TRL's micro-batches partition the batch).

    Each :meth:`add` takes ``(trainer_logps, sampling_logps, filtered_logps or None, mask,
    ratio)`` of one micro-batch (``[b, T]``, ratio ``[b, T]`` or ``[b, 1]``) and says whether
    the batch is complete; :meth:`report` is :func:`is_report` over the rows so far.
    """

    def __init__(self, num_rows: int):
        if num_rows < 1:
            raise ValueError(f"RowCollector(num_rows={num_rows}): a generation batch has rows.")
        self.num_rows = num_rows
        self.parts: list[tuple[Any, ...]] = []

    def add(self, *tensors: Any) -> bool:
        self.parts.append(tuple(t.detach() if t is not None else None for t in tensors))
        return sum(p[0].shape[0] for p in self.parts) >= self.num_rows

    def report(self) -> dict[str, float]:
        import torch
        cols = [None if any(t is None for t in col) else torch.cat(col)
                for col in zip(*self.parts)]
        return is_report(*cols)
