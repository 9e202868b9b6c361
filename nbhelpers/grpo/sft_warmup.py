"""Format warm-up: the reference notebook's short SFT "pre fine-tune for formatting", offline.

Unsloth's ``Qwen3_(4B)-GRPO.ipynb`` (unslothai/notebooks, nb/Qwen3_(4B)-GRPO.ipynb, section
"Pre fine-tuning for formatting") wraps the base model in LoRA (``get_peft_model``), then trains
*that same adapter* with TRL's ``SFTTrainer`` on ``unsloth/OpenMathReasoning-mini`` rows rendered
as ``<start_working_out>{thoughts}<end_working_out><SOLUTION>{answer}</SOLUTION>`` in its chat
template, and only then hands the model to ``GRPOTrainer``. Its ``SFTConfig``: batch 1, no
accumulation, ``warmup_steps=5``, ``learning_rate=2e-4``, linear schedule, ``weight_decay=0.001``,
``adamw_8bit`` (``adamw_torch`` here: bitsandbytes is GPU-only), seed 3407, 2 epochs.
Here the rows are real GSM8K worked solutions (:func:`nbhelpers.data.load_gsm8k`, ``solution``
key) and the run is capped at ``steps`` optimiser steps. The SFT questions are the *last*
:data:`N_SFT_ROWS` of the 100 (file order 60..99); GRPO draws the first ``n_questions``, so the
two sets are disjoint while ``n_questions <= 60`` (:func:`sft_rows` raises otherwise).
:func:`save_merged_folder` writes the warmed weights (adapter merged into the base) as an HF folder
for engines that load weights from a path at start (vLLM colocate).

Run: ``python -c "from nbhelpers.grpo.sft_warmup import sft_rows; print(sft_rows(8)[0])"``.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

from nbhelpers import data

N_SFT_ROWS = 40
"""GSM8K questions kept for the warm-up (the last 40 of the 100 shipped test questions)."""
N_GSM8K = data.N_GSM8K
SFT_LEARNING_RATE = 2e-4
"""The reference notebook's ``SFTConfig(learning_rate=2e-4)``."""


