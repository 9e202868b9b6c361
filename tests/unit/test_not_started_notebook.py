"""A job interrupted before it started leaves a notebook that opens (one markdown cell saying
why), not the 0-byte claim file INDEX.md linked to (fresh-user report, 2026-12-01)."""

from __future__ import annotations

import json

import pytest

from nbhelpers.run.execute import Job, stop_jobs, write_not_started


def _job(tmp_path, name):
    nb = tmp_path / "notebooks" / "phase3_flex" / f"{name}.ipynb"
    out = tmp_path / "executed" / "phase3_flex" / name / "20261201T000000Z_cpu_abc1234.ipynb"
    out.parent.mkdir(parents=True)
    out.write_bytes(b"")  # what runner.claim_output leaves
    return Job(notebook=nb, output=out, sidecar=out.with_suffix(".json"), parameters={})


def test_a_job_that_never_started_gets_a_readable_notebook_and_a_failed_sidecar(tmp_path):
    job = _job(tmp_path, "34_gemma4")
    stop_jobs([job], repo=tmp_path, grace_s=0.1)
    doc = json.loads(job.output.read_text())
    assert doc["nbformat"] == 4 and len(doc["cells"]) == 1
    text = doc["cells"][0]["source"]
    assert text.startswith("# 34_gemma4.ipynb: not run") and "before it started" in text
    side = json.loads(job.sidecar.read_text())
    assert side["status"] == "failed" and "before it started" in side["error"]
    assert job.returncode == 130
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the notebooks extra")
    nbformat.validate(nbformat.reads(job.output.read_text(), as_version=4))


def test_a_notebook_papermill_already_wrote_is_left_alone(tmp_path):
    job = _job(tmp_path, "33_flex_vs_baselines")
    job.output.write_text('{"cells": ["partial"]}')
    write_not_started(job.output, job.notebook.name, "interrupted (x) before it started")
    assert job.output.read_text() == '{"cells": ["partial"]}'
