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
modes and clips (:func:`is_ratio`, TRL's ``token_*`` / ``sequence_*`` rules), puts it in the batch
as ``importance_sampling_ratio`` with the trainer's logprobs as ``old_per_token_logps`` and the
engine's full logprobs as ``sampling_per_token_logps``, and applies it in the loss as TRL does for
vLLM; (2) logs ``sampling/sampling_logp_difference/mean`` and ``/max`` (TRL's key names) from the
loss's own logprobs (no extra forward); (3) logs :data:`IS_KEYS` per step, for flex and for vLLM
(``plans``: vLLM runs through it too, its path is TRL's own; its "same support" gap is ``None``:
vLLM 0.26 returns no kept mass), and for flex :data:`FILTERED_IS_KEYS`, the vLLM-style ratio
against its filtered logprobs (the bias the fix removes).

Run: ``pytest tests/unit/test_grpo_flex.py``.
"""

from __future__ import annotations

import time
from typing import Any

from trl import GRPOTrainer

from nbhelpers.config import SamplingParams

MISMATCH_KEY = "sampling/sampling_logp_difference"
"""TRL's metric prefix (``/mean``, ``/max``) for |engine logprob - trainer logprob|, nats/token."""
FULL_KEY = "full_logprobs"
"""The rollout's extra key: engine logprobs under the full softmax at the sampling temperature."""
IS_KEYS = {"ratio_mean": "sampling/token_is_ratio/mean",
           "outside": "sampling/token_is_ratio/outside_0.9_1.1",
           "same_support": "sampling/same_support_logp_difference/mean"}
"""Per-step IS report: token ratio ``exp(trainer - engine)`` mean, fraction of tokens outside
[0.9, 1.1], mean |engine - trainer| logprob on one support (nats/token)."""
FILTERED_IS_KEYS = {"ratio_mean": "sampling/token_is_ratio_filtered/mean",
                    "outside": "sampling/token_is_ratio_filtered/outside_0.9_1.1"}
"""Flex only, for comparison: the same two numbers against the engine's *filtered* logprob
``log q_S`` (what TRL's vLLM path uses, not renormalised to one support); reported, not applied."""
IS_APPLIED_MEAN = "sampling/importance_sampling_ratio/mean"
"""TRL's key: mean of the ratio as the loss applies it (after its mode and clip)."""


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
                  "logprobs": [list(o.logprobs) for o in outs],
                  FULL_KEY: [list(o.full_logprobs) for o in outs]}
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


def pad_rows(rows: list[list[float]], width: int, device: Any = None) -> Any:
    """``[B, width]`` fp32 tensor of ``rows`` right-padded with 0 (TRL's completion padding)."""
    import torch
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row[:width], dtype=torch.float32)
    return out.to(device)


def is_ratio(trainer_logps: Any, sampling_logps: Any, mask: Any, mode: str = "sequence_mask",
             clip_min: float | None = None, clip_max: float | None = 3.0) -> Any:
    """TRL 1.15.0's importance-sampling ratio (``_generate_and_score_completions``, the
    ``vllm_importance_sampling_*`` block), for any engine.

    ``exp((trainer - sampling) * mask)`` per token (``token_*``, ``[B, T]``) or summed per
    sequence (``sequence_*``, ``[B, 1]``); ``*_truncate`` clamps to ``[clip_min, clip_max]``,
    ``*_mask`` zeroes values outside it. NaN sampling logprobs give ratio 1.
    Raises ``ValueError`` for another ``mode``.
    """
    import math

    import torch
    modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    if mode not in modes:
        raise ValueError(f"importance sampling mode {mode!r}: use one of {modes}.")
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def token_is_stats(trainer_logps: Any, sampling_logps: Any, mask: Any,
                   same_support: bool = True) -> dict[str, float | None]:
    """:data:`IS_KEYS` values over ``mask`` (``[B, T]`` each): mean of the per-token ratio
    ``exp(trainer - sampling)``, fraction outside [0.9, 1.1], mean ``|trainer - sampling|``
    (``None`` unless ``same_support``: the two logprobs are on one support). NaN tokens are left
    out; an empty mask gives ``None`` everywhere."""
    import torch
    delta = (trainer_logps.detach().float() - sampling_logps.float())
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    if delta.numel() == 0:
        return dict.fromkeys(IS_KEYS.values())
    ratio = delta.exp()
    outside = ((ratio < 0.9) | (ratio > 1.1)).float().mean()
    return {IS_KEYS["ratio_mean"]: float(ratio.mean()), IS_KEYS["outside"]: float(outside),
            IS_KEYS["same_support"]: float(delta.abs().mean()) if same_support else None}


class FlexGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` + importance sampling on one support for flex + the IS report (module
    docstring). Training and loss are TRL's own; flex generation goes through ``rollout_func``."""

    _sampling_batch: tuple[Any, Any] | None = None

    @property
    def flex_is(self) -> bool:
        """TRL's IS correction applied to a ``rollout_func`` engine (not vLLM: TRL does that)."""
        return bool(self.args.vllm_importance_sampling_correction) and not self.use_vllm \
            and self.rollout_func is not None

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mask = out["completion_mask"]
        mode = "train" if self.model.training else "eval"
        if self.flex_is:
            filtered = out.get("sampling_per_token_logps")  # TRL's: the rollout's "logprobs"
            self._flex_importance_sampling(out, inputs)
            if filtered is not None:
                self._log_filtered_is(out["old_per_token_logps"], filtered, mask, mode)
            ratio = out["importance_sampling_ratio"]  # TRL's metric of the ratio as applied
            flat = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask.bool()]
            self._metrics[mode][IS_APPLIED_MEAN].append(float(flat.mean()) if flat.numel() else 0.0)
        if "old_per_token_logps" in out and "sampling_per_token_logps" in out:
            stats = token_is_stats(out["old_per_token_logps"], out["sampling_per_token_logps"],
                                   mask, same_support=self.flex_is)
            for key, value in stats.items():
                if value is not None:
                    self._metrics[mode][key].append(value)
        return out

    def _log_filtered_is(self, trainer_logps: Any, filtered: Any, mask: Any, mode: str) -> None:
        """:data:`FILTERED_IS_KEYS`: :func:`token_is_stats` against the engine's filtered
        logprobs ``[B, T]`` (vLLM-style, not renormalised)."""
        stats = token_is_stats(trainer_logps, filtered, mask, same_support=False)
        for name, key in FILTERED_IS_KEYS.items():
            value = stats[IS_KEYS[name]]
            if value is not None:
                self._metrics[mode][key].append(value)

    def _flex_importance_sampling(self, out: dict[str, Any], inputs: list[dict]) -> None:
        """Trainer logprobs, engine full logprobs and TRL's ratio into ``out`` (in place).
        Raises ``KeyError`` when the rollout returned no :data:`FULL_KEY`."""
        import torch
        if any(FULL_KEY not in row for row in inputs):
            raise KeyError(f"IS correction for a rollout_func needs its {FULL_KEY!r} key (flex "
                           "engine); set vllm_importance_sampling_correction=False otherwise.")
        mask = out["completion_mask"]
        sampling = pad_rows([row[FULL_KEY] for row in inputs], mask.shape[1], mask.device)
        if "old_per_token_logps" not in out:
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            attn = torch.cat([out["prompt_mask"], mask], dim=1)
            train = self.model.training
            batch = self.args.per_device_train_batch_size if train else \
                self.args.per_device_eval_batch_size
            with torch.no_grad():
                out["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.model, ids, attn, mask.shape[1], batch_size=batch)[0]
        out["sampling_per_token_logps"] = sampling
        out["importance_sampling_ratio"] = is_ratio(
            out["old_per_token_logps"], sampling, mask, self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)

    def _compute_loss(self, model, inputs):
        self._sampling_batch = (inputs.get("sampling_per_token_logps"), inputs["completion_mask"])
        # TRL 1.15 multiplies the loss by inputs["importance_sampling_ratio"] only under use_vllm
        # (its one use of the flag in _compute_loss); flex's ratio goes through the same line.
        apply_is = self.flex_is and "importance_sampling_ratio" in inputs
        try:
            if apply_is:
                self.use_vllm = True
            return super()._compute_loss(model, inputs)
        finally:
            if apply_is:
                self.use_vllm = False
            self._sampling_batch = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        batch = self._sampling_batch
        # only the loss's own call (compute_entropy=True), once per micro-batch; vLLM: TRL logs it
        if batch is not None and batch[0] is not None and kwargs.get("compute_entropy") \
                and not self.args.use_vllm:
            self._sampling_batch = None
            mean, worst = logprob_mismatch(out[0], batch[0], batch[1])
            mode = "train" if self.model.training else "eval"
            self._metrics[mode][f"{MISMATCH_KEY}/mean"].append(mean)
            self._metrics[mode][f"{MISMATCH_KEY}/max"].append(worst)
        return out
