"""The format warm-up with backend ``vllm``: the warmed weights, merged, as the folder vLLM loads.

vLLM does not run on the CPU, so the parts are checked on tiny-llama (fp32, two SFT steps): the
warm-up :func:`nbhelpers.grpo.trainer._maybe_warmup` runs for ``vllm`` writes
``<output_dir>/format_warmup/merged``, which transformers loads with the logits of the trainer's
warmed model (the merged base for ``warmup_adapter="merge"``, base + live adapter for
``"continue"``), the policy's ``name_or_path`` / ``config._name_or_path`` point at it, the report
names it, and the trainer's own model is untouched by the save. Before launch, vllm and unsloth
with a warm-up pass the runner's checks (a backend outside ``WARMUP_BACKENDS`` would be refused
there with the fix named); ``train`` refuses unsloth with ``warmup_adapter="continue"`` naming
``"merge"`` (the unsloth warm-up itself: tests/unit/test_warmup_unsloth.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.grpo import setup, sft_warmup, trainer
from nbhelpers.grpo.plans import BackendPlan
from nbhelpers.run.params import UserInputError
from nbhelpers.run.values import check_values

REPO = Path(__file__).resolve().parents[2]
NB20 = REPO / "notebooks" / "phase2_grpo" / "20_grpo_equivalence.ipynb"
TOL = 1e-5
"""fp32 logits of the saved folder vs the trainer's model in memory."""
SETTINGS = GRPOSettings(max_steps=1, max_completion_length=4, lora=LoraSpec(rank=4, alpha=8))


def _logits(model, ids):
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits.float()
    model.train(was_training)
    return out


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("adapter", ["continue", "merge"])
def test_vllm_warmup_folder_holds_the_trainers_weights(tmp_path, monkeypatch, adapter):
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    # fp32 on the CPU on any host: a GPU host would load the policy in bf16 on CUDA (plans.
    # load_policy), which neither the CPU ids below nor TOL fit (H200 suite of 2026-12-03)
    monkeypatch.setattr(setup, "is_cuda", lambda: False)
    model, tok, peft, ds, _ = trainer._load_inputs(BackendPlan("vllm"), "tiny-llama", SETTINGS,
                                                   "gsm8k", 4)
    unwarmed_folder = model.name_or_path
    ids = torch.tensor([tok("Natalia sold clips to 48 of her friends.")["input_ids"]])
    base = _logits(model, ids)

    seen = {}
    real_save = sft_warmup.save_merged_folder

    def spy(m, t, folder):  # the trainer's model right before and after the save
        seen["before"] = _snapshot(m)
        out = real_save(m, t, folder)
        seen["after"] = _snapshot(m)
        return out

    monkeypatch.setattr(sft_warmup, "save_merged_folder", spy)
    opts = {"format_warmup_steps": 2, "n_questions": 4, "output_dir": tmp_path,
            "warmup_adapter": adapter, "backend": "vllm"}
    model, peft, warm = trainer._maybe_warmup(model, tok, peft, SETTINGS, opts, ds)

    folder = (tmp_path / "format_warmup" / "merged").resolve()
    assert warm["steps"] == 2 and warm["vllm_model_folder"] == str(folder) != unwarmed_folder
    assert warm["model_folder"] == str(folder)
    assert model.name_or_path == str(folder) and model.config._name_or_path == str(folder)
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    warmed = _logits(model, ids)
    assert (_logits(saved, ids) - warmed).abs().max().item() < TOL
    assert (warmed - base).abs().max().item() > 100 * TOL, "the warm-up did not move the logits"
    assert AutoTokenizer.from_pretrained(folder).chat_template == tok.chat_template is not None

    assert seen["before"].keys() == seen["after"].keys()
    assert all(torch.equal(seen["before"][k], seen["after"][k]) for k in seen["before"])
    if adapter == "continue":  # GRPO keeps training the warm-up adapter, unmerged
        assert isinstance(model, PeftModel) and peft is None
        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        assert layers and not any(m.merged for m in layers)
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        assert lora and all(p.requires_grad for p in lora)
    else:  # the merged base, a fresh adapter for GRPO
        assert not isinstance(model, PeftModel) and isinstance(peft, LoraConfig)


