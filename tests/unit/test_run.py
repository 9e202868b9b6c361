"""nbhelpers.run.runner on tiny throwaway notebooks: names, parameters, failures, INDEX.md, CLI."""

import json
import threading
from pathlib import Path

import nbformat
import pytest

from nbhelpers.__main__ import main
from nbhelpers.run import execute as run_execute
from nbhelpers.run import runner
from nbhelpers.run.index import index_rows, render_index

OK_SOURCE = """from nbhelpers.stats import make_sidecar, write_sidecar
side = make_sidecar(phase="phase0", backend="hf_generate",
                    extra={"headline": {"answer": answer, "step_time_s_median": 1.5}})
write_sidecar(side, sidecar_path)
print("answer is", answer)"""
FAIL_SOURCE = 'print("partial output before the failure")\nraise RuntimeError("boom in cell")'


def _notebook(path: Path, body: str,
              params: str = "answer = 1  # help\nsidecar_path = ''") -> Path:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(params)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), cell, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture
def repo(tmp_path):
    _notebook(tmp_path / "notebooks/phase0_reference/00_ok.ipynb", OK_SOURCE)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/00_ok.cpu.yaml").write_text("answer: 7\n")
    return tmp_path


def test_claim_output_never_reuses_a_name(tmp_path):
    first, side1 = runner.claim_output(tmp_path, "20260101T000000Z_cpu_abc")
    second, _ = runner.claim_output(tmp_path, "20260101T000000Z_cpu_abc")
    assert first != second and first.name == "20260101T000000Z_cpu_abc.ipynb"
    assert second.name == "20260101T000000Z_cpu_abc_1.ipynb"
    assert side1 == first.with_suffix(".json")
    (tmp_path / "x_2.json").write_text("{}")  # an orphan sidecar also blocks its name
    runner.claim_output(tmp_path, "x")
    runner.claim_output(tmp_path, "x")
    assert runner.claim_output(tmp_path, "x")[0].name == "x_3.ipynb"


def test_claim_output_concurrent_claims_are_unique(tmp_path):
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(runner.claim_output(tmp_path, "s")[0]))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 16


def test_resolve_notebooks_phase_path_and_errors(repo):
    assert [p.name for p in runner.resolve_notebooks("phase0", repo)] == ["00_ok.ipynb"]
    path = "notebooks/phase0_reference/00_ok.ipynb"
    assert runner.resolve_notebooks(path, repo) == [repo / path]
    for folder in ("phase0_reference", "notebooks/phase0_reference/"):  # the forms --help names
        assert runner.resolve_notebooks(folder, repo) == [repo / path]
    with pytest.raises(ValueError, match="unknown phase"):
        runner.resolve_notebooks("phase9", repo)
    with pytest.raises(ValueError, match="no notebooks yet"):
        runner.resolve_notebooks("phase1", repo)
    with pytest.raises(FileNotFoundError):
        runner.resolve_notebooks("notebooks/missing.ipynb", repo)


def test_load_parameters_profile_and_overrides(repo):
    nb = repo / "notebooks/phase0_reference/00_ok.ipynb"
    over = runner.parse_overrides([("answer", "9"), ("name", "abc"), ("lr", "0.5"),
                                   ("flag", "true")])
    assert over == {"answer": 9, "name": "abc", "lr": 0.5, "flag": True}
    sci = runner.parse_overrides([("lr", "1e-5"), ("b", "-2E3"), ("name", "e5"), ("v", "1.5e2")])
    assert sci == {"lr": 1e-5, "b": -2000.0, "name": "e5", "v": 150.0}  # YAML 1.1: "1e-5" is str
    assert runner.load_parameters(nb, "cpu", configs=repo / "configs") == {"answer": 7}
    assert runner.load_parameters(nb, "cpu", {"answer": 9}, repo / "configs") == {"answer": 9}
    with pytest.raises(FileNotFoundError, match="h200"):
        runner.load_parameters(nb, "h200", configs=repo / "configs")
    (repo / "configs/00_ok.h200.yaml").write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="must map"):
        runner.load_parameters(nb, "h200", configs=repo / "configs")


