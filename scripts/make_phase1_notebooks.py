"""Generate the phase 1 notebooks (rollout microbenchmark + comparison) with nbformat.

Run: ``python scripts/make_phase1_notebooks.py`` (rewrites both notebooks, outputs stripped).
``--check`` only reports the ones out of sync. Layout and writing: ``scripts/nbgen.py``.
Edit here, not in the .ipynb: logic lives in ``nbhelpers.bench.rollout`` (DESIGN.md rule 1).
"""

from __future__ import annotations

import nbformat
import nbgen

TITLE_10 = """# Phase 1: LoRA rollout engines side by side

**Question:** for GRPO rollouts with a LoRA adapter, how many decode tokens per second does each
engine produce, how much memory does it hold, and how far is it from vLLM and from the memory-
bandwidth limit of the device?

**Result:** computed from this run in the last cell.

Every backend runs in its own process on the same prompt ids (real GSM8K questions in the model's
chat template), warm-up rounds apart from timed rounds, tokens counted from what the engine
returned. Workload W on the H200 (`configs/10_lora_rollout.h200.yaml`): Qwen3-4B architecture with
random bf16 weights, LoRA r=32 / alpha=64 on all 7 projections with non-zero B, 32 prompts of ~150
tokens, 512 new tokens with EOS ignored, sampling T=1.0, min_p=0.1, top_k off. The CPU default is a
smoke run of the same code on `tiny-qwen3`."""

IMPORTS_10 = """%load_ext autoreload
%autoreload 2
%matplotlib inline
from pathlib import Path
import tempfile

import pandas as pd
from IPython.display import Markdown, display

from nbhelpers.bench import rollout
from nbhelpers.config import LoraSpec, Workload
from nbhelpers.stats import gpu_name, run_stamp, write_sidecar"""

PARAMS_10 = """\
model: str = "tiny-qwen3"  # nbhelpers.models name; qwen3-4b is workload W on the GPU
backends: list = ["hf_generate", "hf_cb"]  # nbhelpers.backends.BACKENDS names
lora_rank: int = 32  # LoRA r on all 7 projections, alpha 2r; 0 runs without adapter only
without_lora: bool = False  # also run every backend without an adapter
n_prompts: int = 4  # prompts per round (W: 32)
prompt_tokens: int = 150  # target mean prompt length in tokens (W: ~150)
max_new_tokens: int = 16  # new tokens per prompt, EOS ignored (W: 512)
sampling: str = "grpo"  # preset: grpo (T 1.0, min_p 0.1, top_k off) or greedy
rounds: int = 2  # timed rounds per backend (W: 3)
warmup_rounds: int = 1  # untimed warm-up rounds per backend
engine_options: dict = {}  # per backend: load options, rounds, warmup_rounds, warmup_max_new_tokens, timeout_s
timeout_s: float = 600.0  # wall limit per backend run in seconds
bandwidth_tb_s: float = 4.3  # device memory bandwidth for the limit (H200 measured copy: 4.3)
require_all: bool = True  # assert that every backend run succeeded
sidecar_path: str = ""  # summary sidecar (the runner sets it); backend sidecars go beside it"""

DERIVED_10 = """workload = Workload(n_prompts=n_prompts, prompt_tokens=prompt_tokens,
                    max_new_tokens=max_new_tokens, sampling=sampling, rounds=rounds,
                    warmup_rounds=warmup_rounds)
lora = LoraSpec(rank=lora_rank, alpha=2 * lora_rank) if lora_rank > 0 else None
lora_modes = [lora] * (lora is not None) + [None] * (without_lora or lora is None)
out_dir = (Path(sidecar_path).with_name(Path(sidecar_path).stem + "_backends") if sidecar_path
           else Path(tempfile.mkdtemp(prefix="phase1_")))
prompts = rollout.prepare_prompts(model, workload)
limits = rollout.workload_limits(model, workload, prompts, lora or LoraSpec(),
                               bandwidth_tb_s * 1e12)
print(gpu_name(), out_dir, "prompt lengths:", sorted(map(len, prompts)))
print(f"bandwidth limit at bandwidth_tb_s={bandwidth_tb_s} TB/s (a parameter, not measured here):",
      {("LoRA" if k else "no LoRA"): f"{v:,.0f} tok/s" for k, v in limits.items()})"""

