"""nbhelpers: the GRPO rollout-engine lab's helper package.

The notebook-facing API only; nothing heavy (torch, transformers, trl) is imported at import time:
import the submodules (``nbhelpers.models``, ``nbhelpers.grpo.setup``, ``nbhelpers.engine``...) where needed.
"""

from nbhelpers.config import (
    GRPO_SAMPLING,
    WORKLOAD_W,
    GRPOSettings,
    LoraSpec,
    ModelSpec,
    SamplingParams,
    Workload,
)

__all__ = ["GRPO_SAMPLING", "WORKLOAD_W", "GRPOSettings", "LoraSpec", "ModelSpec",
           "SamplingParams", "Workload"]
__version__ = "0.1.0"
