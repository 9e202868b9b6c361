"""The format warm-up with backend ``unsloth``: warmed on the plain HF policy, Unsloth loads the folder.

Unsloth is not installed on the CPU hosts, so :func:`nbhelpers.grpo.plans._load_unsloth` is
replaced by a fake that records the folder it is given and loads it with transformers. On
tiny-llama (fp32, two SFT steps, ``warmup_adapter="merge"``) the load path of
:func:`nbhelpers.grpo.trainer._load_warmed` warms the HF policy, saves it merged to
``<output_dir>/format_warmup/merged`` and hands that folder to the Unsloth loader; the folder's
logits are the warmed model's (within :data:`TOL`) and not the base's, and the report names the
folder. ``warmup_adapter="continue"`` with unsloth is refused before anything loads, naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from test_warmup_vllm_folder import SETTINGS, TOL, _logits

from nbhelpers import data, models
from nbhelpers.grpo import plans, setup, sft_warmup, trainer
from nbhelpers.grpo.plans import BackendPlan

TEXT = "Natalia sold clips to 48 of her friends."


def test_unsloth_warmup_loads_unsloth_from_the_merged_folder(tmp_path, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    monkeypatch.setattr(setup, "is_cuda", lambda: False)  # fp32 on the CPU on any host
    base, tok = models.load_model("tiny-llama", dtype="float32", seed=SETTINGS.seed)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    base_logits = _logits(base, ids)

    seen = {}
    real_save = sft_warmup.save_merged_folder

    def spy_save(m, t, folder):  # the warmed HF policy, right before it is saved and freed
        seen["warmed"] = _logits(m, ids)
        return real_save(m, t, folder)

    def fake_unsloth(model_name, settings, on_gpu, folder=None):
        seen["unsloth"] = (model_name, on_gpu, folder)
        return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                AutoTokenizer.from_pretrained(folder), None)

    monkeypatch.setattr(sft_warmup, "save_merged_folder", spy_save)
    monkeypatch.setattr(plans, "_load_unsloth", fake_unsloth)
    opts = {"format_warmup_steps": 2, "n_questions": 4, "output_dir": tmp_path,
            "warmup_adapter": "merge", "backend": "unsloth", "dataset": "gsm8k"}
    with caplog.at_level("INFO", logger=trainer.__name__):
        model, tok2, peft, ds, _, warm = trainer._load_warmed(BackendPlan("unsloth"),
                                                              "tiny-llama", SETTINGS, opts, None)

    folder = (tmp_path / "format_warmup" / "merged").resolve()
    assert seen["unsloth"] == ("tiny-llama", False, str(folder))
    assert warm["steps"] == 2 and warm["model_folder"] == str(folder)
    assert warm["vllm_model_folder"] is None and peft is None and len(ds) > 0
    assert "warmed HF policy freed in" in caplog.text
    loaded = _logits(model, ids)
    assert (loaded - seen["warmed"]).abs().max().item() < TOL
    assert (loaded - base_logits).abs().max().item() > 1e-3, "the warm-up did not move the logits"
    assert tok2.chat_template == data.apply_reference_chat_template(tok).chat_template


def test_unsloth_continue_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import train

    def no_load(*args, **kwargs):
        pytest.fail("loaded before refusing")

    monkeypatch.setattr(trainer, "_load_inputs", no_load)
    monkeypatch.setattr(trainer, "plan_backend", no_load)
    with pytest.raises(ValueError, match=r"warmup_adapter='continue'.*pass "
                                         r"warmup_adapter='merge'"):
        train("tiny-llama", GRPOSettings(max_steps=1), backend="unsloth", output_dir=tmp_path,
              format_warmup_steps=2, warmup_adapter="continue")


def test_load_policy_takes_a_folder_for_unsloth_only(tmp_path):
    with pytest.raises(ValueError, match=r"only 'unsloth' loads its policy from a folder; pass "
                                         r"folder=None"):
        plans.load_policy("hf_generate", "tiny-llama", SETTINGS, False, folder=tmp_path)
