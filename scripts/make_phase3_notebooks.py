"""Generate the phase 3 flex-engine notebooks 30-33 with nbformat (output-stripped).

Run: ``python scripts/make_phase3_notebooks.py`` (``--check``: only report notebooks out of
sync). Edit here, not in the .ipynb files; the logic lives in ``nbhelpers/bench/engine_report.py`` and
``nbhelpers/bench/flex_sweep.py`` (DESIGN.md rule 1); layout and writing in ``scripts/nbgen.py``.
"""

from __future__ import annotations

from functools import partial

import nbformat
import nbgen

IMPORTS = """%load_ext autoreload
%autoreload 2
%matplotlib inline
import pandas as pd
from IPython.display import Markdown, display

from nbhelpers import data, models
from nbhelpers.config import LoraSpec, SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.bench import engine_report as rep
from nbhelpers.bench import flex_sweep as eb
from nbhelpers.stats import gpu_name, make_sidecar, write_sidecar"""

NB30 = {
    "title": """# Phase 3 · 30: the flex engine, step by step

**Question:** what does the flex engine do with a batch of GRPO requests: which pages hold whose
tokens, which KV slots each decoding sequence reads, and what the scheduler does when the page
pool runs out?

**Result:** computed from this run in the last cell.

A small model (`tiny-qwen3`, random weights, on the CPU by default) and a deliberately small page
pool, so that the `n` samples of a prompt share its pages and some sequences are preempted and
resumed. Code: `nbhelpers/engine/` (nano-vllm layout).""",
    "params": """model: str = "tiny-qwen3"  # registry name (tiny-qwen3 | tiny-llama | smollm2-135m-instruct)
device: str = "cpu"  # cpu | cuda
n_prompts: int = 3  # GSM8K prompts
num_generations: int = 2  # samples per prompt (TRL num_generations), prefix shared
prompt_tokens: int = 60  # target prompt length in tokens
max_new_tokens: int = 24  # tokens per sample, EOS ignored
page_size: int = 16  # tokens per KV page
num_pages: int = 24  # pages in the pool (small on purpose: forces preemption)
sync_every: int = 8  # decode steps per host readback
min_preemptions: int = 1  # claim: the small pool preempts at least this often
sidecar_path: str = ""  # notebook sidecar to write; empty: none (the runner sets it)""",
    "cells": [
        ("Derived values: model, tokenizer and the prompts (real GSM8K questions).",
         """hf, tok = models.load_model(model, dtype="float32", device=device)
prompts = data.workload_prompt_ids(tok, n_prompts, prompt_tokens, seed=1)
sampling = SamplingParams(temperature=1.0, min_p=0.1, seed=3407, n=num_generations,
                          max_new_tokens=max_new_tokens, ignore_eos=True)
[len(p) for p in prompts]"""),
        ("## A schedule\nEvery prefill, decode window and preemption, with free pages after it.",
         """llm = LLM(hf, page_size=page_size, num_pages=num_pages, sync_every=sync_every,
          max_model_len=prompt_tokens * 4 + max_new_tokens)
llm.trace = []
outs = llm.generate(prompts, sampling)
schedule = rep.trace_frame(llm.trace)
schedule"""),
        (("## The page table after the first prefill\nSamples of one prompt list the same first "
          "pages (shared, reference-counted); the partly filled last page is copied per sample."),
         """first = next(e for e in llm.trace if e["kind"] == "prefill")
rep.block_table_frame(first, page_size)"""),
        (("## Block masks of a decode step\nTop: the token-level mask over physical KV slots "
          "(blue lines: page boundaries). Bottom: the BlockMask's pages per row, i.e. "
          "`kv_indices = block_table`: flex_attention visits only those."),
         """event = next(e for e in llm.trace if e["kind"] == "decode")
token_mask, page_mask = rep.decode_masks(event, num_pages, page_size)
rep.mask_figure(token_mask, page_mask, page_size)"""),
    ],
    "sidecar": """stats = llm.last_stats
side = make_sidecar(phase="phase3_flex", backend="flex", model=models.describe(model),
                    extra={"notebook": "30_engine_walkthrough", "schedule_events": len(schedule),
                           "num_preemptions": stats["num_preemptions"],
                           "prefill_tokens": stats["prefill_tokens"]})
if sidecar_path:
    print("sidecar:", write_sidecar(side, sidecar_path))
assert all(len(o.token_ids) == max_new_tokens for o in outs), "a sequence was truncated"
assert stats["num_preemptions"] >= min_preemptions, stats
shared = first["block_tables"]
assert len(outs) == n_prompts * num_generations
display(Markdown(f"**Result:** {len(outs)} samples, all {max_new_tokens} tokens long, through "
                 f"{len(schedule)} scheduler events with {stats['num_preemptions']} preemptions "
                 f"on a {num_pages}-page pool; prompts prefilled once per group "
                 f"({stats['prefill_tokens']} prefill tokens)."))""",
}

