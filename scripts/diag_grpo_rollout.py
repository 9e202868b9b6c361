"""Why the flex rollout inside GRPO decodes slower than the engine benchmark, measured on one GPU.

Phase 2 on the H200 (2026-11-30, ``executed/phase2_grpo/20_grpo_equivalence/*27cfed8__flex.json``)
generated 4 x 256 tokens per step in 1.82 s, 7.1 ms per decode step at batch 4, while the engine
benchmark (33, bf16 LoRA r32) decodes batch 8 in about 4.5 ms per step. One difference is the
adapter dtype: TRL's ``GRPOTrainer`` builds the PEFT model with PEFT's default
``autocast_adapter_dtype=True`` (trl 1.15 grpo_trainer.py, around line 450), so LoRA A/B are fp32
on the bf16 base, and the engine then takes its separate-A path (cast + fp32 GEMM per projection
group) instead of joining A to the base GEMM. This script times the same rollout shape (one
100-token prompt, ``n=4``, 256 new tokens, min_p 0.1, EOS ignored; also batch 8) for: bf16
adapters, fp32 adapters, fp32 adapters on a model in TRL's training state (``train()`` and
gradient checkpointing), and no LoRA; each with the decode-step kernel profile.

Writes ``<out>/diag_grpo_rollout.json`` and prints one line per variant.
Run (GPU): ``PYTHONPATH=$PWD python3 scripts/diag_grpo_rollout.py --out $OUT``.
CPU smoke (tiny shape, no timing meaning): ``--model tiny-qwen3 --device cpu``.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def variant(base, name: str, lora, log) -> tuple:
    """``(policy, undo)``: the model for one variant and a function that restores ``base``."""
    from nbhelpers.bench import flex_sweep as eb
    if name == "no_lora":
        return base, lambda: None
    # non-zero B, as after some training; fp32 = PEFT's default upcast (TRL's GRPO case)
    peft = eb.attach_lora(base, lora, b_std=0.01,
                          adapter_dtype="float32" if name.startswith("fp32") else "model")
    dtypes = sorted({str(p.dtype) for n, p in peft.named_parameters() if "lora_" in n})
    log(f"{name}: adapter dtypes {dtypes}")
    if name.endswith("_train"):  # TRL's state during GRPO (grad checkpointing on by default)
        peft.train()
        peft.gradient_checkpointing_enable()
        peft.enable_input_require_grads()

    def undo():
        peft.unload()
        base.eval()
    return peft, undo


def measure(policy, batch: int, rounds: int, profile: bool, device: str) -> dict:
    import torch

    from nbhelpers.backends.flex import build_llm
    from nbhelpers.bench import flex_sweep as eb
    from nbhelpers.config import SamplingParams
    n = 4
    heads = eb.random_prompt_ids(batch // n, 100, policy.config.vocab_size)
    sampling = SamplingParams(temperature=1.0, min_p=0.1, n=n, max_new_tokens=256,
                              ignore_eos=True, seed=3407)
    llm = build_llm(policy, [], kv_tokens=batch * 357, max_model_len=357)  # as FlexRollout
    with torch.no_grad():
        res = eb.bench_one(llm, heads, sampling, rounds=rounds, warmup=1)
        if profile and device == "cuda":
            res["breakdown"]["profile"] = eb.profile_decode_step(llm, batch)
    llm.sleep()
    return res


def run_variant(base, name: str, lora, a: argparse.Namespace, log) -> dict:
    """One variant's decode timings per batch size (``a.batches``, ``a.rounds``), or its error
    and traceback tail (the other variants go on)."""
    t0 = time.perf_counter()
    try:
        policy, undo = variant(base, name, lora, log)
        rows = {}
        for b in (int(x) for x in a.batches.split(",")):
            r = measure(policy, b, a.rounds, profile=True, device=a.device)
            rows[b] = {"wall_s_median": r.get("wall_s_median"),
                       "decode_tok_per_s_median": r.get("decode_tok_per_s_median"),
                       "breakdown": r["breakdown"]}
            bd = r["breakdown"]
            prof = bd.get("profile", {})
            log(f"{name} b{b}: generate {r.get('wall_s_median')} s, decode step "
                f"{bd['decode_step_ms']:.2f} ms, replay {bd.get('replay_ms')} ms, kernels "
                f"{prof.get('kernels_per_step')}, by class {prof.get('kernel_ms_per_step')}")
        undo()
        return {"batches": rows, "s": round(time.perf_counter() - t0, 1)}
    except Exception as err:  # noqa: BLE001 -- the other variants go on
        log(f"{name}: {type(err).__name__}: {err}")
        return {"error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-2500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="executed/phase2_grpo/bench")
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--variants", default="bf16_adapters,fp32_adapters,fp32_adapters_train,"
                    "no_lora")
    a = ap.parse_args()
    import torch

    from nbhelpers import models
    from nbhelpers.config import LoraSpec
    from nbhelpers.stats import env_info
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    on_gpu = a.device == "cuda"
    base, _ = models.load_model(a.model, dtype="bfloat16" if on_gpu else "float32",
                                device=a.device, seed=3407)
    lora = LoraSpec(rank=32, alpha=64)
    report = {"env": env_info(), "model": a.model, "lora": {"rank": 32, "alpha": 64},
              "shape": {"prompt_tokens": 100, "n": 4, "max_new_tokens": 256, "min_p": 0.1},
              "variants": {}}
    for name in a.variants.split(","):
        report["variants"][name] = run_variant(base, name, lora, a, log)
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        (out / "diag_grpo_rollout.json").write_text(json.dumps(report, indent=1, default=str))
    log(f"wrote {out / 'diag_grpo_rollout.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
