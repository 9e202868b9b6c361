"""Shim: a pure-torch stand-in for TRL 1.15.0's Triton log-prob kernel, so GRPO runs on the CPU.

Why: TRL 1.15.0's ``GRPOTrainer`` always patches the model with ``add_fused_lm_head`` and scores
completions through ``trl.kernels.ChunkedLogProbFunction``, a Triton kernel. Without Triton (every
CPU-only torch build) ``trl/trainer/utils.py`` sets ``_ChunkedLogProbFunction = None`` on import
("Triton ships with PyTorch on Linux only") and the first training step fails with
``AttributeError: 'NoneType' object has no attribute 'apply'``. Seen here: torch 2.13.0+cpu, TRL
1.15.0 (pinned because Unsloth 2026.10.9 accepts no newer TRL; research/gpu_stack.md).

What it does: :func:`install` puts :class:`TorchLogProb` in that slot only when it is ``None``. It
computes the same five per-token outputs as the kernel's forward (``log_probs``, ``entropy``,
``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; same logit transform: ``logit_scale``, optional
soft-cap, ``1/temperature``) from the full ``[N, V]`` fp32 logits and lets autograd do the
backward. Fine for the CPU smoke sizes (N x V = a few hundred tokens x 49k vocab); on a GPU host
TRL's kernel stays for CUDA tensors (:class:`DeviceDispatch`). A CPU host with Triton installed (the test venv installs it for the
engine's interpreted kernel tests) gets the stand-in too: TRL's kernel cannot run on CPU tensors.

Link: TRL source ``trl/kernels/chunked_logprob.py`` and ``trl/trainer/utils.py``
(https://github.com/huggingface/trl). Removal condition: delete when the pinned TRL falls back to
torch itself without Triton (``tests/unit/test_shim_trl_logprob.py`` checks the slot is still
``None`` without Triton, and compares the two paths' math on a tiny case).
"""

from __future__ import annotations

from typing import Any

OUTPUT_NAMES = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TorchLogProb:
    """Drop-in for ``trl.kernels.ChunkedLogProbFunction``: same ``apply`` signature and outputs."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature: float, chunk_size: int,
              final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
              outputs: tuple[str, ...] = OUTPUT_NAMES) -> tuple[Any, ...]:
        """Per-token outputs for ``hidden`` ``[N, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or
        ``None``, ``targets`` ``[N]`` (int64). Returns 5 fp32 tensors ``[N]`` (bool for
        ``is_top1``), ``None`` for names not in ``outputs``. ``chunk_size`` is ignored."""
        import torch

        z = hidden.float() @ weight.float().t()  # [N, V]
        if bias is not None:
            z = z + bias.float()
        z = z * logit_scale
        if final_logit_softcapping is not None:
            z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
        z = z / temperature
        log_p = torch.log_softmax(z, dim=-1)  # [N, V]
        target_logp = log_p.gather(1, targets[:, None]).squeeze(1)
        want = set(outputs)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in want else None
        with torch.no_grad():
            sq = torch.logsumexp(2 * log_p, dim=-1) if "log_sum_sq_probs" in want else None
            mean = z.mean(-1) if "mean_logits" in want else None
            top1 = (z.argmax(-1) == targets) if "is_top1" in want else None
        return target_logp, entropy, sq, mean, top1


class DeviceDispatch:
    """TRL's Triton kernel for CUDA inputs, :class:`TorchLogProb` for CPU inputs (a CPU-trained
    policy on a host that also has a GPU: TRL's kernel raises "Pointer argument (at 0) cannot be
    accessed from Triton (cpu tensor?)", seen on the H200 with torch 2.11 / triton 3.6)."""

    kernel: Any = None  # TRL's ChunkedLogProbFunction, set by install()

    @classmethod
    def apply(cls, hidden, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        impl = cls.kernel if hidden.is_cuda else TorchLogProb
        return impl.apply(hidden, *args, **kwargs)


def is_needed() -> bool:
    """True when TRL's slot is ``None`` (Triton could not be imported) or still holds TRL's own
    Triton kernel, which cannot take CPU tensors (no CUDA device: triton 3.6/3.9 with TRL 1.15
    says "0 active drivers"; with one, a CPU-trained policy fails as :class:`DeviceDispatch`
    says)."""
    import trl.trainer.utils as trl_utils
    slot = getattr(trl_utils, "_ChunkedLogProbFunction", "absent")
    return slot is None or slot not in ("absent", TorchLogProb, DeviceDispatch)


def install() -> bool:
    """Fill TRL's kernel slot when :func:`is_needed`: :class:`TorchLogProb` when it is ``None``
    or no CUDA device exists, else :class:`DeviceDispatch` around TRL's kernel (CUDA calls keep
    it). True when it changed the slot."""
    import torch
    import trl.trainer.utils as trl_utils
    if not is_needed():
        return False
    slot = trl_utils._ChunkedLogProbFunction
    if slot is None or not torch.cuda.is_available():
        trl_utils._ChunkedLogProbFunction = TorchLogProb
        return True
    DeviceDispatch.kernel = slot
    trl_utils._ChunkedLogProbFunction = DeviceDispatch
    return True
