"""Generate the phase 2 notebooks (GRPO per backend) with nbformat, output-stripped.

Run: ``python scripts/make_phase2_notebooks.py`` (``--check``: only report notebooks out of
sync). Edit here, not in the .ipynb. Logic lives in ``nbhelpers.grpo.trainer`` /
``grpo_compare`` / ``gate`` (DESIGN.md rule 1); layout and writing in ``scripts/nbgen.py``.
"""

from __future__ import annotations

import nbformat
import nbgen

EQ_TITLE = """# Phase 2: GRPO equivalence and speed across rollout backends

**Question:** run the same GRPO setup with each rollout engine (TRL's `generate`, transformers
continuous batching, vLLM colocate, Unsloth `fast_inference=False`, and our flex engine reading
the policy's LoRA live): do they train the same, and what does each cost in step time and memory?

**Result:** computed from this run in the last cell (per backend: median step, peak memory, gate).

Same dataset, reward functions (the reference notebook's four), LoRA, sampling, seed and
statistics callback for every backend; each backend runs in its own process. The coherence gate
(`nbhelpers.grpo.gate`) checks finite losses and grad norms, rewards in the model's expected range, KL
in [0, 0.015] over the first steps and close to the reference backend's, and reports the
per-token gap between the engine's logprobs and the trainer's. A backend that cannot be staged
here keeps its row with the error. Reference (B200, 10 steps, 4 generations; Unsloth PR #5108):
vLLM colocate 74.4 s wall / 4.14 s median step / 158 GB, Unsloth fi=False 355 s / 10.7 GB,
transformers CB 466 s / 55.6 GB."""

EQ_IMPORTS = """%load_ext autoreload
%autoreload 2
%matplotlib inline
import pandas as pd
from IPython.display import Markdown, display

from nbhelpers import plots
from nbhelpers.grpo import compare as grpo_compare
from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.grpo.gate import assert_gate, check_runs, thresholds_for
from nbhelpers.models import describe, get_spec
from nbhelpers.stats import gpu_name"""

EQ_PARAMETERS = """\
backends: list = ["hf_generate", "flex"]  # of hf_generate, hf_cb, vllm, unsloth, flex
reference_backend: str = "hf_generate"  # the gate compares KL, reward, grad norm with it
model: str = "smollm2-135m-instruct"  # nbhelpers.models.list_models() name, hub id, folder
dataset: str = "gsm8k"  # gsm8k | gsm_symbolic | dapo_math
n_questions: int = 16  # questions drawn for the prompts
max_steps: int = 2  # GRPO optimiser steps
num_generations: int = 4  # completions per prompt (TRL num_generations)
per_device_train_batch_size: int = 4  # completions per micro-batch (raised to fit num_generations)
gradient_accumulation_steps: int = 1  # micro-batches per optimiser step (TRL generates them at once)
gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
max_prompt_length: int = 256  # prompts longer than this many tokens are dropped
max_completion_length: int = 32  # max_new_tokens per completion
learning_rate: float = 5e-6  # reference lr
beta: float = 0.04  # KL coefficient; TRL logs KL (the gate's trajectory) only when beta > 0
lora_rank: int = 32  # LoRA r
lora_alpha: int = 64  # LoRA alpha
seed: int = 3407  # reference seed
skip_first: int = 3  # warm-up steps left out of the medians
compile_mode: str = "none"  # none | default | reduce-overhead | max-autotune-no-cudagraphs
compile_dynamic: str = "auto"  # auto (ours: torch's default) | on (the reference's) | off
compile_scope: str = "auto"  # compile_mode only: auto (flex/vllm: layers, others: backbone) | backbone | layers (each layer, fast to compile)
pad_to_multiple_of: int = 0  # TRL: pad ids to a multiple (bounds recompiles; CUDA: NaN grads seen, docstring); 0 off
attn_implementation: str = "auto"  # policy: auto (sdpa) | sdpa | eager | flash_attention_4 (hf_cb: paged|<it>)
vllm_sleep_mode: bool = False  # vLLM only: sleep between rollouts (TRL vllm_enable_sleep_mode)
vllm_gpu_memory_utilization: float = 0.3  # vLLM only: fraction of the card vLLM reserves
flex_sleep_between_rollouts: bool = False  # flex only: free KV pool + graphs while training
flex_compile_attention: str = "auto"  # flex only: auto (on iff CUDA) | on | off
flex_freeze_gc: bool = False  # flex only: freeze the Python heap after the first rollout (vLLM does)
cpu_threads: int = 1  # CPU hosts: torch threads per run (tiny GEMMs: 1 is fastest; 0: default)
kl_tolerance: float = 0.015  # gate: max per-step |KL - KL_reference|
format_warmup_steps: int = 0  # SFT steps on the answer format before GRPO, merged into the base
reuse_runs: dict = {}  # backend -> earlier <run>__<backend>.json, read not trained (same setup)
sidecar_path: str = ""  # summary sidecar to write (+ one per backend beside it); empty: none"""

