"""Batch lists (34's ``batch_sizes``, 33's ``batches``) are checked before a notebook runs: an
empty list or a bad entry failed minutes in, naming ``Workload.n_prompts`` or ``max()`` (fresh-user
report, 2026-12-01), and so is a `-p NAME` given twice (the last one won silently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbhelpers.run.params import UserInputError, parse_overrides, plan_parameters

REPO = Path(__file__).resolve().parents[2]
NB33 = REPO / "notebooks" / "phase3_flex" / "33_flex_vs_baselines.ipynb"
NB34 = REPO / "notebooks" / "phase3_flex" / "34_gemma4.ipynb"


@pytest.mark.parametrize("nb,name", [(NB34, "batch_sizes"), (NB33, "batches")])
@pytest.mark.parametrize("value,what", [
    ("[]", "is empty"),
    ("[1, -2]", r"has \[-2\]"),
    ("[0]", r"has \[0\]"),
    ("[4, 4]", "repeats an entry"),
    ("[4, true]", r"has \[True\]"),
    ("[8, 1000]", r"has \[1000\]"),  # beyond the engine's largest decode batch: failed in cell 5
])
def test_bad_batch_lists_are_refused_before_the_run(nb, name, value, what):
    with pytest.raises(UserInputError, match=rf"-p {name} .*{name}=.* {what}: give a non-empty "
                                             r"list of distinct ints in \[1, 512\], e\.g\. \[4, 8\]"):
        plan_parameters([nb], "cpu", parse_overrides([(name, value)]), REPO)


@pytest.mark.parametrize("nb,name", [(NB34, "batch_sizes"), (NB33, "batches")])
def test_good_batch_lists_pass(nb, name):
    [(_, params)] = plan_parameters([nb], "cpu", parse_overrides([(name, "[1, 8, 512]")]), REPO)
    assert params[name] == [1, 8, 512]


def test_a_parameter_given_twice_is_refused():
    from nbhelpers.run.params import parse_overrides
    with pytest.raises(UserInputError, match=r"-p max_steps given twice \('2' and '3'\): keep "
                                             "the one you mean"):
        parse_overrides([("max_steps", "2"), ("max_steps", "3")])
    assert parse_overrides([("max_steps", "2"), ("seed", "1")]) == {"max_steps": 2, "seed": 1}
