"""The flex engine as TRL's rollout path: zero-copy, live LoRA, engine logprobs checked per token.

Contract: :class:`FlexRollout` is a TRL 1.15.0 ``rollout_func`` (``GRPOTrainer(rollout_func=...)``,
trl/trainer/grpo_trainer.py ``_generate``: called with the per-process prompt slice and the
trainer; returns ``{"prompt_ids", "completion_ids", "logprobs"}``, one row per prompt entry). It
builds one :class:`nbhelpers.engine.LLM` on the *trainer's own* policy (the PEFT model the optimizer
updates, unwrapped from accelerate) on its first call and keeps it: the engine reads
``base_layer.weight`` and ``lora_A/lora_B`` on every call (:mod:`nbhelpers.engine.lora`), so the
optimizer's in-place update is what the next rollout samples from. No merge, no copy, no weight
sync step. Prompts are tokenised by TRL itself (``trainer._tokenize_prompts``: same chat template,
same ids as the other backends). TRL's ``RepeatSampler`` puts the ``num_generations`` copies of a
prompt next to each other; the rollout sends each distinct prompt once with ``n=num_generations``
so the engine prefills the group prefix once, and falls back to ``n=1`` per row otherwise.

:class:`FlexGRPOTrainer` is a thin ``GRPOTrainer`` subclass that adds one metric and changes
nothing else: TRL keeps the engine's logprobs as ``sampling_per_token_logps`` in the batch but
only compares them with the trainer's when ``use_vllm`` is set. The subclass reads the trainer's
per-token logprobs that the loss computes anyway (no extra forward) and logs
``sampling/sampling_logp_difference/mean`` and ``/max`` (nats; TRL's own key names, so the gate
reads vLLM and flex alike). Both are *processed* logprobs (after temperature and ``min_p``), as
TRL's vLLM path requests (``logprobs_mode="processed_logprobs"``); the trainer's are temperature
only, so ``min_p`` renormalisation is part of the measured gap for every engine.

Run: ``pytest tests/unit/test_grpo_flex.py``.
"""

from __future__ import annotations

import time
from typing import Any

from trl import GRPOTrainer

from nbhelpers.config import SamplingParams

MISMATCH_KEY = "sampling/sampling_logp_difference"
"""TRL's metric prefix (``/mean``, ``/max``) for |engine logprob - trainer logprob|, nats/token."""


def sampling_from_args(args: Any, n: int) -> SamplingParams:
    """vLLM-style :class:`SamplingParams` from a ``GRPOConfig`` (``top_k`` 0/None = off)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                          top_k=int(args.top_k or 0), min_p=float(args.min_p or 0.0),
                          n=n, max_new_tokens=args.max_completion_length, seed=None)


def group_prompts(prompt_ids: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """``(distinct prompts, samples per prompt)``: runs of ``n`` equal rows become one prompt
    with ``n`` samples; any other layout is sent row by row (``n=1``)."""
    if n > 1 and len(prompt_ids) % n == 0:
        heads = prompt_ids[::n]
        if all(prompt_ids[i] == heads[i // n] for i in range(len(prompt_ids))):
            return heads, n
    return prompt_ids, 1


class FlexRollout:
    """A TRL ``rollout_func`` running the flex engine on the trainer's policy (module docstring).

    Args:
        max_model_len: prompt + completion tokens one sequence may hold.
        kv_tokens: KV pool size in tokens (``generation_batch_size * max_model_len`` is enough).
        sleep_between_rollouts: free the KV pool and CUDA graphs during the optimizer step
            (``LLM.sleep``), re-allocate before the next rollout (graphs re-captured).
        keep_history: keep every rollout's ids and logprobs in ``history`` (tests, notebooks).
        **engine_options: :func:`nbhelpers.backends.flex.build_llm` options (``page_size``,
            ``sync_every``, ``use_cuda_graphs``, ``compile_attention``, ...).
    """

    __name__ = "flex_rollout"

    def __init__(self, max_model_len: int, kv_tokens: int, sleep_between_rollouts: bool = False,
                 keep_history: bool = False, **engine_options: Any):
        if max_model_len < 2 or kv_tokens < max_model_len:
            raise ValueError(f"FlexRollout(max_model_len={max_model_len}, kv_tokens={kv_tokens}):"
                             " need max_model_len >= 2 and kv_tokens >= max_model_len.")
        self.max_model_len, self.kv_tokens = max_model_len, kv_tokens
        self.sleep_between_rollouts = sleep_between_rollouts
        self.keep_history = keep_history
        self.engine_options = engine_options
        self.llm: Any = None
        self.policy: Any = None
        self.history: list[dict[str, Any]] = []
        self.generate_s: list[float] = []

    def engine(self, trainer: Any) -> Any:
        """The engine over ``trainer``'s policy; built on first use, then reused (same tensors)."""
        if self.llm is None:
            from nbhelpers.backends.flex import build_llm
            self.policy = trainer.accelerator.unwrap_model(trainer.model)
            self.llm = build_llm(self.policy, list(trainer.eos_token_ids),
                                 kv_tokens=self.kv_tokens, max_model_len=self.max_model_len,
                                 **self.engine_options)
        elif self.sleep_between_rollouts:
            self.llm.wake_up()
        return self.llm

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        import torch
        llm = self.engine(trainer)
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        n = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        heads, n = group_prompts([list(p) for p in prompt_ids], n)
        sampling = sampling_from_args(trainer.args, n)
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = llm.generate(heads, sampling)
        self.generate_s.append(time.perf_counter() - t0)
        if self.sleep_between_rollouts:
            llm.sleep()
        result = {"prompt_ids": [list(o.prompt_ids) for o in outs],
                  "completion_ids": [list(o.token_ids) for o in outs],
                  "logprobs": [list(o.logprobs) for o in outs]}
        if self.keep_history:
            self.history.append({"global_step": trainer.state.global_step, **result})
        return result


def logprob_mismatch(trainer_logps: Any, sampling_logps: Any, mask: Any) -> tuple[float, float]:
    """``(mean, max)`` of ``|trainer_logps - sampling_logps|`` over ``mask`` (nats per token).

    Shapes: all ``[B, T]``; ``mask`` 1 on completion tokens. NaN engine logprobs are left out
    (TRL's rule for vLLM). Returns ``(0.0, 0.0)`` for an empty mask.
    """
    import torch
    delta = (trainer_logps.detach().float() - sampling_logps.float()).abs()
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    if delta.numel() == 0:
        return 0.0, 0.0
    return float(delta.mean()), float(delta.max())


class FlexGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` + the engine-vs-trainer logprob metric (module docstring). Training, loss
    and generation are TRL's own; generation goes through ``rollout_func``."""

    _sampling_batch: tuple[Any, Any] | None = None

    def _compute_loss(self, model, inputs):
        self._sampling_batch = (inputs.get("sampling_per_token_logps"), inputs["completion_mask"])
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._sampling_batch = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        batch = self._sampling_batch
        # only the loss's own call (compute_entropy=True), once per micro-batch
        if batch is not None and batch[0] is not None and kwargs.get("compute_entropy"):
            self._sampling_batch = None
            mean, worst = logprob_mismatch(out[0], batch[0], batch[1])
            mode = "train" if self.model.training else "eval"
            self._metrics[mode][f"{MISMATCH_KEY}/mean"].append(mean)
            self._metrics[mode][f"{MISMATCH_KEY}/max"].append(worst)
        return out
