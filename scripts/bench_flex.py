"""GPU benchmark of the flex engine: parity vs HF, workload W with/without LoRA, batch sweep.

Writes one schema-v1 sidecar per measurement (``phase3_flex``, backend ``flex``) plus
``bench_flex.log`` under ``--out`` and prints a table last. Each stage is guarded: a failing stage
writes a sidecar with ``error`` set and the script goes on. Shares every function with notebook
33 through :mod:`nbhelpers.engine_bench`.

Run (H200): ``python scripts/bench_flex.py --out $OUT --sweep 8,32,64,128,256``
Run (CPU smoke): ``python scripts/bench_flex.py --cpu-smoke --out /tmp/bf``
LoRA B as one Triton kernel per group, as an extra stage: add ``--lora-expand triton``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbhelpers import engine_bench as eb
from nbhelpers.config import WORKLOAD_W, LoraSpec
from nbhelpers.stats import utc_stamp, write_sidecar

LOG_PATH: list[Path] = []


def log(msg: str) -> None:
    """Print and append to ``bench_flex.log`` at once (a killed run keeps its log)."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    for path in LOG_PATH:
        with path.open("a") as fh:
            fh.write(line + "\n")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="executed/phase3_flex/bench")
    ap.add_argument("--sweep", default="8,64", help="comma-separated batch sizes (LoRA)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep-rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=WORKLOAD_W.max_new_tokens)
    ap.add_argument("--prompt-tokens", type=int, default=WORKLOAD_W.prompt_tokens)
    ap.add_argument("--sync-every", type=int, default=32)
    ap.add_argument("--skip", default="", help="stages to skip: parity_tiny,parity,w,sweep")
    ap.add_argument("--profile", action="store_true", help="kernel-class breakdown (LoRA, B=32)")
    ap.add_argument("--compiled", action="store_true",
                    help="also run W with compile_decode=True (whole step through inductor)")
    ap.add_argument("--decode-kernel-options", default="",
                    help='JSON flex decode kernel options for an extra W LoRA stage, e.g. '
                    '\'{"SPLIT_KV": 4, "num_warps": 8}\'')
    ap.add_argument("--lora-expand", default="", choices=["", "addmm", "triton"],
                    help="extra W LoRA stage with RunnerOptions.lora_expand (triton: one LoRA-B "
                    "kernel per projection group)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU")
    return ap.parse_args()


def model_block(model, name: str) -> dict:
    n = sum(p.numel() for p in model.parameters())
    return {"name": name, "architecture": "Qwen3ForCausalLM", "n_params": n, "weights": "random"}


def sidecar(out: Path, tag: str, model_info, lora, batch, args, res=None, error=None, extra=None):
    side = eb.flex_sidecar(tag, model_info, lora, batch, args.prompt_tokens, args.max_new_tokens,
                           res, error, extra)
    write_sidecar(side, out / f"{utc_stamp()}_{tag}.json")
    return side


def make_llm(model, batch: int, args, **opts):
    from nbhelpers.backends.flex import build_llm
    per_seq = args.prompt_tokens + args.max_new_tokens
    return build_llm(model, [], kv_tokens=batch * (per_seq + 128), max_num_seqs=max(batch, 8),
                     max_model_len=per_seq + 64, sync_every=args.sync_every, **opts)


def stage(name: str, fn, *a, **k):
    t0 = time.perf_counter()
    try:
        out = fn(*a, **k)
        log(f"{name}: ok in {time.perf_counter() - t0:.1f}s")
        return out, None
    except Exception as err:  # noqa: BLE001 -- a failed stage is recorded, the run goes on
        log(f"{name}: FAILED {type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
        return None, f"{type(err).__name__}: {err}"


def run_parity(args, dev: str) -> dict:
    res = {}
    tiny = eb.random_qwen3(eb.TINY_QWEN3_SHAPE, dtype="float32", device=dev)
    llm = make_llm(tiny, 4, args)
    prompts = eb.random_prompt_ids(3, 37, tiny.config.vocab_size, seed=1)
    res["tiny_fp32"] = eb.parity(tiny, llm, prompts, 16)
    log(f"parity tiny fp32: {res['tiny_fp32']}")
    return res


def run_workload(model, name, lora, batch, args, rounds, tag, profile=False, **opts) -> dict:
    res = eb.run_flex_point(model, batch, args.prompt_tokens, args.max_new_tokens, rounds=rounds,
                            sync_every=args.sync_every, profile=profile, **opts)
    log(f"{tag}: {res['decode_tok_per_s_median']:.0f} tok/s, breakdown {res['breakdown']}, "
        f"peak {res['peak_mem']}")
    return res


def main() -> None:
    args = parse()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG_PATH.append(out / "bench_flex.log")
    if args.cpu_smoke:
        import torch
        torch.set_num_threads(1)
    dev = "cpu" if args.cpu_smoke else "cuda"
    shape = eb.TINY_QWEN3_SHAPE if args.cpu_smoke else eb.QWEN3_4B_SHAPE
    name = "tiny-qwen3-shape" if args.cpu_smoke else "qwen3-4b"
    skip, table = set(args.skip.split(",")), []
    if "parity_tiny" not in skip:
        par, err = stage("parity", run_parity, args, dev)
        (out / "parity.json").write_text(json.dumps({"parity": par, "error": err}, indent=1))
    model = eb.random_qwen3(shape, device=dev,
                            dtype="float32" if args.cpu_smoke else "bfloat16")
    info = model_block(model, name)
    if "parity" not in skip:
        llm = make_llm(model, 4, args)
        par, err = stage("parity 4b bf16", eb.parity, model, llm,
                         eb.random_prompt_ids(2, args.prompt_tokens, shape["vocab_size"], 2), 16)
        log(f"parity {name} bf16: {par} {err or ''}")
        llm.sleep()
    lora = LoraSpec(rank=32, alpha=64)
    if "w" not in skip:
        res, err = stage("W no LoRA", run_workload, model, name, None, WORKLOAD_W.n_prompts, args,
                         args.rounds, "w_nolora")
        sidecar(out, "w_nolora", info, None, WORKLOAD_W.n_prompts, args, res, err)
        table.append(("W no LoRA", WORKLOAD_W.n_prompts, res))
    model = eb.attach_lora(model, lora)
    if "w" not in skip:
        res, err = stage("W LoRA", run_workload, model, name, lora, WORKLOAD_W.n_prompts, args,
                         args.rounds, "w_lora", profile=args.profile)
        sidecar(out, "w_lora", info, lora, WORKLOAD_W.n_prompts, args, res, err)
        table.append(("W LoRA r32", WORKLOAD_W.n_prompts, res))
    for batch in ([int(b) for b in args.sweep.split(",") if b] if "sweep" not in skip else []):
        res, err = stage(f"sweep {batch}", run_workload, model, name, lora, batch, args,
                         args.sweep_rounds, f"sweep_b{batch}")
        sidecar(out, f"sweep_lora_b{batch}", info, lora, batch, args, res, err,
                extra={"sweep_batch": batch})
        table.append(("sweep LoRA", batch, res))
    if args.compiled:
        res, err = stage("W LoRA compiled step", run_workload, model, name, lora,
                         WORKLOAD_W.n_prompts, args, args.rounds, "w_lora_compiled",
                         profile=args.profile, compile_decode=True)
        sidecar(out, "w_lora_compiled", info, lora, WORKLOAD_W.n_prompts, args, res, err,
                extra={"compile_decode": True})
        table.append(("W LoRA r32, compiled step", WORKLOAD_W.n_prompts, res))
    if args.decode_kernel_options:
        kopts = json.loads(args.decode_kernel_options)
        res, err = stage(f"W LoRA kernel options {kopts}", run_workload, model, name, lora,
                         WORKLOAD_W.n_prompts, args, args.rounds, "w_lora_kopts",
                         profile=args.profile, decode_kernel_options=kopts)
        sidecar(out, "w_lora_kopts", info, lora, WORKLOAD_W.n_prompts, args, res, err,
                extra={"decode_kernel_options": kopts})
        table.append((f"W LoRA r32, {kopts}", WORKLOAD_W.n_prompts, res))
    if args.lora_expand:
        table.append(run_lora_expand(args, model, name, info, lora, out))
    print_table(table)


def run_lora_expand(args, model, name, info, lora, out) -> tuple:
    """W LoRA stage with ``lora_expand=args.lora_expand``; its sidecar and table row."""
    mode = args.lora_expand
    res, err = stage(f"W LoRA lora_expand={mode}", run_workload, model, name, lora,
                     WORKLOAD_W.n_prompts, args, args.rounds, f"w_lora_expand_{mode}",
                     profile=args.profile, lora_expand=mode)
    sidecar(out, f"w_lora_expand_{mode}", info, lora, WORKLOAD_W.n_prompts, args, res, err,
            extra={"lora_expand": mode})
    return (f"W LoRA r32, lora_expand={mode}", WORKLOAD_W.n_prompts, res)


def print_table(table) -> None:
    lines = [("| run | batch | tok/s | wall s | prefill s | step ms | replay ms | host ms/step | "
             "peak GiB |"), "|---|---|---|---|---|---|---|---|---|"]
    for label, batch, res in table:
        if not res:
            lines.append(f"| {label} | {batch} | FAILED | | | | | | |")
            continue
        b, mem = res["breakdown"], res["peak_mem"] or {}
        fmt = lambda x, f=".2f": "-" if x is None else format(x, f)
        lines.append(f"| {label} | {batch} | {fmt(res['decode_tok_per_s_median'], '.0f')} | "
                     f"{fmt(res['wall_s_median'])} | {fmt(b['prefill_s'])} | "
                     f"{fmt(b['decode_step_ms'])} | {fmt(b.get('replay_ms'))} | "
                     f"{fmt(b.get('host_overhead_ms_per_step'))} | "
                     f"{fmt(mem.get('allocated'))} |")
    for line in lines:
        log(line)


if __name__ == "__main__":
    main()
