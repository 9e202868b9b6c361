"""scripts/device/run_step.py stages FlashAttention-4's site-xz parts (extras ``fa40``, ``fa41``)
from the fa4 manifest's restore commands, as it does vLLM's; nothing is run (``sh`` recorded)."""

import importlib
import json
from pathlib import Path

import pytest

REAL_REPO = Path(__file__).resolve().parents[2]
BEGIN = ("cp .bundles/fa4/parts/fa4_site.tar.xz.part01 /tmp/ && test x = x && mkdir -p "
         "/tmp/fa4_site && cat /tmp/fa4_site.tar.xz.part* | xz -d | tar -x -C /tmp/fa4_site && "
         "export PYTHONPATH=/tmp/fa4_site || { echo 'restore failed'; exit 1; };")


@pytest.fixture
def run_step(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REAL_REPO / "scripts/device"))
    module = importlib.import_module("run_step")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"device": {"calls": [
        {"begin": "cp .bundles/fa4/parts/fa4_site.tar.xz.part00 /tmp/ || exit;"},
        {"begin": BEGIN}]}}))
    monkeypatch.setattr(module, "REPO", tmp_path)
    monkeypatch.setattr(module, "FA4_MANIFEST", "manifest.json")
    return module


def test_fa4_parts_are_carried_with_the_manifest(run_step, monkeypatch):
    monkeypatch.setitem(run_step.STEPS, "t_fa4", ([], ["fa40"], []))
    assert run_step.carry("t_fa4") == [".bundles/fa4/parts/fa4_site.tar.xz.part00",
                                       "manifest.json"]


def test_fa4_staging_runs_the_restore_without_the_export(run_step, monkeypatch):
    cmds = []
    monkeypatch.setattr(run_step, "sh", lambda cmd, log: cmds.append(cmd))
    monkeypatch.setitem(run_step.STEPS, "t_fa4", ([], ["fa40", "fa41"], []))
    run_step.stage("t_fa4", print)
    assert cmds[0] == "cp .bundles/fa4/parts/fa4_site.tar.xz.part00 /tmp/"
    assert cmds[1].startswith("cp .bundles/fa4/parts/fa4_site.tar.xz.part01 /tmp/ && test")
    assert cmds[1].endswith("tar -x -C /tmp/fa4_site") and "export" not in cmds[1]


def test_the_fa4_steps_stage_parts_in_order_and_run_its_tests(run_step):
    assert run_step.STEPS["f4a"][1] == ["fa40"] and run_step.STEPS["f4m"][1] == ["fa41"]
    for step in ("f4b", "f4p", "f4c"):  # each runs after f4a, f4m: the last part restores
        assert run_step.STEPS[step][1][0] == "fa42", step
    sets, _, jobs = run_step.STEPS["f4b"]
    assert "notebooks" in sets
    assert "test_prefill_fa4" in jobs[0][1]["args"] and "prefill_attention: fa4" in \
        jobs[1][1]["variants"]
