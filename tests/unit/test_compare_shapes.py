"""29_compare groups phase-2 runs by (device, model, shape): two GRPO shapes of one model are
separate groups, the cross-run gate and "latest per backend" never pair runs of different
shapes, older sidecars without the recorded request still load, and the speed table's ratio
comes from the vLLM row of the same group."""

import itertools
import math

import pandas as pd
import pytest

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import compare as grpo_compare
from nbhelpers.stats import gpu_name, read_sidecars

REF = (4, 4, 1, 256)  # num_generations, per_device_train_batch_size, accumulation, new tokens
REALISTIC = (8, 16, 4, 512)
MODEL = {"name": "qwen3-4b", "weights": "random"}


def _rows(step_s, kl):
    return [{"step": i, "loss": 0.01, "grad_norm": 0.3, "reward": -7.5, "kl": kl * i,
             "wall_s": step_s, "generate_s": step_s / 2, "peak_mem_device_gib": 10.0,
             "time/generate_and_score_s": step_s * 0.6, "time/loss_fwd_bwd_s": step_s * 0.3,
             "time/optimizer_s": 0.01} for i in range(1, 5)]


def _run(step_s=2.0, shape=REF, kl=0.001, gpu="NVIDIA H200", model=MODEL, error=None):
    g, b, accum, tokens = shape
    config = {"num_generations": g, "per_device_train_batch_size": b,
              "gradient_accumulation_steps": accum, "max_completion_length": tokens,
              "generation_batch_size": b * accum, "beta": 0.04, "learning_rate": 5e-6,
              "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.1}
    return {"rows": [] if error else _rows(step_s, kl), "wall_s": 4 * step_s, "error": error,
            "summary": None if error else {"skip_first": 0, "step_time_s_median": step_s,
                                           "peak_mem_device_gib": 10.0 * step_s},
            "config": None if error else config, "gpu": gpu, "model": model,
            # a run that failed before TRL built its config still records what was asked
            "request": {"settings": {k: config[k] for k in list(config)[:4]}},
            "completions": []}


def _settings(shape):
    g, b, accum, tokens = shape
    return GRPOSettings(num_generations=g, per_device_train_batch_size=b,
                        gradient_accumulation_steps=accum, max_completion_length=tokens)


@pytest.fixture
def distinct_stamps(monkeypatch):
    """write_sidecars names runs by the UTC second; give every call its own."""
    stamps = (f"20261203T14{m:02d}00Z" for m in itertools.count())
    monkeypatch.setattr("nbhelpers.stats.utc_stamp", lambda: next(stamps))


def test_two_shapes_of_one_model_are_separate_groups(tmp_path, distinct_stamps):
    for folder, shape, backends in [("a", REF, ["hf_generate", "flex"]),
                                    ("b", REALISTIC, ["vllm", "flex"])]:
        runs = {b: _run(shape=shape) for b in backends}
        grpo_compare.write_sidecars(runs, {}, _settings(shape), MODEL,
                                    tmp_path / folder / "r.json")
    runs, _ = grpo_compare.runs_from_sidecars(read_sidecars(tmp_path, phase="phase2"))
    groups = grpo_compare.latest_per_group(runs)  # this host wrote them: its device
    dev = gpu_name()  # "cpu", or torch.cuda.get_device_name(0) ("NVIDIA H200") on a GPU host
    assert list(groups) == [(dev, "qwen3-4b", "g4 b4x1 256tok"),
                            (dev, "qwen3-4b", "g8 b16x4 512tok")]
    assert list(groups[(dev, "qwen3-4b", "g4 b4x1 256tok")]) == ["flex", "hf_generate"]
    assert list(groups[(dev, "qwen3-4b", "g8 b16x4 512tok")]) == ["flex", "vllm"]
    with pytest.raises(ValueError, match="span 2 .device, model, shape. groups"):
        grpo_compare.latest_per_backend(runs)  # newest flex would be the other shape's
    frame = grpo_compare.runs_frame(runs)
    assert frame["sidecar"].str.endswith(".json").all() and frame["utc"].notna().all()


def test_a_gate_never_pairs_runs_of_different_shapes():
    runs = {"hf_generate@20261203T1400Z": _run(shape=REF),
            "vllm@20261203T1401Z": _run(shape=REF),
            "flex@20261203T1402Z": _run(shape=REF),
            # newer, other shape, far from the reference's KL: must not stand in for vllm@1401
            "vllm@20261203T1403Z": _run(shape=REALISTIC, kl=0.01)}
    cross = grpo_compare.gate_latest(runs, "hf_generate")
    ref = "(NVIDIA H200, qwen3-4b, g4 b4x1 256tok)"
    real = "(NVIDIA H200, qwen3-4b, g8 b16x4 512tok)"
    assert set(cross) == {f"hf_generate {ref}", f"vllm {ref}", f"flex {ref}", f"vllm {real}"}
    assert cross[f"vllm {ref}"].status("kl_vs_reference") == "pass"  # the reference-shape vLLM
    # the realistic run has no hf_generate of its shape: no reference checks, not a false fail
    assert cross[f"vllm {real}"].status("kl_vs_reference") == "skip"
    assert "is not in this run" in next(c.detail for c in cross[f"vllm {real}"].checks
                                        if c.name == "kl_vs_reference")


def _old_sidecar(**over):
    """A phase-2 backend sidecar as written on 2026-11-30: no grpo_request, no format warm-up."""
    side = {"schema": 1, "run_id": "20261130T105017Z_vllm", "phase": "phase2", "backend": "vllm",
            "model": MODEL, "lora": {"rank": 32, "alpha": 64},
            "workload": {"n_prompts": 1, "max_new_tokens": 256, "ignore_eos": False,
                         "sampling": {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                      "min_p": 0.1}},
            "env": {"gpu": "NVIDIA H200", "utc": "2026-11-30T10:50:17+00:00"}, "error": None,
            "grpo_steps": _rows(1.7, 0.001), "grpo_summary": {"step_time_s_median": 1.7},
            "grpo_config": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                            "num_generations": 4, "max_completion_length": 256, "beta": 0.04,
                            "learning_rate": 5e-6, "top_k": 0, "min_p": 0.1}}
    return side | over


