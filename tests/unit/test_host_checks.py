"""GPU-sized phase 3 requests on a host without CUDA are refused when the runner plans the jobs
it will run (nothing claimed), not when a device call is only planned; phase 3's flat
``engine_options`` pass the engine's option checks on any host (fresh-user trial, 2026-12-01)."""

from pathlib import Path

import pytest

from nbhelpers.run import host_checks
from nbhelpers.run.params import UserInputError, plan_parameters
from nbhelpers.run.runner import plan_jobs

REPO = Path(__file__).resolve().parents[2]
N33 = "notebooks/phase3_flex/33_flex_vs_baselines.ipynb"
N34 = "notebooks/phase3_flex/34_gemma4.ipynb"
N30 = "notebooks/phase3_flex/30_engine_walkthrough.ipynb"


@pytest.mark.parametrize("nb,over,want", [
    (N33, {"shape": "qwen3-4b"}, (r"-p shape \(33_flex_vs_baselines.ipynb\): shape='qwen3-4b' is "
     r"a GPU workload \(random weights, 4\.0 B parameters\).*-p shape tiny")),
    (N34, {"model": "gemma-4-e2b"}, r"model='gemma-4-e2b' is a GPU workload .*tiny-gemma4"),
    (N30, {"device": "cuda"}, (r"device='cuda' but torch sees no CUDA GPU on this host: use -p "
     r"device cpu here")),
])
def test_gpu_sized_requests_are_refused_before_anything_is_claimed(monkeypatch, tmp_path, nb,
                                                                   over, want):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    with pytest.raises(UserInputError, match=want):
        plan_jobs(nb, "cpu", over, None, tmp_path / "executed", REPO)
    assert not (tmp_path / "executed").exists() or not any((tmp_path / "executed").rglob("*.*"))


def test_with_cuda_they_plan_and_tiny_ones_never_ask(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: True)
    (job,) = plan_jobs(N33, "cpu", {"shape": "qwen3-4b", "device": "cuda"}, None,
                       tmp_path / "executed", REPO)
    assert job.parameters["shape"] == "qwen3-4b"
    monkeypatch.setattr(host_checks, "cuda_available", lambda: pytest.fail("asked for CUDA"))
    plan_jobs(N30, "cpu", {"model": "tiny-llama"}, None, tmp_path / "executed", REPO)


def test_planning_an_h200_config_on_the_cpu_is_not_refused(monkeypatch):
    """run_step.py --dry-run plans the device's notebooks here: only the values are checked."""
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    ((_, params),) = plan_parameters([REPO / N33], "h200", {}, REPO)
    assert params["shape"] == "qwen3-4b"


@pytest.mark.parametrize("opts,want", [
    ({"pdl": "yes"},
     r"RunnerOptions.pdl='yes': must be one of \('auto', 'off', 'on', 'early', 'prefetch'\)"),
    ({"nope": 1}, r"unknown RunnerOptions field\(s\) \['nope'\]"),
])
def test_phase3_engine_options_are_checked_on_any_host(opts, want):
    with pytest.raises(UserInputError, match=r"-p engine_options \(33_flex_vs_baselines.ipynb\)"
                       r": engine_options: " + want):
        plan_parameters([REPO / N33], "cpu", {"engine_options": opts}, REPO)


