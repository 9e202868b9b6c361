"""Static notebook checks (no execution): one parameters cell, no outputs, no absolute paths,
house layout, and the generated notebooks match scripts/make_notebooks.py."""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").rglob("*.ipynb"))
ABSOLUTE = re.compile(r"""(?<![\w.])(/(home|tmp|work|root|Users|mnt|opt|data)/|[A-Z]:\\)""")
PARAM_LINE = re.compile(r"^\w+: [\w\[\], |]+ = .+  # .+$")


def _load(path):
    return nbformat.read(path, as_version=4)


def test_there_are_notebooks():
    assert REPO / "notebooks/phase0_reference/00_reference_grpo.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell_of_typed_commented_literals(path):
    cells = [c for c in _load(path).cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path.name}: {len(cells)} cells tagged 'parameters', want 1"
    bad = [ln for ln in cells[0].source.splitlines() if ln and not PARAM_LINE.match(ln)]
    assert not bad, f"{path.name}: parameter lines not 'name: type = literal  # help': {bad}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_outputs_and_no_absolute_paths(path):
    nb = _load(path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: outputs"
        hit = ABSOLUTE.search(cell.source)
        assert hit is None, f"{path.name}: absolute path {hit.group(0)!r} in {cell.source[:80]!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_house_layout(path):
    nb = _load(path)
    first_md = next(c for c in nb.cells if c.cell_type == "markdown")
    assert first_md.source.startswith("# "), "first markdown cell must be the H1 title"
    assert "Result:" in first_md.source, "the title cell needs a 'Result:' line"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "%autoreload 2" in code[0].source and "import" in code[0].source
    assert "assert" in code[-1].source, "the last code cell must assert the notebook's claims"


def test_generated_notebooks_are_in_sync_with_the_generator():
    spec = importlib.util.spec_from_file_location("make_notebooks",
                                                  REPO / "scripts/make_notebooks.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for rel, build in gen.NOTEBOOKS.items():
        committed = [(c.cell_type, c.source) for c in _load(REPO / rel).cells]
        fresh = [(c.cell_type, c.source) for c in build().cells]
        assert committed == fresh, f"{rel} differs: run python scripts/make_notebooks.py"
