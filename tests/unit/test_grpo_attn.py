"""Issue 13 part 3 (CPU side): ``train(attn_implementation=...)``, phase 2's policy attention
(the hf_cb row on ``paged|flash_attention_4`` is the policy loaded with ``flash_attention_4``).

The word is checked and FlashAttention-4's needs (CUDA, flash-attn-4) are refused before any
model loads (the loader is stubbed to fail when called); the word reaches
``nbhelpers.models.load_model`` for every backend that loads through ``load_policy`` and the
default leaves that call as it was; the sidecar's ``grpo_config`` records the attention the
policy was loaded with and 29_compare keeps a non-default run apart; the runner refuses a bad
``-p attn_implementation`` in one line before launch. CUDA and flash-attn-4 are stubbed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prelaunch import refused

from nbhelpers import models
from nbhelpers.backends.base import BackendNotInstalled
from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import distributed, plans, scaling, setup, trainer
from nbhelpers.run import host_checks
from nbhelpers.run.runner import plan_jobs
from nbhelpers.shims import flash_attn4

REPO = Path(__file__).resolve().parents[2]
N20 = "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"
SETTINGS = GRPOSettings(max_steps=1, num_generations=2, per_device_train_batch_size=2,
                        max_completion_length=4)
WORDS = "use one of ('auto', 'sdpa', 'eager', 'flash_attention_4')"


class Loaded(Exception):
    """Raised by the stub loader once it has recorded what it was given."""


@pytest.fixture
def load_calls(monkeypatch):
    """``models.load_model`` records its keywords and stops the run (nothing is loaded)."""
    calls = []

    def stub(name, **kwargs):
        calls.append(kwargs)
        raise Loaded(name)

    monkeypatch.setattr(models, "load_model", stub)
    return calls


def _train(tmp_path, **kwargs):
    return trainer.train("tiny-llama", SETTINGS, output_dir=tmp_path, n_questions=2,
                         progress=False, skip_first=0, **kwargs)


@pytest.mark.parametrize("word", ["flash", "FLASH_ATTENTION_4", "paged|sdpa",
                                  "flash_attention_2", "", 4])
def test_an_unknown_word_is_refused_before_any_load(load_calls, tmp_path, word):
    with pytest.raises(ValueError, match=re.escape(f"attn_implementation={word!r}: {WORDS}")):
        _train(tmp_path, attn_implementation=word)
    assert load_calls == [] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("backend", ["hf_generate", "hf_cb", "flex", "vllm"])
def test_fa4_without_flash_attn_4_names_the_fa4_extra_before_any_load(
        load_calls, monkeypatch, tmp_path, backend):
    monkeypatch.setattr(flash_attn4, "fa4_installed", lambda: False)
    with pytest.raises(BackendNotInstalled) as err:
        _train(tmp_path, backend=backend, attn_implementation="flash_attention_4")
    assert str(err.value) == (f"backend '{backend} (flash_attention_4)' needs its engine: "
                              "pip install -e '.[fa4]'")
    assert load_calls == [] and not list(tmp_path.iterdir())


def test_fa4_on_this_cpu_host_is_refused_before_any_load(load_calls, tmp_path):
    """The real host check, no stub: this test host has neither CUDA nor flash-attn-4."""
    if flash_attn4.fa4_installed() and torch.cuda.is_available():
        pytest.skip("this host can run flash_attention_4")
    with pytest.raises((BackendNotInstalled, ValueError), match="fa4|CUDA"):
        _train(tmp_path, backend="hf_cb", attn_implementation="flash_attention_4")
    assert load_calls == []


def test_fa4_installed_without_cuda_is_refused_before_any_load(load_calls, monkeypatch,
                                                                tmp_path):
    monkeypatch.setattr(flash_attn4, "fa4_installed", lambda: True)
    monkeypatch.setattr(setup, "is_cuda", lambda: False)
    monkeypatch.setattr(flash_attn4, "apply", lambda: pytest.fail("registered FA4 on the CPU"))
    with pytest.raises(ValueError, match="FlashAttention-4 has CUDA kernels only .* use 'sdpa'"):
        _train(tmp_path, backend="hf_cb", attn_implementation="flash_attention_4")
    assert load_calls == []


def test_fa4_with_cuda_and_flash_attn_4_reaches_the_load(load_calls, monkeypatch, tmp_path):
    """hf_cb + flash_attention_4 on a (stubbed) CUDA host with FA4: the shim's apply() runs in
    the loading process and the policy is loaded with flash_attention_4 in bf16 on cuda."""
    applied = []
    monkeypatch.setattr(flash_attn4, "fa4_installed", lambda: True)
    monkeypatch.setattr(flash_attn4, "apply", lambda: applied.append(1) or False)
    monkeypatch.setattr(setup, "is_cuda", lambda: True)
    with pytest.raises(Loaded):
        _train(tmp_path, backend="hf_cb", attn_implementation="flash_attention_4")
    assert load_calls == [{"dtype": "bfloat16", "device": "cuda", "seed": SETTINGS.seed,
                           "attn_implementation": "flash_attention_4"}]
    assert applied  # checked in train() and again where the policy loads (_train_local)


def test_fa4_is_refused_before_a_multi_process_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(flash_attn4, "fa4_installed", lambda: False)
    monkeypatch.setattr(distributed, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(BackendNotInstalled, match=r"\.\[fa4\]"):
        _train(tmp_path, backend="flex", num_processes=2, attn_implementation="flash_attention_4")


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash_attention_4"])
def test_unsloth_refuses_an_attention_it_cannot_honour(load_calls, tmp_path, attn):
    with pytest.raises(ValueError, match=(rf"attn_implementation='{attn}' with "
                                          r"backend='unsloth': .* applies to backends \('hf_"
                                          r"generate', 'hf_cb', 'flex', 'vllm'\); pass 'auto'")):
        _train(tmp_path, backend="unsloth", attn_implementation=attn)
    assert load_calls == []
    assert plans.check_attn_implementation("auto", "unsloth") is None
    with pytest.raises(ValueError, match="backend 'unsloth' picks its own attention"):
        plans.load_policy("unsloth", "tiny-llama", SETTINGS, False, attn_implementation=attn)


@pytest.mark.parametrize("backend", ["hf_generate", "hf_cb", "flex"])
@pytest.mark.parametrize("attn,loaded", [(None, None), ("auto", None), ("sdpa", "sdpa"),
                                         ("eager", "eager")])
def test_train_passes_the_attention_to_models_load(load_calls, tmp_path, backend, attn,
                                                   loaded):
    with pytest.raises(Loaded):
        _train(tmp_path, backend=backend, attn_implementation=attn)
    on_gpu = setup.is_cuda()  # the policy loads in bf16 on a CUDA host (load_policy)
    assert load_calls == [{"dtype": "bfloat16" if on_gpu else "float32",
                           "device": "cuda" if on_gpu else "cpu", "seed": SETTINGS.seed,
                           "attn_implementation": loaded}]


def _policy_stub(monkeypatch):
    seen = []
    policy = SimpleNamespace(name_or_path="m", config=SimpleNamespace(_name_or_path="m"))
    monkeypatch.setattr(models, "load_model", lambda name, **kw: seen.append(kw) or (policy, None))
    monkeypatch.setattr(models, "model_folder", lambda *a, **k: "/weights")
    return seen


@pytest.mark.parametrize("backend", plans.ATTN_BACKENDS)
def test_load_policy_default_leaves_the_load_call_as_it_was(monkeypatch, backend):
    """Without the keyword: the keywords load_policy gave load_model before it existed, with
    attn_implementation None (load_model's own default: transformers picks)."""
    seen = _policy_stub(monkeypatch)
    plans.load_policy(backend, "tiny-llama", SETTINGS, False)
    plans.load_policy(backend, "tiny-llama", SETTINGS, False, attn_implementation="eager")
    assert seen == [{"dtype": "float32", "device": "cpu", "seed": SETTINGS.seed,
                     "attn_implementation": None},
                    {"dtype": "float32", "device": "cpu", "seed": SETTINGS.seed,
                     "attn_implementation": "eager"}]


@pytest.mark.parametrize("backend,says", [("hf_generate", "hf_generate generates with it too"),
                                          ("hf_cb", "generates with paged|eager"),
                                          ("flex", "flex generates with its own engine")])
def test_the_plan_notes_what_generates_with_it(backend, says):
    notes = plans.plan_backend(backend, GRPOSettings(), attn_implementation="eager").notes
    assert any(n.startswith("attn_implementation='eager': the trainer model's") and says in n
               for n in notes), notes
    assert not any("attn_implementation" in n for n in plans.plan_backend(backend,
                                                                          GRPOSettings()).notes)


def test_rank_args_carry_attn_implementation(tmp_path):
    """The distributed path: train()'s keyword reaches every rank's opts (not GRPOConfig)."""
    opts, overrides = scaling._train_opts(backend="hf_cb", output_dir=tmp_path,
                                          attn_implementation="eager")
    args = json.loads(json.dumps(distributed.rank_args("tiny-llama", GRPOSettings(), opts,
                                                       overrides)))
    assert args["opts"]["attn_implementation"] == "eager"
    assert "attn_implementation" not in args["config_overrides"]
    default, _ = scaling._train_opts(backend="hf_cb", output_dir=tmp_path)
    assert default["attn_implementation"] is None


def test_a_real_run_records_the_attention_it_loaded(tmp_path):
    """One GRPO step of tiny-llama on the CPU with eager attention: the result's config (the
    sidecar's grpo_config) records it and the note says hf_generate generates with it."""
    torch.set_num_threads(1)
    res = _train(tmp_path, backend="hf_generate", attn_implementation="eager")
    assert res.config["attn_implementation"] == "eager"
    assert any("hf_generate generates with it too (eager)" in n for n in res.config["notes"])
    assert len(res.records) == 1


def _side(run_id, attn=None, backend="hf_cb"):
    config = {} if attn is None else {"attn_implementation": attn}
    return {"phase": "phase2", "backend": backend, "run_id": f"{run_id}_{backend}",
            "grpo_steps": [], "grpo_summary": {"step_time_s_median": 1.0},
            "grpo_config": config, "model": {"name": "tiny-llama"}, "env": {"gpu": "NVIDIA H200"}}


def test_29_keeps_a_non_default_attention_run_apart():
    """An older sidecar (no attn recorded) and an sdpa one are hf_cb; the FA4 run is its own row
    of the same (device, model, shape) group, so neither hides the other as "newest hf_cb"."""
    from nbhelpers.grpo import compare as grpo_compare
    from nbhelpers.grpo.compare_sidecars import backend_label
    runs, _ = grpo_compare.runs_from_sidecars([
        _side("20261201T000000Z"), _side("20261202T000000Z", "sdpa"),
        _side("20261203T000000Z", "flash_attention_4"),
        _side("20261203T000000Z", "sdpa", backend="vllm")])
    assert sorted(runs) == ["hf_cb (flash_attention_4)@20261203T000000Z",
                            "hf_cb@20261201T000000Z", "hf_cb@20261202T000000Z",
                            "vllm@20261203T000000Z"]
    latest = grpo_compare.latest_per_backend(runs)  # one group: the attention is no shape field
    assert sorted(latest) == ["hf_cb", "hf_cb (flash_attention_4)", "vllm"]
    assert latest["hf_cb"]["run_id"] == "20261202T000000Z"
    assert grpo_compare.vllm_ratio(latest)["hf_cb (flash_attention_4)"] == 1.0
    assert backend_label("flex", {"attn_implementation": "eager"}) == "flex (eager)"
    assert backend_label("flex", None) == "flex"


# ------------------------------------------------ the runner's -p check, before launch
def test_the_runner_refuses_an_unknown_word(tmp_path):
    refused(N20, {"attn_implementation": "flash"},
            "-p attn_implementation (20_grpo_equivalence.ipynb): attn_implementation='flash': "
            f"{WORDS}.", tmp_path, exact=True)
    refused(N20, {"attn_implementation": 4},
            "-p attn_implementation (20_grpo_equivalence.ipynb): parameter "
            "'attn_implementation' expects str, got 4 (int).", tmp_path, exact=True)


def test_the_runner_refuses_fa4_on_a_cpu_host(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: False)
    refused(N20, {"attn_implementation": "flash_attention_4"},
            "-p attn_implementation (20_grpo_equivalence.ipynb): "
            "attn_implementation='flash_attention_4' needs a CUDA GPU (FlashAttention-4 "
            "kernels) and torch sees none on this host: use -p attn_implementation auto (or "
            "sdpa), or run on a CUDA host with --profile h200.", tmp_path, exact=True)


def test_the_runner_refuses_fa4_without_flash_attn_4(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: True)
    monkeypatch.setattr(flash_attn4, "fa4_installed", lambda: False)
    msg = refused(N20, {"attn_implementation": "flash_attention_4"},
                  "attn_implementation='flash_attention_4' needs flash-attn-4, not importable "
                  "here: stage the fa4 bundle", tmp_path)
    assert "pip install -e '.[fa4]'" in msg and "-p attn_implementation auto" in msg


def test_the_runner_refuses_unsloth_with_a_non_auto_attention(tmp_path):
    refused(N20, {"backends": ["hf_cb", "unsloth"], "attn_implementation": "sdpa"},
            "-p backends (20_grpo_equivalence.ipynb), -p attn_implementation "
            "(20_grpo_equivalence.ipynb): backends ['unsloth'] with attn_implementation='sdpa': "
            "['unsloth'] load their own model class and attention; drop ['unsloth'] (-p "
            "backends '[hf_cb]') or pass -p attn_implementation auto.", tmp_path, exact=True)


def test_the_runner_passes_a_good_word_on(monkeypatch, tmp_path):
    monkeypatch.setattr(host_checks, "cuda_available", lambda: True)
    monkeypatch.setattr(flash_attn4, "fa4_installed", lambda: True)
    for attn in ("auto", "sdpa", "eager", "flash_attention_4"):
        (job,) = plan_jobs(N20, "cpu", {"backends": ["hf_cb"], "attn_implementation": attn},
                           None, tmp_path / "executed", REPO)
        assert job.parameters["attn_implementation"] == attn
    (job,) = plan_jobs(N20, "cpu", {"backends": ["unsloth"], "attn_implementation": "auto"},
                       None, tmp_path / "executed", REPO)
    assert job.parameters["backends"] == ["unsloth"]