@pytest.mark.parametrize("over,want", [
    ({"variants": [{"name": "a", "options": {"sample_kernel": "Triton"}}]},
     (r"-p variants \(33_flex_vs_baselines.ipynb\): variants\[0\] \('a'\): RunnerOptions\."
     r"sample_kernel='Triton': must be one of \('auto', 'torch', 'triton'\)")),
    ({"variants": [{"name": "a", "options": {"sampel_kernel": "triton"}}]},
     r"-p variants .*did you mean 'sample_kernel'\?"),
    ({"variants": [{"name": "a", "options": {"skinny_gemm_cublas": None}}]},
     r"-p variants .*skinny_gemm_cublas=None: must be one of \('auto', 'never'\)"),
    ({"variants": [1]}, r"-p variants .*variants\[0\] = 1: each variant is a dict"),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, r"-p variants .*names must be unique"),
    ({"variants": [{"name": "a", "options": {"lora_expand": "addmm"}}],
      "engine_options": {"pdl": "off", "sample_kernel": "torch"}}, None),
    ({"lora_modes": ["Bf16"]}, r"-p lora_modes .*'Bf16' is no LoRA mode"),
    ({"lora_modes": []}, r"-p lora_modes .*give a non-empty list"),
])
def test_33_variants_and_lora_modes_are_refused_before_anything_is_claimed(tmp_path, over,
                                                                            want):
    """A bad variant failed in cell 5 after the kernel started and left a failed notebook,
    sidecar and INDEX row (fresh-user trial, 2026-12-02); now nothing is written."""
    _plans_or_is_refused(N33, over, want, "variants", tmp_path)  # want None: a valid variant


def test_a_gpu_host_variant_plans_in_a_dry_run_and_is_refused_where_it_would_run(monkeypatch,
                                                                                  tmp_path):
    """Step f4b's FA4 variant: run_step.py --dry-run plans it on a CPU host without FA4
    (plan_parameters checks values only); the runner on such a host refuses it at once."""
    from nbhelpers.engine import prefill_fa4
    monkeypatch.setattr(prefill_fa4, "fa4_importable", lambda: False)
    monkeypatch.setattr(host_checks, "cuda_available", lambda: True)
    over = {"variants": [{"name": "fa4", "options": {"prefill_attention": "fa4"}}]}
    ((_, params),) = plan_parameters([REPO / N33], "h200", over, REPO)
    assert params["variants"] == over["variants"]
    with pytest.raises(UserInputError, match=r"-p variants .*needs FlashAttention-4"):
        plan_jobs(N33, "h200", over, None, tmp_path / "executed", REPO)


N10 = "notebooks/phase1_rollout/10_lora_rollout.ipynb"


@pytest.mark.parametrize("over,want", [
    ({"backends": ["flex"], "engine_options": {"flex": {"sample_kernel": "Triton"}}},
     (r"-p engine_options \(10_lora_rollout.ipynb\): engine_options\['flex'\]: RunnerOptions\."
     r"sample_kernel='Triton': must be one of \('auto', 'torch', 'triton'\)")),
    ({"backends": ["flex"], "engine_options": {"flex": {"sampel_kernel": "torch"}}},
     (r"flex: unknown engine options \['sampel_kernel'\] \('sampel_kernel': did you mean "
     r"'sample_kernel'\?\)")),
    ({"backends": ["flex"], "engine_options": {"flex": {"adapter_dtype": "bf16"}}},
     r"adapter_dtype='bf16': use one of \('peft', 'model'\)"),
    ({"backends": ["flex"], "engine_options": {"flex": {"rounds": 1, "lora_expand": "addmm"}}},
     None),  # a harness key and a good option: planned
])
def test_phase1_flex_options_are_refused_before_anything_is_claimed(tmp_path, over, want):
    """A bad flex option failed at the backend's load; notebook 10 ran on and wrote a failed
    notebook, sidecars and an INDEX row (fresh-user trial, 2026-12-02)."""
    _plans_or_is_refused(N10, over, want, "engine_options", tmp_path)


def _plans_or_is_refused(nb, over, want, key, tmp_path):
    """``want`` None: ``over`` plans one job carrying ``over[key]``; else planning raises
    ``UserInputError`` matching ``want`` and nothing is written under ``executed/``."""
    out = tmp_path / "executed"
    if want is None:
        (job,) = plan_jobs(nb, "cpu", over, None, out, REPO)
        assert job.parameters[key] == over[key]
        return
    with pytest.raises(UserInputError, match=want):
        plan_jobs(nb, "cpu", over, None, out, REPO)
    assert not out.exists() or not any(out.rglob("*.*"))