@pytest.mark.notebooks
def test_run_ok_and_failed_notebooks(repo, monkeypatch, capsys):
    _notebook(repo / "notebooks/phase0_reference/01_fail.ipynb", FAIL_SOURCE)
    monkeypatch.setattr(runner, "REPO", repo)
    monkeypatch.setattr(runner, "git_sha", lambda repo=None: "abc1234")  # read once per run
    monkeypatch.setattr(runner, "utc_stamp", lambda: "20200101T000000Z")  # the run's start
    assert main(["run", "phase0", "-p", "answer", "42"]) == 1  # one failure -> non-zero
    ok, failed = (sorted((repo / "executed/phase0_reference" / s).glob("*.json"))
                  for s in ("00_ok", "01_fail"))
    side_ok, side_fail = json.loads(ok[0].read_text()), json.loads(failed[0].read_text())
    assert side_ok["error"] is None and side_ok["headline"]["answer"] == 42
    # run_id is the file name's stamp (the run's start), not the time the sidecar was written,
    # both for the notebook's own sidecar and the one the runner writes for a failed notebook
    assert ok[0].stem.startswith("20200101T000000Z_") and side_ok["run_id"] == "20200101T000000Z"
    assert side_fail["run_id"] == "20200101T000000Z"
    out = capsys.readouterr().out.splitlines()  # what was measured, under its ok line
    at = next(i for i, line in enumerate(out) if line.startswith("ok "))
    assert out[at + 1].split() == ["result:", "answer=42,", "step_time_s_median=1.5"]
    assert not any("result:" in line for line in out if line.startswith("failed"))
    assert side_ok["env"]["git_sha"] == "abc1234" and ok[0].stem.endswith("_abc1234")
    error = side_fail["error"]
    assert error.startswith("RuntimeError: boom in cell (cell 3,") and side_fail["status"] == "failed"
    assert f"partial notebook: executed/phase0_reference/01_fail/{failed[0].stem}.ipynb" in error
    assert str(repo) not in error  # repo-relative, never machine-specific
    partial = nbformat.read(failed[0].with_suffix(".ipynb"), as_version=4)
    texts = [o.get("text", "") for c in partial.cells if c.cell_type == "code"
             for o in c.get("outputs", [])]
    assert any("partial output before the failure" in t for t in texts)
    index = (repo / "executed/INDEX.md").read_text()
    assert "| failed |" in index and "| ok |" in index and "answer=42" in index
    assert "| error: RuntimeError: boom in cell (cell 3," in index
    # a second run adds files, never overwrites the first
    assert main(["run", "notebooks/phase0_reference/00_ok.ipynb"]) == 0
    assert len(list((repo / "executed/phase0_reference/00_ok").glob("*.json"))) == 2
    assert len(index_rows(repo / "executed")) == 3


def test_index_rendering_without_runs(tmp_path):
    assert "No runs yet" in render_index(index_rows(tmp_path))


ENV_SOURCE = """import os, pathlib, time
from nbhelpers.stats import make_sidecar, write_sidecar
marks = pathlib.Path(marker_dir)
(marks / os.environ["CUDA_VISIBLE_DEVICES"]).touch()
deadline = time.time() + 120  # wait for the other worker: proves both ran at the same time
while len(list(marks.iterdir())) < 2 and time.time() < deadline:
    time.sleep(0.2)
side = make_sidecar(phase="phase0", backend="x", extra={"headline": {
    "cvd": os.environ["CUDA_VISIBLE_DEVICES"], "saw_other": len(list(marks.iterdir())) == 2}})
write_sidecar(side, sidecar_path)"""


@pytest.mark.notebooks
def test_gpus_fan_out_one_worker_per_gpu_at_the_same_time(tmp_path, monkeypatch):
    params = "marker_dir = ''  # help\nsidecar_path = ''  # help"
    for name in ("00_a", "01_b"):
        _notebook(tmp_path / f"notebooks/phase0_reference/{name}.ipynb", ENV_SOURCE, params)
    (tmp_path / "marks").mkdir()
    monkeypatch.setattr(runner, "REPO", tmp_path)
    jobs = runner.run("phase0", gpus=["0", "1"], overrides={"marker_dir": str(tmp_path / "marks")})
    assert [j.status for j in jobs] == ["ok", "ok"]
    heads = [json.loads(j.sidecar.read_text())["headline"] for j in jobs]
    assert sorted(h["cvd"] for h in heads) == ["0", "1"]
    assert all(h["saw_other"] for h in heads)


