"""Notebook 33's A/B table and figures (nbhelpers.bench.flex_ab_figures, flex_figures): every
number they show is the number of that point's sidecar, they refuse rows of another run, and the
frame carries variant, LoRA mode and adapter dtype per point. The sidecars are built with
``flex_sweep.flex_sidecar`` from distinct per-point values (not measured: the figures' data path)."""

from __future__ import annotations

import itertools

import pytest

from nbhelpers.bench import flex_sweep as eb

VARIANTS, MODES, BATCHES = ("default", "previous"), ("none", "bf16", "fp32"), (4, 32)
KB = ("gemm_ms", "attention_ms", "elementwise_ms", "sampling_ms")


def _side(i: int, variant: str, mode: str, batch: int, run_id: str = "run-a") -> dict:
    """A point sidecar whose numbers all derive from ``i`` (distinct per point)."""
    res = {"rounds": [{"wall_s": 1.0 + i, "new_tokens": 1000, "prompt_tokens": 10}],
           "breakdown": {"decode_step_ms": 3.0 + i, "replay_ms": 2.9 + i,
                         "kernel_breakdown": {**{k: 0.1 * (j + 1) + i for j, k in enumerate(KB)},
                                              "kernels_per_step": 400 + i},
                         "aten_ops": {"ops_per_step": 900 + i}},
           "floor": {"floor_ms_per_step": 1.5}, "pct_of_floor": 40.0 + i}
    return eb.flex_sidecar(f"nb33_{variant}_{mode}_b{batch}", {"name": "tiny"}, None, batch, 8, 4,
                           res, run_id=run_id,
                           extra={"variant": {"name": variant, "options": {}}, "lora_mode": mode,
                                  "adapter_dtype": {"none": None, "bf16": "bfloat16",
                                                    "fp32": "float32"}[mode],
                                  "config_pid": 100 + VARIANTS.index(variant) * 10
                                  + MODES.index(mode)})


@pytest.fixture(scope="module")
def sides():
    return [_side(i, v, m, b) for i, (v, m, b)
            in enumerate(itertools.product(VARIANTS, MODES, BATCHES))]


@pytest.fixture(scope="module")
def frame(sides):
    return eb.flex_frame(sides, run_id="run-a")


def _by_key(sides):
    return {(s["variant"]["name"], s["lora_mode"], s["workload"]["n_prompts"]): s for s in sides}


def test_frame_keeps_each_points_variant_mode_dtype_and_numbers(sides, frame):
    assert list(zip(frame["variant"], frame["lora_mode"], frame["batch"])) == list(
        itertools.product(VARIANTS, MODES, BATCHES))  # the run's own order, not alphabetical
    for r in frame.itertuples():
        s = _by_key(sides)[(r.variant, r.lora_mode, r.batch)]
        assert r.decode_tok_per_s == s["decode_tok_per_s_median"]
        assert r.decode_step_ms == s["breakdown"]["decode_step_ms"]
        assert r.kernels_per_step == s["breakdown"]["kernel_breakdown"]["kernels_per_step"]
        assert r.aten_ops_per_step == s["breakdown"]["aten_ops"]["ops_per_step"]
        assert (r.adapter_dtype or None) == s["adapter_dtype"] or r.lora_mode == "none"


def test_ab_table_puts_variants_side_by_side_with_each_points_own_numbers(sides, frame):
    table = eb.ab_frame(frame, "run-a")
    assert list(zip(table["lora_mode"], table["batch"])) == list(itertools.product(MODES, BATCHES))
    got = _by_key(sides)
    for _, row in table.iterrows():
        for v in VARIANTS:
            s = got[(v, row["lora_mode"], row["batch"])]
            kb = s["breakdown"]["kernel_breakdown"]
            assert row[f"tok/s [{v}]"] == s["decode_tok_per_s_median"]
            assert row[f"ms/step [{v}]"] == s["breakdown"]["decode_step_ms"]
            assert row[f"% floor [{v}]"] == s["pct_of_floor"]
            assert row[f"GEMM ms [{v}]"] == kb["gemm_ms"]
            assert row[f"kernels/step [{v}]"] == kb["kernels_per_step"]
            assert row[f"aten ops/step [{v}]"] == s["breakdown"]["aten_ops"]["ops_per_step"]
        base = got[("default", row["lora_mode"], row["batch"])]["decode_tok_per_s_median"]
        prev = got[("previous", row["lora_mode"], row["batch"])]["decode_tok_per_s_median"]
        assert row["tok/s previous / default"] == pytest.approx(prev / base)