@pytest.mark.parametrize("over,want", [
    ({"parity_engine_options": {"pdl": "Early"}},
     (r"-p parity_engine_options \(34_gemma4.ipynb\): parity_engine_options: RunnerOptions\."
      r"pdl='Early': must be one of \('auto', 'off', 'on', 'early', 'prefetch'\)")),
    ({"parity_engine_options": {"sampel_kernel": "torch"}},
     (r"unknown engine option\(s\) \['sampel_kernel'\] \('sampel_kernel': did you mean "
      r"'sample_kernel'\?\)")),
    ({"parity_engine_options": {"page_size": 16}},
     r"\['page_size'\] are set by the notebook \(page_size: -p page_size"),
    ({"parity_engine_options": {"pdl": "early", "sample_kernel": "torch",
                                "use_cuda_graphs": False, "max_num_seqs": 4}}, None),
])
def test_34_parity_engine_options_are_refused_before_anything_is_claimed(tmp_path, over, want):
    """A bad parity option failed in cell 11 after HF and the noise floor ran, leaving a failed
    notebook, sidecar and INDEX row (fresh-user trial, 2026-12-02)."""
    _plans_or_is_refused(N34, over, want, "parity_engine_options", tmp_path)


N20 = "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"


@pytest.mark.parametrize("over,want", [
    ({"backends": ["hf_cb"], "engine_options": {"hf_cb": {"use_cuda_graph": True}}},
     (r"-p engine_options \(10_lora_rollout.ipynb\): engine_options\['hf_cb'\]: hf_cb: "
      r"use_cuda_graph=True needs a CUDA device")),
    ({"backends": ["hf_cb"], "engine_options": {"hf_cb": {"use_cuda_graph": [False, True]}}},
     r"use_cuda_graph=\[False, True\] needs a CUDA device"),
    ({"backends": ["hf_cb"], "engine_options": {"hf_cb": {"use_cuda_graph": "banana"}}},
     r"use_cuda_graph='banana': use true, false or a \[varlen, decode\] pair"),
    ({"backends": ["hf_cb_nograph"], "engine_options": {"hf_cb_nograph": {"blok_size": 64}}},
     r"unknown engine options \['blok_size'\] \('blok_size': did you mean 'block_size'\?\)"),
    ({"backends": ["cb_sync"], "engine_options": {"cb_sync": {"watchdog_s": 30,
                                                              "rounds": 1}}}, None),
    ({"backends": ["hf_cb_nograph"], "engine_options": {"hf_cb_nograph": {"rounds": 1,
                                                                          "block_size": 64}}},
     None),
])
def test_phase1_cb_options_are_refused_before_anything_is_claimed(monkeypatch, tmp_path, over,
                                                                   want):
    """A bad hf_cb / cb_sync option started a kernel and archived a failed run 15-20 s later
    (helper-16's trial, 2026-12-07)."""
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    _plans_or_is_refused(N10, over, want, "engine_options", tmp_path)


def test_dapo_math_without_the_hub_is_refused_before_launch(monkeypatch, tmp_path):
    """Offline, ``-p dataset dapo_math`` started a kernel, failed 31 s later and archived a failed
    run (helper-16's trial); with ``HF_HUB_OFFLINE=1`` (a local cache) it plans."""
    from nbhelpers import data
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(data, "hub_reachable", lambda timeout_s=3.0: False)
    _plans_or_is_refused(N20, {"dataset": "dapo_math"},
                         (r"-p dataset \(20_grpo_equivalence.ipynb\): dataset='dapo_math': Could "
                          r"not load .*not reachable.*HF_HUB_OFFLINE=1.*\(-p dataset gsm8k\)"),
                         "dataset", tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _plans_or_is_refused(N20, {"dataset": "dapo_math"}, None, "dataset", tmp_path)
