"""The package's layering, as pyproject.toml's import-linter contracts state it (DESIGN.md:
config < engine < backends < bench, grpo < run; the engine imports only itself and
nbhelpers.config; no cycles between sibling modules). scripts/test.sh runs ``lint-imports``
before pytest; these tests make a broken contract show in pytest's report too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@pytest.mark.skipif(not LINT_IMPORTS.is_file(), reason="import-linter not installed: "
                    "pip install -e '.[dev]' (pins import-linter==2.17)")
def test_import_linter_contracts_are_kept():
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=REPO, capture_output=True,
                          text=True, timeout=900, check=False)
    report = done.stdout + done.stderr
    assert "Contracts:" in report, report[-3000:]  # it analysed the package
    assert done.returncode == 0, report[-3000:]


def test_the_engine_imports_only_itself_and_config():
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (dev extra)")
    graph = grimp.build_graph("nbhelpers", cache_dir=None)
    engine = {m for m in graph.modules if m == "nbhelpers.engine"
              or m.startswith("nbhelpers.engine.")}
    assert "nbhelpers.engine.llm" in engine  # the graph holds the engine
    outside = {(m, dep) for m in engine for dep in graph.find_modules_directly_imported_by(m)
               if dep.startswith("nbhelpers") and dep not in engine
               and dep != "nbhelpers.config"}
    assert not outside, sorted(outside)