def test_ab_figure_plots_each_variants_tok_s_and_ratio_per_mode(sides, frame):
    fig = eb.ab_figure(frame, "run-a")
    got = _by_key(sides)
    top, bottom = fig.axes[:3], fig.axes[3:6]
    for j, mode in enumerate(MODES):
        for line, ratio, v in zip(top[j].get_lines(), bottom[j].get_lines(), VARIANTS):
            want = [got[(v, mode, b)]["decode_tok_per_s_median"] for b in BATCHES]
            base = [got[("default", mode, b)]["decode_tok_per_s_median"] for b in BATCHES]
            assert list(line.get_xdata()) == list(BATCHES) and list(line.get_ydata()) == want
            assert list(ratio.get_ydata()) == pytest.approx([w / b for w, b in zip(want, base)])


def test_kernels_figure_stacks_each_points_kernel_classes(sides, frame):
    fig = eb.kernels_figure(frame, "run-a")
    got = _by_key(sides)
    for ax, mode in zip(fig.axes, MODES):
        keys = [(v, mode, b) for b in BATCHES for v in VARIANTS]  # variants side by side
        bars = ax.patches  # class-major: every point's GEMM bar, then attention, ...
        for k, cls in enumerate(KB):
            heights = [p.get_height() for p in bars[k * len(keys):(k + 1) * len(keys)]]
            assert heights == pytest.approx(
                [got[key]["breakdown"]["kernel_breakdown"][cls] for key in keys])
        texts = [t.get_text() for t in ax.texts]
        assert texts == [f"{got[key]['breakdown']['kernel_breakdown']['kernels_per_step']:.0f}"
                         for key in keys]


def test_sweep_and_pct_figures_draw_each_points_value_per_variant_and_mode(sides, frame):
    got = _by_key(sides)
    for fig, key in ((eb.sweep_figure(frame, "run-a"), "decode_tok_per_s_median"),
                     (eb.pct_figure(frame, "run-a"), "pct_of_floor")):
        lines = [ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")]
        assert len(lines) == len(VARIANTS) * len(MODES)  # the 100 % guide line aside
        for line, (v, m) in zip(lines, itertools.product(VARIANTS, MODES)):
            assert v in line.get_label() and (m in line.get_label() or m == "none")
            assert list(line.get_ydata()) == [got[(v, m, b)][key] for b in BATCHES]


def test_figures_and_table_refuse_another_runs_rows(sides):
    mixed = eb.flex_frame(sides + [_side(99, "default", "bf16", 4, run_id="run-b")])
    for fn in (eb.ab_frame, eb.ab_figure, eb.kernels_figure):
        with pytest.raises(ValueError, match="rows of runs"):
            fn(mixed, "run-a")


def test_kernels_figure_without_a_profile_says_how_to_get_one(sides):
    bare = [{**s, "breakdown": {"decode_step_ms": 3.0}} for s in sides]
    with pytest.raises(ValueError, match="profile=True on CUDA"):
        eb.kernels_figure(eb.flex_frame(bare, run_id="run-a"), "run-a")


def test_old_sidecars_without_variant_or_mode_still_make_rows(sides):
    old = {k: v for k, v in sides[0].items() if k not in ("variant", "lora_mode",
                                                           "adapter_dtype")}
    with_lora = {**old, "lora": {"rank": 32, "alpha": 64, "targets": []}}
    point = {**old, "point": {"shape": "qwen3-4b", "lora": "fp32", "batch": 4}}
    frame = eb.flex_frame([old, with_lora, point])
    assert sorted(zip(frame["variant"], frame["lora_mode"])) == [
        ("default", "fp32"), ("default", "lora"), ("default", "none")]