def test_kernelspec_runs_this_interpreter_and_is_keyed_by_it(monkeypatch):
    import sys

    def spec_of(env):
        root = Path(env["JUPYTER_PATH"].split(":")[0])
        return root, json.loads((root / "kernels/nbhelpers/kernel.json").read_text())

    root, spec = spec_of(run_execute.kernel_env({}))
    assert spec["argv"][:3] == [sys.executable, "-m", "ipykernel_launcher"]
    monkeypatch.setattr(sys, "executable", "/other/venv/bin/python")
    other_root, other = spec_of(run_execute.kernel_env({"JUPYTER_PATH": "/keep"}))
    assert other_root != root and other["argv"][0] == "/other/venv/bin/python"
    assert spec_of(run_execute.kernel_env({}))[0] != root  # the first spec was not rewritten
    assert json.loads((root / "kernels/nbhelpers/kernel.json").read_text()) == spec


def test_index_links_sidecar_when_no_notebook_and_uses_fallback_headline(tmp_path):
    from nbhelpers.stats import make_sidecar, write_sidecar

    side = make_sidecar(phase="phase3", backend="flex",
                        rounds=[{"wall_s": 2.0, "new_tokens": 20, "prompt_tokens": 0}])
    write_sidecar(side, tmp_path / "phase3_flex/bench/b.json")
    (row,) = index_rows(tmp_path)
    assert row["run"] == "[b](phase3_flex/bench/b.json)" and row["status"] == "ok"
    assert row["headline"] == "decode_tok_per_s_median=10, wall_s_median=2"


def test_runner_error_fails_the_job_instead_of_killing_the_worker(repo, monkeypatch):
    def broken(job, repo):
        raise OSError("disk full")

    monkeypatch.setattr(runner, "REPO", repo)
    monkeypatch.setattr(runner, "execute", broken)
    (job,) = runner.run("phase0")
    side = json.loads(job.sidecar.read_text())
    assert job.status == "failed" and "disk full" in side["error"]
    assert "| failed |" in (repo / "executed/INDEX.md").read_text()


TYPED = ("answer: int = 1  # help = with an equals sign\nlr: float = 0.5\nflag: bool = False\n"
         "name: str | None = None\nitems: list = [1]\nsidecar_path: str = ''")


def _executed_files(repo: Path) -> list[Path]:
    return [p for p in (repo / "executed").rglob("*") if p.is_file()]


@pytest.mark.parametrize("over,match", [
    ({"answr": 3}, (r"-p answr: .* no parameter 'answr'\. Did you mean 'answer'\? "
                    r"Valid names: answer, lr, flag")),
    ({"answer": "abc"}, r"-p answer .*parameter 'answer' expects int, got 'abc' \(str\)"),
    ({"answer": 2.5}, "expects int, got 2.5"),
    ({"answer": True}, "expects int, got True"),
    ({"flag": 1}, "'flag' expects bool, got 1"),
    ({"items": "a"}, "'items' expects list"),
    ({"name": 3}, r"'name' expects str \| None, got 3"),
])
def test_bad_parameters_fail_before_anything_is_claimed(repo, over, match):
    nb = _notebook(repo / "notebooks/phase0_reference/00_ok.ipynb", OK_SOURCE, TYPED)
    with pytest.raises(runner.UserInputError, match=match):
        runner.plan_jobs(str(nb), "cpu", over, None, repo / "executed", repo)
    assert not (repo / "executed").exists()


def test_good_parameters_pass_ints_for_floats_and_none_for_optional(repo):
    _notebook(repo / "notebooks/phase0_reference/00_ok.ipynb", OK_SOURCE, TYPED)
    ((_, params),) = runner.plan_parameters(runner.resolve_notebooks("phase0", repo), "cpu",
                                            {"lr": 1, "name": None, "items": []}, repo)
    assert params == {"answer": 7, "lr": 1, "name": None, "items": []}


def test_config_value_of_wrong_type_names_the_file(repo):
    _notebook(repo / "notebooks/phase0_reference/00_ok.ipynb", OK_SOURCE, TYPED)
    (repo / "configs/00_ok.cpu.yaml").write_text("answer: seven\n")
    with pytest.raises(runner.UserInputError, match=r"configs/00_ok\.cpu\.yaml .*'answer' "
                                                    "expects int, got 'seven'"):
        runner.plan_jobs("phase0", "cpu", {}, None, repo / "executed", repo)


def test_yaml_error_in_a_p_value_names_that_p():
    with pytest.raises(runner.UserInputError, match=r"-p items '\[1, 2': not a YAML literal"):
        runner.parse_overrides([("answer", "1"), ("items", "[1, 2")])


