"""nbhelpers.run.result_line: the line a finished run prints under its ``ok`` line."""

import json

import nbformat

from nbhelpers.run.result_line import MAX_CHARS, result_line, shorten
from nbhelpers.stats import make_sidecar, write_sidecar

PHASE0_RESULT = (
    "**Result:** 10 GRPO steps of `smollm2-135m-instruct` on cpu (hf_generate): median step "
    "51.56 s after 3 warm-up steps, peak memory 4.35 GiB, median mean reward -3.62, losses "
    "finite. Reference: 5.8 s and 158.9 GB (Qwen3-4B-Base, vLLM colocated, NVIDIA B200).")


def _executed(path, *outputs):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x", outputs=list(outputs))]
    nbformat.write(nb, path)
    return path


def _markdown(text):
    return nbformat.v4.new_output("display_data", data={"text/markdown": text,
                                                        "text/plain": "<Markdown object>"})


def test_the_notebooks_result_sentence_without_markdown(tmp_path):
    nb = _executed(tmp_path / "run.ipynb",
                   nbformat.v4.new_output("stream", name="stdout", text="step 1 loss 0.1\n"),
                   _markdown("**Result:** an older line."), _markdown(PHASE0_RESULT))
    got = result_line(nb, tmp_path / "missing.json")
    assert got == ("10 GRPO steps of smollm2-135m-instruct on cpu (hf_generate): median step "
                   "51.56 s after 3 warm-up steps, peak memory 4.35 GiB, median mean reward "
                   "-3.62, losses finite.")


def test_without_a_result_line_the_sidecar_headline_is_shown(tmp_path):
    nb = _executed(tmp_path / "run.ipynb", _markdown("## no result here"))
    side = make_sidecar(phase="phase0", backend="x",
                        extra={"headline": {"step_time_s_median": 1.5, "steps": 2}})
    path = write_sidecar(side, tmp_path / "run.json")
    assert result_line(nb, path) == "step_time_s_median=1.5, steps=2"
    (tmp_path / "bad.json").write_text("[1]")
    assert result_line(nb, tmp_path / "bad.json") is None
    assert result_line(tmp_path / "missing.ipynb", None) is None
    (tmp_path / "text.ipynb").write_text("not json")
    assert result_line(tmp_path / "text.ipynb", path) == "step_time_s_median=1.5, steps=2"
    assert json.loads(path.read_text())["headline"]["steps"] == 2


def test_a_long_line_is_cut_to_about_two_terminal_lines():
    cut = shorten("**Result:** " + "word " * 200)
    assert len(cut) == MAX_CHARS and cut.endswith("...") and "**" not in cut
