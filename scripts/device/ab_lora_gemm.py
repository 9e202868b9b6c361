"""GPU A/B of the decode GEMMs with LoRA: cuBLAS base alone, today's path, the fused lora_gemm kernel.

Run on the device (one GPU, < 4 min with Triton compiles and tuning):
``python3 scripts/device/ab_lora_gemm.py --out $OUT`` writes ``$OUT/ab_lora_gemm.json`` and prints
a table. Check here (CPU, Triton interpreter, tiny shapes): ``python scripts/device/ab_lora_gemm.py
--dry-run``.

Shapes: Qwen3-4B decode (hidden 2560, q 4096, kv 2 x 1024, intermediate 9728, 36 layers), groups
qkv ``[4096, 1024, 1024] x 2560``, o ``2560 x 4096``, gate_up ``[9728, 9728] x 2560``, down
``2560 x 9728``; rows M in {4, 32, 64}; LoRA r=32 on every part, fp32 adapters (PEFT's
``autocast_adapter_dtype`` default, TRL's GRPO) and bf16 adapters. Variants per case:

- ``base``: cuBLAS ``F.linear(x, W)`` alone (the no-LoRA floor of today's engine);
- ``today``: LiveGroup's ``lora_expand="triton"`` path: fp32 adapters ``F.linear`` +
  ``lora_shrink`` + ``lora_expand`` (the add is in the expand); bf16 adapters one cuBLAS GEMM over
  ``[W; A]`` (``ext``) + ``lora_expand``;
- ``fused``: :func:`nbhelpers.engine.kernels.lora_gemm.lora_gemm`, its ``CONFIGS`` tuned per case
  (few rounds each), the winner re-timed; ``fused_default``: ``default_config``;
- ``fused_base``: the same kernel without LoRA (split-K skinny GEMM vs cuBLAS ``base``).

Timing: weights cold, as in a decode step (the other layers evicted them from the 50 MB L2): each
variant is captured in one CUDA graph that runs it once on each of ``n`` weight copies (W, A and B
copied; > 256 MB in all), replayed ``--rounds`` times between CUDA events; the time per call is
the median round / ``n`` (graph replay: no Python launch cost, as in the engine's captured decode
step). Numerics: every variant's output on copy 0 against fp64 math on the same inputs; a
failure is printed and the exit code is 1. ``step_ms`` sums the 4 groups x 36 layers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GROUPS = {"qkv": ([4096, 1024, 1024], 2560), "o": ([2560], 4096),
          "gate_up": ([9728, 9728], 2560), "down": ([2560], 9728)}
DRY_GROUPS = {"qkv": ([64, 32, 32], 96), "o": ([48], 64), "gate_up": ([64, 64], 48),
              "down": ([48], 136)}
LAYERS, RANK, SCALING = 36, 32, 2.0
COLD_BYTES = 256 * 2 ** 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON")
    p.add_argument("--rows", default="4,32,64", help="decode rows M, comma-separated")
    p.add_argument("--rounds", type=int, default=15, help="timed graph replays per variant")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="after this many seconds stop tuning; at 1.15x skip remaining cases")
    p.add_argument("--sha", default=None, help="git sha to record (default: git rev-parse)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: Triton interpreter, tiny shapes, perf_counter timing")
    return p.parse_args(argv)


def git_sha(given: str | None) -> str:
    """``--sha``, else ``NBHELPERS_GIT_SHA`` (run_step.py sets it; the device copy's ``.git`` is
    not this checkout's), else ``git rev-parse``."""
    if given or os.environ.get("NBHELPERS_GIT_SHA"):
        return given or os.environ["NBHELPERS_GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_copies(sizes, k, a_dtype, m, dev, cold_bytes, seed=0):
    """``x [m, k]`` and ``n`` weight sets (dicts: w, w_ext, a, bs) with > ``cold_bytes`` total."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_out, r_tot = sum(sizes), RANK * len(sizes)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
    w_ext = torch.cat([torch.randn(n_out, k, generator=g) / k ** 0.5,
                       torch.randn(r_tot, k, generator=g) / k ** 0.5]).to(torch.bfloat16).to(dev)
    bs = [(torch.randn(o, RANK, generator=g) / RANK ** 0.5).to(dev) for o in sizes]
    set_bytes = w_ext.numel() * 2 + sum(b.numel() for b in bs) * 4
    copies = []
    for i in range(max(2, -(-cold_bytes // set_bytes) + 1)):
        we = w_ext.clone() if i else w_ext
        a = we[n_out:] if a_dtype == torch.bfloat16 else we[n_out:].float()
        copies.append({"w": we[:n_out], "w_ext": we, "a": a,
                       "bs": [b.to(a_dtype).clone() for b in bs]})
    return x, copies


def variants(x, sizes, a_dtype, lg, ls, le):
    """name -> fn(copy) -> y [m, sum(sizes)] (bf16), for ``base``, ``today`` and the fused ones
    (the latter take a config)."""
    import torch
    import torch.nn.functional as F
    n_out, ranks = sum(sizes), [RANK] * len(sizes)

    def today(c):
        if a_dtype == torch.float32:
            y = F.linear(x, c["w"])
            le.lora_expand(y, ls.lora_shrink(x, c["a"]), c["bs"], sizes, ranks, SCALING)
            return y
        full = F.linear(x, c["w_ext"])
        le.lora_expand(full[:, :n_out], full[:, n_out:], c["bs"], sizes, ranks, SCALING)
        return full[:, :n_out]

    return {"base": lambda c: F.linear(x, c["w"]), "today": today,
            "fused": lambda c, cfg=None: lg.lora_gemm(x, c["w"], sizes, None, c["a"], c["bs"],
                                                      ranks, SCALING, cfg),
            "fused_base": lambda c, cfg=None: lg.lora_gemm(x, c["w"], sizes, config=cfg)}


def reference(x, c, sizes, lora: bool):
    """fp64 ``x W^T (+ s (x A^T) B_i^T)`` on copy ``c``."""
    import torch
    y = x.double() @ c["w"].double().t()
    if lora:
        xa = (x.double() @ c["a"].double().t()).split(RANK, -1)
        y = y + SCALING * torch.cat([p @ b.double().t() for p, b in zip(xa, c["bs"])], -1)
    return y


def check(y, ref) -> float | None:
    """Max |y - ref| / max|ref| if within bf16 rounding (2 ulp: today's path rounds the base
    output before the LoRA add), else ``None``."""
    err = (y.double() - ref).abs()
    scale = ref.abs().max().item()
    ok = bool((err <= 2 ** -7 * ref.abs() + 2 ** -9 * scale).all()) and y.shape == ref.shape
    return err.max().item() / scale if ok else None


def time_per_call(fn, copies, rounds: int, on_cuda: bool) -> float:
    """Median ms of one ``fn(copy)`` with cold weights (module docstring)."""
    import torch
    if not on_cuda:
        t = []
        for _ in range(max(1, rounds)):
            t0 = time.perf_counter()
            for c in copies:
                fn(c)
            t.append((time.perf_counter() - t0) * 1e3 / len(copies))
        return statistics.median(t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in copies:  # compiles / warms up outside the capture
            fn(c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in copies:
            fn(c)
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(copies))
    del graph
    return statistics.median(times)


def tune_fused(fn, copies, configs, sizes, rounds, on_cuda, tune_name):
    """``(configs ranked fastest first, {name: ms or error})`` over those fitting ``sizes``;
    a config that fails to launch (out of resources) is recorded and skipped."""
    from nbhelpers.engine.kernels import lora_gemm as lg
    times, ok = {}, {}
    for cfg in (c for c in configs if lg.block_ok(sizes, c.block_n)):
        try:
            ok[cfg] = times[tune_name(cfg)] = time_per_call(
                lambda c, cfg=cfg: fn(c, cfg), copies, max(3, rounds // 3), on_cuda)
        except Exception as err:  # noqa: BLE001 -- a failed config is data, not the end
            times[tune_name(cfg)] = f"{type(err).__name__}: {err}"[:200]
    return sorted(ok, key=ok.get), times


def run_case(group, m, a_dtype, ctx) -> dict:
    """One (group, rows, adapter dtype) case: times and numerics of every variant."""
    import torch

    from nbhelpers.engine.kernels import lora_gemm as lg
    from nbhelpers.engine.kernels import lora_gemm_tune as tune
    sizes, k = ctx["groups"][group]
    x, copies = make_copies(sizes, k, a_dtype, m, ctx["dev"], ctx["cold_bytes"])
    fns = variants(x, sizes, a_dtype, lg, ctx["ls"], ctx["le"])
    row = {"group": group, "M": m, "adapters": str(a_dtype).removeprefix("torch."),
           "N": sizes, "K": k, "copies": len(copies), "ms": {}, "rel_err": {}, "fail": []}
    refs = {True: reference(x, copies[0], sizes, True), False: reference(x, copies[0], sizes,
                                                                          False)}
    tuning = time.monotonic() - ctx["t0"] < ctx["budget"]
    plan = {"base": (fns["base"], False), "today": (fns["today"], True),
            "fused_default": (fns["fused"], True)}
    if ctx["with_base"]:
        plan["fused_base"] = (fns["fused_base"], False)
    if tuning:  # at later M only the 3 best of the group's first M (compiles dominate)
        short = ctx["ranked"].get((group, a_dtype))
        ranked, row["tuning_ms"] = tune_fused(fns["fused"], copies, short[:3] if short else
                                              ctx["configs"], sizes, ctx["rounds"],
                                              ctx["on_cuda"], tune.config_name)
        ctx["ranked"].setdefault((group, a_dtype), ranked)
        best = ranked[0]
        row["fused_config"] = tune.config_name(best)
        plan["fused"] = (lambda c, best=best: fns["fused"](c, best), True)
    for name, (fn, lora) in plan.items():
        row["ms"][name] = time_per_call(fn, copies, ctx["rounds"], ctx["on_cuda"])
        err = check(fn(copies[0]), refs[lora])
        row["rel_err"][name] = err
        if err is None:
            row["fail"].append(name)
    w_bytes = sum(sizes) * k * 2
    row["tb_s"] = {n: w_bytes / (t * 1e-3) / 1e12 for n, t in row["ms"].items()}
    del copies, x
    if ctx["on_cuda"]:
        torch.cuda.empty_cache()
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per (M, adapters): the 36-layer step's GEMM ms for base / today / fused, where ``best``
    takes per group the faster of today and fused (what the engine's tuner would pick)."""
    out = []
    for key in sorted({(r["M"], r["adapters"]) for r in rows}):
        rs = [r for r in rows if (r["M"], r["adapters"]) == key]
        tot = {}
        for name in ("base", "today", "fused", "fused_default"):
            if all(name in r["ms"] for r in rs):
                tot[name] = LAYERS * sum(r["ms"][name] for r in rs)
        if "fused" in tot:
            tot["best"] = LAYERS * sum(min(r["ms"]["today"], r["ms"]["fused"]) for r in rs)
        out.append({"M": key[0], "adapters": key[1], "groups": len(rs), "step_ms": tot})
    return out


def print_table(rows: list[dict], sums: list[dict]) -> None:
    cols = ("base", "today", "fused", "fused_default", "fused_base")
    print(f"{'group':8} {'M':>3} {'lora':8} " + " ".join(f"{c + ' us':>16}" for c in cols)
          + "  config / fail")
    for r in rows:
        cells = " ".join(f"{r['ms'][c] * 1e3:10.1f} ({r['tb_s'][c]:3.1f})" if c in r["ms"]
                         else f"{'-':>16}" for c in cols)
        print(f"{r['group']:8} {r['M']:3d} {r['adapters']:8} {cells}  "
              f"{r.get('fused_config', 'untuned')} {' '.join(r['fail'])}")
    print("(time per call in us, (TB/s of base-weight bytes)); 36-layer GEMM step, ms:")
    for s in sums:
        print(f"  M={s['M']:3d} {s['adapters']:8} "
              + " ".join(f"{k}={v:.3f}" for k, v in s["step_ms"].items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch
    import triton

    from nbhelpers.engine.kernels import lora_expand as le
    from nbhelpers.engine.kernels import lora_gemm as lg
    from nbhelpers.engine.kernels import lora_shrink as ls
    on_cuda = torch.cuda.is_available() and not args.dry_run
    if not on_cuda and not args.dry_run:
        print("no CUDA device: use --dry-run on the CPU", file=sys.stderr)
        return 2
    ctx = {"groups": DRY_GROUPS if args.dry_run else GROUPS, "dev": "cuda" if on_cuda else "cpu",
           "cold_bytes": COLD_BYTES if on_cuda else 0, "ls": ls, "le": le, "on_cuda": on_cuda,
           "rounds": args.rounds, "budget": args.budget_s, "t0": time.monotonic(),
           "ranked": {}, "configs": lg.CONFIGS if on_cuda else (lg.Config(32, 32, 1), lg.Config(16, 32, 3))}
    rows, skipped = [], []
    cases = [(g, m, dt) for m in map(int, args.rows.split(","))
             for dt in (torch.float32, torch.bfloat16) for g in ctx["groups"]]
    for g, m, dt in cases:
        if time.monotonic() - ctx["t0"] > 1.15 * args.budget_s:
            skipped.append(f"{g}/M{m}/{dt}")
            continue
        ctx["with_base"] = dt == torch.float32  # the no-LoRA kernel once per (group, M)
        rows.append(run_case(g, m, dt, ctx))
        r = rows[-1]
        print(f"[{time.monotonic() - ctx['t0']:6.1f} s] {g} M={m} {r['adapters']}: "
              + " ".join(f"{k}={v * 1e3:.1f}us" for k, v in r["ms"].items()), flush=True)
    sums = summary(rows)
    print_table(rows, sums)
    fails = [f"{r['group']}/M{r['M']}/{r['adapters']}:{n}" for r in rows for n in r["fail"]]
    result = {"gpu": torch.cuda.get_device_name() if on_cuda else "cpu (dry run, interpreter)",
              "torch": torch.__version__, "triton": triton.__version__,
              "git_sha": git_sha(args.sha), "rank": RANK, "scaling": SCALING,
              "layers": LAYERS, "rounds": args.rounds, "wall_s": time.monotonic() - ctx["t0"],
              "rows": rows, "summary": sums, "skipped": skipped, "numerics_failures": fails}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_lora_gemm.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'ab_lora_gemm.json'}; skipped {skipped or 'none'}; "
          f"numerics failures {fails or 'none'}; {result['wall_s']:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
