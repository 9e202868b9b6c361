"""The whole pytest suite on the device (a run_step.py script job).

Run on the GPU host: ``python3 scripts/device/suite.py [pytest args]``: ``python -m pytest -q
tests -p no:cacheprovider -ra --junitxml $OUT/junit.xml`` with the output also in
``$OUT/suite.log``; exits with pytest's code (5, no tests collected, becomes 1 as in .ci/run).
When pytest-xdist is importable (the notebooks bundle carries it) and no ``-n`` is given, the
suite runs in ``NBH_SUITE_WORKERS`` (default 8) workers with ``--dist loadfile`` (one test
file per worker, so module-scoped fixtures load once): serially it takes ~15 min on the H200,
mostly Triton compiles, which run on the host's 16 cores in parallel.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _workers(argv: list[str]) -> list[str]:
    """``-n N --dist loadfile`` when xdist is importable and the caller gave no ``-n``."""
    if any(a == "-n" or a.startswith("-n") and a[2:].isdigit() for a in argv):
        return []
    try:
        import xdist  # noqa: F401  (pytest-xdist, from the notebooks bundle)
    except ImportError:
        return []
    return ["-n", os.environ.get("NBH_SUITE_WORKERS", "8"), "--dist", "loadfile"]


def main(argv: list[str]) -> int:
    if "--help" in argv:
        print(__doc__)
        return 0
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "tests", "-p", "no:cacheprovider", "-ra",
           f"--junitxml={out / 'junit.xml'}", *_workers(argv), *argv]
    with (out / "suite.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
    return 1 if rc == 5 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