RUN_10 = """run_id = run_stamp()  # the runner's file stamp (the time now when run by hand)
sides = []
for mode in lora_modes:
    sides += rollout.run_backends(backends, model, mode, workload, out_dir, engine_options,
                                timeout_s=timeout_s, prompts=prompts, run_id=run_id)"""

TABLE_10 = """table = rollout.comparison_table(rollout.results_frame(sides), limits)
table.drop(columns=["error", "run_id"]).round(2)"""

ERRORS_10 = """for s in sides:
    if s["error"]:
        print(f"--- {s['backend']} ---\\n{s['error'][-1500:]}")"""

PLOTS_10 = """display(rollout.bar_figure(table, ["decode_tok_per_s"], "decode tok/s (median round)",
                         "Decode throughput (prefill included in the wall time)"))
rollout.bar_figure(table, ["peak_mem_allocated_gib", "peak_mem_device_gib"], "GiB",
                 "Peak memory: torch allocated vs in use on the device")"""

INTERACTIVE_10 = """from dataclasses import replace

from nbhelpers.backends import BACKENDS
from nbhelpers.widgets import run_controls


def rerun(backends, lora_rank, n_prompts):
    \"\"\"One more run with the picked choices; its sidecars go to <out_dir>/interactive.\"\"\"
    mode = LoraSpec(rank=lora_rank, alpha=2 * lora_rank) if lora_rank else None
    got = rollout.run_backends(backends, model, mode, replace(workload, n_prompts=n_prompts),
                             out_dir / "interactive", engine_options, timeout_s=timeout_s)
    return rollout.comparison_table(rollout.results_frame(got), limits).drop(
        columns=["error", "run_id"])


run_controls(rerun, backends=(BACKENDS, backends), lora_rank=([0, 8, 16, 32, 64], lora_rank),
             n_prompts=([1, 2, 4, 8, 16, 32, 64], n_prompts))"""

SIDECAR_10 = """params = dict(model=model, backends=backends, lora_rank=lora_rank, without_lora=without_lora,
              n_prompts=n_prompts, max_new_tokens=max_new_tokens, sampling=sampling,
              rounds=rounds, bandwidth_tb_s=bandwidth_tb_s, limits_tok_per_s=limits)
summary = rollout.summary_sidecar(sides, table, "10_lora_rollout", params)
if sidecar_path:
    print("sidecar:", write_sidecar(summary, sidecar_path))
assert len(sides) == len(backends) * len(lora_modes), "a backend run left no sidecar"
for s in sides:
    if s["error"] is None:  # EOS ignored: every round returns every requested token
        assert all(r["new_tokens"] == n_prompts * max_new_tokens for r in s["rounds"]), s["backend"]
assert not (require_all and summary["error"]), f"failed runs: {summary['error']}"
display(Markdown(rollout.result_line(table)))"""

TITLE_19 = """# Phase 1: compare every rollout measurement

**Question:** across every phase 1 run archived under `executed/` (any device), how do the rollout
engines rank, with and without LoRA?

**Result:** computed in the last cell.

CPU only: this notebook reads the schema-v1 sidecars the phase 1 notebooks wrote and measures
nothing itself. The latest run of each (device, model, backend) is kept; `pct_of_vllm` compares with
vLLM on the same device and LoRA mode."""

IMPORTS_19 = """%load_ext autoreload
%autoreload 2
%matplotlib inline
import pandas as pd
from IPython.display import Markdown, display

from nbhelpers.bench import rollout
from nbhelpers.stats import make_sidecar, write_sidecar"""

PARAMS_19 = """\
executed_dir: str = "executed/phase1_rollout"  # folder searched for phase 1 sidecars
require_any: bool = True  # assert that at least one backend sidecar was found
sidecar_path: str = ""  # this notebook's summary sidecar (the runner sets it)"""

