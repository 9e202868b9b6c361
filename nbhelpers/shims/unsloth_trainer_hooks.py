"""Shim: Unsloth's ``for_training()`` / ``for_inference()`` hooks on a vanilla HF (or PEFT) model.

Why: ``import unsloth`` swaps TRL's trainers for generated ``Unsloth*Trainer`` classes that call
``model.for_training()`` and ``model.for_inference()`` around generation (Unsloth PR #5108,
``scripts/benchmarks/README.md``, "known integration note" 5). Models loaded without
``FastLanguageModel`` (the hf_generate / hf_cb / cb_sync paths, which must stay vanilla because
Unsloth's patched attention bypasses the paged attention interface: note 3) lack those methods and
the trainer fails with ``AttributeError``.

What: attach the two methods to the model *instance* when they are missing:
``for_training(use_gradient_checkpointing=True)`` -> ``train()``, ``use_cache=False``, gradient
checkpointing on when asked; ``for_inference()`` -> ``eval()``, ``use_cache=True``. A model that
already has them (an Unsloth model) is left untouched.

Affected versions: unsloth 2026.10.9 with TRL 1.15.0 (our pins). Removal condition: when Unsloth's
trainers check for the hooks before calling them.
"""

from __future__ import annotations

import types
from typing import Any


def needed(model: Any) -> bool:
    """True when ``model`` lacks either hook."""
    return not (callable(getattr(model, "for_training", None))
                and callable(getattr(model, "for_inference", None)))


def _config(model: Any) -> Any:
    return getattr(model, "config", None)


def _for_training(self: Any, use_gradient_checkpointing: bool = True) -> Any:
    self.train()
    if _config(self) is not None:
        self.config.use_cache = False
    if use_gradient_checkpointing and hasattr(self, "gradient_checkpointing_enable"):
        self.gradient_checkpointing_enable()
    return self


def _for_inference(self: Any) -> Any:
    self.eval()
    if _config(self) is not None:
        self.config.use_cache = True
    return self


def apply(model: Any) -> bool:
    """Attach the hooks to ``model`` when missing; True when it patched (idempotent)."""
    if not needed(model):
        return False
    model.for_training = types.MethodType(_for_training, model)
    model.for_inference = types.MethodType(_for_inference, model)
    return True
