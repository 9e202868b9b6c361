"""The papermill child (``run/child._execute_in_child``) takes the runner's stop signal as an
interruption whichever exception escapes papermill: the bare ``KeyboardInterrupt``, or the
``CellExecutionError`` / ``PapermillExecutionError`` that nbclient raises when the kernel's own
``KeyboardInterrupt`` reply wins the race (seen under a 12-worker suite on the H200)."""

from __future__ import annotations

import pytest

pm = pytest.importorskip("papermill",
                         reason="the runner needs papermill: pip install -e '.[notebooks]'")

from nbhelpers.run import child as execute


def _raise_during_interrupt(exc: Exception):
    def run(pm_mod, spec, hooks=None):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise exc  # the implicit context is what nbclient leaves
    return run


def _kernel_reply_error() -> Exception:
    from nbclient.exceptions import CellExecutionError
    return CellExecutionError("time.sleep(900)", "KeyboardInterrupt", "")


@pytest.mark.parametrize("make", [
    lambda: KeyboardInterrupt(),
    _kernel_reply_error,
    lambda: pm.PapermillExecutionError(3, 3, "time.sleep(900)", "KeyboardInterrupt", "", []),
], ids=["bare", "cell_error_in_context", "papermill_error_ename"])
def test_stop_signal_is_one_line_and_exit_130(make, monkeypatch, tmp_path, capsys):
    exc = make()
    if isinstance(exc, (KeyboardInterrupt, pm.PapermillExecutionError)):  # no context: ename
        monkeypatch.setattr(execute, "_execute_with_start_retry",
                            lambda pm_mod, spec, hooks=None: (_ for _ in ()).throw(exc))
    else:
        monkeypatch.setattr(execute, "_execute_with_start_retry", _raise_during_interrupt(exc))
    error_file = tmp_path / "error.txt"
    assert execute._execute_in_child({"error_file": str(error_file)}) == 130
    err = capsys.readouterr().err
    assert err.strip() == ("notebook stopped by the runner (interrupted); the partial notebook "
                           "is kept")
    assert not error_file.exists()  # the parent records "interrupted", not a cell error


def test_a_real_cell_error_is_still_a_failure(monkeypatch, tmp_path, capsys):
    exc = pm.PapermillExecutionError(2, 5, "x = 1", "ValueError", "bad batch", [])
    monkeypatch.setattr(execute, "_execute_with_start_retry",
                        lambda pm_mod, spec, hooks=None: (_ for _ in ()).throw(exc))
    error_file = tmp_path / "error.txt"
    assert execute._execute_in_child({"error_file": str(error_file)}) == 1
    assert error_file.read_text() == "ValueError: bad batch (cell 2, execution count 5)"
    assert "notebook failed: ValueError: bad batch" in capsys.readouterr().err
