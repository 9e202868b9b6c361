"""The rollout-backend contract (DESIGN.md "Backend contract").

Every engine (``hf_generate``, ``hf_cb``, ``cb_sync``, ``unsloth``, ``vllm``, ``flex``) implements
:class:`RolloutBackend`: ``load`` once, ``generate`` token-id prompts under one
:class:`~nbhelpers.config.SamplingParams`, ``close`` to free device memory. Prompts are token ids so
that every backend gets identical requests; completions report the tokens actually produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams


@dataclass(frozen=True)
class Completion:
    """One generated sequence.

    Attributes:
        prompt_ids: the prompt's token ids, ``[P]``.
        token_ids: generated token ids, ``[T]`` (EOS included when it ended the sequence).
        logprobs: log-probability of each sampled token under the engine's (processed) distribution,
            ``[T]``, or ``None`` when the engine does not report them.
        finish_reason: ``"length"`` (hit ``max_new_tokens``) or ``"stop"`` (EOS / stop id).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str

    def __post_init__(self) -> None:
        if self.finish_reason not in ("length", "stop"):
            raise ValueError(f"Completion.finish_reason={self.finish_reason!r}: 'length' or 'stop'.")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"Completion.logprobs has {len(self.logprobs)} entries for "
                             f"{len(self.token_ids)} tokens: they must match one to one.")


@runtime_checkable
class RolloutBackend(Protocol):
    name: str

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Generate ``sampling.n`` completions per prompt, ordered prompt-major
        (``[p0s0, p0s1, ..., p1s0, ...]``)."""
        ...

    def close(self) -> None: ...


class BackendNotInstalled(ImportError):
    """Raised by ``load`` when the backend's engine is missing; the message names the extra."""

    def __init__(self, backend: str, extra: str, cause: BaseException | None = None):
        super().__init__(f"backend {backend!r} needs its engine: pip install -e '.[{extra}]'"
                         + (f" (import failed: {cause})" if cause else ""))
