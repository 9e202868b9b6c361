"""nbhelpers.config: every validation error names the field and the fix; derived values."""

import dataclasses

import pytest

from nbhelpers.config import (
    GRPO_SAMPLING,
    WORKLOAD_W,
    GRPOSettings,
    LoraSpec,
    ModelSpec,
    SamplingParams,
    Workload,
)


@pytest.mark.parametrize("cls,kwargs,match", [
    (ModelSpec, {"name": ""}, "name is empty.*list_models"),
    (ModelSpec, {"name": "m", "kind": "weird"}, "kind='weird'"),
    (ModelSpec, {"name": "m", "dtype": "int8"}, "dtype='int8'"),
    (LoraSpec, {"rank": 0}, "rank=0"),
    (LoraSpec, {"alpha": -1}, "alpha=-1"),
    (LoraSpec, {"targets": ()}, "targets is empty.*LORA_TARGETS_ALL"),
    (LoraSpec, {"dropout": 1.0}, "dropout=1.0"),
    (LoraSpec, {"init_b_std": -0.1}, "init_b_std"),
    (SamplingParams, {"temperature": -1.0}, "temperature=-1.0.*greedy"),
    (SamplingParams, {"top_p": 0.0}, r"top_p=0.0.*\(0, 1\]"),
    (SamplingParams, {"top_k": -2}, "top_k=-2.*disables"),
    (SamplingParams, {"min_p": 1.5}, "min_p=1.5"),
    (SamplingParams, {"n": 0}, "n=0"),
    (SamplingParams, {"max_new_tokens": 0}, "max_new_tokens=0"),
    (Workload, {"n_prompts": 0}, "n_prompts=0"),
    (Workload, {"sampling": "beam"}, "sampling='beam'.*grpo"),
    (Workload, {"rounds": 0}, "rounds=0"),
    (GRPOSettings, {"max_steps": 0}, "max_steps=0"),
    (GRPOSettings, {"num_generations": 1}, "num_generations=1.*>= 2"),
    (GRPOSettings, {"learning_rate": 0.0}, "learning_rate=0.0"),
    (GRPOSettings, {"beta": -0.1}, "beta=-0.1"),
    (GRPOSettings, {"top_k": -5}, "top_k=-5"),
])
def test_bad_values_raise_naming_the_field(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GRPOSettings().max_steps = 3  # type: ignore[misc]


def test_sampling_translations():
    assert SamplingParams(top_k=-1).top_k_or_none is None
    assert SamplingParams(top_k=0).top_k_or_none is None
    assert SamplingParams(top_k=7).top_k_or_none == 7
    assert SamplingParams(temperature=0.0).is_greedy and not GRPO_SAMPLING.is_greedy
    assert GRPO_SAMPLING.min_p == 0.1 and GRPO_SAMPLING.seed == 3407


def test_derived_sampling_and_scaling():
    w = WORKLOAD_W.sampling_params()
    assert (w.max_new_tokens, w.ignore_eos, w.min_p) == (512, True, 0.1)
    g = GRPOSettings(num_generations=8, max_completion_length=64).sampling_params()
    assert (g.n, g.max_new_tokens, g.top_k, g.seed) == (8, 64, -1, 3407)
    assert LoraSpec().scaling == 2.0 and len(LoraSpec().targets) == 7
    assert Workload(sampling="greedy").sampling_params().is_greedy


def test_environment_yml_mirrors_pyproject_gpu_extras():
    """environment.yml's pip list == pyproject extras gpu + trl + notebooks (plus `-e .`)."""
    import tomllib
    from pathlib import Path

    import yaml

    repo = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    want = {*extras["gpu"], *extras["trl"], *extras["notebooks"], "-e ."}
    env = yaml.safe_load((repo / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert set(pip) == want
    assert "python=3.12" in env["dependencies"]


@pytest.mark.parametrize("cls,kwargs,match", [
    (LoraSpec, {"rank": 2.5}, r"LoraSpec\.rank=2\.5: expected int, got float"),
    (LoraSpec, {"rank": True}, r"LoraSpec\.rank=True: expected int, got bool"),
    (LoraSpec, {"alpha": "64"}, r"LoraSpec\.alpha='64': expected int, got str"),
    (LoraSpec, {"dropout": "0.1"}, r"LoraSpec\.dropout='0\.1': expected float, got str"),
    (LoraSpec, {"targets": ["q_proj"]}, r"targets=\['q_proj'\]: expected tuple\[str, \.\.\.\]"),
    (LoraSpec, {"targets": ("q_proj", 1)}, (r"expected tuple\[str, \.\.\.\], got tuple of "
                                            r"\['int', 'str'\]")),
    (ModelSpec, {"name": 3}, r"ModelSpec\.name=3: expected str, got int"),
    (ModelSpec, {"name": "m", "kind": 1}, r"ModelSpec\.kind=1: expected str, got int"),
    (ModelSpec, {"name": "m", "architecture": 3}, r"architecture=3: expected str \| None"),
    (SamplingParams, {"seed": 1.0}, r"SamplingParams\.seed=1\.0: expected int \| None"),
    (SamplingParams, {"top_p": None}, r"top_p=None: expected float, got NoneType"),
    (SamplingParams, {"ignore_eos": 1}, r"ignore_eos=1: expected bool, got int"),
    (SamplingParams, {"stop_token_ids": [7, "x"]}, (r"stop_token_ids=\[7, 'x'\]: token ids "
                                                   r"must be ints, got str 'x'")),
    (Workload, {"max_new_tokens": 512.0}, r"Workload\.max_new_tokens=512\.0: expected int"),
    (Workload, {"sampling": None}, r"Workload\.sampling=None: expected str"),
    (GRPOSettings, {"learning_rate": "5e-6"}, r"learning_rate='5e-6': expected float, got str"),
    (GRPOSettings, {"lora": {"rank": 4}}, r"GRPOSettings\.lora=\{'rank': 4\}: expected LoraSpec"),
    (GRPOSettings, {"gradient_checkpointing": "no"}, "gradient_checkpointing='no': expected bool"),
])
def test_wrong_types_raise_naming_field_expected_type_and_value(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_ints_are_fine_for_floats_and_integral_numbers_for_ints():
    import numpy as np

    assert LoraSpec(dropout=0, init_b_std=1).init_b_std == 1
    assert SamplingParams(temperature=1, top_p=1, seed=np.int64(3)).seed == 3
    assert GRPOSettings(learning_rate=1, beta=0).beta == 0
    assert Workload(n_prompts=np.int32(4)).n_prompts == 4
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == (1, 2)
    assert SamplingParams(temperature=np.float32(0.5)).temperature == 0.5
