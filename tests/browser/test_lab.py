"""JupyterLab in headless Chromium: the phase 1 notebook run with its CPU defaults through the
``nbhelpers`` kernel, its "Try other choices" panel clicked, and an executed H200 notebook's
inline plots rendered. Screenshots go to the test's tmp dir (paths printed)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PHASE1 = "phase1_rollout/10_lora_rollout.ipynb"
RUN_ALL_S = 600.0  # the CPU defaults take ~45 s under papermill on 2 cores; slack for a busy host
CLICK_S = 420.0
KERNEL_S = 300.0  # kernel start: imports on a busy host
# State of the notebook panel on the page: code cells, their prompts, tracebacks shown, kernel.
STATE_JS = """() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
  const prompts = cells.map(c => (c.querySelector('.jp-InputPrompt') || {}).textContent || '');
  const outs = [...document.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent);
  const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {n: cells.length, busy: prompts.filter(p => p.includes('*')).length,
          done: prompts.filter(p => /\\[\\d+\\]/.test(p)).length,
          tracebacks: outs.filter(t => t.includes('Traceback')).map(t => t.slice(-800)),
          status: ind ? ind.dataset.status : null};
}"""
IMAGES_JS = """() => [...document.querySelectorAll('.jp-OutputArea-output img')].map(
  i => [i.complete, i.naturalWidth, i.naturalHeight])"""


def copy_into(root: Path, src: Path, rel: str) -> Path:
    """Copy ``src`` to ``root/rel`` (folders made); returns the copy."""
    dest = root / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return dest


def _say(capsys, msg: str) -> None:
    with capsys.disabled():
        print(f"\n[browser] {msg}", flush=True)


def _poll(page, done, timeout_s: float, what: str) -> dict:
    """Evaluate STATE_JS every 2 s until ``done(state)``; TimeoutError with the last state."""
    deadline, state = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        state = page.evaluate(STATE_JS)
        if done(state):
            return state
        page.wait_for_timeout(2000)
    raise TimeoutError(f"{what} not done after {timeout_s:.0f} s; last state {state}")


def _open(page, lab, path: str, workspace: str) -> str:
    """Open ``path`` in its own Lab workspace, wait until a kernel is attached and the kernel
    indicator reads ``idle``; returns the kernel's display name."""
    page.goto(f"{lab.base}/lab/workspaces/{workspace}/tree/{path}?token={lab.token}",
              timeout=300_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=300_000)
    page.wait_for_function("() => { const k = document.querySelector('.jp-KernelName');"
                           " return k && !['', 'No Kernel'].includes(k.textContent.trim()); }",
                           timeout=KERNEL_S * 1000)
    page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=300_000)
    return page.locator(".jp-KernelName").first.inner_text()


@pytest.fixture(scope="module")
def lab_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab_root")
    copy_into(root, REPO / "notebooks" / PHASE1, PHASE1)
    return root


def _h200_with_plots() -> tuple[Path, int]:
    """The newest executed phase 1 H200 notebook with inline PNG plots, and their count."""
    found = []
    for nb in sorted((REPO / "executed/phase1_rollout").rglob("*h200*.ipynb"), reverse=True):
        outs = [o for c in json.loads(nb.read_text())["cells"] for o in c.get("outputs", [])]
        pngs = sum("image/png" in o.get("data", {}) for o in outs)
        if pngs:
            found.append((nb, pngs))
    if not found:
        pytest.skip("no executed phase 1 H200 notebook with plots under executed/")
    return found[0]


def test_phase1_notebook_runs_and_its_panel_reruns(lab, page, tmp_path, capsys):
    t0 = time.monotonic()
    nb_file = lab.root / PHASE1
    lab.api("sessions", {"path": PHASE1, "type": "notebook", "name": nb_file.name,
                         "kernel": {"name": "nbhelpers"}})  # the lab joins this session
    kernel = _open(page, lab, PHASE1, "phase1")
    assert "nbhelpers" in kernel, f"notebook runs on kernel {kernel!r}, not nbhelpers"
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    state = _poll(page, lambda s: s["busy"] == 0 and (s["done"] == s["n"] or s["tracebacks"]),
                  RUN_ALL_S, "Run All Cells")
    shot = tmp_path / "lab_phase1_run_all.png"
    page.screenshot(path=str(shot))
    _say(capsys, f"run all: {state['n']} code cells in {time.monotonic() - t0:.0f} s; "
                 f"screenshot {shot}")
    assert not state["tracebacks"], f"a cell shows an error: {state['tracebacks']}"
    n_code = sum(c["cell_type"] == "code" for c in json.loads(nb_file.read_text())["cells"])
    assert state["done"] == state["n"] == n_code, f"executed {state['done']} of {n_code} cells"

    button = page.locator(".jp-OutputArea-output button.jupyter-button", has_text="Run")
    assert page.locator(".widget-output table").count() == 0
    button.scroll_into_view_if_needed()
    t1 = time.monotonic()
    button.click()
    table = page.locator(".widget-output table").first
    table.wait_for(state="visible", timeout=CLICK_S * 1000)
    table.scroll_into_view_if_needed()
    shot = tmp_path / "lab_phase1_panel_rerun.png"
    page.screenshot(path=str(shot))
    text = table.inner_text()
    _say(capsys, f"panel Run: results table after {time.monotonic() - t1:.0f} s; "
                 f"screenshot {shot}")
    assert "hf_generate" in text and "hf_cb" in text and "decode_tok_per_s" in text
    assert not _poll(page, lambda s: s["busy"] == 0, CLICK_S, "panel run")["tracebacks"]

    page.locator(".jp-Notebook").first.click()
    page.keyboard.press("Control+s")  # the saved file: what the kernel sent, cell by cell
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        cells = [c for c in json.loads(nb_file.read_text())["cells"] if c["cell_type"] == "code"]
        if all(c["execution_count"] for c in cells):
            break
        time.sleep(2)
    assert all(c["execution_count"] for c in cells), "the saved notebook lacks executed cells"
    errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"error outputs in the saved notebook: {errors}"


def test_executed_h200_notebook_shows_its_plots(lab, page, tmp_path, capsys):
    src, pngs = _h200_with_plots()
    rel = f"executed/{src.name}"
    copy_into(lab.root, src, rel)
    _open(page, lab, rel, "executed")
    page.wait_for_function(f"() => document.querySelectorAll('.jp-OutputArea-output img').length"
                           f" >= {pngs}", timeout=300_000)
    page.wait_for_function(f"() => ({IMAGES_JS})().every(([c, w, h]) => c && w > 0 && h > 0)",
                           timeout=300_000)
    sizes = page.evaluate(IMAGES_JS)
    first = page.locator(".jp-OutputArea-output img").first
    first.scroll_into_view_if_needed()
    shot, plot = tmp_path / "lab_executed_h200.png", tmp_path / "lab_executed_h200_plot.png"
    page.screenshot(path=str(shot))
    first.screenshot(path=str(plot))
    _say(capsys, f"{src.relative_to(REPO)}: {len(sizes)} plots {sizes}; screenshots {shot} "
                 f"{plot}")
    assert len(sizes) == pngs and all(w > 0 and h > 0 for _, w, h in sizes)
