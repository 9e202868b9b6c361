"""GPU benchmark of the flex engine: parity vs HF, workload W with/without LoRA, batch sweep.

Writes one schema-v1 sidecar per measurement (``phase3_flex``, backend ``flex``) plus
``bench_flex.log`` under ``--out`` and prints a table last. Each stage is guarded: a failing stage
writes a sidecar with ``error`` set and the script goes on. Shares every function with notebook
33 through :mod:`nbhelpers.bench.flex_sweep`.

Run (H200): ``python scripts/bench_flex.py --out $OUT --sweep 8,32,64,128,256``
Decode-attention variants in one call (one extra W LoRA stage each):
``--decode-attention triton --decode-kernel-options '{"num_warps": 8};{"decode_attention":
"triton", "num_splits": 4}'`` (a dict's ``decode_attention`` key picks its kernel, default flex).
Run (CPU smoke): ``python scripts/bench_flex.py --cpu-smoke --out /tmp/bf``
LoRA B as one Triton kernel per group, as an extra stage: add ``--lora-expand triton``.

A/B of engine options, one fresh process per (point, variant), every sidecar with ``floor``,
``pct_of_floor`` and the kernel-class breakdown (:mod:`nbhelpers.bench.flex_ab`), e.g. old vs new
LoRA kernels on the H200 (issue 12)::

    python scripts/bench_flex.py --out $OUT --rounds 3 --max-new-tokens 256 \
      --points qwen3-4b:fp32:4,qwen3-4b:bf16:4,qwen3-4b:fp32:32,qwen3-4b:bf16:32,qwen3-4b:none:32 \
      --variants '{"name": "old", "options": {"decode_attention": "flex", "lora_expand": "addmm"}};
                  {"name": "new", "options": {}}'

(``options``: RunnerOptions fields; ``{}`` is the engine's default.) CPU smoke of the same path:
``python scripts/bench_flex.py --cpu-smoke --out /tmp/bf --points tiny:fp32:2,tiny:none:2
--prompt-tokens 6 --max-new-tokens 4 --rounds 1 --variants '{"name": "a"};{"name": "b",
"options": {"lora_expand": "addmm"}}'``.

Bad arguments (a count < 1, an unknown stage, shape or engine option, a value that is not JSON, a
non-tiny shape on a host without CUDA) print one ``error: ...`` line naming the fix and exit 2
before any model is built or anything is written (:mod:`nbhelpers.bench.flex_args`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbhelpers.bench import flex_ab as ab
from nbhelpers.bench import flex_args
from nbhelpers.bench import flex_sweep as eb
from nbhelpers.config import WORKLOAD_W, LoraSpec
from nbhelpers.stats import utc_stamp, write_sidecar

LOG_PATH: list[Path] = []
RUN_ID = utc_stamp()
"""One run_id for every sidecar of this call (figures hold to it)."""


def log(msg: str) -> None:
    """Print and append to ``bench_flex.log`` at once (a killed run keeps its log)."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    for path in LOG_PATH:
        with path.open("a") as fh:
            fh.write(line + "\n")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="executed/phase3_flex/bench")
    ap.add_argument("--sweep", default="8,64", help="comma-separated batch sizes (LoRA)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep-rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=WORKLOAD_W.max_new_tokens)
    ap.add_argument("--prompt-tokens", type=int, default=WORKLOAD_W.prompt_tokens)
    ap.add_argument("--sync-every", type=int, default=32)
    ap.add_argument("--num-generations", type=int, default=1,
                    help="A/B mode: samples per prompt (batch / this many prompts, n = this; "
                         "GRPO's num_generations: the samples share their prompt's pages)")
    ap.add_argument("--skip", default="", help=f"stages to skip: {','.join(flex_args.STAGES)}")
    ap.add_argument("--profile", action="store_true", help="kernel-class breakdown (LoRA, B=32)")
    ap.add_argument("--compiled", action="store_true",
                    help="also run W with compile_decode=True (whole step through inductor)")
    ap.add_argument("--decode-kernel-options", default="",
                    help='JSON decode kernel options, several separated by ";", one extra W LoRA '
                    'stage each, e.g. \'{"num_warps": 8};{"decode_attention": "triton", '
                    '"num_splits": 4, "lora_expand": "triton"}\' (decode_attention: flex and '
                    'lora_expand: addmm by default)')
    ap.add_argument("--decode-attention", default="", choices=["", "flex", "triton"],
                    help="an extra W LoRA stage with RunnerOptions.decode_attention set to this")
    ap.add_argument("--lora-expand", default="", choices=["", "addmm", "triton"],
                    help="extra W LoRA stage with RunnerOptions.lora_expand (triton: one LoRA-B "
                    "kernel per projection group)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU")
    ap.add_argument("--points", default="", help="A/B mode: shape:lora:batch,... (lora none|bf16|"
                    "fp32), one process per point and variant; the stages above are skipped")
    ap.add_argument("--variants", default="", help='A/B mode: \'{"name": "old", "options": '
                    '{...}};{"name": "new", "options": {}}\' (RunnerOptions fields)')
    ap.add_argument("--no-floor-gemms", action="store_true",
                    help="A/B mode: skip the cold-weight GEMM times (bandwidth + bytes still)")
    ap.add_argument("--check-only", action="store_true",
                    help="check the arguments as a run would (not the host's GPU), print "
                    "'arguments ok' and exit: what scripts/device/run_step.py --dry-run does")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: one A/B child
    args = ap.parse_args(argv)
    if args.one:  # the parent checked this child's job
        return args
    try:
        args = flex_args.check_args(args, host=not args.check_only)
    except (ValueError, TypeError) as err:  # one line naming the fix, before anything is built or written
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.check_only:
        print("arguments ok")
        raise SystemExit(0)
    return args


def model_block(model, name: str) -> dict:
    n = sum(p.numel() for p in model.parameters())
    return {"name": name, "architecture": "Qwen3ForCausalLM", "n_params": n, "weights": "random"}


def sidecar(out: Path, tag: str, model_info, lora, batch, args, res=None, error=None, extra=None):
    side = eb.flex_sidecar(tag, model_info, lora, batch, args.prompt_tokens, args.max_new_tokens,
                           res, error, extra, run_id=RUN_ID)
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


def run_parity(args, dev: str, variants: list[dict] = ()) -> dict:
    """Greedy parity vs HF of the tiny fp32 Qwen3: without LoRA on the default engine, and with
    a LoRA r8 adapter (non-zero B) on the default engine and on each distinct non-default
    ``(decode_attention, lora_expand)`` of ``variants`` (so every kernel a W stage times is
    checked against HF/PEFT first, with CUDA graphs, on this GPU)."""
    from nbhelpers.config import LoraSpec
    res = {}
    tiny = eb.random_qwen3(eb.TINY_QWEN3_SHAPE, dtype="float32", device=dev)
    prompts = eb.random_prompt_ids(3, 37, tiny.config.vocab_size, seed=1)
    res["tiny_fp32"] = eb.parity(tiny, make_llm(tiny, 4, args), prompts, 16)
    log(f"parity tiny fp32: {res['tiny_fp32']}")
    peft = eb.attach_lora(tiny, LoraSpec(rank=8, alpha=16), b_std=0.05)
    combos = {("flex", "addmm")} | {(v["decode_attention"], v["lora_expand"]) for v in variants}
    for attn, expand in sorted(combos):
        key = f"tiny_fp32_lora_{attn}_{expand}"
        res[key] = eb.parity(peft, make_llm(peft, 4, args, decode_attention=attn,
                                            lora_expand=expand), prompts, 16)
        log(f"parity {key}: {res[key]}")
    return res


def run_workload(model, name, lora, batch, args, rounds, tag, profile=False, **opts) -> dict:
    res = eb.run_flex_point(model, batch, args.prompt_tokens, args.max_new_tokens, rounds=rounds,
                            sync_every=args.sync_every, profile=profile, **opts)
    brief = {k: v for k, v in res["breakdown"].items() if not k.endswith("_tuner")}  # sidecar
    log(f"{tag}: {res['decode_tok_per_s_median']:.0f} tok/s, breakdown {brief}, "
        f"peak {res['peak_mem']}")
    return res


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)  # every check passed: only now is --out created
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:  # an A/B child: one configuration in this process
        job = json.loads(args.one)
        ab.run_config(ab.Point(**job["point"]), job["variant"], job["settings"], job["run_id"],
                      out, "cpu" if job["point"]["shape"] == "tiny" else "cuda")
        return
    LOG_PATH.append(out / "bench_flex.log")
    if args.point_list:
        return run_points(args, out)
    if args.cpu_smoke:
        import torch
        torch.set_num_threads(1)
    run_stages(args, out, args.decode_variant_list)


