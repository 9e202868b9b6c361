"""CLI: ``python -m nbhelpers run|fetch|index|report``.

- ``run TARGET [--profile cpu|h200|...] [--gpus 0,1] [-p NAME VALUE ...]``: execute a phase
  (``phase0``...) or one notebook path through papermill into ``executed/`` (nbhelpers.run.runner);
  prints ``ok``/``failed``/``skipped`` and the path per notebook, and under an ``ok`` one the
  notebook's Result line (nbhelpers.run.result_line); exits 1 when any notebook failed (a
  phase's compare notebook is then skipped, with a line saying why). Every notebook's config and ``-p`` values are checked
  against its ``parameters`` cell (names, types, and the ranges of nbhelpers.run.values) before
  anything runs; a ``-p`` goes to the notebooks of the run that declare it; in a phase run, a notebook without a
  config for the profile is skipped with a note (``19_compare`` is CPU-only).
- ``fetch NAME ...``: download model / dataset assets into the cache (nbhelpers.models).
- ``index``: regenerate ``executed/INDEX.md`` from the sidecars.
- ``report [--executed executed] [--out executed_html]``: ``executed/`` as a static HTML site
  (one page per notebook, plots embedded, ``index.html`` with INDEX.md's rows;
  nbhelpers.run.report).

Bad user input (phase, profile, notebook, asset name, ``-p``, ``--gpus``) prints one line
``error: ...`` to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nbhelpers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks into executed/")
    run.add_argument("target", help="a phase (phase0|phase1|phase2|phase3), its folder "
                     "(phase2_grpo or notebooks/phase2_grpo/: every notebook in it) or one "
                     "notebook (notebooks/<phase folder>/NAME.ipynb)")
    run.add_argument("--profile", default="cpu",
                     help="configs/<stem>.<profile>.yaml: " + "|".join(_profile_names())
                     + " (default: cpu)")
    run.add_argument("--gpus", default=None, help="comma-separated GPU ids, one worker each")
    run.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                     help="override a parameter (VALUE read as a YAML literal)")
    run.add_argument("--executed", default=None, help="archive folder (default: executed/)")
    fetch = sub.add_parser("fetch", help="download assets (models, gsm8k) into the cache")
    fetch.add_argument("names", nargs="+")
    sub.add_parser("index", help="regenerate executed/INDEX.md")
    report = sub.add_parser("report", help="export executed/ as a static HTML site")
    report.add_argument("--executed", default=None, help="archive folder (default: executed/)")
    report.add_argument("--out", default=None, help="site folder (default: executed_html/)")
    return parser


def parse_gpus(spec: str | None) -> list[str] | None:
    """``--gpus 0,1`` -> ``["0", "1"]``, checked against ``nvidia-smi -L``.

    Raises:
        UserInputError: a non-numeric id, no GPU on this host (nvidia-smi absent or lists
            none), or an id beyond the GPUs nvidia-smi lists.
    """
    from nbhelpers.run.params import UserInputError
    if spec is None:
        return None
    gpus = [g.strip() for g in spec.split(",") if g.strip()]
    bad = [g for g in gpus if not g.isdigit()]
    if bad or not gpus:
        raise UserInputError(f"--gpus {spec!r}: give comma-separated GPU indices, e.g. 0,1.")
    count = visible_gpu_count()
    if count == 0:
        raise UserInputError(f"--gpus {spec}: this host has no GPU (nvidia-smi is missing or "
                             "lists none); drop --gpus to run on the CPU.")
    if too_high := [g for g in gpus if int(g) >= count]:
        raise UserInputError(f"--gpus {spec}: no GPU {', '.join(too_high)} (nvidia-smi lists "
                             f"{count}: 0..{count - 1}).")
    return gpus


def visible_gpu_count() -> int:
    """GPUs listed by ``nvidia-smi -L`` (0 when nvidia-smi is missing or fails)."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _run(args: argparse.Namespace) -> int:
    from nbhelpers.run import runner as run
    from nbhelpers.run.params import UserInputError, profiles
    known = profiles(run.REPO / "configs")
    if (args.profile != "cpu" and args.profile in known and args.gpus is None
            and visible_gpu_count() == 0):
        raise UserInputError(f"--profile {args.profile} sizes the runs for a GPU host, and "
                             "nvidia-smi lists no GPU here: use --profile cpu (the CPU sizes).")
    jobs = run.run(args.target, profile=args.profile, gpus=parse_gpus(args.gpus),
                   overrides=run.parse_overrides(args.parameter),
                   executed=Path(args.executed) if args.executed else None)
    from nbhelpers.run.result_line import result_line
    for job in jobs:
        print(f"{job.status:6} {job.skipped or job.output}")
        line = result_line(job.output, job.sidecar) if job.status == "ok" else None
        if line:  # what was measured, without opening the notebook
            print(f"{'':6} result: {line}")
    failed = [j for j in jobs if j.status == "failed"]
    if failed:
        print(f"{len(failed)} of {len(jobs)} notebook(s) failed; their partial output is kept.",
              file=sys.stderr)
    return 1 if failed or any(j.skipped for j in jobs) else 0