def test_an_old_sidecar_without_the_new_fields_loads():
    failed = _old_sidecar(run_id="20261130T110640Z_flex", backend="flex", grpo_config=None,
                          grpo_steps=[], error="RuntimeError: x")
    bare = _old_sidecar(run_id="20261130T000000Z_flex", backend="flex", grpo_config=None,
                        workload=None, grpo_steps=[])
    runs, _ = grpo_compare.runs_from_sidecars([_old_sidecar(), failed, bare])
    assert runs["vllm@20261130T105017Z"]["sidecar"] is None  # no _path: not read from a file
    shape = grpo_compare.run_shape(runs["vllm@20261130T105017Z"])
    # never recorded then: the value every config had (documented in compare_shapes.FALLBACK)
    assert (shape["max_prompt_length"], shape["dataset"], shape["gradient_checkpointing"],
            shape["format_warmup_steps"]) == (256, "gsm8k", False, 0)
    labels = {k: grpo_compare.group_key(r)[2] for k, r in runs.items()}
    # a run that failed before TRL's config existed: the workload block still names its shape
    assert labels == {"vllm@20261130T105017Z": "g4 b4x1 256tok",
                      "flex@20261130T110640Z": "g4 b4x1 256tok",
                      "flex@20261130T000000Z": "g? b?x1 ?tok"}  # nothing recorded: unknown


def test_recorded_differences_from_the_reference_are_named():
    run = _run() | {"request": {"settings": {"max_prompt_length": 512,
                                             "gradient_checkpointing": True},
                                "dataset": "dapo_math", "format_warmup_steps": 60}}
    assert grpo_compare.group_key(run)[2] == "g4 b4x1 256tok prompt512 dapo_math warmup60 gc"


