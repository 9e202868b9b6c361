"""Shim: vLLM-style ``top_k=-1`` ("disabled") for transformers ``generate``.

Why: vLLM and the reference notebook (Unsloth ``Qwen3_(4B)-GRPO.ipynb``:
``SamplingParams(top_k=-1)``) spell "top-k off" as ``-1``. TRL 1.15.0's ``GRPOTrainer`` copies
``GRPOConfig.top_k`` unchanged into ``transformers.GenerationConfig`` on the ``model.generate``
path (``trl/trainer/grpo_trainer.py``, the ``generation_kwargs`` dict), and transformers'
``TopKLogitsWarper.__init__`` rejects it on the first generate call with ``ValueError: `top_k`
has to be a strictly positive integer, but is -1`` (``transformers/generation/logits_process.py``).
transformers treats ``None`` and ``0`` as off (``generation/utils.py``: ``if
generation_config.top_k is not None and generation_config.top_k != 0``) and TRL's own default
for "off" is ``0``, so ``-1`` maps to ``0``.

Affected versions: checked in transformers 5.17.0 + TRL 1.15.0 (the pins of this project); the
``top_k <= 0`` check in ``TopKLogitsWarper`` is older than both. Also listed as "known integration
note" 1 of Unsloth PR #5108 (https://github.com/unslothai/unsloth/pull/5108,
``scripts/benchmarks/README.md``).

Removal condition: delete this file when transformers accepts ``top_k=-1`` as "disabled" or TRL
translates it before building the ``GenerationConfig``; ``tests/unit/test_shim_top_k.py`` has a
canary test that fails once transformers stops rejecting ``-1``.
"""

from __future__ import annotations

TRANSFORMERS_TOP_K_OFF = 0
"""What transformers (``generate``) and TRL (``GRPOConfig.top_k`` default) read as "no top-k"."""


def vllm_top_k_to_transformers(top_k: int | None) -> int:
    """Translate a vLLM ``top_k`` (``-1``/``0``/``None``: off; ``k > 0``: keep k) for transformers.

    Returns:
        ``0`` when top-k is disabled, else ``top_k`` unchanged.

    Raises:
        ValueError: ``top_k`` is not an int or is below ``-1`` (vLLM rejects those too).
    """
    if top_k is None:
        return TRANSFORMERS_TOP_K_OFF
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"top_k={top_k!r}: use an int >= -1 (-1 or 0 disables top-k, vLLM's "
                         "convention).")
    return TRANSFORMERS_TOP_K_OFF if top_k <= 0 else top_k
