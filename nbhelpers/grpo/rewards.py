"""GRPO reward functions of the reference notebook, with its exact regexes and scores.

Source: Unsloth's public notebook "Qwen3_(4B)-GRPO.ipynb" (github.com/unslothai/notebooks,
nb/Qwen3_(4B)-GRPO.ipynb), section "Data Prep": cells ``iQwjTjNz-gY_`` (``match_format``),
``qgFNXORy-lpO`` (``match_format_exactly``), ``cUfHzCVx-nGK`` (``match_format_approximately``),
``hmtI_8gg-uIE`` (``check_answer``), ``AVW0kL8q-wL5`` (``match_numbers``) and ``GjBFrttr-y1_``
(``check_numbers``); the trainer passes them in that order (cell ``vzOuSVCL_GA9``).

Contract: TRL's reward signature ``f(prompts, completions, answer=None, **kwargs) ->
list[float | None]``, one score per completion. ``completions`` may be conversational (each a list
of message dicts; the first message's ``content`` is scored, as in the notebook) or plain strings.
Differences from the notebook, each to make the functions usable outside it:
* the notebook's regex allows an optional EOS token after ``</SOLUTION>`` using its tokenizer's
  ``eos_token``; :func:`make_reward_funcs` takes that token, and ``REWARD_FUNCS`` is built with
  none (TRL decodes completions with ``skip_special_tokens=True``, so EOS text never appears);
* ``check_answer``/``check_numbers`` return ``None`` per completion when ``answer`` is missing
  (TRL then ignores that function for the sample) instead of raising ``TypeError``;
* ``check_numbers`` does not print samples (the notebook prints every 5th call);
* bare ``except:`` becomes ``except (ValueError, ZeroDivisionError, OverflowError)``, the
  errors ``float(...)`` and the ratio can raise (``ZeroDivisionError`` when the true answer is 0).

Run: ``python -c "from nbhelpers.grpo.rewards import REWARD_FUNCS; print([f.__name__ for f in
REWARD_FUNCS])"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from nbhelpers.data import REASONING_END, SOLUTION_END, SOLUTION_START

RewardFunc = Callable[..., list[float | None]]

_NUMERIC_ERRORS = (ValueError, ZeroDivisionError, OverflowError, TypeError)


def match_format_regex(eos_token: str | None = None) -> re.Pattern[str]:
    """The notebook's ``match_format``: ``<end_working_out> ... <SOLUTION>(answer)</SOLUTION>``.

    Compiled with ``re.MULTILINE | re.DOTALL`` exactly as the notebook does (so ``$`` also matches
    before any newline). The opening ``<start_working_out>`` is not required: the chat template's
    generation prompt writes it.
    """
    solution_end_regex = r"</SOLUTION>[\s]{0,}"
    if eos_token:
        solution_end_regex += "(?:" + re.escape(eos_token) + ")?"
    return re.compile(rf"{REASONING_END}.*?{SOLUTION_START}(.+?){solution_end_regex}[\s]{{0,}}$",
                      flags=re.MULTILINE | re.DOTALL)


MATCH_NUMBERS = re.compile(SOLUTION_START + r".*?[\s]{0,}([-]?[\d\.\,]{1,})",
                           flags=re.MULTILINE | re.DOTALL)
"""The notebook's ``match_numbers``: first number after ``<SOLUTION>`` (commas, dots allowed)."""


