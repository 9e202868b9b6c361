"""Offline install bundles for the air-gapped H200: build, verify and list pinned wheel sets.

The CLI of ``python -m nbhelpers.bundles``: build | resplit | verify | list | commands (see
:mod:`nbhelpers.bundles.build` for what each set becomes, :mod:`nbhelpers.bundles.verify` for the
checks).

Run: ``python -m nbhelpers.bundles list``;
``python -m nbhelpers.bundles build vllm --part-mib 40``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nbhelpers.bundles.build import DEFAULT_CACHE, build, get_set, resplit
from nbhelpers.bundles.parts import MIB
from nbhelpers.bundles.sets import SETS


def _list(out: Path) -> None:
    for name, bset in SETS.items():
        mf = out / name / "manifest.json"
        info = json.loads(mf.read_text()) if mf.exists() else None
        size = (f"wheels {info['wheels_bytes'] / MIB:.1f} MiB, parts " +
                ", ".join(f"{p['bytes'] / MIB:.1f}" for p in info["parts"]) + " MiB"
                if info else "not built")
        print(f"{name:10s} {bset.packing:8s} {len(bset.pins):3d} pins  site {bset.site:15s} {size}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``build | resplit | verify | list | commands``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m nbhelpers.bundles", description=__doc__.split(
        "\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, trim, pack one set")
    b.add_argument("set")
    b.add_argument("--python", default="3.12")
    b.add_argument("--part-mib", type=float, default=55.0)
    b.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    v = sub.add_parser("verify", help="Requires-Dist closure, and imports with --installed")
    v.add_argument("set")
    v.add_argument("--installed", help="device-side site dir to import from")
    v.add_argument("--python-exe", default="python3", help="interpreter for the import check")
    r = sub.add_parser("resplit", help="re-chunk a built site-xz set's parts (no rebuild)")
    r.add_argument("set")
    r.add_argument("--part-mib", type=float, required=True)
    c = sub.add_parser("commands", help="carry + command prefix for sets sharing one call")
    c.add_argument("sets", nargs="+")
    lst = sub.add_parser("list", help="sets and built sizes")
    ap.add_argument("--out", type=Path, default=Path(".bundles"), help="bundle root")
    for p in (b, r, v, c, lst):  # SUPPRESS: the top-level --out stays unless given here
        p.add_argument("--out", type=Path, default=argparse.SUPPRESS, help="bundle root")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        m = build(args.set, args.python, args.out, args.part_mib, args.cache)
        print(json.dumps({k: m[k] for k in ("set", "wheels_bytes", "parts", "build_s")}, indent=1))
        return 0
    if args.cmd == "resplit":
        m = resplit(args.set, args.part_mib, args.out)
        print(json.dumps({k: m[k] for k in ("set", "parts", "whole_sha256")}, indent=1))
        return 0
    if args.cmd == "list":
        _list(args.out)
        return 0
    from nbhelpers.bundles import verify as bundle_verify
    if args.cmd == "commands":
        print(bundle_verify.combined_commands(args.sets, args.out))
        return 0
    return bundle_verify.verify(get_set(args.set), args.out, args.installed, args.python_exe)

