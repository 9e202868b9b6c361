"""Field checks shared by the frozen dataclasses of :mod:`nbhelpers.config`: each field's type,
and vLLM / transformers argument names that :class:`~nbhelpers.config.SamplingParams` lacks.

Contract: :func:`check_field_types` checks every dataclass field against its annotation (an
``int`` field takes an int but not a bool or float, a ``float`` field an int or float, ``str`` a
str, ``tuple[str, ...]`` a tuple of str, ``X | None`` also ``None``) and raises
:class:`FieldTypeError`, a ``TypeError`` (what a wrong type is) that is also a ``ValueError``
(what every config check raised before, so ``except ValueError`` keeps catching it; the
precedent is :class:`nbhelpers.token_ids.TokenIdsError`). :func:`reject_unsupported_args` wraps
an ``__init__`` so that a name of :data:`UNSUPPORTED_SAMPLING_ARGS` raises ``TypeError`` naming
the fix instead of a bare "unexpected keyword argument". Stdlib only.
"""

from __future__ import annotations

import functools
import numbers
import types
import typing
from dataclasses import fields
from typing import Any, Literal

__all__ = ["UNSUPPORTED_SAMPLING_ARGS", "FieldTypeError", "check_field_types",
           "reject_unsupported_args"]


class FieldTypeError(TypeError, ValueError):
    """A config field of the wrong type (``SamplingParams(n=2.5)``): a ``TypeError`` that is
    also a ``ValueError`` (see the module docstring)."""


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the type ``hint`` (see the module docstring for the rules)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is Literal:  # the type only: each __post_init__ names the allowed values
        return any(type(value) is type(a) for a in args)
    if origin is tuple:
        items = args[:1] if len(args) == 2 and args[1] is Ellipsis else args
        return isinstance(value, tuple) and all(_fits(v, items[0]) for v in value) \
            if items else isinstance(value, tuple)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "str"
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _value_type(value: Any) -> str:
    if isinstance(value, tuple):
        return f"tuple of {sorted({type(v).__name__ for v in value})}"
    return type(value).__name__


def check_field_types(obj: Any) -> None:
    """Check every dataclass field of ``obj`` against its annotation.

    Raises:
        FieldTypeError: ``<Class>.<field>=<value>: expected <type>, got <type of value>``.
    """
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        if not _fits(value, hints[f.name]):
            raise FieldTypeError(f"{type(obj).__name__}.{f.name}={value!r}: expected "
                                 f"{_type_name(hints[f.name])}, got {_value_type(value)}.")


_PENALTY = ("the flex engine and the rollout backends do not implement {name} (vLLM's "
            "sampling penalty; GRPO's reference run uses none): leave it out")
UNSUPPORTED_SAMPLING_ARGS = {
    "max_tokens": "use max_new_tokens (vLLM's max_tokens)",
    "logprobs": "logprobs of the sampled tokens are always returned (Completion.logprobs / "
                "full_logprobs)",
    "stop": "stop strings are not supported: use stop_token_ids (token ids, e.g. from "
            "tokenizer.encode)",
    "eos_token_id": "the EOS ids are the engine's, not a sampling setting: "
                    "LLM(model, eos_token_id=[...]) (default model.config.eos_token_id); to stop "
                    "on more ids per request pass stop_token_ids=[...]",
    "presence_penalty": _PENALTY.format(name="presence_penalty"),
    "frequency_penalty": _PENALTY.format(name="frequency_penalty"),
    "repetition_penalty": _PENALTY.format(name="repetition_penalty"),
    "best_of": "best_of is not implemented (no ranking of samples): use n=... samples per "
               "prompt and pick among the returned Completions yourself",
}
"""vLLM / transformers names that ``SamplingParams`` lacks, each with its fix."""


def reject_unsupported_args(init: Any) -> Any:
    """Wrap ``SamplingParams.__init__`` so a name of :data:`UNSUPPORTED_SAMPLING_ARGS` raises
    ``TypeError`` naming the fix instead of a bare "unexpected keyword argument"."""
    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for name, fix in UNSUPPORTED_SAMPLING_ARGS.items():
            if name in kwargs:
                raise TypeError(f"SamplingParams({name}=...): {fix}.")
        init(self, *args, **kwargs)
    return checked