EQ_DERIVED = """settings = GRPOSettings(
    max_steps=max_steps, num_generations=num_generations,
    per_device_train_batch_size=per_device_train_batch_size,
    gradient_accumulation_steps=gradient_accumulation_steps,
    gradient_checkpointing=gradient_checkpointing, pad_to_multiple_of=pad_to_multiple_of,
    max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
    learning_rate=learning_rate, beta=beta, seed=seed,
    lora=LoraSpec(rank=lora_rank, alpha=lora_alpha))
device, model_info = gpu_name(), describe(model)
thresholds = thresholds_for(get_spec(model).kind, settings.sampling_params(),
                            kl_tolerance=kl_tolerance)
print(device, model_info)
settings, thresholds"""

EQ_RUN = """runs = grpo_compare.run_backends(
    list(backends), model, settings, dataset=dataset, n_questions=n_questions,
    skip_first=skip_first, compile_mode=compile_mode,
    compile_dynamic=grpo_compare.compile_dynamic_flag(compile_dynamic),
    compile_scope=compile_scope, attn_implementation=attn_implementation,
    vllm_sleep_mode=vllm_sleep_mode,
    vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, cpu_threads=cpu_threads,
    flex_options=grpo_compare.flex_options(flex_sleep_between_rollouts, flex_compile_attention,
                                         flex_freeze_gc),
    format_warmup_steps=format_warmup_steps, progress=False,
    sidecar_path=sidecar_path, model_info=model_info, reuse_runs=reuse_runs)
for name, run in runs.items():
    print(f"{name}: {'ok' if run['error'] is None else run['error'][:300]}"
          f" ({grpo_compare.source_word(run)})")
    warm = (run["config"] or {}).get("format_warmup")
    if warm:
        losses = warm["losses"] or [float("nan")]
        print(f"  format warm-up: {warm['steps']} SFT steps in {warm['wall_s']:.0f} s, loss "
              f"{losses[0]:.2f} -> {losses[-1]:.2f}")
        if folder := warm.get("model_folder") or warm.get("vllm_model_folder"):
            print(f"  {name} started from the merged warm-up folder {folder}")
    if run["error"] and run.get("traceback"):
        print("  traceback (tail):\\n" + run["traceback"][-2500:])"""

EQ_GATE = """gates = check_runs(runs, reference_backend, thresholds)
summary = grpo_compare.summary_frame(runs, gates)
summary"""

EQ_SPLIT = """grpo_compare.step_split_frame(runs).T"""

EQ_IS = """display(grpo_compare.is_frame(runs))
compile_table = grpo_compare.compile_frame(runs)
if compile_mode != "none":
    display(compile_table)
else:
    print("compile_mode none: nothing compiled by the trainer (compile_dynamic and "
          "compile_scope have no effect)")"""

EQ_PLOTS = """steps = grpo_compare.steps_long(runs)
from_note = grpo_compare.reused_caption(runs)  # None: every curve is this run's
panels = [("wall_s", "s", "Step time"), ("generate_s", "s", "Generation time per step"),
          ("reward", "mean reward", "Reward"), ("kl", "KL", "KL to the reference policy"),
          ("grad_norm", "grad norm", "Grad norm")]
for column, label, title in panels:
    if column in steps and steps[column].notna().any():
        fig = plots.metric_by_step(steps, column, label, title)
        display(plots.caption(fig, from_note) if from_note else fig)
    else:
        print(f"{title}: not plotted: {grpo_compare.not_logged_reason(runs, column, beta)}")"""

