"""The flex engine as TRL's rollout path: zero-copy, live LoRA, engine logprobs checked per token.

Contract: :class:`FlexRollout` is a TRL 1.15.0 ``rollout_func`` (``GRPOTrainer(rollout_func=...)``,
trl/trainer/grpo_trainer.py ``_generate``: called with the per-process prompt slice and the
trainer; returns ``{"prompt_ids", "completion_ids", "logprobs", "full_logprobs"}``, one row per
prompt entry; TRL 1.15 keeps ``logprobs`` as ``sampling_per_token_logps`` and hands every other key
to the reward functions as a keyword and merges it into the ``inputs`` rows). It
builds one :class:`nbhelpers.engine.LLM` on the *trainer's own* policy (the PEFT model the optimizer
updates, unwrapped from accelerate) on its first call and keeps it: the engine reads
``base_layer.weight`` and ``lora_A/lora_B`` on every call (:mod:`nbhelpers.engine.lora`), so the
optimizer's in-place update is what the next rollout samples from. No merge, no copy, no weight
sync step. Prompts are tokenised by TRL itself (``trainer._tokenize_prompts``: same chat template,
same ids as the other backends). TRL's ``RepeatSampler`` puts the ``num_generations`` copies of a
prompt next to each other; the rollout sends each distinct prompt once with ``n=num_generations``
so the engine prefills the group prefix once, and falls back to ``n=1`` per row otherwise.

Importance sampling over the same support (issue 13 part 2). The engine samples from the filtered
distribution ``q_S`` (min_p / top-k / top-p keep a set S and renormalise); ``logprobs`` are
``log q_S`` (vLLM's ``processed_logprobs``), the trainer's are the full softmax ``log pi``, so TRL's
ratio ``exp(log pi - log q_S)`` carries the kept mass ``m = sum_{v in S} p_v`` (mean 0.896 at
top_p 0.8 in TRL issue #6789), which is not a policy change. TRL PR #7269 fixes it by putting the
two on one support: the trainer's mass over vLLM's returned kept ids, ``m_pi``, gives
``exp(log pi - log m_pi - log q_S)``. The flex engine returns, per token, its full-softmax logprob
``log q = log q_S + log m_q`` (``full_logprobs``; :mod:`nbhelpers.engine.sampler`), and
:class:`FlexGRPOTrainer` uses ``exp(log pi - log q)``: the trainer's logprob renormalised by the
engine's kept mass over the same S, against the engine's filtered logprob. It equals PR #7269's
ratio times ``m_pi / m_q`` (the two models' mass on the same S): exactly 1 in exact arithmetic when
engine and trainer share weights, and a per-position constant of the size of the engine/trainer
logit noise otherwise. Why not the support itself: S is up to V ids per token (TRL's fused LM head
returns no logits to renormalise over it either); the kept mass is one float, computed inside the
decode CUDA graph.

:class:`FlexGRPOTrainer` is the ``GRPOTrainer`` subclass that (1) when
``args.vllm_importance_sampling_correction`` is on (TRL's default) builds that ratio with TRL's own
modes and clips (:func:`~nbhelpers.grpo.flex_is.is_ratio`, TRL's ``token_*`` / ``sequence_*``
rules) against the engine's full logprobs (``sampling_per_token_logps``) and applies it in the loss
as TRL does for vLLM. The trainer's logprobs in it are the old policy's: off-policy (TRL computes
``old_per_token_logps``, e.g. ``num_iterations=2``) TRL's, and the ratio goes into the batch at
generation; on-policy (TRL's own test, :func:`~nbhelpers.grpo.flex_is.trl_computes_old_logps`)
the old policy is the current one, so the loss forward's detached logprobs give the ratio per
micro-batch and no extra forward runs (:mod:`nbhelpers.grpo.flex_is`: the TRL lines this relies
on); (2) logs ``sampling/sampling_logp_difference/mean`` and ``/max`` (TRL's key names) from the
loss's own logprobs (no extra forward); (3) logs :data:`IS_KEYS` per step, for flex and for vLLM
(``plans``: vLLM runs through it too, its path is TRL's own; its "same support" gap is ``None``:
vLLM 0.26 returns no kept mass), and for flex :data:`FILTERED_IS_KEYS`, the vLLM-style ratio
against its filtered logprobs (the bias the fix removes).

Run: ``pytest tests/unit/test_grpo_flex.py tests/unit/test_flex_is_loss_time.py``.
"""

