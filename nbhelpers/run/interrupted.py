"""What an interrupted run's partial notebook says about the interruption, in papermill's terms.

Contract: papermill stopped by a ``KeyboardInterrupt`` still finalises the partial notebook as a
clean run (its ``finally`` marks the cell in flight and every never-run cell ``completed``; the
notebook keeps ``exception: null``). :class:`CellTracker` (nbclient's ``on_cell_execute`` /
``on_cell_executed`` hooks, in the papermill child) knows the cell in flight; :func:`mark_cells`
then records it as papermill's ``NotebookExecutionManager.cell_exception`` records a failed cell
(cell ``exception: true, status: failed``, notebook ``exception: true``) and gives never-run
cells papermill's ``pending``. :func:`finish_notebook` (the runner, after the child exited) adds
a banner cell on top (why, when, which cell, the sidecar) and papermill's error anchor before the
cell; when the child was killed before it marked the cells, it marks them from papermill's last
save (the cell papermill left ``running``). Both tag their cells with papermill's
``ERROR_MARKER_TAG``, so papermill drops them when the partial notebook is executed again. Used by
:mod:`nbhelpers.run.child` and :mod:`nbhelpers.run.execute`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BANNER_ID = "nbhelpers-interrupted"
ANCHOR_ID = "nbhelpers-interrupted-anchor"
PENDING, RUNNING, FAILED = "pending", "running", "failed"
"""papermill's cell statuses (``papermill.engines.NotebookExecutionManager``)."""


class CellTracker:
    """nbclient hooks: :attr:`in_flight` is the index (papermill's ``cell_index``) of the code
    cell whose execute request went out and whose ``ok`` reply has not come back, else ``None``
    (before the first cell, or between cells)."""

    def __init__(self) -> None:
        self.in_flight: int | None = None

    def on_cell_execute(self, cell: Any, cell_index: int, **_: Any) -> None:
        self.in_flight = cell_index

    def on_cell_executed(self, cell: Any, cell_index: int, execute_reply: Any = None,
                         **_: Any) -> None:
        if ((execute_reply or {}).get("content") or {}).get("status") == "ok":
            self.in_flight = None

    def hooks(self) -> dict[str, Any]:
        """The keyword arguments for ``papermill.execute_notebook`` (passed on to nbclient)."""
        return {"on_cell_execute": self.on_cell_execute,
                "on_cell_executed": self.on_cell_executed}


def _is_marker(cell: Any) -> bool:
    from papermill.execute import ERROR_MARKER_TAG
    return ERROR_MARKER_TAG in cell.get("metadata", {}).get("tags", [])


def _record(cell: Any) -> dict[str, Any]:
    return cell.setdefault("metadata", {}).setdefault("papermill", {})


def mark_cells(nb: Any, in_flight: int | None) -> None:
    """Set papermill's record of an interrupted run on ``nb`` (a ``NotebookNode``) in place:
    notebook ``exception: true``; cell ``in_flight`` (an index over the non-marker cells, as
    papermill counts them; ``None``: no cell was running) ``exception: true, status: failed``;
    cells papermill never started (no ``start_time``) ``status: pending``. A notebook papermill
    already recorded as failed (the kernel's ``KeyboardInterrupt`` reply came first, so
    papermill's own ``cell_exception`` ran) is left as it is."""
    meta = nb.metadata.setdefault("papermill", {})
    if meta.get("exception") is True:
        return
    meta["exception"] = True
    cells = [c for c in nb.cells if not _is_marker(c)]
    for index, cell in enumerate(cells):
        rec = _record(cell)
        if index == in_flight:
            rec.update(exception=True, status=FAILED)
        elif rec.get("start_time") is None:
            rec.update(exception=None, status=PENDING)


def running_cell(nb: Any) -> int | None:
    """The cell papermill's last save left ``running`` (a child killed in a cell), as an index
    over the non-marker cells, else ``None``."""
    cells = [c for c in nb.cells if not _is_marker(c)]
    return next((i for i, c in enumerate(cells) if _record(c).get("status") == RUNNING), None)