def sft_rows(n_grpo_questions: int) -> list[dict[str, Any]]:
    """The warm-up's chat rows ``{"messages": [system, user, assistant], "id"}``.

    The assistant turn is ``<start_working_out>{worked solution}<end_working_out>
    <SOLUTION>{N}</SOLUTION>`` (no newline between; the reference's ``format_dataset``).

    Raises:
        ValueError: ``n_grpo_questions`` > ``100 - N_SFT_ROWS`` (the sets would overlap; lower
            ``n_questions`` or set ``format_warmup_steps=0``).
    """
    if n_grpo_questions > N_GSM8K - N_SFT_ROWS:
        raise ValueError(f"n_questions={n_grpo_questions} overlaps the format warm-up's GSM8K "
                         f"questions (last {N_SFT_ROWS} of {N_GSM8K}): use n_questions <= "
                         f"{N_GSM8K - N_SFT_ROWS} or format_warmup_steps=0.")
    rows = data.load_gsm8k()[N_GSM8K - N_SFT_ROWS:]
    out = []
    for row in rows:
        target = (data.REASONING_START + row["solution"] + data.REASONING_END
                  + data.SOLUTION_START + row["answer"] + data.SOLUTION_END)
        out.append({"id": row["id"], "messages": [
            {"role": "system", "content": data.SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": target}]})
    return out


def sample_completion(model, tokenizer, question: str, max_new_tokens: int = 96) -> str:
    """One greedy completion of ``question`` in the reference prompt (text after the prompt)."""
    import torch
    ids = data.chat_ids(tokenizer, [{"role": "system", "content": data.SYSTEM_PROMPT},
                                    {"role": "user", "content": question}])
    device = next(model.parameters()).device
    inputs = torch.tensor([ids], device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    model.train(was_training)
    return data.REASONING_START + tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def format_warmup(model, tokenizer, rows: list[dict[str, Any]], steps: int, *,
                  output_dir: str, seed: int = 3407, learning_rate: float = SFT_LEARNING_RATE,
                  probe_question: str | None = None, max_seq_length: int = 512,
                  max_new_tokens: int = 96) -> dict[str, Any]:
    """Train the PEFT ``model``'s LoRA adapter in place for ``steps`` SFT steps on ``rows``.

    ``model`` must already be a ``peft.PeftModel`` (the adapter GRPO trains next); the
    tokenizer must carry the reference chat template. One row per step (batch 1, as the
    reference), rows cycled if ``steps > len(rows)``; sequences cut at ``max_seq_length`` tokens.

    Returns:
        ``{"steps", "wall_s", "losses" (per logged step), "before", "after"}``: ``before``/
        ``after`` are greedy completions of ``probe_question`` (``None`` when not given).
    Raises:
        ValueError: ``steps < 1`` or no rows.
        TypeError: ``model`` is not a ``peft.PeftModel``.
    """
    from datasets import Dataset
    from peft import PeftModel
    from trl import SFTTrainer

    from nbhelpers.shims import trl_fused_logprob_cpu
    trl_fused_logprob_cpu.install()  # SFTTrainer's loss uses TRL's Triton log-prob kernel too

    if steps < 1 or not rows:
        raise ValueError(f"format_warmup(steps={steps}, {len(rows)} rows): need steps >= 1 and "
                         "rows (nbhelpers.grpo.sft_warmup.sft_rows).")
    if not isinstance(model, PeftModel):
        raise TypeError("format_warmup needs a peft.PeftModel (get_peft_model(model, "
                        "nbhelpers.grpo.setup.peft_config(lora))) so GRPO continues the same adapter.")

    def probe() -> str | None:
        if probe_question is None:
            return None
        return sample_completion(model, tokenizer, probe_question, max_new_tokens)

    before = probe()
    text = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    trainer = SFTTrainer(model=model, processing_class=tokenizer,
                         args=_sft_config(model, output_dir, steps, seed, learning_rate,
                                          max_seq_length),
                         train_dataset=Dataset.from_dict({"text": text}))
    t0 = time.perf_counter()
    trainer.train()
    wall_s = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"steps": steps, "wall_s": wall_s, "losses": losses, "before": before,
            "after": probe()}


def save_merged_folder(model, tokenizer, folder: str | os.PathLike) -> Path:
    """Write ``model``'s weights, any LoRA adapter merged in, and ``tokenizer`` as an HF folder.

    ``model``: a ``peft.PeftModel`` (its active adapter is merged into a *copy*,
    ``copy.deepcopy`` + ``merge_and_unload``, so the caller's model keeps its unmerged, trainable
    adapter and its tensors; peak memory: one more copy of the model on its device while
    saving) or a plain ``transformers.PreTrainedModel`` (saved as it is). The folder gets
    ``save_pretrained`` of that model (``config.json``, safetensors in the model's dtype,
    generation config) and of the tokenizer, chat template included; files already there are
    overwritten. An engine started from the folder (``vllm.LLM(model=folder)``) holds the
    weights the trainer holds.

    Returns:
        The folder, absolute.
    Raises:
        TypeError: ``model`` has no ``save_pretrained`` (not a transformers / PEFT model).
    """
    from peft import PeftModel
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_merged_folder: {type(model).__name__} has no save_pretrained; pass "
                        "a transformers PreTrainedModel or a peft.PeftModel.")
    folder = Path(folder).resolve()
    merged = copy.deepcopy(model).merge_and_unload() if isinstance(model, PeftModel) else model
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _sft_config(model, output_dir: str, steps: int, seed: int, learning_rate: float,
                max_seq_length: int):
    """TRL ``SFTConfig`` of the warm-up: batch 1, linear schedule, up to 5 warm-up steps."""
    from trl import SFTConfig
    return SFTConfig(output_dir=output_dir, dataset_text_field="text", max_steps=steps,
                     per_device_train_batch_size=1, gradient_accumulation_steps=1,
                     warmup_steps=min(5, max(steps - 1, 0)), learning_rate=learning_rate,
                     lr_scheduler_type="linear", weight_decay=0.001, optim="adamw_torch",
                     seed=seed, logging_steps=1, gradient_checkpointing=False,
                     report_to="none", save_strategy="no", max_length=max_seq_length,
                     packing=False, disable_tqdm=True, use_cpu=not _on_gpu(model),
                     bf16=_on_gpu(model))


def _on_gpu(model) -> bool:
    return next(model.parameters()).device.type == "cuda"
