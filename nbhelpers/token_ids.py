"""Token-id arguments (``stop_token_ids``, an engine's ``eos_token_id``) read one way everywhere.

Contract: :func:`token_ids` turns any sequence of ints (list, tuple, range, 1-D array/tensor; with
``allow_single`` one int) into a tuple of ints and refuses everything else with
:class:`TokenIdsError` naming the field and the fix, so text never becomes a set of characters
(``frozenset("</s>")``). Stdlib only: :mod:`nbhelpers.config` and the engine use it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["TokenIdsError", "token_ids"]


class TokenIdsError(TypeError, ValueError):
    """A token-id argument of the wrong type (text, a float, a mapping, a bare id where a list is
    due). A ``TypeError`` (what it is) that is also a ``ValueError`` (what this module raises for
    any bad field, so ``except ValueError`` keeps catching it), as numpy's
    ``AxisError(ValueError, IndexError)`` is both."""


def token_ids(owner: str, value: Any, allow_single: bool = False) -> tuple[int, ...]:
    """``value`` (any sequence of ints: list, tuple, range, 1-D array/tensor; ``None`` = none;
    with ``allow_single`` also one int id) as a tuple of ints.

    Raises:
        TokenIdsError: a bare id (unless ``allow_single``), text (a string would otherwise be
            read as a set of characters), a mapping, or ids that are not ints; the message names
            ``owner`` (the field) and the fix.
    """
    if value is None:
        return ()
    ids = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
        if allow_single:
            return (int(ids),)
        raise TokenIdsError(f"{owner}={value!r}: a list of token ids is expected; wrap one id "
                            f"as [{int(ids)}].")
    if not isinstance(ids, Iterable) or isinstance(ids, (str, bytes, dict)):
        one = "an int id or " if allow_single else ""
        raise TokenIdsError(f"{owner}={value!r}: expected {one}a sequence of token ids (ints), "
                            f"got {type(value).__name__}: pass e.g. [tokenizer.eos_token_id] "
                            "(tokenizer.convert_tokens_to_ids for a token's text).")
    ids = list(ids)
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)),
               None)
    if bad is not None:
        raise TokenIdsError(f"{owner}={value!r}: token ids must be ints, got "
                            f"{type(bad).__name__} {bad!r}: pass int ids, e.g. "
                            "[tokenizer.eos_token_id].")
    return tuple(int(t) for t in ids)