def mark_file(path: Path, in_flight: int | None) -> bool:
    """:func:`mark_cells` on the notebook file ``path``; ``False`` (nothing written) when it is
    empty or not a readable notebook (papermill never wrote it)."""
    nb = _read(path)
    if nb is None:
        return False
    mark_cells(nb, in_flight)
    _write(nb, path)
    return True


def _where(nb: Any) -> tuple[int | None, str]:
    """Index in ``nb.cells`` of the interrupted cell (``None``: none) and sentences saying
    where the run stopped (papermill's cell index and execution count) and what did not run."""
    cells = [(i, c) for i, c in enumerate(nb.cells) if not _is_marker(c)]
    failed = [(k, i, c) for k, (i, c) in enumerate(cells) if _record(c).get("status") == FAILED]
    rest = "The cells after it did not run (papermill status `pending`)."
    if failed:
        k, i, cell = failed[0]
        return i, (f"It stopped in cell {k} (papermill's index from 0, execution count "
                   f"{cell.get('execution_count')}, [jump there](#papermill-error-cell)); that "
                   f"cell's output is partial. {rest}")
    done = [k for k, (_, c) in enumerate(cells) if _record(c).get("start_time") is not None]
    if not done:
        return None, ("It stopped before its first cell ran (while the kernel started): no "
                      "cell ran (papermill status `pending`).")
    return None, f"It stopped between cells, after cell {done[-1]} had finished. {rest}"


def banner_text(nb: Any, *, notebook: str, reason: str, when: str, sidecar: str) -> str:
    """The banner's markdown (see :func:`finish_notebook`)."""
    return (f"# {notebook}: interrupted\n\nThis run was interrupted ({reason}) at {when}. "
            f"{_where(nb)[1]} The run's sidecar, `{sidecar}`, records the failure.")


def finish_notebook(path: Path, *, notebook: str, reason: str, when: str, sidecar: str,
                    error: str) -> bool:
    """Make the partial notebook ``path`` say it was interrupted: cells marked
    (:func:`mark_cells`, from :func:`running_cell` when the child did not mark them), a markdown
    banner on top (``notebook``'s name, ``reason``, ``when`` (UTC ISO time), which cell, the
    repo-relative ``sidecar``), papermill's error anchor before the interrupted cell (the
    banner links to it), and ``metadata.nbhelpers = {status: failed, error}`` as
    :func:`~nbhelpers.run.execute.write_not_started` writes. Run again, it changes nothing.
    ``False`` when ``path`` is empty or unreadable (nothing written)."""
    import nbformat
    from papermill.execute import ERROR_ANCHOR_MSG, ERROR_MARKER_TAG
    nb = _read(path)
    if nb is None:
        return False
    if nb.metadata.get("papermill", {}).get("exception") is not True:
        mark_cells(nb, running_cell(nb))
    index, _ = _where(nb)
    ids = {c.get("id") for c in nb.cells}
    has_anchor = any('id="papermill-error-cell"' in c.get("source", "") for c in nb.cells)
    if index is not None and not has_anchor:
        nb.cells.insert(index, nbformat.v4.new_markdown_cell(
            ERROR_ANCHOR_MSG, id=ANCHOR_ID, metadata={"tags": [ERROR_MARKER_TAG]}))
    if BANNER_ID not in ids:
        text = banner_text(nb, notebook=notebook, reason=reason, when=when, sidecar=sidecar)
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(
            text, id=BANNER_ID, metadata={"tags": [ERROR_MARKER_TAG]}))
    nb.metadata["nbhelpers"] = {"status": "failed", "error": error}
    _write(nb, path)
    return True


def _read(path: Path) -> Any:
    """``path`` as an nbformat-4 ``NotebookNode``, or ``None`` (missing, empty, not JSON)."""
    import nbformat
    try:
        if not path.stat().st_size:
            return None
        return nbformat.read(path, as_version=4)
    except (OSError, ValueError):  # nbformat's NotJSONError is a ValueError
        return None


def _write(nb: Any, path: Path) -> None:
    """Write ``nb`` to ``path`` atomically (a reader never sees half a notebook)."""
    import os

    import nbformat
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    nbformat.write(nb, tmp)
    tmp.replace(path)