def test_ranks_sharing_an_output_dir_get_their_own_folder(tmp_path, monkeypatch):
    from nbhelpers import data, models
    model, tok = models.load_model("tiny-llama", dtype="float32", seed=0)
    data.apply_reference_chat_template(tok)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    folder = trainer._warm_folder(model, tok, tmp_path)
    assert folder == (tmp_path / "merged_rank1").resolve() and (folder / "config.json").is_file()
    assert model.name_or_path == str(folder)
    with pytest.raises(TypeError, match="pass a transformers PreTrainedModel or a peft"):
        sft_warmup.save_merged_folder(torch.nn.Linear(2, 2), tok, tmp_path / "x")


def test_train_accepts_vllm_and_unsloth_merge_warmups_and_refuses_unsloth_continue():
    trainer._check_warmup(60, "merge", "vllm")
    trainer._check_warmup(60, "continue", "vllm")
    trainer._check_warmup(60, "merge", "unsloth")
    trainer._check_warmup(0, "continue", "unsloth")  # no warm-up: no adapter to continue
    with pytest.raises(ValueError, match=r"backend='unsloth' and warmup_adapter='continue'.*"
                                         r"loads its own model class.*pass "
                                         r"warmup_adapter='merge'.*or format_warmup_steps=0"):
        trainer._check_warmup(60, "continue", "unsloth")


@pytest.mark.parametrize("steps", [2.5, "2", True, -1, None])
def test_train_refuses_a_warmup_step_count_that_is_no_int_before_loading(steps, monkeypatch):
    """``train(format_warmup_steps=...)`` from Python (the runner's ``-p`` checks its own): a
    float used to load the model and fail ~20 s later inside transformers' Trainer, a str raised
    a bare TypeError, True ran one step (helper-19's trial, 2026-12-07)."""
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import train

    def loaded(*args, **kwargs):
        raise AssertionError("the policy loaded before the check")

    monkeypatch.setattr(trainer, "_load_inputs", loaded)
    with pytest.raises(ValueError, match=r"format_warmup_steps=.*: must be an int >= 0 .*"
                                         r"e\.g\. format_warmup_steps=60"):
        train("tiny-llama", GRPOSettings(max_steps=1, max_completion_length=8), backend="flex",
              format_warmup_steps=steps, output_dir="/tmp/never_written")


def test_runner_accepts_vllm_and_unsloth_with_a_warmup_before_launch(monkeypatch):
    from nbhelpers.grpo import plans
    sources = {"backends": "-p backends", "format_warmup_steps": "-p format_warmup_steps"}
    params = {"backends": ["vllm", "flex"], "format_warmup_steps": 60, "n_questions": 60,
              "model": "smollm2-135m-instruct"}
    check_values(params, sources, NB20, REPO)
    check_values(params | {"backends": ["vllm", "unsloth", "flex"]}, sources, NB20, REPO)
    check_values(params | {"backends": ["unsloth"], "format_warmup_steps": 0}, sources, NB20,
                 REPO)
    # a GRPO backend without the warm-up would still be refused before launch, the fix named
    monkeypatch.setattr(plans, "WARMUP_BACKENDS", ("hf_generate", "hf_cb", "flex", "vllm"))
    with pytest.raises(UserInputError, match=r"-p backends .*backends \['unsloth'\] with "
                       r"format_warmup_steps=60.*drop \['unsloth'\] \(-p backends "
                       r"'\[vllm, flex\]'\) or pass -p format_warmup_steps 0"):
        check_values(params | {"backends": ["vllm", "unsloth", "flex"]}, sources, NB20, REPO)


def test_notebook_20_plans_vllm_and_unsloth_with_a_warmup_from_the_command_line():
    """``-p backends '[vllm, flex]' -p format_warmup_steps 60`` (issue 13's row) is planned, and
    so is the issue's full list with unsloth."""
    from nbhelpers.run.params import parse_overrides, plan_parameters
    given = parse_overrides([("backends", "[vllm, flex]"), ("format_warmup_steps", "60"),
                             ("model", "smollm2-135m-instruct"), ("n_questions", "60")])
    ((_, params),) = plan_parameters([NB20], "cpu", given, REPO)
    assert params["backends"] == ["vllm", "flex"] and params["format_warmup_steps"] == 60
    every = ["hf_generate", "hf_cb", "unsloth", "vllm", "flex"]
    ((_, params),) = plan_parameters([NB20], "cpu", given | {"backends": every}, REPO)
    assert params["backends"] == every and params["format_warmup_steps"] == 60
