"""GRPO over every rollout backend (TRL ``GRPOTrainer``): one :func:`train`, per-backend plans.

Modules: ``setup`` (GRPOConfig, PEFT config, dataset), ``plans`` (what each backend changes),
``trainer`` (:func:`train`), ``result`` (:class:`GRPOResult`, :func:`step_rows`),
``flex_rollout`` (the flex engine as TRL's ``rollout_func``), ``callbacks`` (per-step stats),
``rewards``, ``sft_warmup``, ``compile_report``, ``gate`` and ``compare`` (phase 2's checks and
process-per-backend runs), ``phase0_report`` (phase 0's tables). Nothing heavy at import.
"""

from nbhelpers.grpo.result import GRPOResult, step_rows
from nbhelpers.grpo.setup import BACKENDS, DATASETS
from nbhelpers.grpo.trainer import train

__all__ = ["BACKENDS", "DATASETS", "GRPOResult", "step_rows", "train"]