def run_points(args, out: Path) -> None:
    """A/B mode: every ``--points`` x ``--variants`` in its own process (module docstring)."""
    points, variants = args.point_list, args.variant_list
    settings = {"prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
                "rounds": args.rounds, "sync_every": args.sync_every,
                "floor_gemms": not args.no_floor_gemms, "num_generations": args.num_generations}
    run_id = utc_stamp()
    log(f"A/B run {run_id}: {len(points)} points x {len(variants)} variants")
    sides = ab.run_ab(points, variants, settings, run_id, out, str(Path(__file__).resolve()))
    for line in ab.ab_table(sides):
        log(line)


def run_stages(args, out: Path, variants: list[dict]) -> None:
    """The staged run: parity, W with and without LoRA, the LoRA sweep, variants."""
    dev = "cpu" if args.cpu_smoke else "cuda"
    shape = eb.TINY_QWEN3_SHAPE if args.cpu_smoke else eb.QWEN3_4B_SHAPE
    name = "tiny-qwen3-shape" if args.cpu_smoke else "qwen3-4b"
    skip, table = args.skip_stages, []
    if "parity_tiny" not in skip:
        par, err = stage("parity", run_parity, args, dev, variants)
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
    model = run_w_and_sweep(model, name, info, lora, args, out, table, skip)
    if args.compiled:
        res, err = stage("W LoRA compiled step", run_workload, model, name, lora,
                         WORKLOAD_W.n_prompts, args, args.rounds, "w_lora_compiled",
                         profile=args.profile, compile_decode=True)
        sidecar(out, "w_lora_compiled", info, lora, WORKLOAD_W.n_prompts, args, res, err,
                extra={"compile_decode": True})
        table.append(("W LoRA r32, compiled step", WORKLOAD_W.n_prompts, res))
    run_decode_variants(model, name, lora, info, args, out, table, variants)
    print_table(table)


