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

SUITE = Path(__file__).resolve().parents[2] / "scripts/device/suite.py"


def test_sigterm_keeps_the_failures_found_so_far(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t/test_a.py").write_text(
        "import time\n\ndef test_fail():\n    assert 1 == 2\n\n"
        "def test_slow():\n    time.sleep(600)\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "NBH_SUITE_PREFETCH": "0"}
    proc = subprocess.Popen([sys.executable, str(SUITE), "--paths", str(tmp_path / "t/test_a.py"),
                             "-p", "no:xdist"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    live = out / "failed_live.txt"
    deadline = time.monotonic() + 300  # a loose bound for a busy host, not a speed check
    while not (live.is_file() and "test_fail" in live.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "no live failure line"
        time.sleep(0.5)
    [line] = live.read_text().splitlines()
    assert line.startswith("FAILED ") and line.endswith("test_a.py::test_fail (call)")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    log = (out / "suite.log").read_text()
    assert "suite.py: SIGTERM (a time cap)" in log
    summary = log.split("short test summary info", 1)[1]  # its lines are cut to the width
    assert any(ln.startswith("FAILED ") and "test_a.py::test_fail" in ln
               for ln in summary.splitlines())
    assert "KeyboardInterrupt" in log
    cases = {c.get("name"): c for c in ET.parse(out / "junit.xml").iter("testcase")}
    assert cases["test_fail"].find("failure") is not None
