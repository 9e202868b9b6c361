"""A JupyterLab server and a headless Chromium page for the real-browser tests (tests/browser/).

The server runs this interpreter's JupyterLab on 127.0.0.1 (a free port, a random token,
``--no-browser``) over a temp copy of the notebooks it is given, with its config, runtime,
settings and workspace folders in tmp. Chromium is Debian's (``/usr/bin/chromium``, or
``$NBHELPERS_CHROMIUM``) driven by Playwright through ``executable_path``: nothing is downloaded
at run time. Readiness is waited for by signals (HTTP 200 on ``/api/status`` with the token,
the notebook's kernel indicator ``idle``), with timeouts in minutes for a busy 2-core host.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("NBHELPERS_CHROMIUM", "/usr/bin/chromium"))
SERVER_START_S = 240.0
# Lab settings for a test: every cell attached to the DOM (so a cell off screen can be read),
# no news or update checks (no network, no toast over the notebook).
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _browser_or_skip():
    """Playwright's sync API, or a skip that names what is missing and how to get it."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the browser test needs Playwright: pip install -e '.[browser]' "
                    "(scripts/test.sh does)")
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does "
                    "when it can), or set NBHELPERS_CHROMIUM to a Chromium binary")
    return sync_playwright


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"jupyter lab not answering {url} after {SERVER_START_S:.0f} s:\n"
                       f"{log.read_text()[-3000:]}")


class Lab:
    """A running JupyterLab: ``root`` (its files), ``base`` URL, ``token``, ``url(path)``."""

    def __init__(self, root: Path, base: str, token: str):
        self.root, self.base, self.token = root, base, token

    def url(self, path: str) -> str:
        return f"{self.base}/lab/tree/{path}?token={self.token}"

    def api(self, path: str, body: dict | None = None) -> dict:
        """JSON from the server's REST API (POST when ``body`` is given)."""
        req = urllib.request.Request(
            f"{self.base}/api/{path}", method="POST" if body is not None else "GET",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}",
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="module")
def lab_files(tmp_path_factory) -> Path:
    """The server's root folder; a test module copies its notebooks in before ``lab`` starts."""
    return tmp_path_factory.mktemp("lab_root")


@pytest.fixture(scope="module")
def lab(lab_files, tmp_path_factory):
    """Start JupyterLab over ``lab_files``; stopped (SIGTERM, then SIGKILL) after the module."""
    _browser_or_skip()
    state = tmp_path_factory.mktemp("lab_state")
    for name, value in SETTINGS.items():
        (state / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (state / "settings" / name).write_text(json.dumps(value))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"),
               JUPYTER_RUNTIME_DIR=str(state / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(state / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"))
    port, token = _free_port(), secrets.token_hex(16)
    log = state / "server.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={lab_files}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    cmd += ["--allow-root"] if os.geteuid() == 0 else []  # CI containers run as root
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=lab_files, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, f"{base}/api/status?token={token}", log)
        yield Lab(lab_files, base, token)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def page(lab):
    """A headless Chromium page (1400x1000) of Debian's Chromium, closed after the module."""
    sync_playwright = _browser_or_skip()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(180_000)
        pg = context.new_page()
        try:
            yield pg
        finally:
            context.close()
            browser.close()
