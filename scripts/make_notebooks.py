"""Generate the lab's notebooks with nbformat (output-stripped), so they stay reproducible.

Run: ``python scripts/make_notebooks.py`` (rewrites every notebook in ``NOTEBOOKS``; ``--check``
only reports the ones out of sync). Layout and writing: ``scripts/nbgen.py``.
The notebook is the report; logic lives in ``nbhelpers`` (DESIGN.md rule 1). Edit here, not in
the .ipynb.
"""

from __future__ import annotations

import nbformat
import nbgen

PHASE0_TITLE = """# Phase 0: the reference GRPO run (TRL GRPOTrainer + LoRA, HF `generate`)

**Question:** how long does one GRPO step of the reference setup take on this machine, how much
memory does it hold, and does training run (finite losses, rewards logged per function)?

**Result:** computed from this run in the last cell (median step time, peak memory, reward, the
published reference beside them).

The setup is the public Unsloth `Qwen3_(4B)-GRPO.ipynb` notebook's: its system prompt and format
tags, its four reward functions, LoRA r=32 / alpha=64 on all 7 projections, lr 5e-6, linear
schedule, warm-up ratio 0.1, `num_generations=4`, sampling `min_p=0.1, top_p=1.0, top_k=-1`, seed
3407 (values and source in `nbhelpers/config.py`). The rollout engine here is TRL's naive
`model.generate` path (`hf_generate`); later phases swap it. On the CPU default the model is
SmolLM2-135M-Instruct (real weights) answering real GSM8K test questions. As the reference does
("pre fine-tune for formatting"), a short SFT warm-up (`format_warmup_steps`, TRL `SFTTrainer`)
first teaches the LoRA adapter the answer format on 40 other GSM8K questions' worked solutions;
GRPO then continues that adapter (`nbhelpers/grpo/sft_warmup.py`)."""

IMPORTS = """%load_ext autoreload
%autoreload 2
%matplotlib inline
import math
import tempfile
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from nbhelpers import plots
from nbhelpers.grpo import phase0_report as report
from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.grpo import train
from nbhelpers.models import describe
from nbhelpers.stats import gpu_name, write_sidecar"""

PARAMETERS = """\
model: str = "smollm2-135m-instruct"  # nbhelpers.models.list_models() name, hub id, folder
dataset: str = "gsm8k"  # gsm8k | gsm_symbolic | dapo_math
n_questions: int = 32  # questions drawn for the prompts
max_steps: int = 10  # GRPO optimiser steps
num_generations: int = 4  # completions per prompt (TRL num_generations)
per_device_train_batch_size: int = 4  # completions per step (raised to fit num_generations)
max_prompt_length: int = 256  # prompts longer than this many tokens are dropped
max_completion_length: int = 128  # max_new_tokens per completion
learning_rate: float = 5e-6  # reference lr
beta: float = 0.04  # KL coefficient; TRL 1.15 computes and logs KL only when beta > 0
lora_rank: int = 32  # LoRA r
lora_alpha: int = 64  # LoRA alpha (reference: 2 * r)
seed: int = 3407  # reference seed
skip_first: int = 3  # warm-up steps left out of the medians
format_warmup_steps: int = 60  # SFT steps on the answer format before GRPO (0: none)
output_dir: str = ""  # trainer scratch folder; empty: a fresh temporary folder
sidecar_path: str = ""  # JSON sidecar to write; empty: none (the runner sets it)"""

DERIVED = """settings = GRPOSettings(
    max_steps=max_steps, num_generations=num_generations,
    per_device_train_batch_size=per_device_train_batch_size,
    max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
    learning_rate=learning_rate, beta=beta, seed=seed,
    lora=LoraSpec(rank=lora_rank, alpha=lora_alpha))
run_dir = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="phase0_grpo_"))
device = gpu_name()
model_info = describe(model)
pd.set_option("display.max_colwidth", 300)
print(device, model_info)
settings"""

