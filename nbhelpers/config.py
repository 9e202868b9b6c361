"""Frozen, validated configuration objects shared by every notebook, backend and the engine.

Contract: each dataclass is immutable and checks itself in ``__post_init__``: first every field's
type (:func:`check_field_types`: an ``int`` field takes an int but not a bool or float, a
``float`` field an int or float, ``str`` a str, ``tuple[str, ...]`` a tuple of str, ``X | None``
also ``None``; ``SamplingParams.stop_token_ids`` alone also takes a list or any sequence of ints,
as vLLM does, stored as a tuple; :func:`nbhelpers.token_ids.token_ids` reads it), then its
range; a bad value raises ``ValueError`` whose message names the field, and the type expected or
the fix (a wrong type raises :class:`~nbhelpers.config_types.FieldTypeError`, a ``TypeError`` that
is also a ``ValueError``). Notebook ``parameters`` cells map one to one onto these fields.

Reference values (``GRPOSettings`` defaults) come from the public Unsloth notebook
"Qwen3_(4B)-GRPO.ipynb" (unslothai/notebooks, nb/Qwen3_(4B)-GRPO.ipynb): LoRA r=32, alpha=64 (the
notebook uses ``lora_alpha = lora_rank*2``), lr 5e-6, linear schedule, warmup_ratio 0.1,
weight_decay 0.001, optim adamw_8bit (we use adamw_torch: bitsandbytes is optional), num_generations 4,
vLLM sampling min_p=0.1, top_p=1.0, top_k=-1, seed 3407, max_seq_length 2048.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from nbhelpers.config_types import (
    UNSUPPORTED_SAMPLING_ARGS,
    FieldTypeError,
    check_field_types,
    reject_unsupported_args,
)
from nbhelpers.token_ids import token_ids

__all__ = ["GRPO_SAMPLING", "LORA_TARGETS_ALL", "SAMPLING_PRESETS", "UNSUPPORTED_SAMPLING_ARGS",
           "WORKLOAD_W", "Completion", "FieldTypeError", "GRPOSettings", "LoraSpec", "ModelSpec",
           "SamplingParams", "Workload", "check_field_types", "resolve_sampling", "token_ids"]

LORA_TARGETS_ALL: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
"""The 7 projections the reference notebook adapts (``target_modules`` in Qwen3_(4B)-GRPO.ipynb)."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelSpec:
    """A model the lab can load.

    Attributes:
        name: registry key (``smollm2-135m-instruct``, ``qwen3-4b``...), a hub id or a local path.
        kind: ``real`` (weights from a package or folder), ``random`` (architecture only, random
            bf16 weights; speed work), ``hub`` (Hugging Face id or local folder).
        architecture: HF ``config.architectures[0]`` (``Qwen3ForCausalLM``...), when known.
        dtype: ``bfloat16`` | ``float32`` | ``float16``.
    """

    name: str
    kind: Literal["real", "random", "hub"] = "real"
    architecture: str | None = None
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_field_types(self)
        _require(bool(self.name), "ModelSpec.name is empty: pass a registry key (see "
                 "nbhelpers.models.list_models()), a hub id or a local path.")
        _require(self.kind in ("real", "random", "hub"),
                 f"ModelSpec.kind={self.kind!r}: use 'real', 'random' or 'hub'.")
        _require(self.dtype in ("bfloat16", "float32", "float16"),
                 f"ModelSpec.dtype={self.dtype!r}: use 'bfloat16', 'float32' or 'float16'.")


