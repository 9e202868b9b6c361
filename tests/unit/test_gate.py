"""nbhelpers.grpo.gate on synthetic per-step rows (the real-run cases are in test_grpo_flex.py)."""

import math

import pytest

from nbhelpers.grpo.gate import (
    MISMATCH_MEAN,
    RANDOM_WEIGHTS_REWARD,
    GateFailed,
    Thresholds,
    assert_gate,
    check_run,
    check_runs,
    thresholds_for,
)


def rows(n=4, kl=0.001, reward=-7.5, mismatch=None, **at_step2):
    out = []
    for step in range(1, n + 1):
        r = {"step": step, "loss": 0.01 * step, "grad_norm": 0.3, "reward": reward,
             "kl": None if kl is None else kl * step}
        if mismatch is not None:
            r[MISMATCH_MEAN] = mismatch
        out.append(r | (at_step2 if step == 2 else {}))
    return out


TH = thresholds_for("random")


def test_healthy_rows_pass_every_check():
    res = check_run("flex", rows(mismatch=1e-3), TH, reference_rows=rows())
    assert res.passed, res.as_dict()
    assert {c.name: c.status for c in res.checks} == {
        "loss_finite": "pass", "grad_norm_finite": "pass", "reward_range": "pass",
        "kl_early": "pass", "kl_vs_reference": "pass", "reward_vs_reference": "pass",
        "grad_norm_vs_reference": "pass", "logprob_mismatch": "pass", "importance_sampling": "skip", "learning_signal": "info"}


@pytest.mark.parametrize("bad,check", [
    ({"loss": math.nan}, "loss_finite"), ({"loss": None}, "loss_finite"),
    ({"grad_norm": math.inf}, "grad_norm_finite"), ({"reward": 2.0}, "reward_range"),
    ({"kl": 0.02}, "kl_early"), ({"kl": -1e-3}, "kl_early"),
    ({MISMATCH_MEAN: 0.5}, "logprob_mismatch")])
def test_each_injected_fault_fails_its_check(bad, check):
    res = check_run("flex", rows(mismatch=1e-3, **bad), TH)
    assert not res.passed and res.status(check) == "fail"
    with pytest.raises(GateFailed, match=f"flex.{check}"):
        assert_gate({"flex": res})


def test_kl_and_reward_vs_reference_use_stated_tolerances():
    th = Thresholds(reward_range=RANDOM_WEIGHTS_REWARD, kl_tolerance=0.001, reward_tolerance=0.5)
    res = check_run("flex", rows(kl=0.003), th, reference_rows=rows(kl=0.001, reward=-8.5))
    assert res.status("kl_vs_reference") == "fail" and "tolerance 0.001" in \
        next(c.detail for c in res.checks if c.name == "kl_vs_reference")
    assert res.status("reward_vs_reference") == "fail"


def _grads(values, **extra):
    return [r | {"grad_norm": g, **extra} for r, g in zip(rows(n=len(values)), values)]


def test_grad_norm_vs_reference_catches_a_backend_that_barely_trains():
    ref = _grads([0.3, 0.25, 0.35, 0.32])  # hf_generate-like
    # the H200 SmolLM2 vLLM row of 2026-12-03: KL and rewards pass, updates ~200x smaller
    small = _grads([0.0016, 0.0001, 0.002, 0.0015], is_ratio_applied_mean=0.0048)
    res = check_run("vllm", small, TH, reference_rows=ref)
    assert res.status("kl_vs_reference") == "pass" and res.status("reward_vs_reference") == "pass"
    assert res.status("grad_norm_vs_reference") == "fail" and not res.passed
    detail = next(c.detail for c in res.checks if c.name == "grad_norm_vs_reference")
    assert "0.00155 = 0.005 x the reference's 0.31" in detail and "applied IS weight (mean over steps 0.0048)" in detail
    with pytest.raises(GateFailed, match="vllm.grad_norm_vs_reference"):
        assert_gate({"vllm": res})
    for values, status in (([0.27, 0.2, 0.3, 0.26], "pass"),  # flex-like: 0.85x
                           ([0.95, 0.9, 1.0, 0.99], "fail"),  # 3.1x: too large as well
                           ([0.11, 0.1, 0.12, 0.1], "pass")):  # 0.34x: inside 1/3
        assert check_run("flex", _grads(values), TH, ref).status("grad_norm_vs_reference") == status
    th = Thresholds(reward_range=RANDOM_WEIGHTS_REWARD, grad_ratio_max=10)
    assert check_run("flex", _grads([0.95, 0.9, 1.0, 0.99]), th, ref).passed