EQ_DETAILS = """details = pd.DataFrame({name: {
    "notes": "; ".join((run["config"] or {}).get("notes") or []),
    "compile": (run["config"] or {}).get("compile_report"),
    "completion (sample)": (run["completions"] or [{}])[0].get("completion")}
    for name, run in runs.items()}).T
details"""

EQ_INTERACTIVE = """from dataclasses import replace

from nbhelpers.grpo import BACKENDS
from nbhelpers.widgets import run_controls


def rerun(backends, max_steps):
    \"\"\"The same GRPO setup for the picked backends and steps; summary with the gate.\"\"\"
    got = grpo_compare.run_backends(
        backends, model, replace(settings, max_steps=max_steps), dataset=dataset,
        n_questions=n_questions, skip_first=skip_first, compile_mode=compile_mode,
        compile_dynamic=grpo_compare.compile_dynamic_flag(compile_dynamic),
        compile_scope=compile_scope, attn_implementation=attn_implementation,
        vllm_sleep_mode=vllm_sleep_mode,
        vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, cpu_threads=cpu_threads,
        flex_options=grpo_compare.flex_options(flex_sleep_between_rollouts,
                                               flex_compile_attention, flex_freeze_gc),
        format_warmup_steps=format_warmup_steps, progress=False)
    return grpo_compare.summary_frame(got, check_runs(got, reference_backend, thresholds))


run_controls(rerun, backends=(BACKENDS, backends), max_steps=([1, 2, 5, 10, 20], max_steps))"""

EQ_SIDECAR = """display(grpo_compare.gate_frame(gates))
if sidecar_path:
    for path in grpo_compare.write_sidecars(runs, gates, settings, model_info, sidecar_path):
        print("sidecar:", path)
display(Markdown(grpo_compare.result_line(runs, gates, device)))
assert all(len(r["rows"]) == max_steps for r in runs.values() if r["error"] is None)
assert any(r["error"] is None for r in runs.values()), (
    "no backend ran: " + "; ".join(f"{b}: {str(r['error']).splitlines()[0][:160]}"
                                    for b, r in runs.items()))
assert_gate(gates)  # raises GateFailed listing every failed check"""


