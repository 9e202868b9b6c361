"""What one GRPO run measured: :class:`GRPOResult` and its per-step rows.

Contract: :func:`nbhelpers.grpo.trainer.train` returns a :class:`GRPOResult`; :func:`step_rows`
joins its per-step statistics with TRL's extra log keys for the comparison notebooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GENERATE_KEY = "generate_s"
"""TRL log key: seconds spent in ``GRPOTrainer._generate`` (rollout incl. detokenisation)."""

_CONFIG_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                "generation_batch_size", "max_completion_length", "learning_rate", "beta",
                "temperature", "top_p", "top_k", "min_p", "seed", "max_steps", "bf16", "use_cpu",
                "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                "pad_to_multiple_of")
"""GRPOConfig fields a sidecar's ``grpo_config`` records (the IS ones since 2026-12-03: TRL's
correction decides how much a vLLM or flex row's loss is scaled, ``gate.grad_gap_sentence``;
``pad_to_multiple_of`` since 2026-12-04)."""



@dataclass
class GRPOResult:
    """What :func:`train` measured.

    Attributes:
        records: one dict per optimiser step
            (see :class:`~nbhelpers.grpo.callbacks.StatisticsCallback`).
        summary: post-warm-up medians (``StatisticsCallback.summary``).
        completions: sampled rows ``{"step", "question", "completion", "answer", <reward fn>...}``.
        log_history: the trainer's ``state.log_history`` (TRL's raw logs).
        reward_names: the reward functions' names, in TRL's order.
        config: the effective GRPOConfig values that matter for comparisons.
        dataset_stats: the prompt-length filter's stats.
        wall_s: seconds from trainer construction to the end of ``train()``.
        format_warmup: the SFT format warm-up's report (:func:`nbhelpers.grpo.sft_warmup.format_warmup`:
            steps, wall_s, losses, before/after completions; ``model_folder``: the merged
            folder the backend started from, ``vllm`` and ``unsloth``, ``None`` for the others;
            ``vllm_model_folder``: the same for ``vllm`` only); empty when it did not run.
    """

    model_name: str
    backend: str
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    completions: list[dict[str, Any]]
    log_history: list[dict[str, Any]]
    reward_names: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    dataset_stats: dict[str, Any] = field(default_factory=dict)
    wall_s: float | None = None
    format_warmup: dict[str, Any] = field(default_factory=dict)

    def sidecar_extra(self) -> dict[str, Any]:
        """Keys for ``make_sidecar(extra=...)``: GRPO stats beside the schema-v1 keys."""
        return {"grpo_summary": self.summary, "grpo_steps": self.records,
                "grpo_config": self.config, "grpo_wall_s": self.wall_s,
                "grpo_completions_sample": self.completions[:8],
                "dataset_stats": self.dataset_stats, "format_warmup": self.format_warmup}


FLEX_PREFIX = "flex/"
"""TRL log keys of the flex engine's per-rollout split (:data:`nbhelpers.grpo.step_timing.
FLEX_KEYS`), logged by :class:`~nbhelpers.grpo.flex_rollout.FlexRollout`."""


def step_rows(result: Any) -> list[dict[str, Any]]:
    """Per-step rows: the StatisticsCallback record (with its ``time/*`` split) joined with the
    extra TRL log keys (``generate_s``, ``sampling/sampling_logp_difference/{mean,max}``,
    ``step_time``, and flex's ``flex/*``)."""
    extra_keys = (GENERATE_KEY, "step_time", "sampling/sampling_logp_difference/mean",
                  "sampling/sampling_logp_difference/max")
    by_step = {h.get("step"): h for h in result.log_history if "train_runtime" not in h}
    rows = []
    for rec in result.records:
        logs = by_step.get(rec["step"], {})
        rows.append(dict(rec) | {k: v for k, v in logs.items()
                                 if k in extra_keys or k.startswith(FLEX_PREFIX)})
    return rows
