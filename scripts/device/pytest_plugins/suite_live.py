"""pytest plugin of ``scripts/device/suite.py``: each failed or errored test's node id, the moment
its report reaches the controller (with pytest-xdist the workers' reports are replayed there; the
workers themselves write nothing, so each failure is one line), as ``FAILED <nodeid> (call)`` /
``ERROR <nodeid> (setup)`` appended and flushed to ``$NBH_SUITE_LIVE``. A suite stopped at a
device call's cap still says which tests failed before the stop.

Loaded by ``suite.py`` as ``-p suite_live`` with this folder on ``PYTHONPATH``.
"""
from __future__ import annotations

import os

_WORKER = False


def pytest_configure(config) -> None:
    global _WORKER
    _WORKER = hasattr(config, "workerinput")  # an xdist worker: the controller writes


def pytest_runtest_logreport(report) -> None:
    """Append the failing report's node id to ``$NBH_SUITE_LIVE`` (no-op when unset)."""
    path = os.environ.get("NBH_SUITE_LIVE")
    if _WORKER or not path or not report.failed:
        return
    kind = "FAILED" if report.when == "call" else "ERROR"
    with open(path, "a", encoding="utf-8") as out:
        out.write(f"{kind} {report.nodeid} ({report.when})\n")
        out.flush()