@dataclass(frozen=True)
class LoraSpec:
    """A PEFT LoRA adapter description (r, alpha, target module names).

    ``init_b_std`` > 0 re-initialises ``lora_B`` from N(0, init_b_std^2) so the adapter is not a
    no-op (PEFT initialises B to zero, which lets LoRA kernels skip work and flatters them).
    """

    rank: int = 32
    alpha: int = 64
    targets: tuple[str, ...] = LORA_TARGETS_ALL
    dropout: float = 0.0
    init_b_std: float = 0.0

    def __post_init__(self) -> None:
        check_field_types(self)
        _require(self.rank > 0, f"LoraSpec.rank={self.rank}: must be a positive int (e.g. 32).")
        _require(self.alpha > 0, f"LoraSpec.alpha={self.alpha}: must be positive (e.g. 2*rank).")
        _require(len(self.targets) > 0, "LoraSpec.targets is empty: name at least one module, "
                 "e.g. nbhelpers.config.LORA_TARGETS_ALL.")
        _require(0.0 <= self.dropout < 1.0, f"LoraSpec.dropout={self.dropout}: use [0, 1).")
        _require(self.init_b_std >= 0.0, f"LoraSpec.init_b_std={self.init_b_std}: use >= 0.")

    @property
    def scaling(self) -> float:
        """PEFT's ``lora_alpha / r`` (no rsLoRA)."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings with vLLM's meaning (vllm/sampling_params.py).

    ``top_k`` of -1 or 0 disables top-k (vLLM convention; transformers wants ``None``/0, which each
    backend translates). ``temperature == 0`` means greedy. ``seed`` makes a request reproducible.
    ``n`` is the number of samples per prompt (TRL's ``num_generations``). ``stop_token_ids``
    takes any sequence of ints, as vLLM's ``list[int]`` does (``None``: none), and is stored as a
    tuple (the object stays hashable).

    vLLM / transformers names this class lacks raise ``TypeError`` naming the fix
    (:data:`~nbhelpers.config_types.UNSUPPORTED_SAMPLING_ARGS`): ``max_tokens`` (use
    ``max_new_tokens``), ``logprobs`` (always returned), ``stop`` strings (use
    ``stop_token_ids``), ``eos_token_id`` (the engine's: ``LLM(model, eos_token_id=...)``),
    ``presence_penalty`` / ``frequency_penalty`` / ``repetition_penalty`` (not implemented),
    ``best_of`` (use ``n``).

    Raises:
        TypeError: one of those arguments; a field of the wrong type (``n=2.5``:
            :class:`~nbhelpers.config_types.FieldTypeError`, a ``ValueError`` too); or (as
            :class:`~nbhelpers.token_ids.TokenIdsError`, a ``ValueError`` too)
            ``stop_token_ids`` that is not a sequence of ints (text, floats, one bare id).
        ValueError: temperature < 0 or not finite, top_p not in (0, 1], top_k < -1, min_p not in
            [0, 1], n < 1, max_new_tokens < 1, seed outside [0, 2**62), a negative stop id.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    max_new_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids",
                           token_ids("SamplingParams.stop_token_ids", self.stop_token_ids))
        check_field_types(self)
        _require(0.0 <= self.temperature < math.inf, f"SamplingParams.temperature="
                 f"{self.temperature}: must be finite and >= 0 (0 = greedy).")
        _require(self.seed is None or 0 <= self.seed < 2**62, f"SamplingParams.seed="
                 f"{self.seed}: must be in [0, 2**62) (the engine adds the request index).")
        _require(all(t >= 0 for t in self.stop_token_ids), f"SamplingParams.stop_token_ids="
                 f"{self.stop_token_ids}: token ids are >= 0.")
        _require(0.0 < self.top_p <= 1.0, f"SamplingParams.top_p={self.top_p}: must be in (0, 1] "
                 "(1.0 disables it).")
        _require(isinstance(self.top_k, int) and self.top_k >= -1, f"SamplingParams.top_k="
                 f"{self.top_k!r}: must be an int >= -1 (-1 or 0 disables it).")
        _require(0.0 <= self.min_p <= 1.0, f"SamplingParams.min_p={self.min_p}: must be in "
                 "[0, 1] (0 disables it).")
        _require(self.n >= 1, f"SamplingParams.n={self.n}: must be >= 1.")
        _require(self.max_new_tokens >= 1, f"SamplingParams.max_new_tokens="
                 f"{self.max_new_tokens}: must be >= 1.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_or_none(self) -> int | None:
        """``top_k`` for transformers: ``None`` when disabled (transformers rejects -1)."""
        return None if self.top_k <= 0 else self.top_k

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SamplingParams.__init__ = reject_unsupported_args(SamplingParams.__init__)


def resolve_sampling(owner: str, sampling: Any, sampling_params: Any) -> SamplingParams:
    """The one :class:`SamplingParams` of ``owner.generate(prompts, sampling)``, given either as
    ``sampling`` or as vLLM's keyword ``sampling_params=`` (every backend and the flex engine
    accept both names, so vLLM-style calls port unchanged).

    Raises:
        TypeError: both or neither given, or not a ``SamplingParams`` (the message names the fix).
    """
    if (sampling is None) == (sampling_params is None):
        raise TypeError(f"{owner}.generate(prompts, sampling): pass the SamplingParams once, as "
                        "the second argument `sampling` (vLLM's sampling_params= also works).")
    chosen = sampling if sampling is not None else sampling_params
    if not isinstance(chosen, SamplingParams):
        raise TypeError(f"{owner}.generate(sampling=...) takes nbhelpers.config.SamplingParams, "
                        f"got {type(chosen).__name__}: e.g. SamplingParams(temperature=1.0, "
                        "max_new_tokens=64).")
    return chosen


GRPO_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.1, seed=3407)
"""The reference notebook's vLLM sampling (``SamplingParams(min_p=0.1, top_p=1.0, top_k=-1,
seed=3407)`` in Qwen3_(4B)-GRPO.ipynb); temperature 1.0 is TRL's GRPOConfig default."""

