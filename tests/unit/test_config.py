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
