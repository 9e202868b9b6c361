"""Every scoring branch of the reference notebook's four reward functions (nbhelpers.grpo.rewards).

Expected numbers are the notebook's (Qwen3_(4B)-GRPO.ipynb, cells qgFNXORy-lpO, cUfHzCVx-nGK,
hmtI_8gg-uIE, GjBFrttr-y1_). Run: ``pytest tests/unit/test_rewards.py -q``.
"""

from __future__ import annotations

import pytest

from nbhelpers.grpo.rewards import (
    REWARD_FUNCS,
    check_answer,
    check_numbers,
    completion_text,
    make_reward_funcs,
    match_format_approximately,
    match_format_exactly,
)

GOOD = "Let me think!<end_working_out><SOLUTION>42</SOLUTION>"


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_order_and_names_match_the_notebook():
    assert [f.__name__ for f in REWARD_FUNCS] == [
        "match_format_exactly", "match_format_approximately", "check_answer", "check_numbers"]


def test_completion_text_accepts_chat_and_plain_and_rejects_other():
    assert completion_text(chat("a")) == "a"
    assert completion_text("b") == "b"
    with pytest.raises(TypeError, match="list of message dicts"):
        completion_text(3)


def test_format_exact_scores_3_or_0():
    texts = [GOOD, "<end_working_out><SOLUTION>  2  </SOLUTION>\n\n", "no tags",
             "<SOLUTION>1</SOLUTION>"]
    assert match_format_exactly(completions=[chat(t) for t in texts]) == [3.0, 3.0, 0.0, 0.0]
    assert match_format_exactly(completions=texts) == [3.0, 3.0, 0.0, 0.0]


def test_format_exact_keeps_the_notebook_multiline_dollar():
    # re.MULTILINE makes `$` match before any newline, so trailing text on a new line still passes.
    assert match_format_exactly(completions=[GOOD + "\ntrailing words"]) == [3.0]
    assert match_format_exactly(completions=[GOOD + " trailing words"]) == [0.0]


def test_format_exact_eos_token_is_optional_only_when_given():
    text = GOOD + "<|im_end|>"
    assert match_format_exactly(completions=[text]) == [0.0]
    exact_with_eos = make_reward_funcs(eos_token="<|im_end|>")[0]
    assert exact_with_eos.__name__ == "match_format_exactly"
    assert exact_with_eos(completions=[text, GOOD]) == [3.0, 3.0]


def test_format_approx_per_tag_counts():
    texts = [
        GOOD,                                                    # each tag once: 3 * 0.5
        "nothing",                                               # none: 3 * -1.0
        "<end_working_out><end_working_out><SOLUTION>1</SOLUTION>",  # one tag twice
        "<start_working_out>x<end_working_out>",                 # opening tag is not scored
    ]
    assert match_format_approximately(completions=texts) == [1.5, -3.0, 0.0, -1.5]


@pytest.mark.parametrize("solution,answer,score", [
    ("42", "42", 5.0),        # exact string
    (" 42 ", "42", 3.5),      # equal after strip
    ("40", "42", 2.0),        # ratio 0.952 in [0.9, 1.1]
    ("35", "42", 1.5),        # ratio 0.833 in [0.8, 1.2]
    ("50", "42", 1.5),        # ratio 1.19
    ("100", "42", -2.5),      # a number, far off
    ("forty-two", "42", -4.5),  # not a number
    ("1", "0", -4.5),         # ratio divides by zero: the notebook's bare except -> -4.5
])
def test_check_answer_branches(solution, answer, score):
    text = f"<end_working_out><SOLUTION>{solution}</SOLUTION>"
    assert check_answer(prompts=None, completions=[chat(text)], answer=[answer]) == [score]


def test_check_answer_no_format_match_is_minus_2():
    assert check_answer(completions=["<SOLUTION>42</SOLUTION>"], answer=["42"]) == [-2.0]


def test_check_answer_without_answer_column_returns_none():
    assert check_answer(completions=[GOOD, GOOD]) == [None, None]
    assert check_numbers(completions=[GOOD]) == [None]


def test_answers_must_match_completions():
    with pytest.raises(ValueError, match="one answer per completion"):
        check_answer(completions=[GOOD, GOOD], answer=["42"])
    assert check_answer(completions=[GOOD, GOOD], answer="42") == [5.0, 5.0]


@pytest.mark.parametrize("text,answer,score", [
    ("<SOLUTION>42</SOLUTION>", "42", 3.5),
    ("<SOLUTION> The solution is $1,234 </SOLUTION>", "1234", 3.5),  # commas removed
    ("<SOLUTION>-0.5</SOLUTION>", "-0.5", 3.5),
    ("<SOLUTION>41</SOLUTION>", "42", -1.5),
    ("<SOLUTION>1.2.3</SOLUTION>", "42", 0.0),   # extracted but float() fails
    ("<SOLUTION>no digits</SOLUTION>", "42", -2.5),
    ("42 without the tag", "42", -2.5),
])
def test_check_numbers_branches(text, answer, score):
    assert check_numbers(completions=[chat(text)], answer=[answer]) == [score]


def test_trl_style_call_with_extra_kwargs():
    prompts = [[{"role": "user", "content": "q"}]] * 2
    out = [f(prompts=prompts, completions=[chat(GOOD), chat("x")], answer=["42", "42"],
             completion_ids=[[1], [2]], trainer_state=None) for f in REWARD_FUNCS]
    assert out == [[3.0, 0.0], [1.5, -3.0], [5.0, -2.0], [3.5, -2.5]]
