"""nbhelpers.grpo.phase0_report: the phase 0 Result line flags steps without a learning signal;
the sidecar's token rates are over the rollout, and its rounds keep their tokens."""

import pytest

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo.phase0_report import phase0_sidecar, result_line, zero_advantage_steps
from nbhelpers.grpo.result import GRPOResult
from nbhelpers.run.index import headline as index_headline


def _result(reward_stds: list[float]) -> GRPOResult:
    records = [{"step": i + 1, "loss": 0.0, "reward_std": std} for i, std in enumerate(reward_stds)]
    summary = {"n_steps": len(records), "skip_first": 0, "step_time_s_median": 1.0,
               "peak_mem_device_gib": 2.0, "reward_median": -7.5}
    return GRPOResult(model_name="m", backend="hf_generate", records=records, summary=summary,
                      completions=[], log_history=[], reward_names=[])


def test_zero_advantage_steps_counts_flat_groups():
    assert zero_advantage_steps(_result([0.0, 0.5, 0.0])) == 2
    assert zero_advantage_steps(_result([0.1, 0.2])) == 0


def test_result_line_says_when_steps_had_no_learning_signal():
    flat = result_line(_result([0.0, 0.0, 0.3]), "cpu")
    assert "2 of 3 steps had zero advantage" in flat
    every = result_line(_result([0.3, 0.4]), "cpu")
    assert "none of the 2 steps had zero advantage" in every and "no learning signal" not in every


def test_result_line_names_the_steps_its_medians_cover():
    """The medians (step time and reward) are over the steps after skip_first; the sentence says
    which, so the reward is not read as all steps' (helper-24's re-trial, 2026-12-07)."""
    res = _result([0.3] * 10)
    res.summary["skip_first"] = 3
    assert "over steps 4-10 (after 3 warm-up steps) median step 1.00 s and median mean " \
           "reward -7.50; peak memory 2.00 GiB" in result_line(res, "cpu")
    res.summary["skip_first"] = 12
    assert "over all 10 steps (no more than skip_first=12 ran)" in result_line(res, "cpu")


def _timed_result(n_steps: int, generate_s: float | None = 10.0) -> GRPOResult:
    """``n_steps`` steps of 30 s wall, 10 s rollout (TRL's ``generate_s``), 4 x 100 new tokens
    and 200 prompt tokens each."""
    records = [{"step": i + 1, "loss": 0.1, "reward_std": 1.0, "wall_s": 30.0,
                "completion_length_mean_tokens": 100.0, "num_tokens_total": 600.0 * (i + 1)}
               for i in range(n_steps)]
    logs = [{"step": i + 1} | ({} if generate_s is None else {"generate_s": generate_s})
            for i in range(n_steps)]
    summary = {"n_steps": n_steps, "skip_first": 0, "step_time_s_median": 30.0,
               "peak_mem_allocated_gib": 2.0, "peak_mem_device_gib": 2.0, "reward_median": 0.5}
    return GRPOResult(model_name="m", backend="hf_generate", records=records, summary=summary,
                      completions=[], log_history=logs, reward_names=[],
                      config={"generation_batch_size": 4})


def _sidecar(result: GRPOResult, skip_first: int) -> dict:
    return phase0_sidecar(result, GRPOSettings(), {"name": "m"}, skip_first)


def test_phase0_token_rates_are_over_the_rollout_not_the_whole_step():
    side = _sidecar(_timed_result(5), skip_first=3)
    assert [r["generate_s"] for r in side["rounds"]] == [10.0, 10.0]
    assert side["decode_tok_per_s_median"] == pytest.approx(400 / 10)  # not 400 / 30
    assert side["prompt_tok_per_s_median"] == pytest.approx(200 / 10)
    assert side["wall_s_median"] == 30.0  # the whole step stays the step
    assert "not of the whole step" in side["rates_note"]
    assert "steps 4..5 of 5" in side["rounds_note"]
    # INDEX.md shows the notebook's headline (step time, memory, reward), no token rate
    assert index_headline(side).startswith("step_time_s_median=30, peak_mem_gib=2")


def test_phase0_all_steps_skipped_keeps_their_tokens():
    """``-p max_steps 1 -p skip_first 5``: the round was written with 0 tokens and 0 tok/s."""
    side = _sidecar(_timed_result(1), skip_first=5)
    assert side["rounds"] == [{"wall_s": 30.0, "generate_s": 10.0, "new_tokens": 400.0,
                               "prompt_tokens": 200.0}]
    assert side["decode_tok_per_s_median"] == pytest.approx(40.0)
    assert "all 1 steps" in side["rounds_note"] and "skip_first=5" in side["rounds_note"]


def test_phase0_rates_without_a_timed_rollout_are_none_not_per_step():
    side = _sidecar(_timed_result(4, generate_s=None), skip_first=3)
    assert side["rounds"][0]["generate_s"] is None and side["rounds"][0]["new_tokens"] == 400.0
    assert side["decode_tok_per_s_median"] is None and side["prompt_tok_per_s_median"] is None
    assert side["wall_s_median"] == 30.0
