"""``python -m nbhelpers run -p NAME VALUE`` with negative numbers argparse would take for
options (``-1e-5``: its negative-number pattern has no exponent), and the list hint."""

import pytest

from nbhelpers.__main__ import _negative_values, main

NB = "notebooks/phase0_reference/00_reference_grpo.ipynb"


def test_negative_values_reach_the_parameter_checks(capsys):
    assert _negative_values(["run", NB, "-p", "learning_rate", "-1e-5"])[-1] == " -1e-5"
    assert _negative_values(["-p", "beta", "-1", "--profile", "cpu"]) == \
        ["-p", "beta", " -1", "--profile", "cpu"]
    assert _negative_values(["-p", "x", "-.5", "-p", "y", "-inf"]) == \
        ["-p", "x", " -.5", "-p", "y", " -inf"]
    assert _negative_values(["-p", "name", "--profile"]) == ["-p", "name", "--profile"]
    assert main(["run", NB, "-p", "learning_rate", "-1e-5"]) == 2
    err = capsys.readouterr().err
    assert "learning_rate=-1e-05: must be finite and > 0" in err


@pytest.mark.parametrize("value", ["flex", "4"])
def test_a_bare_value_for_a_list_parameter_shows_the_brackets(capsys, value):
    nb = "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"
    assert main(["run", nb, "-p", "backends", value]) == 2
    assert f"Write a list in brackets: -p backends '[{value}]'" in capsys.readouterr().err