def test_grad_norm_vs_reference_skips_untrained_references_and_rejects_bad_limits():
    untrained = _grads([0.0, 0.0, 0.0, 0.0])  # random weights: every reward ties
    res = check_run("flex", _grads([0.0, 0.0, 0.0, 0.0]), TH, reference_rows=untrained)
    assert res.status("grad_norm_vs_reference") == "skip" and res.passed
    assert check_run("flex", rows(), TH).status("grad_norm_vs_reference") == "skip"  # no ref
    for bad in (0.5, math.nan, -3, math.inf, True, None, "3"):
        with pytest.raises(ValueError, match="grad_ratio_max.*must be a finite number >= 1"):
            Thresholds(grad_ratio_max=bad)
    with pytest.raises(ValueError, match="grad_ratio_max='2'"):
        thresholds_for("real", grad_ratio_max="2")
    negative = _grads([-0.3, -0.3, -0.3, -0.3])
    detail = next(c.detail for c in check_run("flex", rows(), TH, negative).checks
                  if c.name == "grad_norm_vs_reference")
    assert detail == "the reference did not train (median grad norm -0.3)"


def test_a_run_without_rows_fails_one_clear_check():
    res = check_run("flex", [], TH, reference_rows=rows())
    assert [(c.name, c.status) for c in res.checks] == [("steps", "fail")]
    with pytest.raises(GateFailed, match="flex.steps: the run logged no step rows") as err:
        assert_gate({"flex": res})
    # the first line carries the failure itself (INDEX.md and logs show one line)
    assert str(err.value).splitlines()[0].startswith(
        "coherence gate failed: flex.steps: the run logged no step rows")
    two = {"flex": res, "vllm": check_run("vllm", [], TH, reference_rows=rows())}
    with pytest.raises(GateFailed) as err:
        assert_gate(two)
    assert str(err.value).splitlines()[0].endswith("(+1 more below)")
    assert len(str(err.value).splitlines()) == 3


@pytest.mark.parametrize("error,says", [
    ("RuntimeError: CUDA out of memory", "failed (RuntimeError: CUDA out of memory)"),
    ("BackendNotInstalled: pip install -e '.[vllm]'", "is not staged")])
def test_cross_checks_name_a_reference_that_failed(error, says):
    runs = {"hf_generate": {"rows": [], "error": error}, "flex": {"rows": rows(), "error": None}}
    res = check_runs(runs, "hf_generate", TH)["flex"]
    for name in ("kl_vs_reference", "reward_vs_reference", "grad_norm_vs_reference"):
        check = next(c for c in res.checks if c.name == name)
        assert check.status == "skip" and check.detail.startswith(
            f"reference backend 'hf_generate' {says}") and "nothing to compare" in check.detail


def test_beta_zero_and_no_logprobs_are_skipped_not_passed():
    res = check_run("hf_generate", rows(kl=None), TH)
    assert res.status("kl_early") == "skip" and res.status("logprob_mismatch") == "skip"
    assert res.passed


def test_no_learning_signal_is_reported():
    res = check_run("flex", [
        r | {"grad_norm": 0.0} for r in rows()], TH)
    detail = next(c.detail for c in res.checks if c.name == "learning_signal")
    assert res.passed and detail.startswith("grad_norm > 0 at 0/4 steps: every reward tie")


def test_check_runs_not_installed_is_skip_other_errors_fail():
    runs = {"hf_generate": {"rows": rows(), "error": None},
            "vllm": {"rows": [], "error": "BackendNotInstalled: pip install -e '.[vllm]'"},
            "flex": {"rows": [], "error": "RuntimeError: boom"}}
    res = check_runs(runs, "hf_generate", TH)
    assert res["hf_generate"].passed and res["vllm"].passed and not res["flex"].passed
    with pytest.raises(GateFailed, match="flex.ran: RuntimeError"):
        assert_gate(res)


def test_check_runs_without_reference_skips_cross_checks_or_uses_given_reference():
    runs = {"vllm": {"rows": rows(kl=0.003), "error": None}}
    alone = check_runs(runs, "hf_generate", TH)["vllm"]
    assert alone.passed and alone.status("kl_vs_reference") == "skip"
    assert "'hf_generate' is not in this run" in next(
        c.detail for c in alone.checks if c.name == "kl_vs_reference")
    th = thresholds_for("random", kl_tolerance=0.001)
    given = check_runs(runs, "hf_generate", th,
                       reference_run={"rows": rows(kl=0.001), "error": None})["vllm"]
    assert given.status("kl_vs_reference") == "fail"  # |0.003 - 0.001| > 0.001
    failed_ref = check_runs(runs, "hf_generate", TH,
                            reference_run={"rows": [], "error": "RuntimeError: x"})["vllm"]
    assert failed_ref.status("kl_vs_reference") == "skip"


