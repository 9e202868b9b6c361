"""The runner refuses a bad ``-p reuse_runs`` before the notebook starts, and a phase run skips its
compare notebook when a notebook it reads failed (nbhelpers.run; the notebooks are not executed:
``runner.execute`` is replaced by a stand-in that records the calls and writes what papermill
would, so each test checks the runner's decisions in well under a second).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import nbformat
import pytest

from nbhelpers.run import runner
from nbhelpers.run.params import UserInputError, parse_overrides, plan_parameters

REPO = Path(__file__).resolve().parents[2]
NB20 = REPO / "notebooks" / "phase2_grpo" / "20_grpo_equivalence.ipynb"


def _sidecar(path: Path, **changes) -> Path:
    """A minimal per-backend phase-2 sidecar as ``write_partial`` writes it."""
    side = {"schema": 1, "phase": "phase2", "backend": "hf_generate", "status": "ok",
            "error": None, "grpo_steps": [{"step": 1, "reward": 0.5}],
            "grpo_request": {"model": "tiny-llama"}, "partial": True} | changes
    path.write_text(json.dumps(side))
    return path


def _plan(reuse: str):
    given = parse_overrides([("backends", "[flex]"), ("reuse_runs", reuse)])
    return plan_parameters([NB20], "cpu", given, repo=REPO)


# ------------------------------------------------------------- reuse_runs preflight
def test_a_missing_reuse_runs_path_fails_before_the_notebook(tmp_path):
    gone = tmp_path / "nope__hf_generate.json"
    with pytest.raises(UserInputError) as err:
        _plan(f"{{hf_generate: {gone}}}")
    msg = str(err.value)
    assert msg.startswith("-p reuse_runs (20_grpo_equivalence.ipynb): reuse_runs['hf_generate']")
    assert "(no such file)" in msg and "give the <run>__hf_generate.json sidecar" in msg


@pytest.mark.parametrize("write, match", [
    (lambda p: p.write_text("{not json"), r"is not a readable JSON object"),
    (lambda p: _sidecar(p, backend="flex"), r"holds backend 'flex'"),
    (lambda p: _sidecar(p, status="failed", error="boom"),
     r"that run failed \(boom\); train hf_generate again"),
    (lambda p: _sidecar(p, phase="phase1"), r"not phase2: give a sidecar of 20_grpo"),
    (lambda p: _sidecar(p, grpo_request=None), r"no grpo_request .* train hf_generate again"),
])
def test_an_unusable_reuse_runs_sidecar_fails_before_the_notebook(tmp_path, write, match):
    path = tmp_path / "run__hf_generate.json"
    write(path)
    with pytest.raises(UserInputError, match=match):
        _plan(f"{{hf_generate: {path}}}")


def test_an_unknown_reuse_runs_backend_names_the_backends(tmp_path):
    path = _sidecar(tmp_path / "run__hf_generate.json")
    with pytest.raises(UserInputError, match=r"reuse_runs=\{'hf_gen': .*map a backend of "
                                             r"\(.*'hf_generate'.*\) to the path"):
        _plan(f"{{hf_gen: {path}}}")


def test_a_usable_sidecar_passes_by_absolute_or_repo_relative_path(tmp_path):
    path = _sidecar(tmp_path / "run__hf_generate.json")
    [(_, params)] = _plan(f"{{hf_generate: {path}}}")
    assert params["reuse_runs"] == {"hf_generate": str(path)}
    summary = tmp_path / "run.json"  # the run's summary sidecar: its __<backend> file is found
    summary.write_text("{}")
    _plan(f"{{hf_generate: {summary}}}")


# ------------------------------------------------------------- compare skipped after a failure
def _notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("sidecar_path = ''  # help")
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


@pytest.fixture
def phase2(tmp_path, monkeypatch):
    """A phase-2 folder with two notebooks and a compare; execute() is a stand-in whose return
    code per notebook the test sets."""
    for stem in ("29_compare", "20_a", "21_b"):
        _notebook(tmp_path / f"notebooks/phase2_grpo/{stem}.ipynb")
    (tmp_path / "configs").mkdir()
    monkeypatch.setattr(runner, "REPO", tmp_path)
    monkeypatch.setattr(runner, "git_sha", lambda repo=None: "abc1234")
    codes, order = {}, []

    def fake_execute(job, repo):
        order.append(job.notebook.stem)
        job.output.write_text("partial output of " + job.notebook.stem)
        job.returncode = codes.get(job.notebook.stem, 0)
        return job.returncode
    monkeypatch.setattr(runner, "execute", fake_execute)
    return tmp_path, codes, order


def test_compare_runs_after_the_others_when_they_pass(phase2):
    _, _, order = phase2
    jobs = runner.run("phase2", gpus=["0", "1"])  # two workers: compare must still wait
    assert order[-1] == "29_compare" and sorted(order[:2]) == ["20_a", "21_b"]
    assert [j.status for j in jobs] == ["ok", "ok", "ok"]


def test_compare_is_skipped_when_a_notebook_it_reads_failed(phase2, caplog, capsys):
    from nbhelpers.__main__ import main
    repo, codes, order = phase2
    codes["21_b"] = 1
    with caplog.at_level(logging.WARNING, logger="nbhelpers.run.runner"):
        assert main(["run", "phase2"]) == 1
    assert order == ["20_a", "21_b"]  # 29_compare never started
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped"))
    assert "29_compare not run: 21_b failed in this run" in line
    assert "python -m nbhelpers run notebooks/phase2_grpo/29_compare.ipynb" in line
    failed = next((repo / "executed/phase2_grpo/21_b").glob("*.ipynb"))
    assert failed.read_text() == "partial output of 21_b"  # the failed notebook's output kept
    assert not list((repo / "executed/phase2_grpo/29_compare").glob("*"))  # nothing left
    out = capsys.readouterr()
    assert "skipped 29_compare not run: 21_b failed" in out.out
    assert "1 of 3 notebook(s) failed" in out.err


def test_compare_alone_still_runs(phase2):
    _, codes, order = phase2
    codes["21_b"] = 1  # not part of this run
    [job] = runner.run("notebooks/phase2_grpo/29_compare.ipynb")
    assert order == ["29_compare"] and job.status == "ok"
