"""The papermill child starts a kernel again when it died before its first reply (a port clash
of two kernels started at once), and never retries any other failure."""

from __future__ import annotations

import pytest

from nbhelpers.run import child as execute


class _FakePapermill:
    def __init__(self, failures: list[Exception]):
        self.failures = list(failures)
        self.calls = 0

    def execute_notebook(self, *args, **kwargs):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)


SPEC = {"input": "in.ipynb", "output": "out.ipynb", "parameters": {}, "cwd": "."}
DEATH = RuntimeError("Kernel died before replying to kernel_info")


def test_a_kernel_dead_at_startup_is_started_again(monkeypatch, capsys):
    monkeypatch.setattr("time.sleep", lambda s: None)
    pm = _FakePapermill([DEATH, DEATH])
    execute._execute_with_start_retry(pm, SPEC)
    assert pm.calls == 3
    assert "starting it again (2 of 2)" in capsys.readouterr().err


def test_start_retries_are_bounded(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    pm = _FakePapermill([DEATH] * (execute.START_RETRIES + 1))
    with pytest.raises(RuntimeError, match="died before replying"):
        execute._execute_with_start_retry(pm, SPEC)
    assert pm.calls == execute.START_RETRIES + 1


@pytest.mark.parametrize("exc", [RuntimeError("Kernel didn't respond in 60 seconds"),
                                 ValueError("bad notebook")])
def test_other_failures_are_not_retried(exc):
    pm = _FakePapermill([exc])
    with pytest.raises(type(exc)):
        execute._execute_with_start_retry(pm, SPEC)
    assert pm.calls == 1
