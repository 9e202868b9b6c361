"""GPU A/B of the paged decode attention kernels: ``v1``, ``v2`` (the engine's "auto" picks v1
under 16 rows, v2 from there) and the opt-in one-launch ``fused``.

Run on the device (one GPU, ~2-4 min with Triton compiles): ``python3 scripts/device/
ab_paged_decode.py --out $OUT`` writes ``$OUT/ab_paged_decode.json`` and prints a table. Check here
(CPU, Triton interpreter, tiny shapes): ``python scripts/device/ab_paged_decode.py --dry-run``.

Shapes (bf16, page ``--page`` 128 = the engine's CUDA default, shuffled pages, ragged rows ``ctx -
[0, 32)`` tokens): Qwen3-4B (32 q / 8 kv heads, D 128), Gemma-4 E2B sliding layers (8 / 1, D 256,
window 512) and full layers (8 / 1, D 512) (``--models``); ``--batches`` x ``--contexts``
(default 4..256 x {406, 662}: workload W's mean and last context, 150 + 256 and 150 + 512).
Variants (``nbhelpers.engine.kernels.paged_decode``, splits at ``--max-model-len``, default 726
= W's): ``v1`` (:func:`choose_num_splits`), ``v2`` (:func:`plan_num_splits`), ``v2_s1`` (one
split, one launch), ``v2_w4`` (4 waves of programs), ``v2_st3`` (3 pipeline stages), ``fused``
(:func:`plan_num_splits_fused`: one wave of resident programs, splits merged in-kernel),
``fused_2x`` (twice the splits: is one wave right?); ``--pdl both`` (default) times each with
and without Programmatic Dependent Launch (``+pdl`` rows; the engine's default on Hopper).

Timing: KV cold, as in a decode step: each variant is captured in one CUDA graph that runs it once
on each of ``n`` pool copies (> 256 MB in all), replayed ``--rounds`` times between CUDA events;
time per call = median round / ``n``. ``tb_s`` = K+V bytes the rows must read (visible tokens x
H_kv x D x 2 x 2 B) / time; ``pct_of_read`` against a 4 GiB ``sum`` measured here (as
/work/shared/tools/gemv_roofline.py). Numerics: each variant on copy 0 vs fp32 torch attention,
max |err| <= 2e-2; a failure (or an exception) is printed and the exit code is 1.
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

MODELS = {"qwen3_4b": (32, 8, 128, None), "gemma4_sliding": (8, 1, 256, 512),
          "gemma4_full": (8, 1, 512, None)}  # heads, kv heads, head dim, window
VARIANTS = {"v1": {"kernel": "v1"}, "v2": {"kernel": "v2"}, "v2_s1": {"kernel": "v2", "S": 1},
            "v2_w4": {"kernel": "v2", "waves": 4.0}, "v2_st3": {"kernel": "v2", "num_stages": 3},
            "fused": {"kernel": "fused"}, "fused_2x": {"kernel": "fused", "split_x": 2}}
TOL = 2e-2


def make_pool(torch, lens, kv_heads, dim, page, dev, gen, dtype):
    """``(k, v [1, H_kv, slots, D], block_table [B, P])`` with shuffled pages (0 = null)."""
    need = [-(-n // page) for n in lens]
    num_pages = sum(need) + 1
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    shape = (1, kv_heads, num_pages * page, dim)
    k = torch.randn(shape, device=dev, dtype=dtype)
    return k, torch.randn_like(k), bt.to(dev)


def reference(torch, q, k, v, bt, lens, page, window):
    """fp32 attention ``[B, H, D]`` over the gathered pages, GQA by head groups."""
    bsz, heads, dim = q.shape
    kvh, lmax = k.shape[1], int(lens.max())
    pos = torch.arange(lmax, device=q.device)
    slots = bt.long()[:, pos // page] * page + pos % page  # [B, L]
    kk, vv = k[0][:, slots].float(), v[0][:, slots].float()  # [H_kv, B, L, D]
    s = torch.einsum("bkgd,kbld->bkgl", q.float().view(bsz, kvh, heads // kvh, dim), kk)
    keep = pos[None] < lens[:, None]
    if window:
        keep &= pos[None] >= lens[:, None] - window
    s = s.masked_fill(~keep[:, None, None], float("-inf")) * dim ** -0.5
    return torch.einsum("bkgl,kbld->bkgd", s.softmax(-1), vv).reshape(bsz, heads, dim)


def graph_us(torch, fns, rounds):
    """Median microseconds per call of ``fns`` (one call per pool copy) in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(fns))
    return statistics.median(times)


