"""Locate the Gemma-4 E2B flex-vs-HF mismatch seen on the H200 (34_gemma4, 2026-11-30, bf16:
argmax agreement 0 of 512, mean |dlogprob| 2.4, already at the first generated token) while CPU
parity (eager flex, fp32/fp64, tiny and E2B-pattern configs) is exact.

One GPU process: load the E2B architecture (random weights, norms/scalars randomised as in 34),
then teacher-forced parity (``gemma4_report.teacher_forced_parity``: engine greedy tokens scored
again by one HF forward) for engine configurations that switch the GPU-only pieces one at a time:
compiled flex_attention, compiled elementwise layers, CUDA-graph decode; plus HF sdpa vs HF eager
(is the reference self-consistent?) and the default engine in fp32. Writes
``<out>/diag_gemma4.json`` and prints one line per configuration.

Run (GPU): ``PYTHONPATH=$PWD python3 scripts/diag_gemma4.py --out $OUT``.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path

CONFIGS = {  # RunnerOptions overrides; None = the engine's CUDA defaults (all on)
    "eager_all": {"compile_attention": False, "compile_layers": False, "use_cuda_graphs": False},
    "compiled_attention_only": {"compile_attention": True, "compile_layers": False,
                                "use_cuda_graphs": False},
    "compiled_layers_only": {"compile_attention": False, "compile_layers": True,
                             "use_cuda_graphs": False},
    "default": {},
}


def run(dtype: str, configs: dict, steps: int, n_prompts: int, log, model: str = "gemma-4-e2b",
        device: str = "cuda") -> dict:
    import torch

    from nbhelpers import data, models
    from nbhelpers.bench import gemma4_report as g4
    res = {}
    hf, tok = models.load_model(model, dtype=dtype, device=device)
    g4.randomise_norms_and_scalars(hf)
    prompts = data.workload_prompt_ids(tok, n_prompts, 150, seed=1)
    try:
        res["hf_sdpa_vs_eager"] = g4.hf_noise_floor(hf, prompts[:1])
        log(f"[{dtype}] hf sdpa vs eager: {res['hf_sdpa_vs_eager']}")
    except Exception as err:  # noqa: BLE001 -- diagnostics go on
        res["hf_sdpa_vs_eager"] = {"error": f"{type(err).__name__}: {err}"}
    for name, opts in configs.items():
        t0 = time.perf_counter()
        try:
            llm = g4.parity_llm(hf, prompts, steps, 128 if device == "cuda" else 16, **opts)
            summary, frame = g4.teacher_forced_parity(hf, llm, prompts, steps)
            summary["first_step_abs_diff"] = float(frame[frame["step"] == 0]["abs_diff"].max())
            res[name] = summary | {"options": opts, "s": round(time.perf_counter() - t0, 1)}
            del llm
        except Exception as err:  # noqa: BLE001
            res[name] = {"error": f"{type(err).__name__}: {err}",
                         "traceback": traceback.format_exc()[-2500:], "options": opts}
        log(f"[{dtype}] {name}: {res[name]}")
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    del hf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--model", default="gemma-4-e2b", help="tiny-gemma4 for a CPU smoke run")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = (out / "diag_gemma4.log").open("a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    kw = {"model": a.model, "device": a.device}
    configs = CONFIGS if a.device == "cuda" else {"eager_all": CONFIGS["eager_all"]}
    result = {"bf16": run("bfloat16", configs, a.steps, a.prompts, log, **kw)}
    (out / "diag_gemma4.json").write_text(json.dumps(result, indent=1, default=str))
    configs = {"default": {}, "eager_all": CONFIGS["eager_all"]} if a.device == "cuda" else configs
    result["fp32"] = run("float32", configs, a.steps, a.prompts, log, **kw)
    (out / "diag_gemma4.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