NB31 = {
    "title": """# Phase 3 · 31: parity with HF

**Question:** does the flex engine produce HF's greedy tokens and logprobs on tiny Qwen3 and
Llama-3 configs and on SmolLM2-135M's real weights?

**Result:** computed from this run in the last cell.

Reference: full HF forwards without a KV cache (the plainest computation), greedy, EOS ignored.
Metric: the share of tokens identical up to the first divergence and the largest |logprob
difference| over that common prefix. fp32 on the CPU; on a GPU in bf16 ties can flip a token.""",
    "params": """model_names: list = ["tiny-qwen3", "tiny-llama", "smollm2-135m-instruct"]  # registry names
device: str = "cpu"  # cpu | cuda
dtype: str = "float32"  # float32 | bfloat16
n_prompts: int = 2  # GSM8K prompts per model
prompt_tokens: int = 60  # target prompt length
steps: int = 12  # greedy tokens compared
page_size: int = 16  # tokens per KV page
max_logprob_diff: float = 1e-3  # claim: max |engine - HF| logprob over matching tokens
min_match_frac: float = 1.0  # claim: share of identical greedy tokens
sidecar_path: str = ""  # notebook sidecar to write; empty: none (the runner sets it)""",
    "cells": [
        ("Derived values: the models and their prompts in each tokenizer's chat template.",
         """loaded = {name: models.load_model(name, dtype=dtype, device=device) for name in model_names}
named = {name: m for name, (m, _) in loaded.items()}
prompts_of = {name: data.workload_prompt_ids(t, n_prompts, prompt_tokens, seed=2)
              for name, (_, t) in loaded.items()}
{name: [len(p) for p in ps] for name, ps in prompts_of.items()}"""),
        ("## Greedy tokens and logprobs vs HF",
         """table = rep.parity_table(named, prompts_of, steps, page_size=page_size, num_pages=64,
                         max_model_len=512)
table"""),
    ],
    "sidecar": """side = make_sidecar(phase="phase3_flex", backend="flex",
                    extra={"notebook": "31_parity", "parity": table.to_dict(orient="index"),
                           "dtype": dtype, "device": gpu_name()})
if sidecar_path:
    print("sidecar:", write_sidecar(side, sidecar_path))
assert (table["prefix_match_frac"] >= min_match_frac).all(), table
assert (table["max_logprob_diff"] <= max_logprob_diff).all(), table
display(Markdown(f"**Result:** on {', '.join(model_names)} the engine's greedy tokens match HF's "
                 f"({table['prefix_match_frac'].min():.0%} of tokens) with logprobs within "
                 f"{table['max_logprob_diff'].max():.1e}."))""",
}

