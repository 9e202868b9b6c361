"""nbhelpers.grpo.phase0_report: the phase 0 Result line flags steps without a learning signal."""

from nbhelpers.grpo.phase0_report import result_line, zero_advantage_steps
from nbhelpers.grpo.result import GRPOResult


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
