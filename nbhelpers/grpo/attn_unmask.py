"""sdpa with fully masked query rows unmasked: the trainer's attention on CUDA.

Why: a left-padded prompt's pad positions are query rows that see no key at all (every key is
padding or in their future). On an H100 (2026-12-07, e858b3e) tiny-model GRPO runs padded with
``pad_to_multiple_of=64`` had NaN gradients at step 1 on CUDA and none on the CPU; the loss never
reads those rows, so the NaN can only come from a kernel's handling of them. Public reports of
the same: pytorch/pytorch#119320 (memory-efficient sdpa backward on fp32 CUDA gives NaN
gradients that the math backend does not), #178251 (EfficientAttentionBackward NaN with an
attn_mask), huggingface/transformers#38690 (non-math backends give NaN at padding tokens).
transformers 4.x avoided it for sdpa by unmasking such rows
(``AttentionMaskConverter._unmask_unattended``: a fully masked row attends to every key);
5.x dropped that (``sdpa_mask``'s ``allow_torch_fix`` "has no effect anymore").

What: :data:`NAME`, registered with transformers' ``AttentionInterface`` (its own sdpa forward,
unchanged) and ``AttentionMaskInterface`` (:func:`unmasked_rows_mask`: ``sdpa_mask``'s boolean
mask, then every row with no ``True`` set to all ``True``). Each valid row's softmax is computed
over the same keys as before, so valid positions get the same outputs; an unmasked pad row now
averages real values, but no valid row attends to a pad key and the loss reads no pad position,
so nothing downstream changes and its backward receives a zero output gradient. The mask is
built once per forward (not per layer).

:func:`apply` switches a CUDA policy loaded with ``sdpa`` to it (TRL's reference pass runs the
same module with the adapter disabled, so it follows); CPU runs keep plain sdpa (no NaN seen
there, and the CPU reference runs stay as they were).
"""
from __future__ import annotations

from typing import Any

NAME = "sdpa_unmasked_rows"
"""The attention implementation's name in transformers' registries (and in run notes)."""


def unmasked_rows_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' ``sdpa_mask(*args, **kwargs)`` with fully masked query rows unmasked.

    Returns:
        ``None`` where ``sdpa_mask`` returns it (no padding: sdpa's ``is_causal``), else a bool
        tensor ``[batch, 1 | heads, q_len, kv_len]`` (True = attend; an integer mask, from an
        integer 2-D ``attention_mask``, comes back as bool) in which every row that had no True
        is all True. A float mask (an additive bias) is returned unchanged.
    """
    from transformers.masking_utils import sdpa_mask
    mask = sdpa_mask(*args, **kwargs)
    if mask is None or mask.is_floating_point():
        return mask
    mask = mask.bool()  # an integer 2-D padding mask gives an integer 0/1 mask
    return mask | ~mask.any(dim=-1, keepdim=True)


def register() -> str:
    """Register :data:`NAME` with transformers' attention and mask registries (idempotent);
    returns :data:`NAME`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, unmasked_rows_mask)
    return NAME


def apply(model: Any, notes: list[str], *, force: bool = False) -> bool:
    """Switch ``model`` (an HF causal LM, or a PEFT model over one) from ``sdpa`` to :data:`NAME`
    when its parameters are on CUDA (``force=True``: on any device, for the CPU tests).

    Appends one line to ``notes`` when it switches. Returns whether it switched; a model loaded
    with another attention (eager, FlashAttention-4, Unsloth's own) is left alone.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    param = next(iter(base.parameters()), None)
    if (getattr(config, "_attn_implementation", None) != "sdpa" or param is None
            or not (force or param.is_cuda) or not hasattr(base, "set_attn_implementation")):
        return False
    base.set_attn_implementation(register())
    notes.append(f"attention: sdpa with fully masked query rows unmasked ({NAME}; left-padded "
                 "prompts' pad rows, never read: CUDA sdpa gave NaN gradients there, "
                 "nbhelpers.grpo.attn_unmask)")
    return True