SAMPLING_PRESETS: dict[str, SamplingParams] = {
    "grpo": GRPO_SAMPLING,
    "greedy": SamplingParams(temperature=0.0),
}


@dataclass(frozen=True)
class Completion:
    """One generated sequence.

    Attributes:
        prompt_ids: the prompt's token ids, ``[P]``.
        token_ids: generated token ids, ``[T]`` (EOS included when it ended the sequence).
        logprobs: log-probability of each sampled token under the engine's (processed) distribution,
            ``[T]``, or ``None`` when the engine does not report them.
        finish_reason: ``"length"`` (hit ``max_new_tokens``) or ``"stop"`` (EOS / stop id).
        full_logprobs: the same tokens' log-probability under the *full* softmax at the sampling
            temperature, ``[T]`` (``full_logprobs - logprobs = log(kept mass)`` of the min_p /
            top-k / top-p filters), or ``None`` (engines other than flex).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    full_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in ("length", "stop"):
            raise ValueError(f"Completion.finish_reason={self.finish_reason!r}: 'length' or 'stop'.")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"Completion.logprobs has {len(self.logprobs)} entries for "
                             f"{len(self.token_ids)} tokens: they must match one to one.")
        if self.full_logprobs is not None and len(self.full_logprobs) != len(self.token_ids):
            raise ValueError(f"Completion.full_logprobs has {len(self.full_logprobs)} entries for "
                             f"{len(self.token_ids)} tokens: they must match one to one.")


@dataclass(frozen=True)
class Workload:
    """A rollout benchmark workload (DESIGN.md, workload W).

    ``ignore_eos`` makes every request run to ``max_new_tokens`` so engines are compared on equal
    token counts.
    """

    n_prompts: int = 32
    prompt_tokens: int = 150
    max_new_tokens: int = 512
    ignore_eos: bool = True
    sampling: str = "grpo"
    rounds: int = 3
    warmup_rounds: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_field_types(self)
        _require(self.n_prompts >= 1, f"Workload.n_prompts={self.n_prompts}: must be >= 1.")
        _require(self.prompt_tokens >= 1, f"Workload.prompt_tokens={self.prompt_tokens}: must be >= 1.")
        _require(self.max_new_tokens >= 1, f"Workload.max_new_tokens={self.max_new_tokens}: must be >= 1.")
        _require(self.sampling in SAMPLING_PRESETS, f"Workload.sampling={self.sampling!r}: use one "
                 f"of {sorted(SAMPLING_PRESETS)}.")
        _require(self.rounds >= 1, f"Workload.rounds={self.rounds}: must be >= 1.")
        _require(self.warmup_rounds >= 0, f"Workload.warmup_rounds={self.warmup_rounds}: >= 0.")

    def sampling_params(self) -> SamplingParams:
        base = SAMPLING_PRESETS[self.sampling]
        return SamplingParams(**{**base.to_dict(), "max_new_tokens": self.max_new_tokens,
                                 "ignore_eos": self.ignore_eos})


WORKLOAD_W = Workload()
"""DESIGN.md workload W: 32 prompts x ~150 tokens, 512 new tokens, EOS ignored, GRPO sampling."""


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO run settings; defaults are the reference notebook's (module docstring gives the source).

    ``per_device_train_batch_size`` counts completions (TRL); it is rounded up to a multiple of
    ``num_generations`` by :func:`nbhelpers.grpo.setup.build_config` with a logged message.

    Raises:
        FieldTypeError: a field of the wrong type (a ``TypeError`` and a ``ValueError``).
        ValueError: a count below its minimum (``num_generations`` >= 2, the others >= 1);
            ``learning_rate`` not finite and > 0; ``beta`` or ``weight_decay`` not finite and
            >= 0; ``warmup_ratio`` not in [0, 1]; ``seed`` not in [0, 2**32) (what
            ``transformers.set_seed`` takes: numpy's seed range); ``pad_to_multiple_of`` < 0 or
            above the longer of ``max_prompt_length`` and ``max_completion_length``;
            the sampling fields as
            :class:`SamplingParams` checks them. NaN fails every range check.
    """

    max_steps: int = 10
    num_generations: int = 4
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    max_prompt_length: int = 256
    max_completion_length: int = 128
    learning_rate: float = 5e-6
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.1
    weight_decay: float = 0.001
    beta: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.1
    seed: int = 3407
    logging_steps: int = 1
    gradient_checkpointing: bool = False
    lora: LoraSpec = field(default_factory=LoraSpec)
    pad_to_multiple_of: int = 0
    """TRL's ``GRPOConfig.pad_to_multiple_of``: prompt and completion ids (and their masks) padded
    to a multiple of this many tokens before the trainer's forwards; 0 = off (TRL's ``None``, the
    reference). For ``compile_mode`` runs: every new sequence length is a new shape to the compiled
    trainer (on the H200, 2026-12-03, ``compile_mode="default"``: step 1 took 252 s for two
    compiles, grad and no-grad, and step 2 recompiled for 344 -> 345 tokens), so bucketing the
    lengths bounds the recompiles; padded positions are masked, the loss is unchanged (tested on
    the CPU). On CUDA the trainer runs a padded run with SDPA's cuDNN backend excluded: on an
    H100 (2026-12-07) the padded tiny-llama bf16 runs of ``tests/unit/test_pad_to_multiple_of.py``
    had a finite loss and NaN gradients at step 1 for ``hf_generate`` and ``flex``, and autograd's
    anomaly mode named ``ScaledDotProductCudnnAttentionBackward0`` (step ``t19``); with cuDNN
    excluded they trained within bf16 noise of the unpadded runs (``trainer._padding_sdpa_guard``,
    a run note says so). With ``compile_scope="layers"``
    (2026-12-07) a recompile costs one layer's graph instead of the backbone's, so unpadded
    compiled runs fit (an H100 flex run: 10 steps in 81.5 s); lengths still recompile until
    dynamo turns dynamic (one recompile at step 2 there)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        _require(self.pad_to_multiple_of >= 0, f"GRPOSettings.pad_to_multiple_of="
                 f"{self.pad_to_multiple_of}: must be >= 0 (0 = no padding; 64 buckets lengths "
                 "for compile_mode runs).")
        longest = max(self.max_prompt_length, self.max_completion_length)
        _require(self.pad_to_multiple_of <= longest, f"GRPOSettings.pad_to_multiple_of="
                 f"{self.pad_to_multiple_of}: must be <= {longest} (the longer of "
                 "max_prompt_length and max_completion_length: a larger multiple only adds "
                 "padding); use max_prompt_length for one prompt shape, 64 to bucket, 0 for none.")
        _require(self.num_generations >= 2, f"GRPOSettings.num_generations="
                 f"{self.num_generations}: GRPO needs >= 2 completions per prompt.")
        for name in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "max_prompt_length", "max_completion_length", "logging_steps"):
            _require(getattr(self, name) >= 1,
                     f"GRPOSettings.{name}={getattr(self, name)}: must be >= 1.")
        _require(0 < self.learning_rate < math.inf, f"GRPOSettings.learning_rate="
                 f"{self.learning_rate}: must be finite and > 0 (the reference uses 5e-6).")
        for name in ("beta", "weight_decay"):
            _require(0 <= getattr(self, name) < math.inf,
                     f"GRPOSettings.{name}={getattr(self, name)}: must be finite and >= 0.")
        _require(0 <= self.warmup_ratio <= 1, f"GRPOSettings.warmup_ratio={self.warmup_ratio}: "
                 "must be in [0, 1] (a fraction of max_steps).")
        _require(0 <= self.seed < 2**32, f"GRPOSettings.seed={self.seed}: must be in [0, 2**32) "
                 "(transformers.set_seed passes it to numpy, which takes no more).")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       min_p=self.min_p)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, seed=self.seed, n=self.num_generations,
                              max_new_tokens=self.max_completion_length)
