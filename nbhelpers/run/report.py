"""``python -m nbhelpers report``: the ``executed/`` archive as a static HTML site.

Contract: :func:`write_site` converts every executed notebook under ``executed/`` with nbconvert's
``lab`` HTML template into ``<out>/<same relative path>.html`` (plots are the notebook's own
``image/png`` outputs, embedded as ``data:`` URIs; the template's CDN scripts, require.js and
MathJax, are dropped so a page loads nothing from elsewhere), writes each sidecar-only run's JSON
as a page beside them, and writes ``<out>/index.html`` with the same rows as ``executed/INDEX.md``
(:func:`nbhelpers.run.index.index_rows`), failed runs marked. Every page links back to the index.
A notebook that is not JSON (0 bytes: its run was interrupted before papermill wrote it) is
skipped with a line on stderr naming it, and listed on the index as not exported.
The folder can be published as is (any static host, or opened from disk).

Run: ``python -m nbhelpers report [--executed executed] [--out executed_html]``.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from pathlib import Path

from nbhelpers.run.index import headline, index_rows, status

COLUMNS = ("notebook", "run", "date", "device", "sha", "headline", "status")
_EXTERNAL_SCRIPT = re.compile(r"<script[^>]*\bsrc=\"https?://[^\"]*\"[^>]*>\s*</script>\s*")
STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}"
         "tr.failed td{background:#fde2e2}td.status-failed{color:#a00;font-weight:bold}"
         ".nbh-nav{padding:6px 10px;background:#eef;font:14px system-ui,sans-serif}"
         ".nbh-failed{padding:6px 10px;background:#fde2e2;color:#a00;font:14px system-ui}")


def _exporter():
    from nbconvert import HTMLExporter
    return HTMLExporter(template_name="lab", embed_images=True)


def _banner(rel_index: str, side: dict | None) -> str:
    """The nav bar put first in ``<body>``: a link to the index, and a failed run's error."""
    nav = f'<div class="nbh-nav"><a href="{rel_index}">&larr; index of executed runs</a></div>'
    if side is not None and status(side) == "failed":
        nav += f'<div class="nbh-failed">failed run: {html.escape(headline(side))}</div>'
    return nav


def notebook_page(notebook: Path, rel_index: str, side: dict | None, exporter=None) -> str:
    """One executed notebook as a self-contained HTML page (see the module docstring).

    Raises:
        nbformat.reader.NotJSONError: ``notebook`` is not a notebook file.
    """
    body, _ = (exporter or _exporter()).from_filename(str(notebook))
    body = _EXTERNAL_SCRIPT.sub("", body)
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + _banner(rel_index, side), body,
                  count=1)


def _cell(row: dict[str, str], col: str, skipped: dict[str, str]) -> str:
    if col == "run" and row["_target"] in skipped:
        return f'{html.escape(row["_key"])} (not exported: {html.escape(skipped[row["_target"]])})'
    if col == "run":
        href = str(Path(row["_target"]).with_suffix(".html"))
        return f'<a href="{html.escape(href)}">{html.escape(row["_key"])}</a>'
    return html.escape(row[col])


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{STYLE}</style></head><body>{body}</body></html>\n")


def index_page(rows: list[dict[str, str]], orphans: list[str],
               skipped: dict[str, str] | None = None) -> str:
    """``index.html``: the INDEX.md table (``rows`` from ``index_rows``) plus the notebooks that
    have no sidecar (``orphans``: relative ``.html`` paths), so every page is reachable, and the
    notebooks not exported (``skipped``: relative ``.ipynb`` path -> reason; their rows unlinked)."""
    skipped = skipped or {}
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    body = "".join(f'<tr class="{r["status"]}">' + "".join(
        f'<td class="status-{r["status"]}">{_cell(r, c, skipped)}</td>' if c == "status"
        else f"<td>{_cell(r, c, skipped)}</td>" for c in COLUMNS) + "</tr>" for r in rows)
    extra = ""
    if orphans:
        items = "".join(f'<li><a href="{html.escape(p)}">{html.escape(p)}</a></li>'
                        for p in orphans)
        extra = f"<h2>Notebooks without a sidecar</h2><ul>{items}</ul>"
    if skipped:
        items = "".join(f"<li>{html.escape(p)}: {html.escape(why)}</li>"
                        for p, why in skipped.items())
        extra += f"<h2>Notebooks not exported (empty or not started)</h2><ul>{items}</ul>"
    return _page("Executed runs", f"<h1>Executed runs</h1><p>{len(rows)} runs from the JSON "
                 "sidecars (the rows of executed/INDEX.md), newest first per notebook; failed "
                 f"runs in red.</p><table><tr>{head}</tr>{body}</table>{extra}")