TRAIN = """# progress=False: each step prints its logged values as a line, which the runner's terminal
# shows as it comes; TRL's progress bar in a kernel is an HTML table that only the notebook shows
result = train(model, settings, backend="hf_generate", dataset=dataset,
               n_questions=n_questions, output_dir=run_dir, progress=False,
               skip_first=skip_first, format_warmup_steps=format_warmup_steps)
print(f"{len(result.records)} steps in {result.wall_s:.1f} s")
result.dataset_stats"""

WARMUP = """warm = result.format_warmup
if warm:
    print(f"{warm['steps']} SFT steps in {warm['wall_s']:.1f} s; loss first/last "
          f"{warm['losses'][0]:.3f} / {warm['losses'][-1]:.3f}")
    display(pd.DataFrame({"greedy completion": [warm["before"], warm["after"]]},
                         index=["before warm-up", "after warm-up"]))
else:
    print("format_warmup_steps=0: GRPO started from the untrained LoRA adapter")"""

COMPLETIONS = """completions = report.completions_table(result)
display(completions.groupby("step").head(2))  # two completions of every step
completions.drop(columns=["question", "completion", "answer"]).groupby("step").mean()"""

STEPS = """steps = plots.steps_frame(result.records, "hf_generate")
steps"""

PLOTS = """plots.grpo_panel(steps, plots.rewards_frame(result.records, "hf_generate"))"""

REFERENCE = """\
The reference numbers are published, not measured here: the canonical notebook with vLLM
colocated on a B200 (Unsloth PR #5108, `scripts/benchmarks/results/notebook_ref_10.md`, quoted
in `research/anchors.md`). Different model size, engine and device: read them as context, not as a
like-for-like comparison. Peak memory in GB (1e9 bytes) as published; vLLM's figure is mostly
its KV-cache reservation."""

REFERENCE_CODE = """summary = pd.Series(result.summary)
display(summary.to_frame("post-warm-up"))
report.reference_table(result, device)"""

SIDECAR = """side = report.phase0_sidecar(result, settings, model_info, skip_first)
if sidecar_path:
    print("sidecar:", write_sidecar(side, sidecar_path))
assert len(result.records) == max_steps, f"{len(result.records)} steps ran, expected {max_steps}"
assert report.losses_finite(result), "a step logged no loss or a non-finite loss"
assert all(r["wall_s"] > 0 for r in result.records), "a step has no wall time"
assert len(completions) > 0 and completions["total"].notna().all(), "no scored completions"
display(Markdown(report.result_line(result, device)))"""


def phase0() -> nbformat.NotebookNode:
    """The phase 0 reference GRPO notebook."""
    return nbgen.build(PHASE0_TITLE, IMPORTS, PARAMETERS, [
        ("Derived values: the settings object every later cell uses.", DERIVED),
        (("## Run GRPO\nEach SFT warm-up step, then each GRPO step, prints one line: TRL's logged "
          "values for that step (loss, rewards, KL, ...), as it happens."), TRAIN),
        (("## Format warm-up (SFT before GRPO)\nOne greedy completion of the first GRPO question "
          "before and after the SFT warm-up on the reference format (GSM8K worked solutions of "
          "questions 60-99, disjoint from GRPO's first `n_questions`)."), WARMUP),
        (("## Completions and their rewards\nReal completions of the policy, with the score each "
          "reward function gave them (`total` = their sum, TRL's reward)."), COMPLETIONS),
        (("## Per-step statistics\n`wall_s`: seconds per optimiser step (generation + training); "
          "`peak_mem_*_gib`: GiB (GPU: allocated / in use on the card; CPU: peak RSS)."), STEPS),
        ("## Plots\nStep time, rewards per function, KL and loss per step.", PLOTS),
        ("## Beside the reference\n" + REFERENCE, REFERENCE_CODE)],
        sidecar=(nbgen.SIDECAR_MD, SIDECAR))


NOTEBOOKS = {"notebooks/phase0_reference/00_reference_grpo.ipynb": phase0}


if __name__ == "__main__":
    raise SystemExit(nbgen.main(NOTEBOOKS))
