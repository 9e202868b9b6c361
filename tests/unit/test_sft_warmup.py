"""nbhelpers.grpo.sft_warmup: the SFT format warm-up before GRPO (tiny-llama, CPU, a few steps)."""

import pytest

from nbhelpers import data
from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.grpo import sft_warmup


def test_worked_solution_drops_annotations_and_final_line():
    text = "She eats 3 + 4 = <<3+4=7>>7 eggs.\nShe sells 16 - 7 = <<16-7=9>>9.\n#### 9\n"
    assert data.worked_solution(text) == "She eats 3 + 4 = 7 eggs.\nShe sells 16 - 7 = 9."
    with pytest.raises(ValueError, match="####"):
        data.worked_solution("no final answer")


def test_sft_rows_are_reference_format_and_disjoint_from_grpo_prompts():
    rows = sft_warmup.sft_rows(60)
    grpo_ids = {r["id"] for r in data.load_gsm8k(60)}
    assert len(rows) == sft_warmup.N_SFT_ROWS and not grpo_ids & {r["id"] for r in rows}
    system, user, assistant = rows[0]["messages"]
    assert system["content"] == data.SYSTEM_PROMPT and user["role"] == "user"
    answer = data.load_gsm8k()[60]["answer"]
    assert assistant["content"].startswith(data.REASONING_START)
    assert assistant["content"].endswith(
        f"{data.REASONING_END}{data.SOLUTION_START}{answer}{data.SOLUTION_END}")
    assert "<<" not in assistant["content"] and "####" not in assistant["content"]


def test_sft_rows_refuse_overlap_with_grpo_questions():
    with pytest.raises(ValueError, match="n_questions <= 60"):
        sft_warmup.sft_rows(61)


def _lora(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def test_format_warmup_changes_lora_and_keeps_it_trainable(tmp_path):
    from peft import get_peft_model

    from nbhelpers import models
    from nbhelpers.grpo.setup import peft_config
    model, tok = models.load_model("tiny-llama", dtype="float32", seed=0)
    data.apply_reference_chat_template(tok)
    with pytest.raises(TypeError, match="PeftModel"):
        sft_warmup.format_warmup(model, tok, sft_warmup.sft_rows(8), 2, output_dir=str(tmp_path))
    model = get_peft_model(model, peft_config(LoraSpec(rank=4, alpha=8)))
    before = _lora(model)
    report = sft_warmup.format_warmup(model, tok, sft_warmup.sft_rows(8), 2,
                                      output_dir=str(tmp_path), probe_question="1 + 1?",
                                      max_new_tokens=4, max_seq_length=128)
    after = _lora(model)
    assert report["steps"] == 2 and len(report["losses"]) == 2 and report["wall_s"] > 0
    assert report["before"].startswith(data.REASONING_START) and report["after"] is not None
    assert any(not (before[k] == after[k]).all() for k in before), "LoRA weights did not move"
    assert all(p.requires_grad for k, p in model.named_parameters() if "lora_" in k)


def test_grpo_continues_the_warmed_up_adapter(tmp_path):
    from nbhelpers.grpo import train
    settings = GRPOSettings(max_steps=1, max_completion_length=8, num_generations=2,
                            per_device_train_batch_size=2, lora=LoraSpec(rank=4, alpha=8))
    result = train("tiny-llama", settings, n_questions=4, output_dir=tmp_path, progress=False,
                   skip_first=0, format_warmup_steps=2)
    assert result.format_warmup["steps"] == 2 and len(result.format_warmup["losses"]) == 2
    assert len(result.records) == 1 and result.records[0]["loss"] is not None
    assert result.sidecar_extra()["format_warmup"]["steps"] == 2
