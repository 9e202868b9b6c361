"""Phase 2 requests this host cannot run, and 29_compare inputs it cannot read, are refused when
the runner plans the jobs: one line naming the fix, nothing written under ``--executed``
(fresh-user trial, 2026-12-03: each failed after launch with a failed notebook, sidecars and
INDEX rows). The notebooks are not executed; CUDA is stubbed."""

from __future__ import annotations

from pathlib import Path

import pytest
from prelaunch import refused, write_sidecar

from nbhelpers.run import host_checks
from nbhelpers.run.runner import plan_jobs

REPO = Path(__file__).resolve().parents[2]
N20 = "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"
N29 = "notebooks/phase2_grpo/29_compare.ipynb"


def _refused(nb, over, want, tmp_path):
    return refused(nb, over, want, tmp_path, exact=False)


@pytest.mark.parametrize("over,want", [
    ({"backends": ["vllm"], "reference_backend": "vllm", "format_warmup_steps": 60},
     ("-p backends (20_grpo_equivalence.ipynb): backends ['vllm'] need a CUDA GPU and torch "
      "sees none on this host: use backends that run on the CPU (-p backends '[hf_generate, "
      "flex]' -p reference_backend hf_generate), or run on a CUDA host with --profile h200.")),
    ({"backends": ["vllm", "flex"]},
     ("backends ['vllm'] need a CUDA GPU and torch sees none on this host: drop ['vllm'] "
      "(-p backends '[flex]'), or run on a CUDA host with --profile h200.")),
    ({"backends": ["hf_generate", "unsloth"], "reference_backend": "unsloth"},
     "drop ['unsloth'] (-p backends '[hf_generate]' -p reference_backend hf_generate)"),
])
def test_cuda_only_backends_are_refused_on_a_cpu_host(monkeypatch, tmp_path, over, want):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    _refused(N20, over, want, tmp_path)