def _fetch(names: list[str]) -> int:
    from nbhelpers import models
    from nbhelpers.run.params import UserInputError
    for name in names:  # check all names before downloading anything
        if name == "gsm8k":
            continue
        try:
            models.get_spec(name)
        except ValueError as exc:
            raise UserInputError(f"unknown asset {name!r}: use gsm8k or one of "
                                 f"{models.list_models()} (or a hub id / local folder, which "
                                 "need no fetch).") from exc
    for name in names:
        print(models.fetch_assets(name))
    return 0


def _report(args: argparse.Namespace) -> int:
    import time

    from nbhelpers.run import runner as run
    from nbhelpers.run.params import UserInputError
    from nbhelpers.run.report import write_site
    start = time.perf_counter()
    out = Path(args.out or run.REPO / "executed_html")
    try:
        pages = write_site(Path(args.executed or run.REPO / "executed"), out)
    except OSError as exc:
        if exc.filename is None or not str(exc.filename).startswith(str(out)):
            raise UserInputError(str(exc)) from exc  # the archive side: its own message
        raise UserInputError(f"--out {out}: cannot write the site there ({exc.strerror or exc}); "
                             "pick a writable folder, e.g. --out site/") from exc
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    print(f"{pages[0]}: {len(pages)} pages in {time.perf_counter() - start:.0f} s")
    return 0


def _profile_names() -> list[str]:
    """The profiles of ``configs/`` (cpu first), for ``--help``."""
    from nbhelpers.run import runner as run
    from nbhelpers.run.params import profiles
    known = sorted(profiles(run.REPO / "configs"))
    return sorted(known, key=lambda p: (p != "cpu", p)) or ["cpu"]


_NEGATIVE = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-\.?inf$", re.IGNORECASE)


def _negative_values(argv: list[str]) -> list[str]:
    """``-p NAME VALUE`` with a negative VALUE argparse takes for an option (``-1e-5``: its
    negative-number pattern has no exponent): prefixed with a space, which the YAML read of
    VALUE ignores, so ``-p learning_rate -1e-5`` reaches the parameter checks."""
    out = list(argv)
    for i, arg in enumerate(out[:-2]):
        if arg in ("-p", "--parameter") and _NEGATIVE.match(out[i + 2]):
            out[i + 2] = " " + out[i + 2]
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from nbhelpers.run.params import UserInputError
    args = _parser().parse_args(_negative_values(sys.argv[1:] if argv is None else argv))
    try:
        if args.command == "run":
            _sigterm_as_interrupt()
            return _run(args)
        if args.command == "fetch":
            return _fetch(args.names)
        if args.command == "report":
            return _report(args)
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # run() already stopped its children and wrote their sidecars
        index = Path(args.executed) / "INDEX.md" if getattr(args, "executed", None) \
            else Path("executed") / "INDEX.md"
        print(f"interrupted: the partial notebook is kept and marked failed in {index}",
              file=sys.stderr)
        return 130
    from nbhelpers.run import runner as run
    from nbhelpers.run.index import write_index
    print(write_index(run.REPO / "executed"))
    return 0


def _sigterm_as_interrupt() -> None:
    """SIGTERM (``timeout``, ``kill``) takes the Ctrl-C path: children stopped, run recorded."""
    import signal
    import threading

    def handler(signum, frame):
        raise KeyboardInterrupt
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    sys.exit(main())
