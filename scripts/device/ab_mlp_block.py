"""GPU A/B of the one-launch decode MLP probe (``nbhelpers/engine/kernels/mlp_block.py``) against
the launches it would replace, cold weights (docs/decode_floor_plan.md, piece 1).

Run on the device (one GPU, ~1-2 min with Triton compiles): ``python3 scripts/device/
ab_mlp_block.py --out $OUT`` writes ``$OUT/ab_mlp_block.json`` and prints a table. Check here (CPU,
Triton interpreter, tiny shapes, no timing): ``python scripts/device/ab_mlp_block.py --dry-run``.

Variants at Qwen3-4B's MLP (H 2560, I 9728, bf16) for ``--rows`` (default 4 and 16; the kernel
takes up to 64, ``--rows 4,16,32,64`` asks whether the block could serve the realistic GRPO
batch of 64 too; above 16 rows the blocks run in 8 warps):
``cublas`` (``F.linear`` gate_up, SiLU x up in torch, ``F.linear`` down: three GEMM/elementwise
launches plus torch's), ``skinny`` (the engine's split-K kernel with the H200 tuner's choices of
2026-12-07 for these shapes at M 4: gate_up ``Config(64, 128, 1)``, down ``Config(64, 128, 8)``,
and torch's SiLU x up between), ``block<J>`` (:func:`mlp_block` with ``BLOCK_J`` J, its fp32
accumulator zeroed by a memset in the same timing) and ``block<J>_nozero`` (the accumulator not
zeroed: the engine's consumer kernel would zero it after reading; the numbers are then wrong,
only the time counts). Timing: ``ab_lora_gemm.time_per_call`` (each variant captured in one CUDA
graph that runs it once on each of ``n`` weight copies, > 256 MB in all, replayed ``--rounds``
times between CUDA events; time per call = median round / ``n``); ``tb_s`` = the MLP's weight
bytes / time; ``pct_of_read`` against :func:`nbhelpers.bench.floor.read_bandwidth` measured
here. Numerics: every variant on copy 0
against fp64 torch, max relative error <= 2e-2 (not checked for ``_nozero``); a failure is
printed and the exit code is 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # ab_lora_gemm.time_per_call

TOL = 2e-2


def reference(torch, x, wgu, wd):
    """LlamaMLP rounded as transformers rounds it in the weights' dtype, the down sum in fp64."""
    inter = wd.shape[1]
    g = (x.double() @ wgu[:inter].double().t()).to(x.dtype)
    u = (x.double() @ wgu[inter:].double().t()).to(x.dtype)
    h = (torch.nn.functional.silu(g.float()).to(x.dtype).float() * u.float()).to(x.dtype)
    return h.double() @ wd.double().t()


def variants(torch, hidden, dry_run, rows=4):
    """``{name: fn(x, wgu, wd, out) -> [M, H] tensor}`` (above 16 rows the blocks run in 8
    warps: two ``[rows, BLOCK_J]`` fp32 accumulators a program)."""
    import torch.nn.functional as F

    from nbhelpers.engine.kernels import mlp_block as mb
    from nbhelpers.engine.kernels import skinny_gemm as sg

    def cublas(x, wgu, wd, out):
        gu = F.linear(x, wgu)
        g, u = gu.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, wd)

    def skinny(x, wgu, wd, out):
        gu = sg.skinny_gemm(x, wgu, config=sg.Config(64, 128, 1))
        g, u = gu.chunk(2, dim=-1)
        return sg.skinny_gemm((F.silu(g) * u).contiguous(), wd, config=sg.Config(64, 128, 8))

    small = {"block_k": 32, "block_n": 32} if dry_run else {}
    if rows > 16 and not dry_run:
        small["num_warps"] = 8
    out = {"cublas": cublas, "skinny": skinny}
    for bj in ((32,) if dry_run else (32, 64, 128)):
        def block(x, wgu, wd, acc, bj=bj):
            acc.zero_()
            return mb.mlp_block(x, wgu, wd, out=acc, block_j=bj, **small)

        def nozero(x, wgu, wd, acc, bj=bj):
            return mb.mlp_block(x, wgu, wd, out=acc, block_j=bj, **small)
        out[f"block{bj}"], out[f"block{bj}_nozero"] = block, nozero
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--rows", default="4,16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from ab_lora_gemm import time_per_call
    dev = "cpu" if args.dry_run else "cuda"
    hidden, inter = (64, 96) if args.dry_run else (2560, 9728)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    weight_bytes = 3 * hidden * inter * (4 if args.dry_run else 2)
    n_copies = 1 if args.dry_run else max(2, -(-(256 << 20) // weight_bytes) + 1)
    copies = [((torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(dev),
               (torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(dev))
              for _ in range(n_copies)]
    from nbhelpers.bench.floor import read_bandwidth
    bw = None if args.dry_run else read_bandwidth(dev)["bytes_per_s"]
    result = {"gpu": None if args.dry_run else torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "git_sha": os.environ.get("NBHELPERS_GIT_SHA"), "hidden": hidden, "inter": inter,
              "dtype": str(dtype), "copies": n_copies, "read_tb_s": bw and bw / 1e12,
              "weight_bytes": weight_bytes, "dry_run": args.dry_run, "rows": []}
    failed = False
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, hidden, generator=g).to(dtype).to(dev)
        acc = torch.zeros(m, hidden, dtype=torch.float32, device=dev)
        ref = reference(torch, x, *copies[0])
        for name, fn in variants(torch, hidden, args.dry_run, m).items():
            row = {"rows": m, "variant": name}
            try:
                got = fn(x, *copies[0], acc)
                err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
                row["max_rel_err"] = err
                row["ok"] = name.endswith("_nozero") or err <= TOL
                if not args.dry_run:
                    def call(c, fn=fn, x=x, acc=acc):
                        return fn(x, *c, acc)
                    t = time_per_call(call, copies, args.rounds, on_cuda=True) / 1e3  # ms -> s
                    row.update(us=t * 1e6, tb_s=weight_bytes / t / 1e12,
                               pct_of_read=100 * weight_bytes / t / bw)
            except Exception as exc:  # noqa: BLE001 (a failed variant is a row, the rest go on)
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
            failed |= not row["ok"]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ab_mlp_block.json").write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
