"""The one line a finished run prints under its ``ok`` line: what the notebook measured.

Contract: :func:`result_line` returns the executed notebook's ``**Result:**`` line (the last
output that starts with it: every notebook's last cell displays one, DESIGN.md house style 2),
its first sentence, without markdown, cut to :data:`MAX_CHARS`; without one, the sidecar's
``executed/INDEX.md`` headline (:func:`nbhelpers.run.index.headline`); ``None`` when neither is
readable. Reads JSON with the standard library only (no nbformat), never raises.

Run: ``python -c "from nbhelpers.run.result_line import result_line; print(result_line(
'executed/phase0_reference/00_reference_grpo/<run>.ipynb'))"``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RESULT_MARK = "**Result:**"
MAX_CHARS = 300
"""About two terminal lines."""


def _texts(output: dict[str, Any]) -> list[str]:
    """The markdown and stream texts of one cell output."""
    def join(v: Any) -> str:
        return "".join(v) if isinstance(v, list) else str(v)
    if output.get("output_type") == "stream":
        return [join(output.get("text", ""))]
    return [join(output["data"]["text/markdown"])] if "text/markdown" in output.get(
        "data", {}) else []


def notebook_result(notebook: str | Path) -> str | None:
    """The text after the last ``**Result:**`` (or a printed ``Result:``) that starts an output
    of ``notebook``'s cells; ``None`` without one or when the file is not a readable notebook."""
    try:
        cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    found = None
    for cell in cells:
        for output in cell.get("outputs", []) if isinstance(cell, dict) else []:
            for text in _texts(output):
                for line in text.splitlines():
                    for mark in (RESULT_MARK, "Result:"):
                        if line.strip().startswith(mark):
                            found = line.strip()[len(mark):].strip()
                            break
    return found or None


def shorten(text: str, max_chars: int = MAX_CHARS) -> str:
    """``text``'s first sentence without markdown emphasis or code marks, at most
    ``max_chars`` characters (``...`` marks a cut)."""
    plain = re.sub(r"\*\*|`", "", " ".join(text.split()))
    first = re.split(r"(?<=[.!?])\s", plain, maxsplit=1)[0]
    return first if len(first) <= max_chars else first[:max_chars - 3].rstrip() + "..."


def result_line(notebook: str | Path, sidecar: str | Path | None = None) -> str | None:
    """What the run measured, in one or two lines (module docstring)."""
    found = notebook_result(notebook)
    if found:
        return shorten(found)
    if sidecar is None:
        return None
    try:
        side = json.loads(Path(sidecar).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(side, dict):
        return None
    from nbhelpers.run.index import headline
    line = headline(side)
    return None if line == "-" else shorten(line)
