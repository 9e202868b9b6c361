"""The rollout-backend contract (DESIGN.md "Backend contract").

Every engine (``hf_generate``, ``hf_cb``, ``cb_sync``, ``unsloth``, ``vllm``, ``flex``) implements
:class:`RolloutBackend`: ``load`` once, ``generate`` token-id prompts under one
:class:`~nbhelpers.config.SamplingParams`, ``close`` to free device memory. Prompts are token ids so
that every backend gets identical requests; completions report the tokens actually produced.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from nbhelpers.config import Completion, LoraSpec, ModelSpec, SamplingParams

__all__ = ["BackendNotInstalled", "Completion", "RolloutBackend"]


@runtime_checkable
class RolloutBackend(Protocol):
    name: str

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None, *,
                 sampling_params: SamplingParams | None = None,
                 **unexpected: Any) -> list[Completion]:
        """Generate ``sampling.n`` completions per prompt, ordered prompt-major
        (``[p0s0, p0s1, ..., p1s0, ...]``). ``sampling_params=`` (vLLM's name) is an alias of
        ``sampling``; both or neither given raise ``TypeError`` naming the fix
        (:func:`nbhelpers.config.resolve_sampling`); any other keyword (vLLM's ``max_tokens=``,
        ``presence_penalty=``...) raises ``TypeError`` naming where it belongs
        (:func:`nbhelpers.engine.llm_checks.check_generate_kwargs`)."""
        ...

    def close(self) -> None: ...


class BackendNotInstalled(ImportError):
    """Raised by ``load`` when the backend's engine is missing; the message names the extra."""

    def __init__(self, backend: str, extra: str, cause: BaseException | None = None):
        super().__init__(f"backend {backend!r} needs its engine: pip install -e '.[{extra}]'"
                         + (f" (import failed: {cause})" if cause else ""))
