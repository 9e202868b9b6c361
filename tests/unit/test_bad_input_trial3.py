"""Bad input found by a fresh-user trial, third round, on the runner and the config dataclasses:
values that passed the up-front checks and failed inside the notebook, a notebook path outside
the phase folders, and phase 1's ``engine_options`` without its backend keys. Each is refused
before any output name is claimed, with an error that names the fix (CPU, nothing executed).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nbhelpers.config import GRPOSettings, SamplingParams
from nbhelpers.run import runner
from nbhelpers.run.params import UserInputError, parse_overrides, plan_parameters

REPO = Path(__file__).resolve().parents[2]
NB10 = REPO / "notebooks" / "phase1_rollout" / "10_lora_rollout.ipynb"
NB20 = REPO / "notebooks" / "phase2_grpo" / "20_grpo_equivalence.ipynb"


# ------------------------------------------------------------- 1: GRPOSettings ranges
@pytest.mark.parametrize("kwargs, match", [
    ({"learning_rate": math.inf}, r"learning_rate=inf: must be finite and > 0"),
    ({"learning_rate": math.nan}, r"learning_rate=nan: must be finite and > 0"),
    ({"beta": math.inf}, r"beta=inf: must be finite and >= 0"),
    ({"weight_decay": math.inf}, r"weight_decay=inf: must be finite and >= 0"),
    ({"weight_decay": -0.1}, r"weight_decay=-0.1: must be finite and >= 0"),
    ({"warmup_ratio": 1.5}, r"warmup_ratio=1.5: must be in \[0, 1\]"),
    ({"warmup_ratio": math.nan}, r"warmup_ratio=nan: must be in \[0, 1\]"),
    ({"seed": -1}, r"seed=-1: must be in \[0, 2\*\*32\) \(transformers.set_seed"),
    ({"seed": 2**32}, r"seed=4294967296: must be in \[0, 2\*\*32\)"),
    ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0: must be >= 1"),
    ({"logging_steps": 0}, r"logging_steps=0: must be >= 1"),
    ({"temperature": math.inf}, r"temperature=inf: must be finite"),
    ({"top_p": math.nan}, r"top_p=nan: must be in \(0, 1\]"),
    ({"min_p": math.inf}, r"min_p=inf: must be in \[0, 1\]"),
])
def test_grpo_settings_refuse_values_the_trainer_would_fail_on(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOSettings(**kwargs)


def test_grpo_settings_edges_still_pass():
    s = GRPOSettings(seed=0, beta=0.0, warmup_ratio=1.0, weight_decay=0.0)
    assert (s.seed, s.beta, s.warmup_ratio) == (0, 0.0, 1.0)
    assert GRPOSettings(seed=2**32 - 1).seed == 2**32 - 1


@pytest.mark.parametrize("name, value, match", [
    ("learning_rate", ".inf", (r"-p learning_rate \(20_grpo_equivalence.ipynb\): .*"
                              r"learning_rate=inf: must be finite")),
    ("beta", ".inf", r"-p beta .*beta=inf: must be finite and >= 0"),
    ("seed", "-1", r"-p seed .*seed=-1: must be in \[0, 2\*\*32\)"),
    ("seed", "4294967296", r"-p seed .*must be in \[0, 2\*\*32\)"),
    ("backends", "[flex, flex]", (r"-p backends .*names \['flex'\] more than once: give each "
                                 r"backend once, e.g. \['flex'\]")),
])
def test_phase2_values_fail_before_any_name_is_claimed(tmp_path, name, value, match):
    with pytest.raises(UserInputError, match=match):
        runner.plan_jobs("phase2", "cpu", parse_overrides([(name, value)]), None,
                         tmp_path / "executed", REPO)
    assert not (tmp_path / "executed").exists()


@pytest.mark.parametrize("name, value, match", [
    ("kl_tolerance", ".nan", r"-p kl_tolerance .*kl_tolerance=nan: must be a finite number\."),
    ("vllm_gpu_memory_utilization", "1.5", r"=1.5: must be a finite number in \(0, 1\]"),
    ("vllm_gpu_memory_utilization", "0.0", r"=0.0: must be a finite number in \(0, 1\]"),
])
def test_phase2_notebook_floats_must_be_finite_and_in_range(name, value, match):
    with pytest.raises(UserInputError, match=match):
        plan_parameters([NB20], "cpu", parse_overrides([(name, value)]), REPO)


def test_phase1_floats_outside_any_config_are_checked_too():
    with pytest.raises(UserInputError, match=r"timeout_s=inf: must be a finite number > 0"):
        plan_parameters([NB10], "cpu", {"timeout_s": math.inf}, REPO)
    ((_, params),) = plan_parameters([NB10], "cpu", {"timeout_s": 30.0}, REPO)
    assert params["timeout_s"] == 30.0


def test_phase1_duplicate_backends_are_refused_too():
    with pytest.raises(UserInputError, match=r"\['hf_cb'\] more than once"):
        plan_parameters([NB10], "cpu", {"backends": ["hf_cb", "hf_generate", "hf_cb"]}, REPO)


# ------------------------------------------------------------- 2: notebooks outside notebooks/
def _executed_copy(root: Path) -> Path:
    copy = root / "executed/phase0_reference/00_reference_grpo/20261201T000000Z_cpu_abc.ipynb"
    copy.parent.mkdir(parents=True)
    copy.write_bytes((REPO / "notebooks/phase0_reference/00_reference_grpo.ipynb").read_bytes())
    return copy


def test_an_executed_copy_is_refused_naming_its_source_notebook(tmp_path):
    copy = _executed_copy(tmp_path)
    with pytest.raises(UserInputError) as err:
        runner.plan_jobs(str(copy), "cpu", {}, None, tmp_path / "out", REPO)
    msg = str(err.value)
    assert "is not in a phase folder" in msg and "skip the phase's value checks" in msg
    assert ("Run its source notebook, python -m nbhelpers run "
            "notebooks/phase0_reference/00_reference_grpo.ipynb") in msg
    assert not (tmp_path / "out").exists()


def test_a_scratch_notebook_is_refused_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    from nbhelpers.__main__ import main
    scratch = tmp_path / "probe" / "x.ipynb"
    scratch.parent.mkdir()
    scratch.write_bytes(NB10.read_bytes())
    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("a notebook ran"))
    out = tmp_path / "executed"
    assert main(["run", str(scratch), "--executed", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: notebook ") and "Move it into notebooks/<phase dir>/" in err
    assert "python -m nbhelpers run phase0 ... phase3" in err
    assert not out.exists()


def test_notebooks_in_phase_folders_still_resolve_by_relative_or_absolute_path():
    rel = "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"
    assert runner.resolve_notebooks(rel, REPO) == [NB20]
    assert runner.resolve_notebooks(str(NB20), REPO) == [NB20]


# ------------------------------------------------------------- 3: phase 1 engine_options keys
def test_engine_options_without_a_backend_key_show_the_form():
    given = parse_overrides([("engine_options", "{gpu_memory_utilization: 0.5}")])
    with pytest.raises(UserInputError) as err:
        plan_parameters([NB10], "cpu", given, REPO)
    msg = str(err.value)
    assert msg.startswith("-p engine_options (10_lora_rollout.ipynb): key "
                          "'gpu_memory_utilization' is not a backend")
    assert "would be ignored" in msg and "{vllm: {gpu_memory_utilization: 0.5}}" in msg


def test_engine_options_for_a_backend_outside_the_run_are_refused():
    given = parse_overrides([("backends", "[hf_generate]"),
                             ("engine_options", "{vllm: {max_num_seqs: 8}}")])
    with pytest.raises(UserInputError, match=r"key 'vllm' is not a backend of this run "
                                             r"\(\['hf_generate'\]\)"):
        plan_parameters([NB10], "cpu", given, REPO)


def test_engine_options_value_must_be_a_mapping():
    given = parse_overrides([("engine_options", "{hf_cb: 3}")])
    with pytest.raises(UserInputError, match=r"engine_options\['hf_cb'\]=3 is not a mapping"):
        plan_parameters([NB10], "cpu", given, REPO)


def test_engine_options_of_the_run_and_config_keys_outside_a_split_pass():
    """-p keyed by a run backend passes; the H200 config's options for backends that a
    ``-p backends`` split leaves out stay allowed (the sweep is run in parts)."""
    given = parse_overrides([("backends", "[hf_cb]"), ("engine_options", "{hf_cb: {rounds: 1}}")])
    ((_, params),) = plan_parameters([NB10], "cpu", given, REPO)
    assert params["engine_options"] == {"hf_cb": {"rounds": 1}}
    from nbhelpers.run.values import check_values
    check_values({"backends": ["flex"], "engine_options": {"vllm": {"max_num_seqs": 32}}},
                 {"engine_options": "configs/10_lora_rollout.h200.yaml"}, NB10, REPO)


# ------------------------------------------------------------- 6: SamplingParams types
@pytest.mark.parametrize("kwargs", [{"n": 2.5}, {"max_new_tokens": "8"}, {"seed": 1.0}])
def test_wrong_sampling_types_are_type_errors_and_still_value_errors(kwargs):
    from nbhelpers.config import FieldTypeError
    with pytest.raises(TypeError, match="expected int") as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, ValueError) and isinstance(err.value, FieldTypeError)


@pytest.mark.parametrize("name, match", [
    ("presence_penalty", "backends do not implement presence_penalty"),
    ("frequency_penalty", "backends do not implement frequency_penalty"),
    ("repetition_penalty", "backends do not implement repetition_penalty"),
    ("best_of", r"best_of is not implemented .*use n=\.\.\. samples per prompt"),
])
def test_vllm_sampling_names_the_engine_lacks_say_so(name, match):
    with pytest.raises(TypeError, match=rf"SamplingParams\({name}=\.\.\.\): .*{match}"):
        SamplingParams(**{name: 2})
