"""Test helper (no tests here): the lab's runner, ``nbhelpers run phase0``, in a child process over
a throwaway repo, as a user's terminal starts it; for the tests that signal a running notebook
(``test_run.py``, ``test_interrupted_record.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REAL_REPO = Path(__file__).resolve().parents[2]


def pid_notebook(path: Path, body: list[Any], head: tuple[Any, ...] = ()) -> None:
    """Write a phase-0-style notebook at ``path`` (folders made): ``head`` cells, the parameters
    cell (``pid_file``, the readiness signal the tests wait for, and ``sidecar_path``), then
    ``body`` (nbformat cells), on the ``python3`` kernel."""
    import nbformat
    params = nbformat.v4.new_code_cell("pid_file = ''\nsidecar_path = ''")
    params.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook()
    nb.cells = [*head, params, *body]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def child_env() -> dict[str, str]:
    """This environment with the real repo prepended to ``PYTHONPATH`` (prepended, not replaced:
    the GPU host's papermill/ipykernel come from ``PYTHONPATH``, /tmp/site)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REAL_REPO), os.environ.get("PYTHONPATH")]))}


def start_phase0(root: Path, config: str, pid_file: Path, stdout: Any,
                 stderr: Any, new_session: bool = False) -> subprocess.Popen:
    """Write ``root/configs/<config>.cpu.yaml`` (``pid_file: ...``, the notebook's readiness
    signal) and start ``nbhelpers run phase0`` with ``runner.REPO = root``; ``stdout`` /
    ``stderr`` as for ``subprocess.Popen`` (use files, not pipes: a full pipe stalls the
    runner). ``new_session``: the runner leads its own process group, so a test can signal the
    whole group as a terminal's Ctrl-C does (``os.killpg``)."""
    (root / "configs").mkdir(exist_ok=True)
    (root / f"configs/{config}.cpu.yaml").write_text(f"pid_file: {pid_file}\n")
    # SIGINT at its default (KeyboardInterrupt), as in a terminal: a process started while
    # SIGINT is ignored inherits SIG_IGN and Python then installs no handler, so the runner
    # never saw the tests' Ctrl-C. Seen 2026-12-03 in a clean-clone run: an xdist worker had
    # SIGINT ignored (/proc/<pid>/status SigIgn bit 2; something the worker ran earlier set
    # it), its two interrupt tests hung at their 600 s caps; they passed in isolation.
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "import sys; from pathlib import Path; from nbhelpers.__main__ import main; "
            f"from nbhelpers.run import runner as run; run.REPO = Path({str(root)!r}); "
            "sys.exit(main(['run', 'phase0']))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, env=child_env(),
                            stdout=stdout, stderr=stderr, text=True,
                            start_new_session=new_session)