def equivalence() -> nbformat.NotebookNode:
    """20_grpo_equivalence: every backend on one GRPO setup, per-step plots, gate, sidecars."""
    return nbgen.build(EQ_TITLE, EQ_IMPORTS, EQ_PARAMETERS, [
        ("Derived values: the GRPO settings and the gate's thresholds.", EQ_DERIVED),
        (("## Run every backend\nOne spawned process per backend; a failure keeps its row. "
          "Each finished backend is written at once to `<run>__<backend>.json` beside "
          "`sidecar_path` (`partial: true`; the last cell's write replaces it), so a run killed "
          "later keeps it. While a backend trains, its process appends each logged step to "
          "`<run>__<backend>.progress.jsonl` (the step's row, peak allocated GiB, the compile "
          "counts so far); if the run is stopped (Ctrl-C, a time cap) or the process dies, that "
          "backend's sidecar is written from those steps, marked `interrupted after N steps`, "
          "and 29 shows it labelled, never gated or ranked as a finished run. A backend in `reuse_runs` is read from that earlier sidecar instead "
          "(its settings, model, seed and device must match this run's, else a ValueError "
          "names the field) and labelled with its file and date."), EQ_RUN),
        (("## Summary and gate verdict\n`wall_s`: trainer construction to end of training; "
          "`step_time_s_median` / `generate_s_median`: seconds, median after `skip_first` "
          "steps; `peak_mem_device_gib`: GiB in use on the card at each step's end, "
          "`peak_mem_device_max_gib`: the card's estimated peak during the steps (torch's "
          "peak reserved plus what is in use outside it; the memory goal uses it where "
          "recorded) (CPU: peak RSS for both); "
          "`logprob_mismatch_max`: worst per-step mean |engine - trainer| logprob, nats/token."),
         EQ_GATE),
        (("## Where the step goes\nPer backend, medians over the steps in the summary's "
          "medians (after `skip_first`) of this run's step rows "
          "(`grpo_compare.step_split_frame`), seconds, CUDA-synchronised on the GPU. `wall_s`: "
          "the step; `generate_s`: TRL's `_generate` (the rollout); "
          "`time/generate_and_score_s`: `_generate_and_score_completions` (rollout, rewards, "
          "old/ref logprobs, advantages); `time/loss_fwd_bwd_s`: loss forward + backward; "
          "`time/optimizer_s`: `optimizer.step()`; `time/other_s`: the rest of the step. flex "
          "only, its engine per rollout: `flex/rollout_s` (the whole `rollout_func`), "
          "`flex/generate_wall_s` (`llm.generate`) = `flex/prefill_s` + `flex/decode_s` + "
          "`flex/host_s` + `flex/other_s` (scheduler, graph captures), `flex/decode_steps`, "
          "`flex/decode_ms_per_step` (ms)."), EQ_SPLIT),
        (("## Importance sampling and recompiles\nPer backend, means over the run's steps "
          "(`grpo_compare.is_frame`): `is_ratio_mean`, the per-token ratio exp(trainer - "
          "engine) logprob; `is_outside_0.9_1.1`, the fraction of tokens outside [0.9, 1.1]; "
          "`same_support_logp_diff`, mean |engine - trainer| logprob on one support, "
          "nats/token (flex renormalises the trainer's logprob by the engine's kept mass; vLLM "
          "returns no kept mass, so none); `is_ratio_applied_mean`, TRL's ratio as the loss "
          "applies it; `filtered_*` (flex only): the vLLM-style ratio against the engine's "
          "filtered logprobs, not on one support (reported, not applied). Then the compile report (`compile_mode` not none): recompiles and graph "
          "breaks with `compile_dynamic` and `compile_scope`, and the seconds spent compiling."), EQ_IS),
        (("## Per-step curves\nOne colour per backend (`nbhelpers.plots.BACKEND_COLORS`); a "
          "backend reused from an earlier sidecar (`reuse_runs`) is named with its file and "
          "date under each figure."),
         EQ_PLOTS),
        (("## Notes, compile report, a completion\nvLLM-only settings ignored elsewhere; graph "
          "breaks and recompiles of `compile_mode`."), EQ_DETAILS),
        (("## Try other choices (JupyterLab)\nPick backends and steps, then Run: the same "
          "`grpo_compare.run_backends` and gate as above. Under papermill the panel is only "
          "shown."), EQ_INTERACTIVE)],
        sidecar=("## Gate checks, sidecars and the verdict\nFails loudly when the gate fails.",
                 EQ_SIDECAR))


CMP_TITLE = """# Phase 2: compare GRPO runs across backends (from sidecars)

**Question:** over every executed `20_grpo_equivalence` run, how do the backends compare in median
step time, its split, peak memory, importance sampling and the coherence gate, within each GRPO
shape, and how does flex's median step compare with vLLM colocate's at each shape?

**Result:** computed in the last cell from the sidecars (this notebook runs nothing).

Runs are compared only within one (device, model, shape) group: the shape is the GRPO workload a
run's sidecar records (`g4 b4x1 256tok`: num_generations 4, per_device_train_batch_size 4 x
gradient_accumulation_steps 1, 256 new tokens; fields that differ from the reference setup, such
as a format warm-up, are appended; `nbhelpers.grpo.compare_shapes`). The newest run of each backend
in a group that did not fail (else its newest failed run, shown as failed) is gated and timed
against the others of that group only."""

CMP_IMPORTS = """%load_ext autoreload
%autoreload 2
%matplotlib inline
import pandas as pd
from IPython.display import Markdown, display

from nbhelpers import plots
from nbhelpers.grpo import compare as grpo_compare
from nbhelpers.stats import make_sidecar, write_sidecar"""

