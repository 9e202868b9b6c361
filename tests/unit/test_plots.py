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


def test_shape_figures_draw_each_backend_in_its_colour_and_carry_their_caption():
    import pandas as pd
    split = pd.DataFrame({"step_time_s_median": [1.4, 1.7], "time/optimizer_s": [0.01, None]},
                         index=["flex", "vllm"])
    fig = plots.caption(plots.grouped_bars(split, list(split.columns), "s", "split"),
                        "From: flex: a__flex.json (2026-12-03 14:38 UTC)")
    bars = fig.axes[0].patches
    assert [b.get_height() for b in bars[:2]] == [1.4, 0.01]  # flex's two bars first
    assert bars[0].get_facecolor()[:3] == pytest.approx(
        tuple(int(plots.BACKEND_COLORS["flex"][i:i + 2], 16) / 255 for i in (1, 3, 5)))
    assert "a__flex.json" in fig._supxlabel.get_text()
    panel = plots.metrics_by_step(plots.steps_frame(RECORDS, "vllm"),
                                  [("wall_s", "s"), ("generate_s", "s")], "title")
    assert len(panel.axes) == 2 and panel.axes[1].texts[0].get_text() == "generate_s not logged"
    with pytest.raises(ValueError, match="grouped_bars: frame lacks"):
        plots.grouped_bars(split, ["generate_s"], "s", "t")


def test_grouped_bars_skip_missing_values_and_name_columns_nobody_logged():
    """29_compare crashed in ax.bar on CPU records whose time/* columns were all None."""
    import pandas as pd
    split = pd.DataFrame({"step_time_s_median": [1.4, 1.7],
                          "time/loss_fwd_bwd_s": [None, None],
                          "time/optimizer_s": [0.01, None]}, index=["flex", "hf_generate"])
    assert split["time/loss_fwd_bwd_s"].dtype == object  # what pandas makes of all-None
    fig = plots.grouped_bars(split, list(split.columns), "s", "split")
    assert [b.get_height() for b in fig.axes[0].patches] == [1.4, 0.01, 1.7]
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["step_time_s_median", "loss_fwd_bwd_s\n(not logged)", "optimizer_s"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["flex",
                                                                              "hf_generate"]


def test_metrics_by_step_log_scale_for_grad_norms():
    """29's grad-norm panel: the H200 SmolLM2 vLLM row's grad norms are ~200x below flex's and
    hf_generate's, flat at zero on a linear axis."""
    import pandas as pd
    frame = pd.DataFrame({"backend": ["flex"] * 3 + ["vllm"] * 3, "step": [1, 2, 3] * 2,
                          "grad_norm": [0.3, 0.25, 0.27, 0.0016, 0.0001, 0.002]})
    fig = plots.metrics_by_step(frame, [("grad_norm", "grad norm", "log")], "t")
    assert fig.axes[0].get_yscale() == "log"
    zero = frame.assign(grad_norm=[0.3, 0.0, 0.27, 0.0016, 0.0001, 0.002])
    fig = plots.metrics_by_step(zero, [("grad_norm", "grad norm", "log")], "t")
    assert fig.axes[0].get_yscale() == "linear"
    assert fig.axes[0].get_ylabel() == "grad norm (linear: values <= 0)"
    with pytest.raises(ValueError, match="scale 'symlog' for 'grad_norm': use 'log'"):
        plots.metrics_by_step(frame, [("grad_norm", "grad norm", "symlog")], "t")
