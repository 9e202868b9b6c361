"""Checks of folder parameters against the file system, run with the other value checks before
anything is launched (:func:`nbhelpers.run.values.check_values`).

Contract: :func:`check_output_dir` raises :class:`~nbhelpers.run.errors.UserInputError` when a
notebook's ``output_dir`` (phase 0: the trainer's scratch folder) names an existing file, or a
path under one, so that the folder cannot be created: that failed about 25 s in, after the model
loaded, with ``FileExistsError`` (fresh-user trial, 2026-12-07: ``-p output_dir README.md``).
Relative paths are read from ``repo``, the notebook's working directory. ``""`` (a fresh
temporary folder) and folders that exist or can be created pass.

Run: ``pytest tests/unit/test_run.py -k output_dir``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbhelpers.run.errors import UserInputError

FOLDER_PARAMETERS = ("output_dir",)
"""Parameters that name a folder the notebook creates or writes into."""


def blocking_file(path: Path) -> Path | None:
    """The existing non-folder that ``path`` is or lies under (so it cannot be a folder), or
    ``None`` when ``path`` is a folder or can be created as one."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def check_output_dir(params: dict[str, Any], where: Callable[[str], str], repo: Path) -> None:
    """Refuse a :data:`FOLDER_PARAMETERS` value that names a file or a path under one (module
    docstring), naming the parameter and what to pass instead."""
    for name in FOLDER_PARAMETERS:
        value = params.get(name)
        if not isinstance(value, str) or not value:
            continue
        target = Path(value).expanduser()
        target = target if target.is_absolute() else repo / target
        blocker = blocking_file(target)
        if blocker is None:
            continue
        what = ("is an existing file" if blocker == target
                else f"lies under the existing file {_shown(blocker, repo)}")
        raise UserInputError(
            f"{where(name)}: {name}={value!r} {what}, not a folder: pass a folder to create or "
            f"reuse (e.g. -p {name} /tmp/phase0_grpo) or -p {name} '' for a fresh temporary "
            "folder.")


def _shown(path: Path, repo: Path) -> str:
    """``path`` relative to ``repo`` when inside it (as the user typed it), else as it is."""
    try:
        return str(path.relative_to(repo))
    except ValueError:
        return str(path)
