"""Phase 1 requests this host cannot run, and 19_compare inputs it cannot read, are refused when
the runner plans the jobs: one line naming the fix, nothing written under ``--executed`` (before,
``-p backends '[vllm]'`` wrote a failed notebook, sidecars and an INDEX row 14 s after launch, and
19 with a missing ``executed_dir`` failed in its last cell). The same checks as phase 2's
(``host_checks.check_cuda_backends``, the size check, ``check_compare_sidecars``). The notebooks
are not executed; CUDA is stubbed."""

from __future__ import annotations

from pathlib import Path

import pytest
from prelaunch import refused, write_sidecar

from nbhelpers.run import host_checks
from nbhelpers.run.runner import plan_jobs

REPO = Path(__file__).resolve().parents[2]
N10 = "notebooks/phase1_rollout/10_lora_rollout.ipynb"
N19 = "notebooks/phase1_rollout/19_compare.ipynb"


def _refused(nb, over, want, tmp_path):
    return refused(nb, over, want, tmp_path, exact=True)


CPU_FIX = ", or run on a CUDA host with --profile h200."


@pytest.mark.parametrize("backends,want", [
    (["vllm"], ("-p backends (10_lora_rollout.ipynb): backends ['vllm'] need a CUDA GPU and "
                "torch sees none on this host: use backends that run on the CPU (-p backends "
                "'[hf_generate, hf_cb]')" + CPU_FIX)),
    (["hf_generate", "unsloth"], ("-p backends (10_lora_rollout.ipynb): backends ['unsloth'] "
                                  "need a CUDA GPU and torch sees none on this host: drop "
                                  "['unsloth'] (-p backends '[hf_generate]')" + CPU_FIX)),
    (["hf_cb_fa4", "hf_cb", "vllm"], ("-p backends (10_lora_rollout.ipynb): backends "
                                      "['hf_cb_fa4', 'vllm'] need a CUDA GPU and torch sees "
                                      "none on this host: drop ['hf_cb_fa4', 'vllm'] "
                                      "(-p backends '[hf_cb]')" + CPU_FIX)),
])
def test_cuda_only_backends_are_refused_on_a_cpu_host(monkeypatch, tmp_path, backends, want):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    _refused(N10, {"backends": backends}, want, tmp_path)


def test_a_gpu_sized_phase1_model_is_refused_on_a_cpu_host(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    _refused(N10, {"model": "qwen3-4b"},
             "-p model (10_lora_rollout.ipynb): model='qwen3-4b' is a GPU workload (random "
             "weights, 4.0 B parameters) and torch sees no CUDA GPU here: on this host use a "
             "tiny one such as -p model tiny-qwen3 (the CPU config's), or run it with "
             "--profile h200 on the GPU host.", tmp_path)


def test_with_cuda_phase1_plans_and_cpu_backends_never_ask(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: True)
    over = {"backends": ["vllm", "unsloth", "hf_cb_fa4", "flex"], "model": "qwen3-4b"}
    (job,) = plan_jobs(N10, "cpu", over, None, tmp_path / "executed", REPO)
    assert job.parameters["backends"] == over["backends"]
    monkeypatch.setattr(host_checks, "cuda_available", lambda: pytest.fail("asked for CUDA"))
    plan_jobs(N10, "cpu", {}, None, tmp_path / "executed", REPO)  # the CPU config
    (job,) = plan_jobs(N10, "cpu", {"backends": ["hf_cb_nograph", "cb_sync", "hf_generate"]},
                       None, tmp_path / "executed", REPO)
    assert job.parameters["backends"] == ["hf_cb_nograph", "cb_sync", "hf_generate"]


def _sidecar(folder: Path, phase: str = "phase1", engine: bool = True) -> Path:
    """A minimal phase-1 backend sidecar (``engine`` key: what backend_sidecars keeps)."""
    return write_sidecar(folder / "20261203T140000Z_cpu_hf_generate.json", phase, "hf_generate",
                         "tiny-qwen3", **({"engine": {"name": "hf_generate"}} if engine else {}))


@pytest.mark.parametrize("make,why", [
    (lambda d: d / "nope", "no such folder"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "no sidecar files in it"),
    (lambda d: _sidecar(d / "p2", phase="phase2"), "only sidecars of ['phase2']"),
    (lambda d: _sidecar(d / "sums", engine=False),
     "only notebook summaries, no <run>_backends/*.json"),
])
def test_19_without_phase1_sidecars_is_refused_before_launch(tmp_path, make, why):
    folder = make(tmp_path)
    _refused(N19, {"executed_dir": str(folder)},
             f"-p executed_dir (19_compare.ipynb): no phase-1 sidecars under {folder} ({why}): "
             "run 10_lora_rollout first, or point executed_dir at the folder it wrote.", tmp_path)


def test_19_plans_with_sidecars_or_without_require_any(tmp_path):
    folder = _sidecar(tmp_path / "s")
    (job,) = plan_jobs(N19, "cpu", {"executed_dir": str(folder)}, None, tmp_path / "executed",
                       REPO)
    assert job.parameters["executed_dir"] == str(folder)
    (job,) = plan_jobs(N19, "cpu", {"executed_dir": str(tmp_path / "nope"),
                                    "require_any": False}, None, tmp_path / "executed", REPO)
    assert job.parameters["require_any"] is False
    (job,) = plan_jobs(N19, "cpu", {}, None, tmp_path / "executed", REPO)  # the archive
    assert job.parameters["executed_dir"] == "executed/phase1_rollout"


def test_the_notebook_itself_fails_early_with_the_same_message(tmp_path):
    """API users (19's first cell after the parameters): load_backend_sidecars raises before any
    table; a relative folder is read from the checkout or, under Jupyter, two folders up."""
    from nbhelpers.bench import rollout
    with pytest.raises(ValueError, match=r"no phase-1 sidecars under .* \(no sidecar files in "
                                         r"it\): run 10_lora_rollout first"):
        rollout.load_backend_sidecars(tmp_path)
    assert rollout.load_backend_sidecars(tmp_path, require_any=False) == (tmp_path, [])
    _sidecar(tmp_path / "a/b/s")
    root, sides = rollout.load_backend_sidecars("b/s", cwd=tmp_path / "a")  # the runner's cwd
    assert root == tmp_path / "a/b/s" and [s["backend"] for s in sides] == ["hf_generate"]
    root, _ = rollout.load_backend_sidecars("b/s", cwd=tmp_path / "a/x/y")  # Jupyter's cwd
    assert root == tmp_path / "a/b/s"
    src = (REPO / N19).read_text()
    assert "rollout.load_backend_sidecars(executed_dir, require_any)" in src