CMP_PARAMETERS = """\
sidecar_dir: str = "executed/phase2_grpo/20_grpo_equivalence"  # where 20_* wrote its sidecars
reference_backend: str = "hf_generate"  # cross-run gate: KL, reward, grad norm against it
device: str = ""  # keep runs whose device name contains this (e.g. "h200", "cpu"); empty: all
sidecar_path: str = ""  # this notebook's summary sidecar (the runner sets it)"""

CMP_LOAD = """# ValueError naming the fix: no phase-2 run under sidecar_dir, or device matches none
root, sidecars, runs, gates = grpo_compare.load_runs(sidecar_dir, device)  # "h200": "NVIDIA H200"
groups = grpo_compare.latest_per_group(runs)  # {(device, model, shape): {backend: newest run}}
print(f"{len(sidecars)} phase-2 sidecars under {root}, {len(runs)} backend runs"
      f"{f' on {device}' if device else ''}, {len(groups)} (device, model, shape) groups")
grpo_compare.runs_frame(runs).join(grpo_compare.summary_frame(runs, gates))"""

CMP_SPEED = """speed = grpo_compare.speed_frame(runs)
for (gpu, model, shape), table in speed.groupby(["device", "model", "shape"], sort=False):
    display(Markdown(f"### {gpu}, {model}, `{shape}`\\n\\nFrom: "
                     f"{grpo_compare.sources(groups[(gpu, model, shape)])}"))
    # utc stays: a group can hold runs of different days (and commits); the caption names files
    display(table.set_index("backend").drop(columns=["device", "model", "shape", "sidecar"])
            .assign(utc=lambda t: t["utc"].str[:16].str.replace("T", " ")).round(3))
for (gpu, model, shape), latest in groups.items():
    print(f"{gpu}, {model}, {shape}: flex median step / vLLM's = "
          f"{grpo_compare.ratio_text(latest)}")"""

CMP_SPLIT = """split_columns = ["step_time_s_median", "generate_s", "time/generate_and_score_s",
                 "time/loss_fwd_bwd_s", "time/optimizer_s"]
for (gpu, model, shape), table in speed.groupby(["device", "model", "shape"], sort=False):
    fig = plots.grouped_bars(table.set_index("backend"), split_columns, "s (median over steps)",
                             f"{gpu}, {model}, {shape}: step and its split")
    display(plots.caption(fig, "From: " + grpo_compare.sources(groups[(gpu, model, shape)])))"""

CMP_PLOTS = """metrics = [("wall_s", "step wall s"), ("generate_s", "generation s"),
           ("reward", "mean reward"), ("kl", "KL"), ("grad_norm", "grad norm", "log")]
for (gpu, model, shape), latest in groups.items():
    fig = plots.metrics_by_step(grpo_compare.steps_long(latest), metrics,
                                f"{gpu}, {model}, {shape}: newest run per backend")
    display(plots.caption(fig, "From: " + grpo_compare.sources(latest)))"""

CMP_IS = """display(grpo_compare.runs_frame(runs)[["shape"]].join(grpo_compare.is_frame(runs)))
compiled = grpo_compare.compile_frame(runs, compiled_only=True)
display(compiled if len(compiled) else Markdown("No run compiled the trainer (compile_mode none)."))"""

CMP_CROSS = """cross = grpo_compare.gate_latest(runs, reference_backend)
display(grpo_compare.gate_frame(cross))
print(grpo_compare.failed_checks_text(cross))  # every failed check in full (the table is cut)"""

CMP_GOAL = """goals = pd.DataFrame({
    ", ".join(g): grpo_compare.perf_goal(grpo_compare.summary_frame(latest), g)
    for g, latest in groups.items()}).T
display(goals)
result = grpo_compare.result_by_shape(groups)
gate_text = grpo_compare.gate_conclusion(runs, cross, reference_backend)
display(Markdown(f"**Result:** {len(runs)} runs in {len(groups)} (device, model, shape) groups; "
                 f"{result}; {gate_text}"))
side = make_sidecar(phase=grpo_compare.PHASE, backend="summary:29_compare", extra={
    "kind": "summary", "notebook": "29_compare", "device": device, "n_sidecars": len(sidecars),
    "speed": speed.to_dict(orient="records"), "result": result, "gate_conclusion": gate_text,
    "cross_gate": {name: g.as_dict() for name, g in cross.items()},
    "headline": grpo_compare.headline_by_shape(groups) | grpo_compare.gate_headline(cross)})
if sidecar_path:
    print("sidecar:", write_sidecar(side, sidecar_path))
assert runs, f"no phase-2 sidecars under {root}: run 20_grpo_equivalence first"
assert all(len({grpo_compare.group_key(r) for r in latest.values()}) == 1
           for latest in groups.values()), "a group holds runs of different shapes"
assert (speed.loc[speed["backend"] == "vllm", "step_vs_vllm"].dropna() == 1.0).all()
"""


