"""Shim: ``from vllm.sampling_params import GuidedDecodingParams`` on vLLM releases that dropped it.

Why: vLLM renamed guided decoding to structured outputs (``StructuredOutputsParams``, the
``structured_outputs=`` field of ``SamplingParams``) and removed ``GuidedDecodingParams`` (gone by
vLLM 0.12/0.13; 0.26.0, our pin, has only ``StructuredOutputsParams``). TRL releases before the
switch, and code that patches them (Unsloth's ``UnslothGRPOTrainer`` is generated from TRL's
source), still run ``from vllm.sampling_params import GuidedDecodingParams`` at import time and
fail with ``ImportError`` although they never use guided decoding in GRPO. Listed as "known
integration note" 4 of Unsloth PR #5108 (https://github.com/unslothai/unsloth/pull/5108,
``scripts/benchmarks/README.md``). TRL 1.15.0 itself imports ``StructuredOutputsParams``
(``trl/generation/vllm_generation.py``), so with our pins the shim is a no-op there.

What: when vLLM is importable, lacks ``GuidedDecodingParams`` and has ``StructuredOutputsParams``,
export the latter under the old name in ``vllm.sampling_params`` (same keyword fields: json,
regex, choice, grammar, json_object). Apply before importing TRL / Unsloth.

Removal condition: when no supported TRL or Unsloth release imports ``GuidedDecodingParams``.
"""

from __future__ import annotations

import importlib
import sys


def needed() -> bool:
    """True when vLLM is importable, lacks ``GuidedDecodingParams`` and has the new class."""
    try:
        sp = importlib.import_module("vllm.sampling_params")
    except ImportError:
        return False
    return not hasattr(sp, "GuidedDecodingParams") and hasattr(sp, "StructuredOutputsParams")


def apply() -> bool:
    """Alias ``GuidedDecodingParams`` to ``StructuredOutputsParams``; True when it patched.

    Idempotent. Without vLLM (or on a vLLM that still has the old name) nothing is changed.
    """
    if not needed():
        return False
    sp = sys.modules["vllm.sampling_params"]
    sp.GuidedDecodingParams = sp.StructuredOutputsParams
    return True
