"""Bad input found by a fresh-user trial, fourth round (session 19, 2026-12-07, helper-15 on a clean
clone at fd17357): phase 2 values that passed the runner's up-front checks and failed only inside
the notebook, after a kernel had started and a failed run was archived. Each is now refused
before any output name is claimed, naming the parameter and the fix (CPU, nothing executed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbhelpers.run import runner
from nbhelpers.run.params import UserInputError, parse_overrides

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, *pairs: tuple[str, str]):
    return runner.plan_jobs("phase2", "cpu", parse_overrides(list(pairs)), None,
                            tmp_path / "executed", REPO)


@pytest.mark.parametrize("name, value, match", [
    ("gradient_accumulation_steps", "0",
     r"-p gradient_accumulation_steps .*gradient_accumulation_steps=0: must be >= 1"),
    ("cpu_threads", "-1", r"-p cpu_threads .*cpu_threads=-1 must be >= 0"),
    ("flex_compile_attention", "maybe",
     r"-p flex_compile_attention .*compile_attention='maybe': use auto \| on \| off"),
])
def test_phase2_values_the_notebook_failed_on_are_refused_up_front(tmp_path, name, value, match):
    with pytest.raises(UserInputError, match=match):
        _plan(tmp_path, (name, value))
    assert not (tmp_path / "executed").exists()


def test_a_model_folder_without_config_json_is_refused_up_front(tmp_path):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "weights.txt").write_text("x")
    with pytest.raises(UserInputError, match=r"-p model .*folder without a config.json"):
        _plan(tmp_path, ("model", str(folder)))
    assert not (tmp_path / "executed").exists()


def test_good_values_of_those_parameters_still_plan(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    jobs = _plan(tmp_path, ("gradient_accumulation_steps", "2"), ("cpu_threads", "0"),
                 ("flex_compile_attention", "auto"), ("model", str(folder)))
    assert jobs


def test_run_isolated_refuses_negative_cpu_threads_before_a_child_starts():
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo.compare import run_isolated
    with pytest.raises(ValueError, match=r"cpu_threads=-1: give an int >= 0"):
        run_isolated("hf_generate", "tiny-llama", GRPOSettings(), cpu_threads=-1)


def test_completions_longer_than_the_models_context_are_refused_up_front(tmp_path):
    # tiny-qwen3: max_position_embeddings 2,048 (its config builder; no weights, no assets)
    with pytest.raises(UserInputError, match=r"-p max_completion_length .*256 \+ 2000 = 2256 "
                                             r"tokens exceeds tiny-qwen3's context of 2048 .*"
                                             r"lower max_completion_length to <= 1792"):
        _plan(tmp_path, ("model", "tiny-qwen3"), ("max_completion_length", "2000"))
    assert not (tmp_path / "executed").exists()
    assert _plan(tmp_path, ("model", "tiny-qwen3"), ("max_completion_length", "1792"))


def test_model_context_reads_builders_and_folders_and_says_none_when_unknown(tmp_path):
    import json

    from nbhelpers.run.values import model_context
    assert model_context("qwen3-4b") == 40960 and model_context("tiny-qwen3") == 2048
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config":
                                                    {"max_position_embeddings": 4096}}))
    assert model_context(str(folder)) == 4096
    (folder / "config.json").write_text(json.dumps({"model_type": "x"}))
    assert model_context(str(folder)) is None
    assert model_context("org/some-hub-model") is None
