"""CLI: ``python -m nbhelpers run|fetch|index``.

- ``run TARGET [--profile cpu|h200] [--gpus 0,1] [-p NAME VALUE ...]``: execute a phase
  (``phase0``...) or one notebook path through papermill into ``executed/`` (nbhelpers.run);
  exits 1 when any notebook failed.
- ``fetch NAME ...``: download model / dataset assets into the cache (nbhelpers.models).
- ``index``: regenerate ``executed/INDEX.md`` from the sidecars.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nbhelpers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks into executed/")
    run.add_argument("target", help="phase0|phase1|phase2|phase3 or notebooks/...ipynb")
    run.add_argument("--profile", default="cpu", help="configs/<stem>.<profile>.yaml (cpu|h200)")
    run.add_argument("--gpus", default=None, help="comma-separated GPU ids, one worker each")
    run.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                     help="override a parameter (VALUE read as a YAML literal)")
    run.add_argument("--executed", default=None, help="archive folder (default: executed/)")
    fetch = sub.add_parser("fetch", help="download assets (models, gsm8k) into the cache")
    fetch.add_argument("names", nargs="+")
    sub.add_parser("index", help="regenerate executed/INDEX.md")
    return parser


def _run(args: argparse.Namespace) -> int:
    from nbhelpers import run
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else None
    jobs = run.run(args.target, profile=args.profile, gpus=gpus,
                   overrides=run.parse_overrides(args.parameter),
                   executed=Path(args.executed) if args.executed else None)
    for job in jobs:
        print(f"{job.status:6} {job.output}")
    failed = [j for j in jobs if j.status != "ok"]
    if failed:
        print(f"{len(failed)} of {len(jobs)} notebook(s) failed; their partial output is kept.",
              file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "fetch":
        from nbhelpers import models
        for name in args.names:
            models.fetch_assets(name)
        return 0
    from nbhelpers import run
    from nbhelpers.run_index import write_index
    print(write_index(run.REPO / "executed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