def test_phase_plan_fails_as_a_whole_and_claims_nothing(repo):
    """The second notebook's bad config stops the run before the first one's name is claimed."""
    _notebook(repo / "notebooks/phase0_reference/01_b.ipynb", OK_SOURCE, TYPED)
    (repo / "configs/01_b.cpu.yaml").write_text("answer: 1.5\n")
    with pytest.raises(runner.UserInputError, match="01_b"):
        runner.run("phase0", repo=repo)
    assert not (repo / "executed").exists()


def test_profile_config_missing_skips_a_phase_notebook_but_not_a_target(repo, caplog):
    _notebook(repo / "notebooks/phase0_reference/09_compare.ipynb", OK_SOURCE)
    (repo / "configs/00_ok.h200.yaml").write_text("answer: 8\n")
    with caplog.at_level("WARNING", logger="nbhelpers.run.runner"):
        planned = runner.plan_parameters(runner.resolve_notebooks("phase0", repo), "h200", {},
                                         repo)
    assert [(nb.name, p) for nb, p in planned] == [("00_ok.ipynb", {"answer": 8})]
    assert "skipped (the rest of the phase runs): no configs/09_compare.h200.yaml" in caplog.text
    with pytest.raises(FileNotFoundError, match="09_compare.h200.yaml"):
        runner.plan_parameters([repo / "notebooks/phase0_reference/09_compare.ipynb"], "h200",
                               {}, repo)
    (repo / "configs/00_ok.h200.yaml").unlink()
    (repo / "configs/50_other_phase.h200.yaml").write_text("x: 1\n")
    with pytest.raises(FileNotFoundError, match="00_ok.h200.yaml"):  # none of the phase has one
        runner.plan_parameters(runner.resolve_notebooks("phase0", repo), "h200", {}, repo)
    with pytest.raises(runner.UserInputError, match=r"unknown profile 'b200'.*\['cpu', 'h200'\]"):
        runner.plan_parameters(runner.resolve_notebooks("phase0", repo), "b200", {}, repo)


def test_phase_override_goes_only_to_the_notebooks_declaring_it(repo):
    _notebook(repo / "notebooks/phase0_reference/09_compare.ipynb", OK_SOURCE,
              "executed_dir: str = 'executed'\nsidecar_path: str = ''")
    planned = runner.plan_parameters(runner.resolve_notebooks("phase0", repo), "cpu",
                                     {"answer": 3}, repo)
    assert [p for _, p in planned] == [{"answer": 3}, {}]
    with pytest.raises(runner.UserInputError, match="Did you mean 'executed_dir'"):
        runner.plan_parameters(runner.resolve_notebooks("phase0", repo), "cpu",
                               {"executed_dirs": "x"}, repo)


@pytest.mark.parametrize("argv,match", [
    (["run", "phase9"], "unknown phase 'phase9'"),
    (["run", "notebooks/nope.ipynb"], "notebook 'notebooks/nope.ipynb' not found"),
    (["run", "phase0", "--profile", "b200"], "unknown profile 'b200'"),
    (["run", "phase0", "-p", "answr", "1"], "Did you mean 'answer'"),
    (["run", "phase0", "-p", "answer", "[1"], "-p answer '\\[1': not a YAML literal"),
    (["run", "phase0", "--gpus", "abc"], "--gpus 'abc': give comma-separated GPU indices"),
    (["run", "phase0", "--gpus", "0"], "--gpus 0: this host has no GPU"),
    (["fetch", "nope-model"], r"unknown asset 'nope-model': use gsm8k or one of \["),
])
def test_cli_user_errors_are_one_line_exit_2(repo, monkeypatch, capsys, argv, match):
    import re

    from nbhelpers import __main__ as cli

    monkeypatch.setattr(runner, "REPO", repo)
    monkeypatch.setattr(cli, "visible_gpu_count", lambda: 0)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert re.search(match, err)
    assert not (repo / "executed").exists()