def run_w_and_sweep(model, name, info, lora, args, out: Path, table: list, skip: set):
    """W without LoRA, then LoRA attached (in place) for W and the sweep; the PEFT model."""
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
    for batch in (args.sweep_batches if "sweep" not in skip else []):
        res, err = stage(f"sweep {batch}", run_workload, model, name, lora, batch, args,
                         args.sweep_rounds, f"sweep_b{batch}")
        sidecar(out, f"sweep_lora_b{batch}", info, lora, batch, args, res, err,
                extra={"sweep_batch": batch})
        table.append(("sweep LoRA", batch, res))
    return model


def run_decode_variants(model, name, lora, info, args, out: Path, table: list,
                        variants: list[dict]) -> None:
    """One W LoRA stage, sidecar and table row per decode variant
    (:func:`nbhelpers.bench.flex_args.decode_variants`)."""
    for var in variants:
        opts = {k: v for k, v in var.items() if k != "tag"}
        label = (f"{opts['decode_attention']} decode, lora_expand {opts['lora_expand']} "
                 f"{opts['decode_kernel_options'] or ''}").strip()
        res, err = stage(f"W LoRA {label}", run_workload, model, name, lora,
                         WORKLOAD_W.n_prompts, args, args.rounds, var["tag"],
                         profile=args.profile, **opts)
        sidecar(out, var["tag"], info, lora, WORKLOAD_W.n_prompts, args, res, err, extra=opts)
        table.append((f"W LoRA r32, {label}", WORKLOAD_W.n_prompts, res))


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