def test_mismatch_is_info_only_under_filtered_sampling():
    from nbhelpers.config import SamplingParams
    th = thresholds_for("real", SamplingParams(min_p=0.1))
    assert th.sampling_is_filtered and not thresholds_for("real", SamplingParams()).sampling_is_filtered
    res = check_run("flex", rows(mismatch=0.3), th)
    assert res.status("logprob_mismatch") == "info" and res.passed


def test_thresholds_validate():
    assert thresholds_for("real").reward_range == (-10.0, 13.0)
    with pytest.raises(ValueError, match="low < high"):
        Thresholds(reward_range=(1.0, 0.0))
    with pytest.raises(ValueError, match=">= 0"):
        Thresholds(kl_tolerance=-1.0)


def _run(reward=-7.5, error=None, wall=2.0, peak=1.0):
    steps = [r | {"wall_s": wall, "peak_mem_device_gib": peak, "completion_length_mean_tokens": 8.0,
                  "num_tokens_total": 100.0 * r["step"]} for r in rows(reward=reward)]
    summary = {"skip_first": 0, "step_time_s_median": wall, "peak_mem_device_gib": peak,
               "peak_mem_allocated_gib": peak, "reward_median": reward}
    return {"rows": [] if error else steps, "summary": None if error else summary,
            "config": {"generation_batch_size": 4}, "wall_s": 4 * wall, "completions": [],
            "error": error}


def test_sidecars_round_trip_gate_and_perf_goal(tmp_path):
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import compare as grpo_compare
    from nbhelpers.stats import read_sidecars
    runs = {"hf_generate": _run(wall=3.0), "flex": _run(wall=1.0, peak=1.0),
            "vllm": _run(wall=2.0, peak=10.0), "unsloth": _run(error="BackendNotInstalled: x")}
    gates = check_runs(runs, "hf_generate", TH)
    paths = grpo_compare.write_sidecars(runs, gates, GRPOSettings(), {"name": "m"},
                                        tmp_path / "run.json")
    assert [p.name for p in paths] == ["run.json", "run__hf_generate.json", "run__flex.json",
                                       "run__vllm.json", "run__unsloth.json"]
    back, back_gates = grpo_compare.runs_from_sidecars(read_sidecars(tmp_path, phase="phase2"))
    latest = grpo_compare.latest_per_backend(back)
    assert set(latest) == set(runs) and latest["flex"]["rows"][0]["reward"] == -7.5
    summary = grpo_compare.summary_frame(latest, {k.split("@")[0]: g for k, g in back_gates.items()})
    assert summary.loc["unsloth", "gate"] == "not staged" and summary.loc["flex", "gate"] == "pass"
    goal = grpo_compare.perf_goal(summary)
    assert goal == {"step_ratio": 0.5, "memory_ratio": 0.1, "met": True, "step_goal": None,
                    "memory_limit_gib": summary.loc["hf_generate", "peak_mem_device_gib"] + 2.0,
                    "met_issue13": None}


def test_flex_options_from_notebook_parameters():
    from nbhelpers.grpo.compare import flex_options
    assert flex_options() is None
    assert flex_options(True, "on") == {"sleep_between_rollouts": True, "compile_attention": True}
    assert flex_options(freeze_gc=True) == {"freeze_gc": True}  # RunnerOptions.freeze_gc
    with pytest.raises(ValueError, match="auto | on | off"):
        flex_options(compile_attention="yes")


def test_flex_freeze_gc_reaches_the_engine():
    """``flex_options={"freeze_gc": True}`` (phase 2's ``flex_freeze_gc``) is a name the flex
    backend's option check accepts and the engine's RunnerOptions holds."""
    from nbhelpers.backends.flex import check_engine_options
    from nbhelpers.engine.runner_options import RunnerOptions
    check_engine_options({"freeze_gc": True})
    assert RunnerOptions(freeze_gc=True).freeze_gc is True
    with pytest.raises((TypeError, ValueError), match="freeze_gc"):
        check_engine_options({"freeze_gc": "yes"})


