"""pytest plugin of ``scripts/device/suite.py``: longest tests first (LPT list scheduling), by each
test's duration in an earlier run's junit XML (``$NBH_SUITE_DURATIONS``), so xdist's ``--dist
load``, which hands tests out in collection order, does not start a 90 s GPU test last. Tests the
junit does not know (new ones, often GPU kernels that compile) count as its 75th-percentile
duration. Order only: every collected test still runs. Replaying the 7bd3c6b junit (1,531 s of
tests, 12 workers): collection order 155 s, this order 128 s, the bound max(sum / 12, longest)
128 s (list-scheduling simulation, 2026-12-01; real runs add collection and GPU contention).

Loaded by ``suite.py`` as ``-p suite_order`` with this folder on ``PYTHONPATH``; a missing or
unreadable XML leaves the order as collected (``suite.py`` logs which file it passed).
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET


def junit_durations(path: str) -> dict[str, float]:
    """``{nodeid: seconds}`` from a junit XML (classname ``tests.engine.test_x`` + name ->
    ``tests/engine/test_x.py::name``); ``{}`` when the file is missing or not XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    out = {}
    for case in root.iter("testcase"):
        module, name = case.get("classname") or "", case.get("name") or ""
        if module and name:
            out[module.replace(".", "/") + ".py::" + name] = float(case.get("time") or 0.0)
    return out


def lpt_order(nodeids: list[str], durations: dict[str, float]) -> list[str]:
    """``nodeids`` longest first; unknown ones at the known durations' 75th percentile; ties
    keep their collection order (a stable sort)."""
    known = sorted(durations.values())
    default = known[int(0.75 * (len(known) - 1))] if known else 0.0
    return sorted(nodeids, key=lambda n: -durations.get(n, default))


def pytest_collection_modifyitems(config, items) -> None:
    path = os.environ.get("NBH_SUITE_DURATIONS")
    durations = junit_durations(path) if path else {}
    if not durations:  # with xdist each worker collects and sorts alike (a deterministic key)
        return
    rank = {n: i for i, n in enumerate(lpt_order([it.nodeid for it in items], durations))}
    items.sort(key=lambda it: rank[it.nodeid])
