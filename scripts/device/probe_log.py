"""The device probes' output lines: printed and, given a folder, appended to a log there, so they
survive a device call whose output is cut to its tail (``fa4_probe.py``'s lines were lost that
way on 2026-12-07). Imported by the probes in this folder (``python3 scripts/device/<probe>.py``
puts it on ``sys.path``)."""

from __future__ import annotations

import os


def say(line: str, out_dir: str | None, name: str) -> None:
    """Print ``line``; with ``out_dir``, also append it to ``<out_dir>/<name>``."""
    print(line, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, name), "a") as fh:
            fh.write(line + "\n")