def test_gate_latest_gates_runs_of_separate_calls_against_the_reference(tmp_path):
    """Two notebook runs (as on two device calls): vLLM alone, then hf_generate + flex; the
    cross-run gate puts vLLM against the hf_generate run and sees a KL gap the per-run gate
    could not."""
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import compare as grpo_compare
    from nbhelpers.stats import read_sidecars
    vllm = _run() | {"rows": rows(kl=0.01)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    grpo_compare.write_sidecars({"vllm": vllm}, check_runs({"vllm": vllm}, "hf_generate", TH),
                                GRPOSettings(), {"name": "m", "weights": "random"},
                                tmp_path / "a" / "run.json")
    first = {"hf_generate": _run(), "flex": _run()}
    grpo_compare.write_sidecars(first, check_runs(first, "hf_generate", TH), GRPOSettings(),
                                {"name": "m", "weights": "random"}, tmp_path / "b" / "run.json")
    from nbhelpers.stats import make_sidecar, write_sidecar
    write_sidecar(make_sidecar(phase="phase2", backend="unknown", error="SyntaxError: x",
                               extra={"status": "failed"}), tmp_path / "b" / "failed.json")
    runs, own = grpo_compare.runs_from_sidecars(
        read_sidecars(tmp_path / "a", phase="phase2") + read_sidecars(tmp_path / "b", phase="phase2"))
    assert not any(k.startswith("unknown@") for k in runs)  # a failed notebook is not a run
    vllm_own = next(g for k, g in own.items() if k.startswith("vllm@"))
    assert {c["name"]: c["status"] for c in vllm_own["checks"]}["kl_vs_reference"] == "skip"
    cross = grpo_compare.gate_latest(runs, "hf_generate")
    assert set(cross) == {"vllm", "hf_generate", "flex"}
    assert cross["flex"].status("kl_vs_reference") == "pass"
    assert cross["vllm"].status("kl_vs_reference") == "fail"  # 0.04 vs 0.004 at step 4 > 0.015
    assert cross["hf_generate"].status("kl_vs_reference") == "skip"


def test_gate_latest_never_mixes_devices_or_models(tmp_path):
    from nbhelpers.grpo import compare as grpo_compare
    runs = {"hf_generate@1": _run() | {"gpu": "NVIDIA H200", "model": {"name": "q"}},
            "vllm@2": _run() | {"rows": rows(kl=0.01), "gpu": "NVIDIA H200", "model": {"name": "q"}},
            "hf_generate@3": _run() | {"gpu": "cpu", "model": {"name": "s"}},
            "flex@4": _run() | {"gpu": "cpu", "model": {"name": "s"}}}
    cross = grpo_compare.gate_latest(runs, "hf_generate")
    shape = "g? b?x1 ?tok"  # _run's config records no workload counts (compare_shapes.FALLBACK)
    assert set(cross) == {f"hf_generate (NVIDIA H200, q, {shape})", f"vllm (NVIDIA H200, q, {shape})",
                          f"hf_generate (cpu, s, {shape})", f"flex (cpu, s, {shape})"}
    assert cross[f"vllm (NVIDIA H200, q, {shape})"].status("kl_vs_reference") == "fail"
    assert cross[f"flex (cpu, s, {shape})"].status("kl_vs_reference") == "pass"


def test_filter_device_matches_part_of_the_name_and_names_the_devices_seen():
    from nbhelpers.grpo import compare as grpo_compare
    runs = {"flex@a": {"gpu": "NVIDIA H200"}, "flex@b": {"gpu": "cpu"}}
    gates = {"flex@a": "ga", "flex@b": "gb"}
    assert grpo_compare.filter_device(runs, gates, "") == (runs, gates)
    kept, kept_gates = grpo_compare.filter_device(runs, gates, "h200")
    assert list(kept) == ["flex@a"] and kept_gates == {"flex@a": "ga"}
    with pytest.raises(ValueError, match=r"matches no phase-2 run.*'NVIDIA H200'"):
        grpo_compare.filter_device(runs, gates, "a100")


def test_grad_gap_sentence_names_trls_is_correction_only_when_its_weight_is_small():
    from nbhelpers.grpo.gate import IS_SWITCHES, grad_gap_sentence
    ref = _grads([0.3, 0.25, 0.35, 0.32])
    small = _grads([0.0016, 0.0001, 0.002, 0.0015], is_ratio_applied_mean=0.0048)
    text = grad_gap_sentence("vllm", small, ref, "hf_generate", TH)
    assert text.startswith("vllm: the policy gradient is much smaller than the reference's "
                           "(hf_generate: median grad norm 0.00155 = 0.005 x 0.31")
    assert "importance-sampling correction (vllm_importance_sampling_mode sequence_mask" in text
    assert all(s in text for s in IS_SWITCHES) and text.endswith(".")
    unweighted = grad_gap_sentence("vllm", _grads([0.0016] * 4, is_ratio_applied_mean=0.9),
                                   ref, "hf_generate", TH)
    assert "much smaller" in unweighted and "importance-sampling" not in unweighted
    assert "much larger" in grad_gap_sentence("flex", _grads([0.95] * 4), ref, "hf_generate")
    assert grad_gap_sentence("flex", _grads([0.27] * 4), ref, "hf_generate") is None  # passes
    assert grad_gap_sentence("flex", _grads([0.27] * 4), None, "hf_generate") is None


def test_29_prints_every_failed_cross_run_check_in_full_and_says_why():
    """29's gate table is cut by pandas (100 rows shown as 10, details at 50 characters): the
    H200 SmolLM2 vLLM row's grad_norm_vs_reference failure was visible by chance only, and the
    Result line and INDEX headline did not mention it (review, 2026-12-03)."""
    from nbhelpers.grpo import compare as grpo_compare
    small = {"name": "smollm2-135m-instruct", "weights": "real"}
    ref = _grads([0.3, 0.25, 0.35, 0.32])
    vllm = _grads([0.0016, 0.0001, 0.002, 0.0015], is_ratio_applied_mean=0.000442)
    runs = {"hf_generate@1": _run() | {"rows": ref, "gpu": "NVIDIA H200", "model": small},
            "vllm@2": _run() | {"rows": vllm, "gpu": "NVIDIA H200", "model": small},
            "hf_generate@3": _run() | {"gpu": "cpu", "model": small},
            "flex@4": _run() | {"gpu": "cpu", "model": small}}
    cross = grpo_compare.gate_latest(runs, "hf_generate")
    key = "vllm (NVIDIA H200, smollm2-135m-instruct, g? b?x1 ?tok)"
    detail = next(c.detail for c in cross[key].checks if c.name == "grad_norm_vs_reference")
    assert len(detail) > 50  # longer than pandas shows in a cell
    text = grpo_compare.failed_checks_text(cross)
    assert text.splitlines() == ["cross-run gate: FAILED, 1 check:",
                                 f"- {key}: grad_norm_vs_reference: {detail}"]
    assert grpo_compare.failed_checks(cross) == [
        {"backend": key, "check": "grad_norm_vs_reference", "detail": detail}]
    conclusion = grpo_compare.gate_conclusion(runs, cross, "hf_generate")
    assert conclusion.startswith(f"cross-run gate FAILED: 1 check ({key}.grad_norm_vs_reference). "
                                 f"{key}: the policy gradient is much smaller than the reference's")
    assert "TRL's applied IS weight has mean 0.000442 over steps" in conclusion
    assert "vllm_importance_sampling_correction=False" in conclusion
    assert grpo_compare.gate_headline(cross) == {
        "cross_gate": f"FAIL {key}.grad_norm_vs_reference"}
    good = {k: r for k, r in runs.items() if r["gpu"] == "cpu"}
    cross = grpo_compare.gate_latest(good, "hf_generate")
    assert grpo_compare.failed_checks_text(cross) == "cross-run gate: pass"
    assert grpo_compare.gate_conclusion(good, cross, "hf_generate") == "cross-run gate: pass."
    assert grpo_compare.gate_headline(cross) == {"cross_gate": "pass"}
    from pathlib import Path

    import nbformat
    nb = nbformat.read(Path(__file__).parents[2] / "notebooks/phase2_grpo/29_compare.ipynb", 4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert code.index("print(grpo_compare.failed_checks_text(cross))") > code.index(
        "display(grpo_compare.gate_frame(cross))")
    assert "gate_conclusion(runs, cross, reference_backend)" in code
    assert "grpo_compare.gate_headline(cross)" in code


def test_a_pass_without_any_gradient_is_labelled_untrained():
    """Every step at grad_norm 0 (every reward tied): the gate passes, but the summary says the
    backends were compared untrained (helper-16's 2-step padded CPU run read "gate pass")."""
    from nbhelpers.grpo.compare_tables import gate_word
    flat = {"rows": [r | {"grad_norm": 0.0} for r in rows()]}
    moving = {"rows": rows()}
    gates = check_runs({"hf_generate": flat, "flex": flat}, "hf_generate", TH)
    assert gate_word(gates, "flex") == "pass (untrained)"
    gates = check_runs({"hf_generate": moving, "flex": moving}, "hf_generate", TH)
    assert gate_word(gates, "flex") == "pass"