NB32 = {
    "title": """# Phase 3 · 32: the sampler

**Question:** does the engine's sampler draw from exactly the filtered softmax (temperature,
min_p, top-k, top-p in vLLM v1's order) for several settings?

**Result:** computed from this run in the last cell.

Logits: the next-token logits of a real prompt under the model. For each setting the sampler
draws `n_draws` tokens (one seed each), and a Pearson chi-square test compares the counts with the
exact filtered distribution (categories with expected count < 5 pooled). Then the same check
through `LLM.generate` itself (prefill, prefix sharing, sampler) for the GRPO setting.""",
    "params": """model: str = "smollm2-135m-instruct"  # registry name (real weights: peaked logits)
device: str = "cpu"  # cpu | cuda
n_draws: int = 4000  # sampler draws per setting (H200: 100000)
engine_draws: int = 1024  # first tokens drawn through LLM.generate (GRPO setting)
min_p_value: float = 1e-3  # claim: every chi-square p-value is above this
sidecar_path: str = ""  # notebook sidecar to write; empty: none (the runner sets it)""",
    "cells": [
        ("Derived values: the model, a prompt, its next-token logits and the settings.",
         """import torch
hf, tok = models.load_model(model, dtype="float32", device=device)
prompt = data.workload_prompt_ids(tok, 1, 80, seed=3)[0]
with torch.no_grad():
    logits = hf(torch.tensor([prompt], device=device)).logits[0, -1].float().cpu()
settings = {
    "grpo T=1 min_p=0.1": SamplingParams(temperature=1.0, min_p=0.1),
    "T=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T=1.3 top_k=20": SamplingParams(temperature=1.3, top_k=20),
    "T=1 top_k=50 top_p=0.8 min_p=0.02": SamplingParams(top_k=50, top_p=0.8, min_p=0.02),
}"""),
        ("## Sampler vs the exact filtered softmax",
         """draws = rep.sampling_counts(logits, settings, n_draws)
table = rep.sampling_frame(draws)
display(table)
rep.sampling_figure(draws)"""),
        ("## Through the engine (GRPO setting)",
         """llm = LLM(hf, page_size=16, num_pages=512, max_model_len=512, max_num_seqs=128)
grpo = settings["grpo T=1 min_p=0.1"]
counts = rep.engine_draws(llm, prompt, grpo, engine_draws)
engine_test = rep.chi_square(counts, rep.exact_filtered_probs(logits, grpo))
engine_test"""),
    ],
    "sidecar": """side = make_sidecar(phase="phase3_flex", backend="flex", model=models.describe(model),
                    extra={"notebook": "32_sampling", "chi_square": table.to_dict(orient="index"),
                           "engine_chi_square": engine_test, "n_draws": n_draws})
if sidecar_path:
    print("sidecar:", write_sidecar(side, sidecar_path))
assert (table["off_support"] == 0).all(), "a filtered-out token was drawn"
assert (table["p_value"] > min_p_value).all(), table
assert engine_test["off_support"] == 0 and engine_test["p_value"] > min_p_value, engine_test
display(Markdown(f"**Result:** for {len(settings)} settings the draws fit the exact filtered "
                 f"softmax (smallest chi-square p = {table['p_value'].min():.3f}; engine path "
                 f"p = {engine_test['p_value']:.3f}); no filtered-out token was ever drawn."))""",
}