READ_19 = """# ValueError naming the fix: require_any and no phase-1 backend sidecar under executed_dir
root, sides = rollout.load_backend_sidecars(executed_dir, require_any)
frame = rollout.results_frame(sides)
print(f"{len(sides)} phase 1 backend sidecars under {root};",
      frame["gpu"].nunique() if len(frame) else 0, "device(s)")"""

TABLE_19 = """keys = ["gpu", "model"]
latest = frame.sort_values("run_id").groupby([*keys, "backend"], dropna=False).tail(1)
table = (pd.concat([rollout.comparison_table(g) for _, g in latest.groupby(keys, dropna=False)])
         if len(latest) else latest)
table.drop(columns=["error"], errors="ignore").round(2)"""

PLOTS_19 = """for (gpu, model), group in table.groupby(["gpu", "model"], dropna=False):
    display(rollout.bar_figure(group, ["decode_tok_per_s"], "decode tok/s",
                             f"{gpu}, {model}: decode"))"""

SIDECAR_19 = """summary = make_sidecar(phase="phase1", backend="summary:19_compare", extra={
    "kind": "summary", "notebook": "19_compare", "n_sidecars": len(sides),
    "table": [] if table.empty else table.to_dict(orient="records")})
if sidecar_path:
    print("sidecar:", write_sidecar(summary, sidecar_path))
assert not (require_any and not sides), f"no phase 1 sidecars under {executed_dir}"
ok = table[table["decode_tok_per_s"].notna()] if len(table) else table
assert (ok["decode_tok_per_s"] > 0).all(), "a successful run reports no throughput"
groups = ["gpu", "model", "lora"]
best = (ok.loc[ok.groupby(groups, dropna=False)["decode_tok_per_s"].idxmax()] if len(ok)
        else ok)
display(Markdown("**Result:** " + ("; ".join(
    f"{r.gpu}, {r.model}, {'LoRA' if r.lora else 'no LoRA'}: {r.backend} fastest at "
    f"{r.decode_tok_per_s:,.0f} tok/s ({r.peak_mem_device_gib:.1f} GiB on the device)"
    for r in best.itertuples()) or "no successful runs found") + "."))"""


def lora_rollout() -> nbformat.NotebookNode:
    """10_lora_rollout: run the backends, table, charts, sidecar."""
    return nbgen.build(TITLE_10, IMPORTS_10, PARAMS_10, [
        (("Derived values: workload, LoRA modes, output folder, prompt ids, and the bandwidth "
          "limit (`rollout.decode_limit_tok_per_s`: weights + KV read once per decode step)."),
         DERIVED_10),
        (("## Run every backend\nOne subprocess per backend and LoRA mode; a failure is recorded "
          "in that backend's sidecar and the next one runs."), RUN_10),
        (("## Table\n`decode_tok_per_s`: new tokens / wall seconds of a round (median); "
          "`pct_of_vllm`: vs vLLM in the same LoRA mode; `pct_of_limit`: vs the bandwidth limit; "
          "memory in GiB (`device` includes vLLM's up-front reservation)."), TABLE_10),
        ("## Errors\nTraceback tails of failed runs, if any.", ERRORS_10),
        ("## Charts", PLOTS_10),
        (("## Try other choices (JupyterLab)\nPick backends, LoRA rank and batch, then Run: the "
          "same `rollout.run_backends` call as above, into `interactive/` beside this run's "
          "sidecars. Under papermill the panel is only shown; the parameters cell drove the run."),
         INTERACTIVE_10)],
        sidecar=("## Sidecar and checks", SIDECAR_10))


def compare() -> nbformat.NotebookNode:
    """19_compare: read every phase 1 sidecar, table and charts per device."""
    return nbgen.build(TITLE_19, IMPORTS_19, PARAMS_19, [
        ("## Read the sidecars", READ_19),
        ("## Latest run per device and backend", TABLE_19),
        ("## Charts", PLOTS_19)],
        sidecar=("## Sidecar and checks", SIDECAR_19))


NOTEBOOKS = {"notebooks/phase1_rollout/10_lora_rollout.ipynb": lora_rollout,
             "notebooks/phase1_rollout/19_compare.ipynb": compare}


if __name__ == "__main__":
    raise SystemExit(nbgen.main(NOTEBOOKS))
