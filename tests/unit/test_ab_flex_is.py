"""scripts/ab_flex_is.py on the CPU: phase 2's flex trainer, both IS variants in one process.

tiny-llama (fp32), the cpu profile with short completions: one lead-in step, then 2 rounds x 2
variants x 2 steps. The
sidecar must hold both variants in the AB/BA schedule, one row per optimizer step with TRL's
timings, and the policy forward calls per step: reference logprobs + the loss's micro-batch = 2
with the loss-time ratio, + the extra no-grad forward (one chunk of per_device_train_batch_size
4 rows) = 3 on the old path. The settings and train() options must be what the notebook's own
cells build from the same parameters (evaluated from the notebook's source here).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from nbhelpers.run.params import UserInputError
from nbhelpers.stats import median, validate_sidecar

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["--model", "tiny-llama", "-p", "n_questions", "4", "-p", "max_completion_length", "8",
         "-p", "flex_compile_attention", '"off"']


def _load():
    spec = importlib.util.spec_from_file_location("ab_flex_is", REPO / "scripts/ab_flex_is.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ab = _load()


def test_both_variants_in_one_process(tmp_path, capsys):
    side = ab.main([*SMOKE, "--steps", "2", "--rounds", "2", "--lead-in", "1",
                    "--out", str(tmp_path)])
    files = list(tmp_path.glob("*_ab_flex_is.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == side
    validate_sidecar(side)
    assert (side["phase"], side["backend"], side["kind"], side["error"]) == (
        "phase2", "flex", "flex_is_ab", None)
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    assert side["env"]["git_sha"] and side["env"]["trl"] and side["env"]["gpu"] == gpu
    assert side["args"]["steps"] == 2 and side["model"]["name"] == "tiny-llama"
    assert side["grpo_config"]["max_steps"] == 9 and side["workload"]["max_completion_length"] == 8
    cfg = side["grpo_config"]  # TRL's IS settings ride along (they scale the loss)
    assert cfg["vllm_importance_sampling_correction"] is True
    assert cfg["vllm_importance_sampling_mode"] == "sequence_mask"
    assert cfg["vllm_importance_sampling_clip_max"] == 3.0
    rows = side["steps"]
    assert [r["step"] for r in rows] == list(range(1, 10))
    lt, ef = "loss_time", "extra_forward"
    assert [r["variant"] for r in rows] == [lt, lt, lt, ef, ef, ef, ef, lt, lt]  # AB, then BA
    assert [r["round"] for r in rows] == [-1, 0, 0, 0, 0, 1, 1, 1, 1]
    assert [r["warmup"] for r in rows] == [True] + [True, False] * 4
    for r in rows:
        assert r["generate_s"] > 0 and r["step_time_s"] > r["generate_s"]
        assert r["trainer_s"] == pytest.approx(r["step_time_s"] - r["generate_s"])
        assert r["wall_s"] >= r["step_time_s"] and r["completion_length_mean_tokens"] == 8
        assert r["policy_forwards"] == {lt: 2, ef: 3}[r["variant"]], r  # ref + loss (+ extra)
    med = side["medians"]
    for v in (lt, ef):
        kept = [r for r in rows if r["variant"] == v and not r["warmup"]]
        assert med[v]["n_steps"] == 2
        assert med[v]["trainer_s"] == pytest.approx(median([r["trainer_s"] for r in kept]))
    assert (med[lt]["policy_forwards"], med[ef]["policy_forwards"]) == (2, 3)
    per_round = [median([r["trainer_s"] for r in rows if r["round"] == n and not r["warmup"]
                         and r["variant"] == v]) for n in (0, 1) for v in (lt, ef)]
    expected = median([per_round[0] - per_round[1], per_round[2] - per_round[3]])
    assert med["paired_delta"]["trainer_s"] == pytest.approx(expected)
    table = capsys.readouterr().out
    assert "| loss_time | 2 |" in table and "| extra_forward | 2 |" in table


def _cell(marker: str) -> str:
    cells = json.loads((REPO / "notebooks/phase2_grpo/20_grpo_equivalence.ipynb").read_text())
    return next("".join(c["source"]) for c in cells["cells"] if marker in "".join(c["source"]))


@pytest.mark.parametrize("profile", ["cpu", "h200"])
def test_settings_and_options_are_the_notebooks(profile):
    from nbhelpers.config import GRPOSettings, LoraSpec
    from nbhelpers.grpo import compare as grpo_compare
    params = ab.phase2_parameters(profile, {})
    tree = ast.parse(_cell("settings = GRPOSettings("))
    stmt = next(n for n in tree.body if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "settings")
    scope = dict(params, GRPOSettings=GRPOSettings, LoraSpec=LoraSpec)
    exec(compile(ast.Module([stmt], []), "derived", "exec"), scope)  # noqa: S102
    assert ab.settings_from(params, params["max_steps"]) == scope["settings"]
    call = next(n for n in ast.walk(ast.parse(_cell("grpo_compare.run_backends(")))
                if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("run_backends"))
    opts = ab.train_options(params, "/tmp/x")
    scope = dict(params, grpo_compare=grpo_compare)
    passed = {k.arg: eval(compile(ast.Expression(k.value), "kw", "eval"), scope)
              for k in call.keywords
              if k.arg not in ("cpu_threads", "sidecar_path", "model_info", "reuse_runs",
                               "skip_first")}  # skip_first: GRPOResult.summary only, unused
    assert {k: opts[k] for k in passed} == passed
    assert opts["backend"] == "flex" and opts["warmup_adapter"] == grpo_compare.WARMUP_ADAPTER


@pytest.mark.parametrize(("argv", "match"), [
    (["--steps", "1"], "--steps 1: need >= 2"),
    (["--rounds", "0"], "need rounds >= 1"),
    (["--lead-in", "-1"], "lead-in >= 0"),
])
def test_bad_counts_name_the_fix(argv, match, capsys):
    with pytest.raises(SystemExit):
        ab.main(argv)
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["--profile", "h200_fp32"], r"'h200_fp32': use one of \[[^]]*'h200'"),  # 33's only
    (["--model", "no-such-model"], "Unknown model 'no-such-model'"),
    (["-p", "max_steps", "3"], "use --steps and --rounds"),
    (["-p", "no_such", "3"], "not a parameter of 20_grpo_equivalence"),
    (["-p", "flex_compile_attention", "off"], "expects str, got False"),
    (["-p", "num_generations", "1"], "num_generations"),
])
def test_bad_parameters_name_the_fix(argv, match):
    with pytest.raises(UserInputError, match=match):
        ab.main(argv)


def _cli(argv: list[str], monkeypatch, capsys) -> str:
    """The script's ``__main__`` path in this process: its stderr once it exited 2."""
    import runpy
    monkeypatch.setattr("sys.argv", ["ab_flex_is.py", *argv])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / "scripts/ab_flex_is.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_a_gpu_profile_on_a_host_without_gpu_is_refused_before_the_trainer(
        monkeypatch, capsys, tmp_path):
    import nbhelpers.__main__ as cli
    from nbhelpers.grpo import trainer
    monkeypatch.setattr(cli, "visible_gpu_count", lambda: 0)
    built = []
    monkeypatch.setattr(trainer, "_train_local", lambda *a, **k: built.append(a))
    err = _cli(["--profile", "h200", "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert ("--profile h200 sizes the run for a GPU host, and nvidia-smi lists no GPU here: "
            "use --profile cpu") in err
    assert built == [] and not (tmp_path / "out").exists()
    monkeypatch.setattr(cli, "visible_gpu_count", lambda: 1)
    ab.check_host("h200")  # a GPU host passes
    ab.check_host("cpu")


def test_a_bad_model_names_the_model_flag_the_user_typed(monkeypatch, capsys):
    err = _cli(["--model", "smollm3"], monkeypatch, capsys)
    assert err.startswith("error: --model (20_grpo_equivalence.ipynb): Unknown model 'smollm3'")
    assert "-p model" not in err
    with pytest.raises(UserInputError, match=r"^-p model \(20_grpo.*Unknown model 'smollm3'"):
        ab.main(["-p", "model", '"smollm3"'])  # typed as -p: named as -p
