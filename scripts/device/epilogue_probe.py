"""GPU probe of ``lora_expand="epilogue"``: the skinny LoRA-epilogue GEMM against the default path.

Run on the device (one GPU, ~30-60 s with Triton compiles): ``python3
scripts/device/epilogue_probe.py`` prints a table and writes ``$OUT/epilogue_probe.json`` (or
``--out DIR``). Check here (CPU, Triton interpreter, tiny shapes): ``python
scripts/device/epilogue_probe.py --tiny --out /tmp`` (``tests/engine/test_epilogue_probe.py``).

Shapes: Qwen3-4B's two LoRA groups the epilogue serves, r=32 on every part, bf16 weights and B
(the engine's ext buffers): qkv ``W' [6144 + 96, 2560]`` (parts 4096, 1024, 1024), gate_up ``W'
[19456 + 64, 2560]`` (parts 9728, 9728); rows M in ``--rows`` (4, 32). Per (group, M, config,
PDL off/on) the variants (µs a launch):

- ``plain``: :func:`.skinny_gemm.skinny_gemm` on ``W'`` alone (the ext GEMM, no LoRA B);
- ``default``: ``plain`` + :func:`.lora_expand.lora_expand` on its columns (the
  ``lora_expand="triton"`` path this kernel replaces);
- ``epilogue``: :func:`.skinny_lora_epilogue.skinny_lora_gemm` (one launch);
- ``epilogue_dns``: the same kernel built with the ``do_not_specialize`` list it had before
  f097a8c (``n``, ``k``, ``n_out`` and the part bounds unspecialised: 4-byte W copies), to
  measure what that change is worth.

Configs (``--configs``): ``default`` (:func:`.skinny_gemm.default_config`, what the engine runs
before its tuner has a choice), names as ``n64_k128_s4_w4_st3`` (:func:`.skinny_gemm_tune.
config_name`), or ``all`` (every candidate fitting the GPU's shared memory). Timing: the method
of :mod:`.skinny_gemm_tune` (cold weights: one CUDA graph over copies of ``W'`` and B, >= 256 MB
in all, best of 5 replays, per launch); on the CPU ``perf_counter`` over the copies. Numerics:
``epilogue`` against ``default`` on copy 0 (max |diff| / max |default|; same roundings, so a few
bf16 ulps at most). The JSON also has each compiled epilogue kernel's registers, spills and
shared memory (``kernels``), for the register-pressure question.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GROUPS = {"qkv": ([4096, 1024, 1024], 32, 2560), "gate_up": ([9728, 9728], 32, 2560)}
TINY_GROUPS = {"qkv": ([64, 32, 32], 8, 256), "gate_up": ([64, 64], 8, 256)}
"""Group -> (parts' out_i, rank of each part, K)."""
SCALING = 2.0
COLD_BYTES = 256 << 20
OLD_DNS = ["m", "n", "n_out", "k", "end0", "end1", "roff1", "roff2", "r0", "r1", "r2"]
VARIANTS = ("plain", "default", "epilogue", "epilogue_dns")
MAX_REL_ERR = 2 ** -6
"""Largest ``max |epilogue - default| / max |default|`` taken as equal (bf16 roundings)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON")
    p.add_argument("--rows", default="4,32", help="decode rows M, comma-separated")
    p.add_argument("--groups", default="qkv,gate_up", help=f"of {sorted(GROUPS)}")
    p.add_argument("--configs", default="default", help="default, all, or config names")
    p.add_argument("--pdl", default="off,on", help="off, on or both (on needs sm_90)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {VARIANTS}")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip cases after this")
    p.add_argument("--tiny", action="store_true",
                   help="CPU: Triton interpreter, tiny shapes, perf_counter timing")
    return p.parse_args(argv)


def git_sha() -> str:
    """``NBHELPERS_GIT_SHA`` (the device copy's ``.git`` is not this checkout's), else git."""
    if os.environ.get("NBHELPERS_GIT_SHA"):
        return os.environ["NBHELPERS_GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_copies(sizes, rank, k, m, dev, cold_bytes):
    """``x [m, k]`` bf16 and copies of ``(W' [n_out + R, k], bs)`` (bf16), > ``cold_bytes``."""
    import torch
    g = torch.Generator().manual_seed(0)
    n_out, r_tot = sum(sizes), rank * len(sizes)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn(n_out + r_tot, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(dev)
    bs = [(torch.randn(o, rank, generator=g) / rank ** 0.5).to(torch.bfloat16).to(dev)
          for o in sizes]
    set_bytes = (w.numel() + sum(b.numel() for b in bs)) * 2
    n = max(2, -(-cold_bytes // set_bytes))
    return x, [(w, bs)] + [(w.clone(), [b.clone() for b in bs]) for _ in range(n - 1)]


@contextlib.contextmanager
def old_specialisation(ep, triton):
    """``ep._skinny_lora`` rebuilt with :data:`OLD_DNS` inside the block."""
    old = ep._skinny_lora
    ep._skinny_lora = triton.jit(do_not_specialize=OLD_DNS)(old.fn)
    try:
        yield ep._skinny_lora
    finally:
        ep._skinny_lora = old


def launchers(x, sizes, rank, cfg, mods):
    """variant -> fn((W', bs)) -> y [m, n_out] bf16."""
    sg, le, ep = mods["sg"], mods["le"], mods["ep"]
    n_out, ranks = sum(sizes), [rank] * len(sizes)

    def default(c):
        full = sg.skinny_gemm(x, c[0], None, cfg)
        le.lora_expand(full[:, :n_out], full[:, n_out:], c[1], sizes, ranks, SCALING)
        return full[:, :n_out]

    def epilogue(c):
        return ep.skinny_lora_gemm(x, c[0], n_out, c[1], sizes, ranks, SCALING, None, cfg)

    return {"plain": lambda c: sg.skinny_gemm(x, c[0], None, cfg)[:, :n_out],
            "default": default, "epilogue": epilogue, "epilogue_dns": epilogue}


def us_per_call(fn, copies, on_cuda: bool) -> float:
    """µs of one ``fn(copy)`` with cold weights (module docstring)."""
    if on_cuda:
        from nbhelpers.engine.kernels.skinny_gemm_tune import graph_ms
        return 1e3 * graph_ms(lambda: [fn(c) for c in copies], reps=2) / len(copies)
    fn(copies[0])  # the interpreter's first call parses the kernel
    t0 = time.perf_counter()
    for c in copies:
        fn(c)
    return 1e6 * (time.perf_counter() - t0) / len(copies)


def configs_for(spec: str, m: int, n: int, k: int, mods, on_cuda: bool) -> dict:
    """``{name: Config}`` for ``--configs``; raises ``ValueError`` for an unknown name."""
    import torch
    sg, tune = mods["sg"], mods["tune"]
    limit = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin",
                    232448) if on_cuda else 232448  # the H200's where torch lacks the field
    cands = tune.candidates(m, n, k, 2, limit)
    default = sg.default_config(n, k)
    out = {}
    for name in spec.split(","):
        if name == "all":
            out.update(cands)
        elif name == "default":
            out[f"default={tune.config_name(default)}"] = default
        elif name in cands:
            out[name] = cands[name]
        else:
            raise ValueError(f"--configs: {name!r} is not a candidate for M{m} N{n} K{k} "
                             f"(one of default, all, {sorted(cands)})")
    return out


def run_case(group, m, cfg_name, cfg, pdl_on, ctx) -> dict:
    """One (group, M, config, PDL) row: µs a launch per variant, and the epilogue's error."""
    mods, (sizes, rank, k) = ctx["mods"], ctx["groups"][group]
    x, copies = ctx["data"][(group, m)]
    fns = launchers(x, sizes, rank, cfg, mods)
    row = {"group": group, "M": m, "config": cfg_name, "pdl": pdl_on, "N": sizes, "R":
           rank * len(sizes), "K": k, "copies": len(copies), "us": {}, "errors": {}}
    with mods["pdl"].scope(pdl_on):
        ref = fns["default"](copies[0]).double()
        for name in ctx["variants"]:
            dns = old_specialisation(mods["ep"], mods["triton"]) if name == "epilogue_dns" \
                else contextlib.nullcontext()
            try:
                with dns:
                    row["us"][name] = us_per_call(fns[name], copies, ctx["on_cuda"])
                    if name.startswith("epilogue"):
                        y = fns[name](copies[0]).double()
                        err = ((y - ref).abs().max() / ref.abs().max()).item()
                        row[f"{name}_rel_err"] = err
                        if not err <= MAX_REL_ERR:
                            row["errors"][f"{name}_numerics"] = f"rel err {err:.3g} vs default"
            except Exception as err:  # noqa: BLE001 -- a failed variant is data, not the end
                row["errors"][name] = f"{type(err).__name__}: {err}"[:300]
    return row


def kernel_info(ep) -> list[dict]:
    """Registers, spills and shared bytes of every compiled ``_skinny_lora`` (best effort: the
    cache layout differs across Triton versions; empty under the interpreter)."""
    out = []
    for entry in getattr(ep._skinny_lora, "device_caches", {}).values():
        for kern in (entry[0] if isinstance(entry, tuple) else {}).values():
            meta = getattr(kern, "metadata", None)
            out.append({"n_regs": getattr(kern, "n_regs", None),
                        "n_spills": getattr(kern, "n_spills", None),
                        "shared_bytes": getattr(meta, "shared", None),
                        "num_warps": getattr(meta, "num_warps", None)})
    return out


def table(rows: list[dict], variants: list[str]) -> str:
    """Fixed-width text table of the rows (µs a launch; ``-`` where a variant failed)."""
    names = " ".join(f"{v:>13}" for v in variants)
    lines = [f"{'group':8} {'M':>3} {'config':28} {'pdl':4} {names} {'epi/default':>11}"]
    for r in rows:
        us = [r["us"].get(v) for v in variants]
        cells = " ".join(f"{u:13.1f}" if u is not None else f"{'-':>13}" for u in us)
        d, e = r["us"].get("default"), r["us"].get("epilogue")
        ratio = f"{e / d:11.2f}" if d and e else f"{'-':>11}"
        pdl = "on" if r["pdl"] else "off"
        lines.append(f"{r['group']:8} {r['M']:3d} {r['config']:28} {pdl:4} {cells} {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch
    import triton

    from nbhelpers.engine.kernels import lora_expand, pdl, skinny_gemm, skinny_gemm_tune
    from nbhelpers.engine.kernels import skinny_lora_epilogue as ep
    on_cuda = torch.cuda.is_available() and not args.tiny
    if not (on_cuda or args.tiny):
        print("epilogue_probe: no CUDA device; use --tiny on the CPU", file=sys.stderr)
        return 2
    mods = {"sg": skinny_gemm, "le": lora_expand, "ep": ep, "tune": skinny_gemm_tune,
            "pdl": pdl, "triton": triton}
    groups = TINY_GROUPS if args.tiny else GROUPS
    rows_m = [int(v) for v in args.rows.split(",")]
    pdls = [v == "on" for v in args.pdl.split(",")]
    if not (on_cuda and pdl.supported(torch.device("cuda"))):
        pdls = [False]  # the interpreter (and pre-Hopper GPUs) have no PDL
    ctx = {"mods": mods, "groups": groups, "on_cuda": on_cuda, "data": {},
           "variants": [v for v in args.variants.split(",") if v in VARIANTS]}
    dev, t0, rows = "cuda" if on_cuda else "cpu", time.monotonic(), []
    for group in args.groups.split(","):
        sizes, rank, k = groups[group]
        for m in rows_m:
            ctx["data"][(group, m)] = make_copies(sizes, rank, k, m, dev,
                                                  COLD_BYTES if on_cuda else 0)
            n = sum(sizes) + rank * len(sizes)
            for name, cfg in configs_for(args.configs, m, n, k, mods, on_cuda).items():
                for pdl_on in pdls:
                    if time.monotonic() - t0 > args.budget_s:
                        print(f"budget: skipped {group} M{m} {name} pdl {pdl_on}")
                        continue
                    rows.append(run_case(group, m, name, cfg, pdl_on, ctx))
            del ctx["data"][(group, m)]
    result = {"sha": git_sha(), "device": torch.cuda.get_device_name() if on_cuda else "cpu",
              "triton": triton.__version__, "tiny": args.tiny, "unit": "us per launch",
              "rows": rows, "kernels": kernel_info(ep), "wall_s": time.monotonic() - t0}
    print(table(rows, ctx["variants"]))
    for r in rows:
        for name, err in r["errors"].items():
            print(f"{r['group']} M{r['M']} {r['config']} pdl {r['pdl']} {name}: {err}")
    out = Path(args.out) / "epilogue_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