def test_the_ratio_column_comes_from_the_same_groups_vllm_row():
    small = {"name": "smollm2-135m-instruct", "weights": "real"}
    runs = {"flex@1": _run(1.0, REF), "vllm@2": _run(2.0, REF),
            "flex@3": _run(6.0, REALISTIC), "vllm@4": _run(8.0, REALISTIC),
            "flex@5": _run(0.5, REF, model=small),
            "flex@6": _run(0.4, REF, gpu="cpu"),
            "vllm@7": _run(error="RuntimeError: x", gpu="cpu")}
    speed = grpo_compare.speed_frame(runs).set_index(["device", "model", "shape", "backend"])
    ratio = speed["step_vs_vllm"]
    assert ratio[("NVIDIA H200", "qwen3-4b", "g4 b4x1 256tok", "flex")] == pytest.approx(0.5)
    assert ratio[("NVIDIA H200", "qwen3-4b", "g8 b16x4 512tok", "flex")] == pytest.approx(0.75)
    assert ratio[("NVIDIA H200", "qwen3-4b", "g8 b16x4 512tok", "vllm")] == 1.0
    assert math.isnan(ratio[("NVIDIA H200", "smollm2-135m-instruct", "g4 b4x1 256tok", "flex")])
    row = speed.loc[("NVIDIA H200", "qwen3-4b", "g8 b16x4 512tok", "flex")]
    assert row["step_time_s_median"] == 6.0 and row["generate_s"] == 3.0
    assert row["time/loss_fwd_bwd_s"] == pytest.approx(1.8) and row["peak_mem_device_gib"] == 60.0
    groups = grpo_compare.latest_per_group(runs)
    assert grpo_compare.vllm_ratio(groups[("NVIDIA H200", "smollm2-135m-instruct",
                                           "g4 b4x1 256tok")]) == {"flex": None}  # no vLLM row
    # a failed vLLM run of the same shape gives no step time: no ratio, not a ratio of NaN
    assert grpo_compare.vllm_ratio(groups[("cpu", "qwen3-4b", "g4 b4x1 256tok")]) == {
        "flex": None, "vllm": None}
    assert "flex/vLLM median step 0.750 (flex 6.000 s, vllm 8.000 s)" in \
        grpo_compare.result_by_shape(groups)


def test_perf_goal_is_none_when_vllms_row_has_no_numbers():
    summary = pd.DataFrame({"step_time_s_median": [1.0, math.nan],
                            "peak_mem_device_gib": [2.0, math.nan]}, index=["flex", "vllm"])
    assert grpo_compare.perf_goal(summary) == {"step_ratio": None, "memory_ratio": None,
                                               "met": None, "step_goal": None,
                                               "memory_limit_gib": None, "met_issue13": None}


def test_perf_goal_states_issue_13s_goal_per_shape():
    """0.8x at the Qwen3-4B reference shape, 0.7x at the realistic preset, none elsewhere; the
    memory limit is the group's hf_generate peak + 2 GiB where that row exists."""
    summary = pd.DataFrame({"step_time_s_median": [1.367, 1.719, 21.1],
                            "peak_mem_device_gib": [23.9, 64.2, 22.4]},
                           index=["flex", "vllm", "hf_generate"])
    ref = grpo_compare.perf_goal(summary, ("NVIDIA H200", "qwen3-4b", "g4 b4x1 256tok"))
    assert ref["step_goal"] == 0.8 and ref["memory_limit_gib"] == pytest.approx(24.4)
    assert ref["step_ratio"] == pytest.approx(0.7952, abs=1e-4) and ref["met_issue13"] is True
    assert ref["met"] is False  # issue 6's 1/5-of-vLLM's-memory goal: 0.37
    heavy = summary.assign(peak_mem_device_gib=[25.0, 64.2, 22.4])
    assert grpo_compare.perf_goal(heavy, ("d", "qwen3-4b", "g4 b4x1 256tok"))["met_issue13"] \
        is False  # 25.0 > 22.4 + 2
    real = grpo_compare.perf_goal(summary.drop(index="hf_generate"),
                                  ("d", "qwen3-4b", "g8 b16x4 512tok"))
    assert (real["step_goal"], real["memory_limit_gib"], real["met_issue13"]) == (0.7, None, False)
    other = grpo_compare.perf_goal(summary, ("d", "smollm2-135m-instruct", "g4 b4x1 256tok"))
    assert other["step_goal"] is None and other["met_issue13"] is None