from __future__ import annotations

import time
from typing import Any

from trl import GRPOTrainer

from nbhelpers.config import SamplingParams
from nbhelpers.grpo.flex_is import (  # noqa: F401 (IS names re-exported from their first home)
    FILTERED_IS_KEYS,
    FILTERED_KEY,
    FULL_KEY,
    IS_APPLIED_MEAN,
    IS_KEYS,
    RowCollector,
    engine_full_logps,
    is_ratio,
    is_report,
    pad_rows,
    token_is_stats,
    trl_computes_old_logps,
)

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

    Per rollout it keeps ``generate_s`` (seconds of ``llm.generate``, CUDA-synchronised) and
    ``engine_stats`` (:func:`nbhelpers.grpo.step_timing.engine_split`, also logged to TRL's
    metrics as ``flex/*``, hence into each step row).

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
        self.engine_stats: list[dict[str, float]] = []  # per rollout: step_timing.FLEX_KEYS

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

        from nbhelpers.grpo.step_timing import engine_split, log_metrics
        from nbhelpers.stats import _cuda_sync
        t_call = time.perf_counter()
        llm = self.engine(trainer)
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        n = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        heads, n = group_prompts([list(p) for p in prompt_ids], n)
        sampling = sampling_from_args(trainer.args, n)
        _cuda_sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = llm.generate(heads, sampling)
        _cuda_sync()
        self.generate_s.append(time.perf_counter() - t0)
        gen_stats = dict(llm.last_stats)
        if self.sleep_between_rollouts:
            llm.sleep()
        result = {"prompt_ids": [list(o.prompt_ids) for o in outs],
                  "completion_ids": [list(o.token_ids) for o in outs],
                  "logprobs": [list(o.logprobs) for o in outs],
                  FULL_KEY: [list(o.full_logprobs) for o in outs]}
        self.engine_stats.append(engine_split(gen_stats, self.generate_s[-1],
                                              time.perf_counter() - t_call))
        log_metrics(trainer, self.engine_stats[-1])
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
    """``GRPOTrainer`` + importance sampling on one support for flex + the IS report (module
    docstring). Training and loss are TRL's own; flex generation goes through ``rollout_func``."""

    _loss_batch: tuple[dict[str, Any], bool] | None = None
    _defer_is = True
    """``False`` forces the extra no-grad forward at generation even on-policy (the path before
    :mod:`nbhelpers.grpo.flex_is`'s loss-time ratio; tests compare the two)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._pending_is: dict[str, RowCollector] = {}

    @property
    def flex_is(self) -> bool:
        """TRL's IS correction applied to a ``rollout_func`` engine (not vLLM: TRL does that)."""
        return bool(self.args.vllm_importance_sampling_correction) and not self.use_vllm \
            and self.rollout_func is not None

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if self.flex_is:
            self._flex_importance_sampling(out, inputs, mode)
        elif "old_per_token_logps" in out and "sampling_per_token_logps" in out:
            self._log_is(mode, token_is_stats(out["old_per_token_logps"],
                                              out["sampling_per_token_logps"],
                                              out["completion_mask"], same_support=False))
        return out

    def _flex_importance_sampling(self, out: dict[str, Any], inputs: list[dict],
                                  mode: str) -> None:
        """Engine full logprobs into ``out`` (in place), then the ratio and its report: now from
        TRL's old logprobs (or, when forced, an extra forward), or at loss time when on-policy
        (:func:`trl_computes_old_logps` False; :mod:`nbhelpers.grpo.flex_is`). Raises
        ``KeyError`` when the rollout returned no :data:`FULL_KEY`."""
        mask = out["completion_mask"]
        filtered = out.get("sampling_per_token_logps")  # TRL's: the rollout's "logprobs"
        out["sampling_per_token_logps"] = engine_full_logps(inputs, mask)
        self._flush_is(mode)  # a generation batch the loss left unfinished (none expected)
        if self._defer_is and "old_per_token_logps" not in out \
                and not trl_computes_old_logps(self):
            if filtered is not None:
                out[FILTERED_KEY] = filtered
            self._pending_is[mode] = RowCollector(mask.shape[0])
            return
        if "old_per_token_logps" not in out:
            out["old_per_token_logps"] = self._old_logps(out)
        old, sampling = out["old_per_token_logps"], out["sampling_per_token_logps"]
        out["importance_sampling_ratio"] = self._is_ratio(old, sampling, mask)
        self._log_is(mode, is_report(old, sampling, filtered, mask,
                                     out["importance_sampling_ratio"]))

    def _old_logps(self, out: dict[str, Any]) -> Any:
        """``[B, T]`` policy logprobs of ``out``'s completions by a no-grad forward, chunked as
        TRL chunks its own (``per_device_{train,eval}_batch_size``)."""
        import torch
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        batch = self.args.per_device_train_batch_size if self.model.training else \
            self.args.per_device_eval_batch_size
        with torch.no_grad():
            return self._get_per_token_logps_and_entropies(
                self.model, ids, attn, out["completion_ids"].shape[1], batch_size=batch)[0]

    def _is_ratio(self, trainer_logps: Any, sampling_logps: Any, mask: Any) -> Any:
        return is_ratio(trainer_logps, sampling_logps, mask, self.vllm_importance_sampling_mode,
                        self.vllm_importance_sampling_clip_min,
                        self.vllm_importance_sampling_clip_max)

    def _log_is(self, mode: str, values: dict[str, float | None]) -> None:
        for key, value in values.items():
            if value is not None:
                self._metrics[mode][key].append(value)

    def _flush_is(self, mode: str) -> None:
        """Log the loss-time report of ``mode``'s pending generation batch, if any."""
        pending = self._pending_is.pop(mode, None)
        if pending is not None and pending.parts:
            self._log_is(mode, pending.report())

    def _compute_loss(self, model, inputs):
        # A copy: a loss-time ratio must not stay in TRL's buffered batch (reused when
        # num_iterations > 1). Decided before the flip below (flex_is reads use_vllm).
        inputs = dict(inputs)
        apply_is = self.flex_is
        self._loss_batch = (inputs, apply_is and "importance_sampling_ratio" not in inputs)
        # TRL 1.15 multiplies the loss by inputs["importance_sampling_ratio"] only under use_vllm
        # (its one use of the flag in _compute_loss); flex's ratio goes through the same line.
        try:
            if apply_is:
                self.use_vllm = True
            return super()._compute_loss(model, inputs)
        finally:
            if apply_is:
                self.use_vllm = False
            self._loss_batch = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        # only the loss's own call (compute_entropy=True), once per micro-batch
        if self._loss_batch is None or not kwargs.get("compute_entropy"):
            return out
        (batch, loss_time_is), self._loss_batch = self._loss_batch, None
        logps, mode = out[0].detach(), "train" if self.model.training else "eval"
        sampling = batch.get("sampling_per_token_logps")
        if sampling is not None and not self.args.use_vllm:  # vLLM: TRL logs it
            mean, worst = logprob_mismatch(logps, sampling, batch["completion_mask"])
            self._metrics[mode][f"{MISMATCH_KEY}/mean"].append(mean)
            self._metrics[mode][f"{MISMATCH_KEY}/max"].append(worst)
        if loss_time_is:
            self._loss_time_is(batch, logps, mode)
        return out

    def _loss_time_is(self, batch: dict[str, Any], logps: Any, mode: str) -> None:
        """The on-policy ratio of one micro-batch from the loss forward's detached ``logps``
        ``[b, T]`` into ``batch`` (TRL reads it after that forward); its rows to the report.
        Raises ``KeyError`` when the batch has no engine logprobs."""
        if "sampling_per_token_logps" not in batch:
            raise KeyError("flex IS at loss time needs the batch's 'sampling_per_token_logps' "
                           "(made by FlexGRPOTrainer._generate_and_score_completions).")
        mask, sampling = batch["completion_mask"], batch["sampling_per_token_logps"]
        ratio = batch["importance_sampling_ratio"] = self._is_ratio(logps, sampling, mask)
        pending = self._pending_is.get(mode)
        if pending is not None and pending.add(logps, sampling, batch.get(FILTERED_KEY), mask,
                                               ratio):
            self._flush_is(mode)
