"""Shared notebook builder for the ``scripts/make_*notebook*.py`` generators.

Every lab notebook has the house layout (DESIGN.md): an H1 title markdown cell, one imports code
cell, one code cell tagged ``parameters`` (papermill injects overrides after it), then sections
(a markdown cell followed by one or more code cells), the last of which is the sidecar cell that
writes the schema-v1 sidecar and asserts the notebook's claims. ``build`` turns that spec into an
nbformat v4 notebook with stable cell ids (``c00``, ``c01``, ...) so regenerating keeps diffs
small; ``main`` writes the notebooks of a generator, or with ``--check`` only reports the ones
whose committed file differs from what the generator produces.

Generators import this as ``import nbgen`` (``python scripts/make_x.py`` puts ``scripts/`` on
``sys.path``); it is not part of the ``nbhelpers`` package, which never imports nbformat.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
SIDECAR_MD = "## Sidecar and checks\nWrites the schema-v1 sidecar and asserts the claims."

Section = tuple[str, ...]  # (markdown, code, code, ...): a heading cell and its code cells
Builder = Callable[[], nbformat.NotebookNode]


def _section_cells(section: Section) -> list[nbformat.NotebookNode]:
    if len(section) < 2:
        raise ValueError(f"section {section[:1]!r} has no code cell: pass (markdown, code, ...)")
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    return [md(section[0])] + [code(src) for src in section[1:]]


def build(title: str, imports: str, parameters: str, sections: Sequence[Section],
          sidecar: Section) -> nbformat.NotebookNode:
    """One notebook in the house layout, validated, with stable cell ids.

    ``title``: markdown of the H1 title cell (``# ...`` with a ``**Result:**`` line);
    ``imports``: source of the first code cell; ``parameters``: source of the single cell tagged
    ``parameters`` (``name: type = literal  # help`` lines); ``sections``:
    ``(markdown, code, ...)`` tuples in order; ``sidecar``: the last section, whose last code cell
    must ``assert`` the notebook's claims. Raises ValueError naming the fix when a section has no
    code cell, the title is not an H1, or the sidecar cell asserts nothing; nbformat's
    ValidationError if the result is not a valid v4 notebook.
    """
    if not title.startswith("# "):
        raise ValueError(f"title must start with '# ' (the H1 cell), got {title[:40]!r}")
    if "assert" not in sidecar[-1]:
        raise ValueError("the sidecar section's last code cell must assert the notebook's claims")
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    params = code(parameters)
    params.metadata["tags"] = ["parameters"]
    cells = [md(title), code(imports), params]
    for section in [*sections, sidecar]:
        cells += _section_cells(section)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell["id"] = f"c{i:02d}"
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> bytes:
    """The exact bytes ``nbformat.write(nb, path)`` puts in a file (UTF-8, trailing newline)."""
    buf = io.StringIO()
    nbformat.write(nb, buf)
    return buf.getvalue().encode("utf-8")


def stale(notebooks: Mapping[str, Builder]) -> list[str]:
    """Repo-relative paths in ``notebooks`` whose committed file is missing or differs in bytes
    from what its builder produces now."""
    return [rel for rel, builder in notebooks.items()
            if not (REPO / rel).is_file() or (REPO / rel).read_bytes() != render(builder())]


def write(notebooks: Mapping[str, Builder]) -> None:
    """Build every notebook of ``notebooks`` (repo-relative path -> builder) and write it."""
    for rel, builder in notebooks.items():
        path = REPO / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(render(builder()))
        print("wrote", rel)


def main(notebooks: Mapping[str, Builder], argv: Sequence[str] | None = None) -> int:
    """Command line of a generator: write its notebooks, or with ``--check`` write nothing and
    return 1 (listing them) when a committed notebook is out of sync with the generator."""
    parser = argparse.ArgumentParser(description="Write the notebooks of this generator.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed notebook differs")
    args = parser.parse_args(argv)
    if not args.check:
        write(notebooks)
        return 0
    bad = stale(notebooks)
    for rel in bad:
        print("out of sync:", rel, "(run the generator without --check to rewrite it)")
    return 1 if bad else 0