def splits_of(pd, name, batch, kv_heads, dim, max_len, sms, block_n):
    spec = VARIANTS[name]
    if "S" in spec:
        return spec["S"]
    if spec["kernel"] == "v1":
        return pd.choose_num_splits(batch, kv_heads, max_len, sms)
    if spec["kernel"] == "fused":
        s = pd.plan_num_splits_fused(batch, kv_heads, max_len, sms, pd.resident_programs(dim),
                                     block_n or pd.default_block_n(dim))
        return min(pd.MAX_SPLITS, s * spec.get("split_x", 1))
    return pd.plan_num_splits(batch, kv_heads, max_len, sms, spec.get("waves", pd.TARGET_WAVES))


def run_point(torch, pd, model, batch, ctx, args, sms, dev, gen):
    """Rows of the table for one (model, batch, context): every variant timed and checked."""
    heads, kvh, dim, window = MODELS[model]
    lens = [max(1, ctx - int(x)) for x in torch.randint(0, 32, (batch,), generator=gen)]
    visible = sum(min(n, window or n) for n in lens)
    nbytes = visible * kvh * dim * 2 * 2
    copies = 1 if args.dry_run else min(64, max(2, -(-(256 << 20) // nbytes)))
    dtype = torch.float32 if args.dry_run else torch.bfloat16  # interpreter: no bf16 tl.dot
    pools = [make_pool(torch, lens, kvh, dim, args.page, dev, gen, dtype) for _ in range(copies)]
    seq = torch.tensor(lens, device=dev, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device=dev, dtype=dtype)
    ref = reference(torch, q, *pools[0], seq, args.page, window)
    rows = []
    for name, spec, on in [(n, s, on) for n, s in VARIANTS.items() for on in args.pdl_modes]:
        s = splits_of(pd, name, batch, kvh, dim, args.max_model_len, sms, args.block_n)
        kw = {"kernel": spec["kernel"], "num_stages": spec.get("num_stages", 2),
              "sliding_window": window}
        if args.block_n:
            kw["block_n"] = args.block_n
        row = {"model": model, "batch": batch, "ctx": ctx, "variant": name + "+pdl" * on,
               "pdl": on, "num_splits": s, "kv_bytes": nbytes, "copies": copies}
        try:
            fns = [lambda p=p, on=on, s=s, kw=kw: _call(pd, on, q, p, seq, dim ** -0.5,
                                                        args.page, s, kw) for p in pools]
            err = (fns[0]().float() - ref).abs().max().item()
            row.update(max_err=err, ok=err <= TOL)
            row["us"] = (graph_us(torch, fns, args.rounds) if dev == "cuda"
                         else _cpu_us(fns[0]))
        except Exception as exc:  # a variant that does not compile is a result too
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
        rows.append(row)
    return rows


def _call(pd, on, q, pool, seq, scale, page, splits, kw):
    """One kernel call, PDL-launched iff ``on`` (``pdl.scope``; off under the interpreter)."""
    from nbhelpers.engine.kernels import pdl
    with pdl.scope(on):
        return pd.paged_decode_attention(q, pool[0], pool[1], pool[2], seq, scale, page, splits,
                                         **kw)


def _cpu_us(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def read_bandwidth(torch):
    """TB/s of a 4 GiB bf16 ``sum`` (read once), CUDA-graph timed."""
    big = torch.ones(1 << 31, device="cuda", dtype=torch.bfloat16)
    us = graph_us(torch, [lambda: big.sum(dtype=torch.float32)] * 3, 5)
    return (2 << 31) / us / 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ab_paged_decode"),
                    help="folder for ab_paged_decode.json (default: $OUT, else /tmp/ab_paged_decode)")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--page", type=int, default=128, help="the engine's CUDA default")
    ap.add_argument("--max-model-len", type=int, default=726, help="W: 150 + 512 + 64")
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {list(MODELS)}")
    ap.add_argument("--batches", default="4,8,32,64,128,256")
    ap.add_argument("--contexts", default="406,662", help="W's mean and last context")
    ap.add_argument("--pdl", choices=("off", "on", "both"), default="both")
    args = ap.parse_args(argv)
    args.pdl_modes = {"off": [False], "on": [True], "both": [False, True]}[args.pdl]
    if unknown := sorted(set(args.models.split(",")) - set(MODELS)):
        ap.error(f"--models {unknown}: choose from {list(MODELS)}")
    for name in set(MODELS) - set(args.models.split(",")):
        del MODELS[name]
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        MODELS.clear()
        MODELS.update({"tiny_gqa2": (4, 2, 16, None), "tiny_window": (4, 1, 32, 16)})
        args.page, args.max_model_len = 16, 512  # several splits, most of them empty
    import torch
    import triton

    from nbhelpers.engine.kernels import paged_decode as pd
    dev = "cpu" if args.dry_run else "cuda"
    sms = 132 if args.dry_run else torch.cuda.get_device_properties(0).multi_processor_count
    read_tb_s = None if args.dry_run else read_bandwidth(torch)
    gen = torch.Generator().manual_seed(0)
    grid = [(2, 40), (3, 23)] if args.dry_run else [
        (int(b), int(c)) for b in args.batches.split(",") for c in args.contexts.split(",")]
    rows = []
    for model in MODELS:
        for batch, ctx in grid:
            rows += run_point(torch, pd, model, batch, ctx, args, sms, dev, gen)
    for r in rows:
        if "us" in r and read_tb_s:
            r["tb_s"] = r["kv_bytes"] / r["us"] / 1e6
            r["pct_of_read"] = 100 * r["tb_s"] / read_tb_s
    result = {"gpu": "cpu-interpreter" if args.dry_run else torch.cuda.get_device_name(0),
              "torch": torch.__version__, "triton": triton.__version__, "git_sha": _sha(),
              "num_sms": sms, "read_tb_s": read_tb_s, "page_size": args.page,
              "max_model_len": args.max_model_len, "dry_run": args.dry_run, "rows": rows}
    out = Path(args.out) / "ab_paged_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    _print(rows, read_tb_s, out)
    return 0 if all(r["ok"] for r in rows) else 1


def _print(rows, read_tb_s, out):
    print(f"read bandwidth: {read_tb_s and round(read_tb_s, 2)} TB/s; json: {out}")
    print(f"{'model':15} {'B':>3} {'ctx':>5} {'variant':12} {'S':>3} {'us':>9} {'TB/s':>6} "
          f"{'%read':>6} {'err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:15} {r['batch']:3} {r['ctx']:5} {r['variant']:12} FAILED "
                  f"{r['error']}")
            continue
        print(f"{r['model']:15} {r['batch']:3} {r['ctx']:5} {r['variant']:12} "
              f"{r['num_splits']:3} {r['us']:9.1f} {r.get('tb_s', 0):6.2f} "
              f"{r.get('pct_of_read', 0):6.1f} {r['max_err']:8.1e}" + ("" if r["ok"] else " BAD"))


def _sha():
    """``NBHELPERS_GIT_SHA`` first (run_step.py sets it: the device copy's ``.git``, if any, is
    not this checkout's: it recorded 3ae45ee on 2026-12-01 for a run of 2c76cc9)."""
    if os.environ.get("NBHELPERS_GIT_SHA"):
        return os.environ["NBHELPERS_GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