def test_output_dir_that_is_a_file_is_one_error_line_before_anything_runs(
        repo, monkeypatch, capsys):
    """Fresh-user trial 2026-12-07: ``-p output_dir README.md`` failed 25 s in, in cell 7."""
    _notebook(repo / "notebooks/phase0_reference/00_ok.ipynb", OK_SOURCE,
              "answer = 1  # help\noutput_dir = ''  # folder\nsidecar_path = ''")
    (repo / "README.md").write_text("a file\n")
    monkeypatch.setattr(runner, "REPO", repo)
    monkeypatch.setattr(runner, "execute", lambda job, repo: pytest.fail("it ran"))
    assert main(["run", "phase0", "-p", "output_dir", "README.md"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: -p output_dir (00_ok.ipynb): output_dir='README.md' is an "
                          "existing file") and "\n" not in err and "-p output_dir ''" in err
    assert not (repo / "executed").exists()


def test_gpus_beyond_the_visible_count_are_refused(monkeypatch):
    from nbhelpers import __main__ as cli

    monkeypatch.setattr(cli, "visible_gpu_count", lambda: 2)
    assert cli.parse_gpus("0, 1") == ["0", "1"] and cli.parse_gpus(None) is None
    with pytest.raises(runner.UserInputError, match=r"no GPU 2 \(nvidia-smi lists 2: 0\.\.1\)"):
        cli.parse_gpus("0,2")


def test_failed_headline_is_the_error_first_line_shortened():
    from nbhelpers.run.index import headline

    assert headline({"error": "ValueError: short\npartial notebook: x"}) == "error: ValueError: short"
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'head_dim'\n"
    assert headline({"error": tb}) == "error: KeyError: 'head_dim'"
    long = headline({"error": "E: " + "x" * 200, "headline": {"a": 1}})
    assert long.startswith("error: E: xxx") and long.endswith("...") and len(long) == 7 + 80


REAL_REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nb,over,match", [
    ("phase0_reference/00_reference_grpo", {"max_steps": 0},
     r"-p max_steps \(00_reference_grpo\.ipynb\): GRPOSettings\.max_steps=0: must be >= 1"),
    ("phase2_grpo/20_grpo_equivalence", {"num_generations": 1},
     r"GRPOSettings\.num_generations=1: GRPO needs >= 2"),
    ("phase0_reference/00_reference_grpo", {"learning_rate": 0.0},
     r"GRPOSettings\.learning_rate=0\.0: must be finite and > 0"),
    ("phase0_reference/00_reference_grpo", {"lora_rank": 0},
     r"LoraSpec\.rank=0: must be a positive int .*\(lora_rank is LoraSpec\.rank\)"),
    ("phase1_rollout/10_lora_rollout", {"sampling": "grpo2"},
     r"-p sampling .*Workload\.sampling='grpo2': use one of \['greedy', 'grpo'\]"),
    ("phase1_rollout/10_lora_rollout", {"lora_rank": -1}, r"LoraSpec\.rank=-1"),
    ("phase3_flex/30_engine_walkthrough", {"num_generations": 0},
     r"SamplingParams\.n=0: must be >= 1.*\(num_generations is SamplingParams\.n\)"),
    ("phase3_flex/34_gemma4", {"warmup_rounds": -1}, r"Workload\.warmup_rounds=-1: >= 0"),
    ("phase0_reference/00_reference_grpo", {"skip_first": -1}, "skip_first=-1 must be >= 0"),
    ("phase0_reference/00_reference_grpo", {"model": "nope-model"}, "Unknown model 'nope-model'"),
    ("phase0_reference/00_reference_grpo", {"dataset": "gsm9k"}, "dataset='gsm9k': use one of"),
    ("phase1_rollout/10_lora_rollout", {"backends": ["hf_generate", "tgi"]},
     r"unknown backend\(s\) \['tgi'\]"),
    ("phase2_grpo/20_grpo_equivalence", {"backends": ["cb_sync"]},
     r"unknown backend\(s\) \['cb_sync'\]"),
    ("phase2_grpo/20_grpo_equivalence", {"n_questions": 150}, "ships 100 questions"),
    ("phase0_reference/00_reference_grpo", {"n_questions": 80}, "would overlap the warm-up"),
    ("phase0_reference/00_reference_grpo", {"sidecar_path": "/tmp/s.json"}, "--executed DIR"),
    ("phase0_reference/00_reference_grpo", {"output_dir": "README.md"},
     (r"^-p output_dir \(00_reference_grpo\.ipynb\): output_dir='README\.md' is an existing "
      r"file, not a folder: pass a folder .* or -p output_dir '' for a fresh temporary folder\.$")),
    ("phase0_reference/00_reference_grpo", {"output_dir": "README.md/grpo"},
     r"output_dir='README\.md/grpo' lies under the existing file README\.md, not a folder"),
    ("phase2_grpo/20_grpo_equivalence", {"reference_backend": "nope"},
     "reference_backend='nope': use one of"),
    ("phase2_grpo/20_grpo_equivalence", {"backends": []}, r"backends=\[\]: name at least one"),
    ("phase2_grpo/20_grpo_equivalence", {"compile_dynamic": "yes"},
     r"-p compile_dynamic .*compile_dynamic='yes': use one of \('auto', 'on', 'off'\)"),
    ("phase2_grpo/20_grpo_equivalence", {"compile_mode": "max"}, "compile_mode='max': use one"),
    ("phase2_grpo/20_grpo_equivalence", {"compile_scope": "model"},
     r"-p compile_scope .*compile_scope='model': use one of \('auto', 'backbone', 'layers'\)"),
    ("phase2_grpo/20_grpo_equivalence", {"compile_scope": "layers",
                                         "backends": ["hf_generate", "flex"]},
     r"-p compile_scope .*'layers' with backend='hf_generate'"),
])
def test_values_are_checked_before_anything_runs(nb, over, match):
    path = REAL_REPO / "notebooks" / f"{nb}.ipynb"
    with pytest.raises(runner.UserInputError, match=match):
        runner.plan_parameters([path], "cpu", over, REAL_REPO)


