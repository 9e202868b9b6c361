"""scripts/device/suite.py stopped by a device call's cap (SIGTERM from run_step.py): the failures
so far are named live (``failed_live.txt``), pytest's short summary reaches the log and the junit
XML is written, and suite.py exits 130. A tiny test file stands in for the suite; no prefetch."""

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "scripts/device/suite.py"


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_keeps_the_failures_found_so_far(tmp_path, sigint):
    """``ignored``: suite.py started with SIGINT ignored, as a background job of a
    non-interactive shell (``cmd &``) is; pytest must still get a working SIGINT (a clean-clone
    run started that way lost its summary to the SIGKILL before suite.py restored it)."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t/test_a.py").write_text(
        "import time\n\ndef test_fail():\n    assert 1 == 2\n\n"
        "def test_slow():\n    time.sleep(600)\n")
    out = tmp_path / "out"
    # one process: NBH_SUITE_WORKERS=0 (with xdist importable, as on the H200, suite.py would
    # add "-n 12", which "-p no:xdist" turned into a usage error, exit 4)
    env = {**os.environ, "OUT": str(out), "NBH_SUITE_PREFETCH": "0", "NBH_SUITE_WORKERS": "0"}
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    proc = subprocess.Popen([sys.executable, str(SUITE), "--paths", str(tmp_path / "t/test_a.py")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            preexec_fn=ignore)  # noqa: PLW1509 (no threads started here)
    live = out / "failed_live.txt"
    deadline = time.monotonic() + 300  # a loose bound for a busy host, not a speed check
    while not (live.is_file() and "test_fail" in live.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "no live failure line"
        time.sleep(0.5)
    [line] = live.read_text().splitlines()
    assert line.startswith("FAILED ") and line.endswith("test_a.py::test_fail (call)")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 130
    log = (out / "suite.log").read_text()
    assert "suite.py: SIGTERM (a time cap)" in log
    summary = log.split("short test summary info", 1)[1]  # its lines are cut to the width
    assert any(ln.startswith("FAILED ") and "test_a.py::test_fail" in ln
               for ln in summary.splitlines())
    assert "KeyboardInterrupt" in log
    cases = {c.get("name"): c for c in ET.parse(out / "junit.xml").iter("testcase")}
    assert cases["test_fail"].find("failure") is not None


def test_suite_order_runs_the_longest_first(tmp_path):
    """``suite_order``: durations from a junit XML, unknown tests at the 75th percentile, a stable
    sort; a real pytest run in that order (``-p suite_order``, no xdist)."""
    sys.path.insert(0, str(SUITE.parent / "pytest_plugins"))
    try:
        import suite_order
    finally:
        sys.path.pop(0)
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="t.test_a" name="test_quick" time="0.1"/>'
                     '<testcase classname="t.test_a" name="test_slow" time="9.0"/>'
                     '<testcase classname="t.test_a" name="test_mid" time="3.0"/>'
                     '<testcase classname="t.test_a" name="test_mid2" time="3.0"/>'
                     '</testsuite></testsuites>')
    got = suite_order.junit_durations(str(junit))
    assert got["t/test_a.py::test_slow"] == 9.0 and len(got) == 4
    ids = ["t/test_a.py::test_quick", "t/test_a.py::test_new", "t/test_a.py::test_mid",
           "t/test_a.py::test_slow", "t/test_a.py::test_mid2"]
    assert suite_order.lpt_order(ids, got) == [
        "t/test_a.py::test_slow", "t/test_a.py::test_new", "t/test_a.py::test_mid",
        "t/test_a.py::test_mid2", "t/test_a.py::test_quick"]  # new = p75 = 3.0, before the ties
    assert suite_order.junit_durations(str(tmp_path / "missing.xml")) == {}
    (tmp_path / "t").mkdir()
    (tmp_path / "t/test_a.py").write_text(
        "ORDER = []\n\ndef test_quick():\n    ORDER.append('quick')\n\n"
        "def test_mid():\n    ORDER.append('mid')\n\ndef test_slow():\n    ORDER.append('slow')\n"
        "\ndef test_last():\n    assert ORDER == ['slow', 'mid', 'quick']\n")
    junit.write_text(junit.read_text().replace('name="test_mid2" time="3.0"',
                                               'name="test_last" time="0.0"'))
    env = {**os.environ, "NBH_SUITE_DURATIONS": str(junit),
           "PYTHONPATH": str(SUITE.parent / "pytest_plugins")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_order", "-p",
                           "no:xdist", "-p", "no:cacheprovider", "t/test_a.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
