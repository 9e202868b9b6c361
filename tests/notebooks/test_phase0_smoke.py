"""Papermill smoke run of the real phase 0 notebook on a tiny model (2 GRPO steps, CPU)."""

import json

import nbformat
import pytest

from nbhelpers.run import runner
from nbhelpers.stats import validate_sidecar

NOTEBOOK = "notebooks/phase0_reference/00_reference_grpo.ipynb"
TINY = {"model": "tiny-llama", "max_steps": 2, "max_completion_length": 8, "n_questions": 8,
        "max_prompt_length": 256, "lora_rank": 4, "lora_alpha": 8, "skip_first": 1,
        "format_warmup_steps": 1}


@pytest.mark.notebooks
def test_phase0_notebook_runs_and_writes_its_sidecar(tmp_path, capfd):
    jobs = runner.run(NOTEBOOK, profile="cpu", overrides=TINY, executed=tmp_path)
    _assert_steps_reach_the_terminal(capfd.readouterr().out)
    assert [j.status for j in jobs] == ["ok"], f"see {jobs[0].output}"
    side = json.loads(jobs[0].sidecar.read_text())
    validate_sidecar(side)
    assert side["error"] is None and side["phase"] == "phase0"
    assert side["backend"] == "hf_generate" and side["model"]["name"] == "tiny-llama"
    assert side["lora"]["rank"] == 4 and side["workload"]["max_new_tokens"] == 8
    steps = side["grpo_steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["wall_s"] > 0 and s["loss"] is not None for s in steps)
    assert {"rewards/match_format_exactly/mean", "rewards/check_numbers/mean"} <= set(steps[0])
    assert side["grpo_summary"]["n_steps_in_median"] == 1  # skip_first=1 of 2 steps
    assert side["grpo_completions_sample"][0]["completion"] is not None
    assert side["headline"]["steps"] == 2
    assert side["format_warmup"]["steps"] == 1 and side["format_warmup"]["after"] is not None
    # token rates over the rollout (TRL's generate_s), run_id = the file name's stamp
    (only,) = side["rounds"]  # skip_first=1 of 2 steps
    assert 0 < only["generate_s"] < only["wall_s"] and only["new_tokens"] > 0
    assert side["decode_tok_per_s_median"] == only["new_tokens"] / only["generate_s"]
    assert side["run_id"] == jobs[0].sidecar.stem.split("_")[0]
    nb = nbformat.read(jobs[0].output, as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert images, "the plots cell produced no inline image"
    markdown = [o["data"]["text/markdown"] for c in nb.cells if c.cell_type == "code"
                for o in c.outputs if "text/markdown" in o.get("data", {})]
    assert markdown and markdown[-1].startswith("**Result:** 2 GRPO steps of `tiny-llama`")
    assert "| ok |" in (tmp_path / "INDEX.md").read_text()


def _assert_steps_reach_the_terminal(terminal: str) -> None:
    """Each SFT and GRPO step's logged values reach the runner's terminal once, as a line of
    their own, before the train cell's closing line. Before: the train call's ``progress=True``
    made transformers draw its notebook progress bar (an HTML table, which papermill never copies
    to the terminal), so 8.5 min of GRPO steps showed nothing there (a new user, 2026-12-07)."""
    lines = terminal.splitlines()
    grpo = [i for i, ln in enumerate(lines) if ln.startswith("{'loss'") and "'reward'" in ln]
    sft = [i for i, ln in enumerate(lines)
           if ln.startswith("{'loss'") and "'mean_token_accuracy'" in ln]
    done = [i for i, ln in enumerate(lines) if ln == "2 steps in" or ln.startswith("2 steps in ")]
    assert len(grpo) == 2 and len(sft) == 1 and len(done) == 1, terminal
    assert sft[0] < grpo[0] < grpo[1] < done[0], terminal
