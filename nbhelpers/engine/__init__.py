"""The flex engine (nano-vllm shape): ``llm`` facade, ``scheduler``, ``kv_cache``, ``model_runner``,
``sampler``, ``lora`` (live PEFT LoRA), ``models/`` (architecture registry).

Nothing heavy at import: ``from nbhelpers.engine import LLM`` imports torch only when an ``LLM`` is
built. See DESIGN.md "Flex engine: where the speed is".
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from nbhelpers.engine.llm import LLM
        return LLM
    raise AttributeError(name)
