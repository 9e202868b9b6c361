"""``nbhelpers.run.params`` reads a notebook's parameters cell with the standard library only (the
H200 image has no nbformat): list or string ``source``, no cell, and unreadable files."""

import json
import sys

import pytest

from nbhelpers.run.params import UserInputError, notebook_parameters

NOTEBOOK = "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"


def _nb(tmp_path, cells, name="x.ipynb"):
    path = tmp_path / name
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


def test_without_nbformat(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nbformat", None)  # import nbformat would raise
    got = notebook_parameters(__import__("pathlib").Path(NOTEBOOK))
    assert got["model"] == "str" and got["max_steps"] == "int"
    tagged = {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "outputs": []}
    lines = _nb(tmp_path, [{**tagged, "source": ["a: int = 1\n", "b = 'x'\n"]}], "lines.ipynb")
    assert notebook_parameters(lines) == {"a": "int", "b": None}
    text = _nb(tmp_path, [{**tagged, "source": "c: float = 2.0"}], "text.ipynb")
    assert notebook_parameters(text) == {"c": "float"}
    untagged = _nb(tmp_path, [{"cell_type": "code", "metadata": {}, "source": "d = 1"}])
    assert notebook_parameters(untagged) is None


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"cells": 3}', ""])
def test_unreadable_notebook_names_the_fix(tmp_path, content):
    bad = tmp_path / "bad.ipynb"
    bad.write_text(content)
    with pytest.raises(UserInputError, match=r"bad\.ipynb: not a readable Jupyter notebook .*"
                       r"give one of the notebooks/<phase>/\*\.ipynb files"):
        notebook_parameters(bad)


def test_a_yaml_boolean_for_a_word_parameter_says_to_quote_it():
    """`-p compile_dynamic on` reaches the check as True (YAML 1.1); the error names the quoting
    (found planning step c13a, 2026-12-03), and a list hint is not given for it."""
    from nbhelpers.run.params import check_value
    with pytest.raises(UserInputError, match=r"expects str, got True \(bool\)\. YAML reads "
                       r"on/off.*quote the word, e\.g\. -p compile_dynamic \"'on'\""):
        check_value("compile_dynamic", "str", True, "-p compile_dynamic")
    with pytest.raises(UserInputError, match=r"-p flag \"'off'\""):
        check_value("flag", "str", False, "-p flag")
    check_value("compile_dynamic", "str", "on", "-p compile_dynamic")  # quoted: accepted
    with pytest.raises(UserInputError) as err:
        check_value("backends", "list[str]", True, "-p backends")
    assert "quote the word" not in str(err.value)  # no str in the annotation: no quoting hint


def test_an_empty_value_for_a_word_parameter_names_the_empty_string():
    """`-p device ''` reaches the check as None (an empty YAML document); the error says how to
    pass an empty string (a fresh user's probe of 29_compare, 2026-12-03)."""
    from nbhelpers.run.params import check_value
    with pytest.raises(UserInputError, match=r"got None \(NoneType\)\. An empty value reads as "
                       r"null in YAML: for an empty string pass -p device '\"\"'"):
        check_value("device", "str", None, "-p device")
    check_value("device", "str", "", "-p device")  # the quoted form is accepted
    check_value("device", "str | None", None, "-p device")  # nullable: no error