def test_a_newer_failed_run_does_not_replace_an_older_good_one():
    """29's "newest per backend" prefers the newest run that did not fail; a backend with only
    failed runs keeps its newest failed one, marked failed in the speed table, and the ratio
    line names the failed vLLM run (fresh-user trial, 2026-12-03)."""
    oom = "torch.OutOfMemoryError: CUDA out of memory.\nTraceback (most recent call last): ..."
    runs = {"flex@20261203T1400Z": _run(1.0, REF),
            "vllm@20261203T1401Z": _run(2.0, REF),
            "vllm@20261203T1402Z": _run(error=oom) | {"run_id": "20261203T1402Z"},
            "flex@20261203T1403Z": _run(1.5, REALISTIC),
            "vllm@20261203T1404Z": _run(error="RuntimeError: a", shape=REALISTIC),
            "vllm@20261203T1405Z": _run(error=oom, shape=REALISTIC)
            | {"run_id": "20261203T1405Z"}}
    groups = grpo_compare.latest_per_group(runs)
    ref, real = (groups[("NVIDIA H200", "qwen3-4b", s)] for s in ("g4 b4x1 256tok",
                                                                  "g8 b16x4 512tok"))
    assert ref["vllm"] is runs["vllm@20261203T1401Z"]  # the good one, not the newer failure
    assert real["vllm"] is runs["vllm@20261203T1405Z"]  # only failures: the newest, shown failed
    one_group = {k: runs[k] for k in list(runs)[:3]}
    assert grpo_compare.latest_per_backend(one_group)["vllm"] is runs["vllm@20261203T1401Z"]
    speed = grpo_compare.speed_frame(runs).set_index(["shape", "backend"])
    assert speed.loc[("g4 b4x1 256tok", "vllm"), "status"] == "ok"
    assert speed.loc[("g4 b4x1 256tok", "flex"), "step_vs_vllm"] == pytest.approx(0.5)
    failed = speed.loc[("g8 b16x4 512tok", "vllm")]
    assert failed["status"] == "failed"
    assert failed["error"] == "torch.OutOfMemoryError: CUDA out of memory."
    assert grpo_compare.ratio_text(ref) == "0.500"
    assert grpo_compare.ratio_text(real) == ("n/a (vLLM run 20261203T1405Z failed: "
                                             "torch.OutOfMemoryError: CUDA out of memory.)")
    assert grpo_compare.ratio_text({"flex": ref["flex"]}) == "n/a (no vLLM run in this group)"
    assert ("g8 b16x4 512tok: no flex/vLLM ratio: vLLM run 20261203T1405Z failed: "
            "torch.OutOfMemoryError") in grpo_compare.result_by_shape(groups)


def test_a_missing_curve_says_why_from_the_run():
    """20's per-step plots named beta even when beta was 0.04 and no backend had run."""
    failed = {"vllm": _run(error="BackendNotInstalled: x"), "flex": _run(error="E: y")}
    ok = {"flex": _run(), "vllm": _run(error="E: z")}
    reason = grpo_compare.not_logged_reason
    assert reason(failed, "kl", 0.04) == "no backend ran (vllm, flex: see each error above)"
    assert reason(ok, "kl", 0.0) == "beta is 0 (TRL logs KL only when beta > 0)"
    assert reason(ok, "grad_norm", 0.04) == "no step of flex logged it"
    from pathlib import Path
    src = (Path(__file__).resolve().parents[2]
           / "notebooks/phase2_grpo/20_grpo_equivalence.ipynb").read_text()
    assert "kl needs beta > 0" not in src
    assert "grpo_compare.not_logged_reason(runs, column, beta)" in src


def test_speed_columns_nobody_logged_are_float_nan_and_plot():
    """CPU records from before the step split logged no time/*: their whole-None columns were
    object dtype and crashed 29_compare's bar plot (TypeError: int + NoneType)."""
    from nbhelpers import plots
    old = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in _rows(2.0, 0.001)]
    runs = {"flex@1": _run(1.0, gpu="cpu") | {"rows": old},
            "hf_generate@2": _run(2.0, gpu="cpu") | {"rows": old}}
    speed = grpo_compare.speed_frame(runs)
    split = ["step_time_s_median", "generate_s", "time/generate_and_score_s",
             "time/loss_fwd_bwd_s", "time/optimizer_s"]
    for column in [*split, "flex/prefill_s", "step_vs_vllm", "peak_mem_device_gib"]:
        assert speed[column].dtype == float, column
    assert speed[["time/loss_fwd_bwd_s", "step_vs_vllm"]].isna().all().all()
    fig = plots.grouped_bars(speed.set_index("backend"), split, "s", "cpu")
    assert len(fig.axes[0].patches) == 4  # step and generate_s for each backend, nothing else


def test_20s_figures_name_a_reused_backend_with_its_file_and_date():
    """20's per-step figures drew session 6's reused hf_generate row beside this run's curves
    with no label (H200 SmolLM2 run of 2026-12-03): the caption now names each curve's source."""
    from nbhelpers.grpo.compare import reused_caption
    mine = {"rows": [{"step": 1}]}
    reused = {"rows": [{"step": 1}], "reused_from": {
        "path": "executed/phase2_grpo/20_grpo_equivalence/x__hf_generate.json",
        "utc": "2026-12-01T16:05:47+00:00", "partial": False}}
    assert reused_caption({"flex": mine, "vllm": mine}) is None
    assert reused_caption({"hf_generate": reused, "flex": mine}) == (
        "From: hf_generate: reused: x__hf_generate.json (2026-12-01T16:05:47+00:00); "
        "flex: this run")
