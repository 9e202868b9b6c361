"""nbhelpers.plots: figures from tidy frames, fixed backend colours, clear errors."""

import pytest
from matplotlib.figure import Figure

from nbhelpers import plots

RECORDS = [{"step": i, "wall_s": 1.0 + i, "loss": 0.1 * i, "kl": 0.01 * i,
            "rewards/match_format_exactly/mean": float(i), "rewards/check_answer/mean": -1.0}
           for i in (1, 2, 3)]


def test_every_backend_has_its_own_colour():
    names = {"hf_generate", "hf_cb", "hf_cb_nograph", "cb_sync", "unsloth", "vllm", "flex",
             "reference"}
    assert names <= set(plots.BACKEND_COLORS)
    assert len(set(plots.BACKEND_COLORS.values())) == len(plots.BACKEND_COLORS)
    assert plots.color("unknown-engine") == plots.FALLBACK_COLOR


def test_frames_are_tidy():
    steps = plots.steps_frame(RECORDS, "hf_generate")
    assert list(steps["backend"].unique()) == ["hf_generate"] and len(steps) == 3
    rewards = plots.rewards_frame(RECORDS, "vllm")
    assert len(rewards) == 6
    assert set(rewards["reward_func"]) == {"match_format_exactly", "check_answer"}


def test_builders_return_figures_with_backend_colours():
    steps = plots.steps_frame(RECORDS, "vllm")
    for build in (plots.step_time, plots.kl, plots.loss):
        fig = build(steps)
        assert isinstance(fig, Figure)
        line = fig.axes[0].get_lines()[0]
        assert line.get_color() == plots.BACKEND_COLORS["vllm"]
    fig = plots.rewards(plots.rewards_frame(RECORDS, "vllm"))
    assert len(fig.axes[0].get_lines()) == 2
    panel = plots.grpo_panel(steps.drop(columns=["kl"]), plots.rewards_frame(RECORDS, "vllm"))
    assert len(panel.axes) == 4 and panel.axes[2].texts[0].get_text() == "kl not logged"


def test_missing_column_names_the_fix():
    steps = plots.steps_frame(RECORDS, "flex").drop(columns=["wall_s"])
    with pytest.raises(ValueError, match=r"lacks columns \['wall_s'\].*steps_frame"):
        plots.step_time(steps)