@pytest.mark.parametrize("nb,over", [
    ("phase3_flex/30_engine_walkthrough", {"num_generations": 1}),  # SamplingParams.n >= 1
    ("phase1_rollout/10_lora_rollout", {"lora_rank": 0}),  # phase 1: 0 = no adapter
    ("phase0_reference/00_reference_grpo", {"skip_first": 20}),  # >= max_steps is allowed
    ("phase0_reference/00_reference_grpo", {"output_dir": "docs"}),  # an existing folder
    ("phase0_reference/00_reference_grpo", {"output_dir": "executed/no/such/folder"}),  # created
    ("phase2_grpo/20_grpo_equivalence", {"compile_mode": "default", "compile_dynamic": "on"}),
    ("phase2_grpo/20_grpo_equivalence", {"compile_mode": "default", "compile_scope": "layers",
                                         "backends": ["flex", "vllm"]}),
])
def test_values_the_config_dataclasses_accept_pass(nb, over):
    path = REAL_REPO / "notebooks" / f"{nb}.ipynb"
    ((_, params),) = runner.plan_parameters([path], "cpu", over, REAL_REPO)
    assert params.items() >= over.items()


def test_phase_comes_from_the_folder_not_the_file_name(tmp_path):
    """A ``2x_`` notebook in phase 3's folder is checked as phase 3 (num_generations 1 is fine)
    and a ``3x_`` one in phase 2's folder as phase 2 (GRPOSettings: >= 2)."""
    from nbhelpers.run.phases import phase_of
    params = "num_generations: int = 2\nsidecar_path: str = ''"
    in3 = _notebook(tmp_path / "notebooks/phase3_flex/20_x.ipynb", "pass", params)
    in2 = _notebook(tmp_path / "notebooks/phase2_grpo/30_x.ipynb", "pass", params)
    (tmp_path / "configs").mkdir()
    assert (phase_of(in3), phase_of(in2), phase_of(tmp_path / "x.ipynb")) == \
        ("phase3", "phase2", None)
    assert runner.plan_parameters([in3], "cpu", {"num_generations": 1}, tmp_path)
    with pytest.raises(runner.UserInputError, match="GRPO needs >= 2"):
        runner.plan_parameters([in2], "cpu", {"num_generations": 1}, tmp_path)