def test_a_gpu_sized_phase2_model_is_refused_on_a_cpu_host(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    msg = _refused(N20, {"model": "qwen3-4b"}, "-p model (20_grpo_equivalence.ipynb): "
                   "model='qwen3-4b' is a GPU workload (random weights, 4.0 B parameters)",
                   tmp_path)
    assert "use a small model such as -p model smollm2-135m-instruct" in msg
    assert "--profile h200 on the GPU host" in msg


def test_with_cuda_phase2_plans_and_cpu_sized_runs_never_ask(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: True)
    (job,) = plan_jobs(N20, "cpu", {"backends": ["vllm", "flex"], "model": "qwen3-4b"}, None,
                       tmp_path / "executed", REPO)
    assert job.parameters["backends"] == ["vllm", "flex"]
    monkeypatch.setattr(host_checks, "cuda_available", lambda: pytest.fail("asked for CUDA"))
    plan_jobs(N20, "cpu", {}, None, tmp_path / "executed", REPO)  # the CPU config


def _sidecar(folder: Path, gpu: str = "cpu", phase: str = "phase2") -> Path:
    """A minimal per-backend phase-2 sidecar (what runs_from_sidecars reads)."""
    return write_sidecar(folder / "20261203T140000Z_cpu_abc__flex.json", phase, "flex",
                         "tiny-llama", gpu, run_id="20261203T140000Z_flex", grpo_steps=[],
                         grpo_summary={})


@pytest.mark.parametrize("make,why", [
    (lambda d: d / "nope", "no such folder"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "no sidecar files in it"),
    (lambda d: _sidecar(d / "p1", phase="phase1"), "only sidecars of ['phase1']"),
])
def test_29_without_phase2_sidecars_is_refused_before_launch(tmp_path, make, why):
    folder = make(tmp_path)
    _refused(N29, {"sidecar_dir": str(folder)},
             f"-p sidecar_dir (29_compare.ipynb): no phase-2 sidecars under {folder} ({why}): "
             "run 20_grpo_equivalence first, or point sidecar_dir at the folder it wrote.",
             tmp_path)


def test_29_device_must_match_a_sidecar_device_before_launch(tmp_path):
    folder = _sidecar(tmp_path / "s", gpu="NVIDIA H200")
    _refused(N29, {"sidecar_dir": str(folder), "device": "a100x"},
             "-p device (29_compare.ipynb): device='a100x' matches no phase-2 run; the sidecars "
             "hold runs on ['NVIDIA H200']: pass one of those (a part of the name is enough) "
             "or ''.", tmp_path)
    for device in ("h200", ""):
        (job,) = plan_jobs(N29, "cpu", {"sidecar_dir": str(folder), "device": device}, None,
                           tmp_path / "executed", REPO)
        assert job.parameters["device"] == device


def test_29_reads_a_repo_relative_folder_as_the_kernel_does(tmp_path):
    """The runner starts the kernel in the checkout: a relative sidecar_dir is read from there
    (the config's executed/phase2_grpo/20_grpo_equivalence)."""
    from nbhelpers.grpo.compare_sidecars import sidecar_root
    assert sidecar_root("executed/x", REPO) == REPO / "executed/x"
    nb_dir = REPO / "notebooks/phase2_grpo"  # Jupyter's kernel: two folders below the checkout
    assert sidecar_root("executed", nb_dir) == REPO / "executed"


@pytest.mark.parametrize("phase, folder_param, stems", [
    ("phase1", "executed_dir", ["10_lora_rollout", "19_compare"]),
    ("phase2", "sidecar_dir", ["20_grpo_equivalence", "29_compare"])])
def test_a_phase_runs_compare_notebook_is_not_checked_before_its_writer(
        monkeypatch, tmp_path, phase, folder_param, stems):
    """run phase1 / phase2 runs 10 / 20 first (they write the sidecars 19 / 29 read): the compare
    notebook's folder is not checked then."""
    monkeypatch.setattr(host_checks, "check_compare_sidecars",
                        lambda *a, **k: pytest.fail(f"checked a phase run's {stems[1]}"))
    jobs = plan_jobs(phase, "cpu", {folder_param: str(tmp_path / "nope")}, None,
                     tmp_path / "executed", REPO)
    assert [j.notebook.stem for j in jobs] == stems


def test_the_notebook_itself_fails_early_with_the_same_message(tmp_path):
    """API users (29's first cell after the parameters): load_runs raises before any table."""
    from nbhelpers.grpo import compare as grpo_compare
    with pytest.raises(ValueError, match=r"no phase-2 sidecars under .* \(no sidecar files in "
                                         r"it\): run 20_grpo_equivalence first"):
        grpo_compare.load_runs(tmp_path)
    src = (REPO / N29).read_text()
    assert "grpo_compare.load_runs(sidecar_dir, device)" in src


def test_a_phase_run_into_another_archive_compares_the_runs_it_writes_there(tmp_path):
    """`run phase2 --executed DIR` wrote 20's sidecars to DIR while 29 read the checkout's
    archive (a fresh user's probe, 2026-12-03): 29's config path moves under DIR in a phase run;
    a `-p sidecar_dir` stays as given; a single 29 run keeps reading the archive."""
    from nbhelpers.run.runner import reroot_archive_paths
    out = tmp_path / "elsewhere"
    jobs = plan_jobs("phase2", "cpu", {}, None, out, REPO)
    n29 = {j.notebook.stem: j for j in jobs}["29_compare"]
    assert n29.parameters["sidecar_dir"] == str(out.resolve() / "phase2_grpo/20_grpo_equivalence")
    given = str(tmp_path / "mine")
    jobs = plan_jobs("phase2", "cpu", {"sidecar_dir": given}, None, out, REPO)
    assert {j.notebook.stem: j for j in jobs}["29_compare"].parameters["sidecar_dir"] == given
    (job,) = plan_jobs(N29, "cpu", {"device": ""}, None, out, REPO)
    assert job.parameters["sidecar_dir"] == "executed/phase2_grpo/20_grpo_equivalence"
    params = {"sidecar_dir": "executed/phase2_grpo/20_grpo_equivalence", "device": "h200"}
    assert reroot_archive_paths(params, {}, REPO / "executed", REPO) == params  # default archive
    inside = reroot_archive_paths(params, {}, REPO / "scratch_archive", REPO)
    assert inside == {"sidecar_dir": "scratch_archive/phase2_grpo/20_grpo_equivalence",
                      "device": "h200"}  # repo-relative inside the checkout; other values kept