NB33 = {
    "title": """# Phase 3 · 33: flex engine vs the phase 1 engines

**Question:** how fast is the flex engine on workload W (Qwen3-4B shape, LoRA r=32, 32 prompts,
512 new tokens, GRPO sampling) beside vLLM / Unsloth / transformers, how does it scale with the
batch, what do fp32 adapters (TRL's default) cost against bf16 ones, how do engine variants
(old vs new kernels) compare, and where does a decode step's time go?

**Result:** computed from this run in the last cell.

Runs the batch sweep here (random weights; speed does not depend on values) with the same
`run_flex_point` as `scripts/bench_flex.py`, each (variant, LoRA mode) configuration in its own
process (`nbhelpers/bench/flex_configs.py`: no compile cache, CUDA graph pool or allocator state
carried from one configuration into the next). Every figure and table shows only this run's
points (held to its `run_id`), the phase 1 H200 engines (`docs/reference_measurements/gold_*.json`)
as labelled reference points, earlier flex sidecars of `executed/phase3_flex/bench` only as a
labelled table. Breakdown: `prefill_s`, the decode step (`decode_step_ms`: graph replays + one
readback per window), one graph replay alone (`replay_ms`), % of the bandwidth floor, and with
`profile` a kernel profile of one eager step by class and kernels per step for every point.""",
    "params": """shape: str = "tiny"  # tiny (CPU smoke) | qwen3-4b (H200)
device: str = "cpu"  # cpu | cuda
batches: list = [2, 4]  # batch sweep (H200: 4, 8, 32, 64, 128, 256)
prompt_tokens: int = 16  # prompt length (W: 150)
max_new_tokens: int = 8  # new tokens (W: 512)
rounds: int = 1  # timed rounds (W: 3)
lora_rank: int = 32  # LoRA r (alpha is 2r), on all 7 projections
lora_modes: list = ["bf16"]  # none | bf16 (model dtype) | fp32 (PEFT upcast); true: bf16
variants: list = []  # A/B: [{name, options}] over engine_options; empty: 'default'
profile: bool = False  # every point: kernel classes, kernels/step (CUDA), aten ops
engine_options: dict = {}  # RunnerOptions of every variant, e.g. {"lora_expand": "addmm"}
gold_dir: str = "docs/reference_measurements"  # phase-1 H200 reference runs (absent: none)
bench_dir: str = "executed/phase3_flex/bench"  # earlier flex sidecars (a labelled table only)
min_tok_per_s: float = 1.0  # claim: every point ran and produced tokens
sidecar_path: str = ""  # notebook sidecar to write; empty: none (the runner sets it)""",
    "cells": [
        (("Derived values: the configurations (bad LoRA modes, variants or options fail here, "
          "before any point runs), the workload every process measures, and this run's id."),
         """import glob
from nbhelpers.bench import flex_configs as fc
from nbhelpers.stats import read_sidecars, run_stamp
configs = fc.plan_configs(lora_modes, variants, engine_options)
settings = fc.sweep_settings(shape=shape, device=device, batches=batches,
                             prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                             rounds=rounds, lora_rank=lora_rank, profile=profile)
lora = LoraSpec(rank=lora_rank, alpha=2 * lora_rank)
run_id = run_stamp()  # the file's stamp; every sidecar of this run carries it, figures refuse others
display(pd.DataFrame([{"variant": c.variant, "lora_mode": c.lora_mode, "options": c.options}
                      for c in configs]))
run_id"""),
        (("## Batch sweep\nOne child process per (variant, LoRA mode): it builds the random "
          "model, attaches the LoRA of its mode (`bf16`: the model's dtype; `fp32`: PEFT's "
          "upcast, `adapter_dtype` records what PEFT holds) and measures every batch. Each point "
          "records its bandwidth floor (bytes per step / read bandwidth measured in its process)."),
         """sides = fc.run_configs(configs, settings, run_id)
sweep = eb.flex_frame(sides, run_id=run_id)
sweep"""),
        (("## Variants side by side\nEach (LoRA mode, batch) with every variant's tok/s, ms per "
          "step, % of floor, kernel classes (ms per step) and kernels per step (CUDA profile; "
          "aten ops per step on any device), and tok/s over the first variant's."),
         """ab = eb.ab_frame(sweep, run_id)
display(ab)
eb.ab_figure(sweep, run_id)"""),
        (("## This run beside phase 1\nThe figure: this run's points and the phase 1 H200 engines "
          "(labelled with their file and date). Earlier flex runs, if any, only as a table with "
          "their source file and date."),
         """reference = eb.reference_frame(sorted(glob.glob(f"{gold_dir}/gold_*.json")))
display(reference)
earlier = eb.earlier_frame(read_sidecars(bench_dir, phase="phase3_flex"), run_id)
if earlier is not None:
    display(Markdown(f"Earlier flex runs from `{bench_dir}` (not this run):"))
    display(earlier)
eb.sweep_figure(sweep, run_id, reference if shape == "qwen3-4b" else None)"""),
        (("## % of the bandwidth floor\nEach point's bytes per decode step (weights + LoRA + KV at "
          "the mean context) over its measured step time, as a share of the read bandwidth "
          "measured in its process: 100 % streams every byte once at that rate."),
         """display(sweep[["tag", "variant", "lora_mode", "batch", "decode_step_ms", "floor_ms",
               "pct_of_floor"]])
eb.pct_figure(sweep, run_id)"""),
        (("## Where a decode step goes\nKernel classes of one eager step (CUDA profile) of every "
          "point of this run against its measured graph step, kernels per step on each bar; no "
          "profile in this run: said so."),
         """(eb.kernels_figure(sweep, run_id) if sweep["gemm_ms"].notna().any() else
 Markdown("No kernel profile in this run (profile=False or CPU); with profile=True the aten "
          "ops per step are in the table above."))"""),
        (("## Decode GEMMs against the floor\nEvery decode GEMM shape this run's tuner timed with "
          "cold weights (`skinny_tuner` in each point's sidecar): the chosen kernel's "
          "microseconds, its weight bytes at the read bandwidth measured in the same process "
          "(`floor_us`) and the rest (`fixed_us`: ramp-up, the last wave's tail, the split-K "
          "fix-up); then per row count the decode step's sum (a layer GEMM once per layer, the "
          "LM head once). `fixed_ms` is what streaming a whole layer without launch boundaries "
          "could remove (issue 12). Empty on the CPU (no tuner)."),
         """from nbhelpers.bench import gemm_floor

gemm_rows = gemm_floor.gemm_floor_frame(sides, run_id, **gemm_floor.model_dims(shape))
if gemm_rows.empty:
    display(Markdown("No skinny-GEMM tuner times in this run (CPU, or `skinny_gemm` off)."))
else:
    display(gemm_rows.round(2))
    display(gemm_floor.step_overhead(gemm_rows).round(3))"""),
        (("## Try other choices (JupyterLab)\nPick batch sizes and decode kernels, then Run: the "
          "same per-configuration processes as the sweep, for this notebook's LoRA modes. Under "
          "papermill the panel is only shown."),
         """from nbhelpers.widgets import run_controls

KERNELS = {"auto (Triton on CUDA)": {}, "flex + addmm": {"decode_attention": "flex",
                                                        "lora_expand": "addmm"}}


def rerun(batches, kernels):
    \"\"\"The sweep again for the picked batches and decode kernels; a frame like `sweep`.\"\"\"
    picked = fc.plan_configs(lora_modes, [{"name": "ui", "options": KERNELS[kernels]}],
                             engine_options)
    got = fc.run_configs(picked, {**settings, "batches": list(batches)}, run_id)
    return eb.flex_frame(got, run_id=run_id)


run_controls(rerun, batches=([1, 2, 4, 8, 16, 32, 64, 128, 256], batches),
             kernels=(list(KERNELS), "auto (Triton on CUDA)"))"""),
    ],
    "sidecar": """side = make_sidecar(phase="phase3_flex", backend="flex", model=sides[0]["model"],
                    lora={"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)},
                    workload={"batches": batches, "prompt_tokens_mean": prompt_tokens,
                              "max_new_tokens": max_new_tokens, "ignore_eos": True,
                              "sampling": "grpo"},
                    rounds=sides[-1]["rounds"], run_id=run_id,
                    extra={"notebook": "33_flex_vs_baselines", "engine_options": engine_options,
                           "configs": [dict(c.__dict__) for c in configs],
                           "sweep": sweep.to_dict(orient="records"),
                           "ab_table": ab.to_dict(orient="records"), "points": sides})
if sidecar_path:
    print("sidecar:", write_sidecar(side, sidecar_path))
keys = ["variant", "lora_mode", "batch"]
assert (sweep["error"] == "").all(), sweep
assert (sweep["decode_tok_per_s"] >= min_tok_per_s).all(), sweep
assert sweep["pct_of_floor"].notna().all() and set(sweep["run_id"]) == {run_id}, sweep
assert len(sweep.drop_duplicates(keys)) == len(sweep) == len(configs) * len(batches), sweep[keys]
assert (sweep.groupby(keys[:2])["config_pid"].nunique() == 1).all(), "a configuration split"
assert sweep["config_pid"].nunique() == len(configs), "configurations shared a process"
assert not profile or sweep["aten_ops_per_step"].notna().all(), "a point was not profiled"
assert not (profile and device == "cuda") or sweep["kernels_per_step"].notna().all(), sweep
rows = [f"{r['variant']} {eb.mode_label(r['lora_mode'])} batch {r['batch']}: "
        f"{r['decode_tok_per_s']:.0f} tok/s (step {r['decode_step_ms']:.2f} ms, "
        f"{r['pct_of_floor']:.1f} % of floor, peak {r['peak_gib']:.2f} GiB)"
        for _, r in sweep.iterrows()]
display(Markdown(f"**Result:** on {gpu_name()} ({shape} shape, {prompt_tokens}-token prompts, "
                 f"{max_new_tokens} new tokens, {len(configs)} configurations in their own "
                 "processes) the flex engine reached: " + "; ".join(rows)))""",
}

SPECS = {"30_engine_walkthrough": NB30, "31_parity": NB31, "32_sampling": NB32,
         "33_flex_vs_baselines": NB33}


def build(spec: dict) -> nbformat.NotebookNode:
    """One flex notebook from its spec: ``title``, ``params``, ``cells`` (markdown, code) pairs and
    the ``sidecar`` code; every notebook shares ``IMPORTS`` and the sidecar heading."""
    return nbgen.build(spec["title"], IMPORTS, spec["params"], spec["cells"],
                       sidecar=(nbgen.SIDECAR_MD, spec["sidecar"]))


NOTEBOOKS = {f"notebooks/phase3_flex/{stem}.ipynb": partial(build, spec)
             for stem, spec in SPECS.items()}


if __name__ == "__main__":
    raise SystemExit(nbgen.main(NOTEBOOKS))
