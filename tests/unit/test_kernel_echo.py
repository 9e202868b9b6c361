"""The runner's papermill child prints a notebook's subprocess output once, and the notebook
keeps it (``nbhelpers.run.child.echo_free_kernel_manager``).

Before: ipykernel echoed a spawned process's fd-1 output to the kernel's stdout (the terminal)
and papermill printed the same lines from the notebook: phase 2's training logs showed twice.
"""
from __future__ import annotations

import json
import sys

import nbformat
import pytest

from nbhelpers.run.child import _execute_with_start_retry


def test_a_subprocess_line_reaches_the_terminal_once_and_the_notebook(tmp_path, capfd,
                                                                      monkeypatch):
    pm = pytest.importorskip("papermill")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager

    from nbhelpers.run.execute import KERNEL_NAME
    if KERNEL_NAME not in KernelSpecManager().find_kernel_specs():
        pytest.skip(f"the {KERNEL_NAME!r} kernel is not registered: bash scripts/setup.sh does it")
    # ipykernel does not watch fd 1 when it sees PYTEST_CURRENT_TEST (its OutStream): the kernel
    # must run as it does under the runner
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import subprocess, sys\nprint('IN-KERNEL-LINE')\n"
        "subprocess.run([sys.executable, '-c', 'print(\"SUBPROCESS-LINE\")'], check=True)")]
    src, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nb, src)
    spec = {"input": str(src), "output": str(out), "parameters": {}, "cwd": str(tmp_path)}
    _execute_with_start_retry(pm, spec)
    sys.stdout.flush()
    terminal = capfd.readouterr().out
    assert terminal.count("SUBPROCESS-LINE") == 1, terminal
    assert terminal.count("IN-KERNEL-LINE") == 1, terminal
    texts = "".join("".join(o.get("text", "")) for o in json.loads(out.read_text())["cells"][0]
                    ["outputs"])
    assert "SUBPROCESS-LINE" in texts and "IN-KERNEL-LINE" in texts