def completion_text(completion: Any) -> str:
    """The scored text: ``completion[0]["content"]`` for chat completions, else the string.

    Raises:
        TypeError: neither a string nor a non-empty list of message dicts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[0], dict):
        return completion[0]["content"]
    raise TypeError(f"completion must be a str or a list of message dicts, got {completion!r}; "
                    "pass TRL's `completions` unchanged.")


def _texts(completions: Sequence[Any]) -> list[str]:
    return [completion_text(c) for c in completions]


def score_format_exact(text: str, pattern: re.Pattern[str]) -> float:
    """+3.0 when ``pattern`` finds the whole format, else 0.0 (``match_format_exactly``)."""
    return 3.0 if pattern.search(text) is not None else 0.0


def score_format_approx(text: str) -> float:
    """+0.5 for each of ``<end_working_out>``, ``<SOLUTION>``, ``</SOLUTION>`` seen exactly once,
    -1.0 for each seen 0 or 2+ times (notebook: ``match_format_approximately``; the opening tag is
    not scored because the generation prompt always writes it). Range [-3.0, 1.5]."""
    return sum(0.5 if text.count(tag) == 1 else -1.0
               for tag in (REASONING_END, SOLUTION_START, SOLUTION_END))


def score_answer(guess: str | None, true_answer: str) -> float:
    """Notebook ``check_answer`` for one completion.

    No format match -> -2.0; exact string -> 5.0; equal after ``strip()`` -> 3.5; else the ratio
    guess/true within [0.9, 1.1] -> 2.0, within [0.8, 1.2] -> 1.5, other numbers -> -2.5; not a
    number (or true answer 0) -> -4.5.
    """
    if guess is None:
        return -2.0
    if guess == true_answer:
        return 5.0
    if guess.strip() == true_answer.strip():
        return 3.5
    try:
        ratio = float(guess) / float(true_answer)
    except _NUMERIC_ERRORS:
        return -4.5
    if 0.9 <= ratio <= 1.1:
        return 2.0
    if 0.8 <= ratio <= 1.2:
        return 1.5
    return -2.5


def score_numbers(guess: str | None, true_answer: str) -> float:
    """Notebook ``check_numbers`` for one completion: no number after ``<SOLUTION>`` -> -2.5;
    ``float`` equal (commas removed from the guess) -> 3.5, unequal -> -1.5; unparseable -> 0.0."""
    if guess is None:
        return -2.5
    try:
        return 3.5 if float(guess.strip().replace(",", "")) == float(true_answer.strip()) else -1.5
    except _NUMERIC_ERRORS:
        return 0.0


def _first_group(pattern: re.Pattern[str], text: str) -> str | None:
    found = pattern.search(text)
    return found.group(1) if found is not None else None


def _answers(answer: Any, n: int) -> list[str] | None:
    if answer is None:
        return None
    answers = [answer] * n if isinstance(answer, (str, int, float)) else list(answer)
    if len(answers) != n:
        raise ValueError(f"got {len(answers)} answers for {n} completions: pass one answer per "
                         "completion (TRL repeats the dataset column num_generations times).")
    return [str(a) for a in answers]


def make_reward_funcs(eos_token: str | None = None) -> list[RewardFunc]:
    """The notebook's four reward functions, in its order, with stable ``__name__``s.

    Args:
        eos_token: the tokenizer's EOS text allowed after ``</SOLUTION>`` (notebook behaviour
            with ``tokenizer.eos_token``); ``None`` when completions are decoded without it.
    """
    pattern = match_format_regex(eos_token)

    def match_format_exactly(prompts=None, completions=(), answer=None, **kwargs):
        return [score_format_exact(t, pattern) for t in _texts(completions)]

    def match_format_approximately(prompts=None, completions=(), answer=None, **kwargs):
        return [score_format_approx(t) for t in _texts(completions)]

    def check_answer(prompts=None, completions=(), answer=None, **kwargs):
        texts = _texts(completions)
        answers = _answers(answer, len(texts))
        if answers is None:
            return [None] * len(texts)
        return [score_answer(_first_group(pattern, t), a) for t, a in zip(texts, answers)]

    def check_numbers(prompts=None, completions=(), answer=None, **kwargs):
        texts = _texts(completions)
        answers = _answers(answer, len(texts))
        if answers is None:
            return [None] * len(texts)
        return [score_numbers(_first_group(MATCH_NUMBERS, t), a) for t, a in zip(texts, answers)]

    return [match_format_exactly, match_format_approximately, check_answer, check_numbers]


REWARD_FUNCS: list[RewardFunc] = make_reward_funcs()
"""The four reward functions for TRL's ``GRPOTrainer(reward_funcs=...)``, notebook order."""

match_format_exactly, match_format_approximately, check_answer, check_numbers = REWARD_FUNCS