def sidecar_page(sidecar: Path, rel_index: str) -> str:
    """A run that has a sidecar but no notebook (a backend's run): its JSON, pretty-printed."""
    side = json.loads(sidecar.read_text())
    text = html.escape(json.dumps(side, indent=1))
    return _page(sidecar.stem, f"{_banner(rel_index, side)}<h1>{html.escape(sidecar.name)}</h1>"
                 f"<pre>{text}</pre>")


def _sidecar_of(notebook: Path) -> dict | None:
    side = notebook.with_suffix(".json")
    return json.loads(side.read_text()) if side.is_file() else None


def _write_notebooks(executed: Path, out: Path, with_side: set[str]):
    """Export each notebook under ``executed``; returns (pages written, relative ``.html`` paths of
    the notebooks without a sidecar, {relative ``.ipynb`` path: why it was skipped})."""
    from nbformat.reader import NotJSONError
    exporter, written, orphans, skipped = _exporter(), [], [], {}
    for nb in sorted(executed.rglob("*.ipynb")):
        rel = nb.relative_to(executed)
        page = (out / rel).with_suffix(".html")
        rel_index = os.path.relpath(out / "index.html", page.parent)
        try:
            text = notebook_page(nb, rel_index, _sidecar_of(nb), exporter)
        except NotJSONError as exc:
            why = ("0 bytes: its run was interrupted before the notebook was written"
                   if nb.stat().st_size == 0 else f"not a notebook: {str(exc)[:120]}")
            print(f"report: skipped {nb}: {why}", file=sys.stderr)
            skipped[str(rel)] = why
            continue
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
        written.append(page)
        if str(rel) not in with_side:
            orphans.append(str(rel.with_suffix(".html")))
    return written, orphans, skipped


def write_site(executed: Path, out: Path) -> list[Path]:
    """Write the site for ``executed`` into ``out`` (created; existing pages are overwritten).

    Returns:
        The written files, ``out/index.html`` first.
    Raises:
        FileNotFoundError: ``executed`` is not a folder.
        ValueError: ``out`` is an existing file, or ``executed`` or inside it (the site would
            land in the archive).
    """
    executed, out = Path(executed).resolve(), Path(out).resolve()
    if not executed.is_dir():
        what = "is a file, not a folder" if executed.exists() else "no such folder"
        raise FileNotFoundError(f"--executed {executed}: {what}; pass the archive folder (default "
                                "executed/; run a notebook first: python -m nbhelpers run phase0 "
                                "--profile cpu).")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is an existing file: pick a folder (it is created).")
    if out == executed or executed in out.parents:
        raise ValueError(f"--out {out} is inside the archive {executed}: pick a folder outside.")
    rows = index_rows(executed)
    written, orphans, skipped = _write_notebooks(executed, out, {r["_target"] for r in rows})
    for row in rows:  # sidecar-only runs (a backend's sidecar): the JSON as a page
        if row["_target"].endswith(".json"):
            page = (out / row["_target"]).with_suffix(".html")
            page.parent.mkdir(parents=True, exist_ok=True)
            rel_index = os.path.relpath(out / "index.html", page.parent)
            page.write_text(sidecar_page(executed / row["_target"], rel_index))
            written.append(page)
    (out / "index.html").write_text(index_page(rows, orphans, skipped))
    return [out / "index.html", *written]