def compare() -> nbformat.NotebookNode:
    """29_compare: reads the phase-2 sidecars only."""
    return nbgen.build(CMP_TITLE, CMP_IMPORTS, CMP_PARAMETERS, [
        (("## Runs found\nOne row per backend run (`backend@run_id`), with its (device, model, "
          "shape) group and the sidecar it was read from."), CMP_LOAD),
        (("## Speed per shape\nOne table per (device, model, shape) group, the newest run of "
          "each backend that did not fail: median step (s), generation (`generate_s`), the "
          "step split "
          "(`time/*`: generate-and-score, loss forward+backward, optimizer; flex also its "
          "prefill and ms per decode step), peak device GiB, the IS columns, and "
          "`step_vs_vllm`: the backend's median step over vLLM's in the same group (NaN when "
          "the group has no vLLM step time); `status` / `error`: a backend whose runs all "
          "failed keeps its newest failed run, marked `failed` with its error's first line, "
          "and the ratio line says which run failed; a run stopped mid-backend (a time cap, "
          "Ctrl-C) shows the medians of the steps it logged, marked `interrupted after N steps "
          "(of M)`, never ranked above a finished run nor used in a ratio. The issue's goal is flex <= 0.8x vLLM at the "
          "reference shape and <= 0.7x at the realistic preset; the ratio is printed as "
          "measured."), CMP_SPEED),
        (("## Step split per shape\nMedian seconds per step and per part, one bar per "
          "backend (colours as everywhere); the caption names the sidecars."), CMP_SPLIT),
        (("## Per-step curves\nNewest run of each backend, one figure per (device, model, "
          "shape) group; grad norm on a log axis (the gate's `grad_norm_vs_reference` compares "
          "its medians)."), CMP_PLOTS),
        (("## Importance sampling and recompiles across runs\nPer run (`backend@run_id`, with "
          "its shape): IS "
          "ratio mean, fraction of tokens outside [0.9, 1.1], mean |engine - trainer| logprob "
          "on one support (nats/token), TRL's applied ratio; then the runs that compiled the "
          "trainer, with `compile_dynamic` (None: torch's default) and their recompiles."),
         CMP_IS),
        (("## Gate across runs\nThe newest run of each backend against the newest "
          "`reference_backend` run of the same (device, model, shape) group, wherever they ran "
          "(one device call may hold only some backends, so a run's own gate can lack the "
          "reference; a group without a reference run skips the reference checks: KL, reward "
          "and median grad norm). The table is long and pandas cuts it; every failed check is "
          "printed in full under it."),
         CMP_CROSS)],
        sidecar=(("## The flex goal per shape, sidecar and checks\nPer group, newest run per "
                  "backend: the ratios flex / vLLM (median step, peak device memory; `None` "
                  "when either backend has no numbers) against issue 13's goal (`step_goal`: "
                  "0.8 at the Qwen3-4B reference shape, 0.7 at the realistic preset, none for "
                  "other groups; `memory_limit_gib`: the group's hf_generate peak + 2 GiB; "
                  "`met_issue13`) and issue 6's older one (`met`: median step <= vLLM's at <= "
                  "1/5 of its peak memory), the Result line (with the cross-run gate's failures "
                  "in words), and this notebook's summary sidecar."), CMP_GOAL))


NOTEBOOKS = {"notebooks/phase2_grpo/20_grpo_equivalence.ipynb": equivalence,
             "notebooks/phase2_grpo/29_compare.ipynb": compare}


if __name__ == "__main__":
    raise SystemExit(nbgen.main(NOTEBOOKS))