def test_a_file_that_is_not_a_notebook_is_a_one_line_user_error(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "notebooks/phase0_reference/bad.ipynb"  # a phase folder: read, not refused
    bad.parent.mkdir(parents=True)
    bad.write_text("{}")
    monkeypatch.setattr(runner, "REPO", tmp_path)
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not a readable Jupyter notebook" in err
    assert "\n" not in err


def test_phase_folder_paths_resolve_like_phase_names():
    by_name = runner.resolve_notebooks("phase0", REAL_REPO)
    assert runner.resolve_notebooks("notebooks/phase0_reference", REAL_REPO) == by_name
    assert runner.resolve_notebooks("phase0_reference/", REAL_REPO) == by_name


def test_gpu_profile_on_a_host_without_gpu_is_a_user_error(repo, monkeypatch, capsys):
    from nbhelpers import __main__ as cli
    (repo / "configs/00_ok.h200.yaml").write_text("answer: 1\n")
    monkeypatch.setattr(runner, "REPO", repo)
    monkeypatch.setattr(cli, "visible_gpu_count", lambda: 0)
    assert main(["run", "phase0", "--profile", "h200"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --profile h200 sizes the runs for a GPU host")
    assert "--profile cpu" in err and not (repo / "executed").exists()


SLEEP_SOURCE = """import os, pathlib, time
ready = pathlib.Path(pid_file)
ready.with_suffix(".tmp").write_text(str(os.getpid()))
ready.with_suffix(".tmp").replace(ready)  # atomic: the test never reads a half-written pid
time.sleep(900)"""
READY_CAP_S = 600.0
"""Generous caps, not timings: the test proceeds on events (the kernel's pid file appears, the
runner exits, the kernel's pid disappears); a cap only bounds a hung run (a busy 2-core host
once needed more than 60 s to start the kernel)."""


def _wait_for(event, cap_s: float, what: str, proc=None, log: Path | None = None) -> None:
    """Poll ``event()`` until true; fail after ``cap_s`` or when ``proc`` exits first (the
    failure then quotes the end of ``log``, the runner's stderr)."""
    import time
    deadline = time.monotonic() + cap_s
    while not event():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None and log.is_file() else ""
            pytest.fail(f"the runner exited ({proc.returncode}) before {what}; its stderr:\n"
                        f"{tail}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {cap_s:.0f} s")
        time.sleep(0.2)


def _pid_gone(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_stops_the_kernel_and_records_the_run(tmp_path, sig):
    """Ctrl-C (SIGINT to the runner) or SIGTERM: exit 130, a failed sidecar and an INDEX row,
    and the notebook's kernel is gone (the papermill child runs in its own session, so the
    runner stops it and papermill shuts its kernel down). The signal is sent once the kernel
    runs the notebook (its pid file is the readiness signal), never after a fixed delay."""
    import os
    import signal
    import subprocess
    pid_file = tmp_path / "kernel.pid"
    _notebook(tmp_path / "notebooks/phase0_reference/00_sleep.ipynb", SLEEP_SOURCE,
              "pid_file = ''\nsidecar_path = ''")
    from runner_proc import start_phase0
    log = tmp_path / "runner.log"  # a file, not a pipe: a full pipe would stall the runner
    with log.open("w") as err:
        proc = start_phase0(tmp_path, "00_sleep", pid_file, subprocess.DEVNULL, err)
    try:
        _wait_for(pid_file.exists, READY_CAP_S, "kernel pid file (kernel start)", proc, log)
        kernel = int(pid_file.read_text())
        proc.send_signal(getattr(signal, sig))
        _wait_for(lambda: proc.poll() is not None, READY_CAP_S, "runner exit after the signal")
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    # one clean line from the runner and one from its papermill child, no KeyboardInterrupt
    # traceback from either (the kernel's own shutdown log is not theirs to silence)
    assert "interrupted: the partial notebook is kept" in text
    assert "notebook stopped by the runner (interrupted)" in text
    assert "KeyboardInterrupt" not in text, text[-3000:]
    (side,) = (tmp_path / "executed/phase0_reference/00_sleep").glob("*.json")
    doc = json.loads(side.read_text())
    assert doc["status"] == "failed" and "interrupted" in doc["error"]
    assert "failed" in (tmp_path / "executed/INDEX.md").read_text()
    try:  # the kernel exits shortly after papermill's shutdown request
        _wait_for(lambda: _pid_gone(kernel), READY_CAP_S, "exit of the notebook's kernel")
    finally:
        if not _pid_gone(kernel):
            os.kill(kernel, signal.SIGKILL)


def test_executed_folder_that_cannot_be_written_is_a_user_error(repo, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(runner.UserInputError, match="cannot create or write there"):
        runner.run("phase0", repo=repo, executed=blocker / "sub")


def test_run_help_names_every_target_form():
    """``run --help`` names the forms :func:`runner.resolve_notebooks` takes: a phase, its
    folder and one notebook (helper-16's trial: the help named no folder form)."""
    from nbhelpers.__main__ import _parser
    sub = next(a for a in _parser()._actions if a.dest == "command").choices["run"]
    text = next(a for a in sub._actions if a.dest == "target").help
    assert all(w in text for w in ("phase0", "phase2_grpo", "notebooks/phase2_grpo/", ".ipynb"))
