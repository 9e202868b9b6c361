"""Static notebook checks (no execution): one parameters cell, no outputs, no absolute paths,
house layout, and every committed notebook is byte-identical to what its generator
(``scripts/make_*notebook*.py``, built on ``scripts/nbgen.py``) writes."""

import importlib.util
import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").rglob("*.ipynb"))
ABSOLUTE = re.compile(r"""(?<![\w.])(/(home|tmp|work|root|Users|mnt|opt|data)/|[A-Z]:\\)""")
PARAM_LINE = re.compile(r"^\w+: [\w\[\], |]+ = .+  # .+$")
GENERATORS = sorted((REPO / "scripts").glob("make_*notebook*.py"))


def _load(path):
    return nbformat.read(path, as_version=4)


def _module(name, path):
    """Import a script by path and register it, so generators' ``import nbgen`` resolves."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


nbgen = _module("nbgen", REPO / "scripts/nbgen.py")
BUILT = [(gen.name, rel, build) for gen in GENERATORS
         for rel, build in _module(gen.stem, gen).NOTEBOOKS.items()]


def test_there_are_notebooks():
    assert REPO / "notebooks/phase0_reference/00_reference_grpo.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell_of_typed_commented_literals(path):
    cells = [c for c in _load(path).cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path.name}: {len(cells)} cells tagged 'parameters', want 1"
    bad = [ln for ln in cells[0].source.splitlines() if ln and not PARAM_LINE.match(ln)]
    assert not bad, f"{path.name}: parameter lines not 'name: type = literal  # help': {bad}"
    # papermill's parameter parser splits on '=': one in the help text made it drop the line
    # ("Unable to parse line 22 ... Passed unknown parameter: cpu_threads")
    eq = [ln for ln in cells[0].source.splitlines() if "=" in ln.partition("#")[2]]
    assert not eq, f"{path.name}: '=' in a parameter's help comment confuses papermill: {eq}"


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_training_in_the_kernel_prints_its_steps_not_an_html_bar(path):
    """A trainer run in the kernel with ``progress=True`` gets transformers' notebook progress
    bar, an HTML table that papermill never copies to the runner's terminal: phase 0's 8.5 min
    of GRPO steps showed nothing there (2026-12-07). ``progress=False`` prints each step's logged
    values as a line, which the terminal shows as it comes (tests/notebooks/test_phase0_smoke.py
    runs it)."""
    code = "\n".join(c.source for c in _load(path).cells if c.cell_type == "code")
    assert "progress=True" not in code, f"{path.name}: pass progress=False (docstring)"


def test_every_committed_notebook_has_exactly_one_generator():
    claimed = [rel for _, rel, _ in BUILT]
    assert len(claimed) == len(set(claimed)), f"a notebook has two generators: {claimed}"
    committed = {str(p.relative_to(REPO)) for p in NOTEBOOKS}
    assert committed == set(claimed), (f"no generator for {committed - set(claimed)}; "
                                       f"generated but not committed: {set(claimed) - committed}")


@pytest.mark.parametrize("script, rel, build", BUILT, ids=[rel for _, rel, _ in BUILT])
def test_committed_notebook_is_byte_identical_to_its_generator(script, rel, build):
    assert (REPO / rel).read_bytes() == nbgen.render(build()), (
        f"{rel} is out of sync: run python scripts/{script}")


def test_check_mode_reports_missing_and_edited_notebooks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nbgen, "REPO", tmp_path)
    rel = "notebooks/x/00_x.ipynb"
    notebooks = {rel: lambda: nbgen.build("# X\n\n**Result:** r", "%autoreload 2\nimport os",
                                          'a: int = 1  # help', [("## S", "a", "a + 1")],
                                          sidecar=("## Checks", "assert a == 1"))}
    assert nbgen.main(notebooks, ["--check"]) == 1  # missing file
    assert nbgen.main(notebooks, []) == 0
    nb = _load(tmp_path / rel)
    assert [c.id for c in nb.cells] == [f"c{i:02d}" for i in range(8)]
    assert nb.cells[2].metadata["tags"] == ["parameters"]
    assert nbgen.main(notebooks, ["--check"]) == 0
    (tmp_path / rel).write_text((tmp_path / rel).read_text().replace("a + 1", "a + 2"))
    assert nbgen.main(notebooks, ["--check"]) == 1
    assert f"out of sync: {rel}" in capsys.readouterr().out


@pytest.mark.parametrize("title, sections, sidecar, fix", [
    ("Title", [], ("## C", "assert True"), "must start with '# '"),
    ("# T", [("## S",)], ("## C", "assert True"), "has no code cell"),
    ("# T", [], ("## C", "print(1)"), "must assert"),
])
def test_build_rejects_a_bad_spec_naming_the_fix(title, sections, sidecar, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        nbgen.build(title, "import os", "a: int = 1  # help", sections, sidecar)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_is_valid_python(path):
    """A generator's string escapes can break a cell (e.g. a literal newline inside a string:
    the H200 phase 2 run of 2026-11-30 failed on one); IPython magics are blanked first."""
    import ast
    for i, cell in enumerate(_load(path).cells):
        if cell.cell_type != "code":
            continue
        src = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln
                        for ln in cell.source.splitlines())
        try:
            ast.parse(src)
        except SyntaxError as err:
            pytest.fail(f"{path.name} cell {i}: {err}")


FIGURE_CALLS = re.compile(r"\beb\.(\w+_figure)\((.*?)\)(?=\s*(?:if\b|$|\n))", re.DOTALL)


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.parent.name == "phase3_flex"],
                         ids=lambda p: p.name)
def test_flex_figures_take_this_runs_id_and_no_earlier_run(path):
    """Issue 12: the H200 run of 33 plotted older bench sidecars (``eb.sweep_figure(earlier
    ...)``) and fell back to an older run's profile. Every figure helper call passes the run's
    ``run_id`` (the helpers refuse rows of another run: tests/unit/test_floor.py) and is never
    handed the earlier-runs table; no cell reads an older profile for a figure."""
    code = "\n".join(c.source for c in _load(path).cells if c.cell_type == "code")
    calls = FIGURE_CALLS.findall(code)
    for name, args in calls:
        assert "run_id" in args, f"{path.name}: eb.{name}({args}) without the run's run_id"
        assert "earlier" not in args, f"{path.name}: eb.{name} is handed earlier runs: {args}"
    assert "prof_sides" not in code and "fall back" not in code, f"{path.name}: older profile"
    if path.stem == "33_flex_vs_baselines":
        assert {n for n, _ in calls} >= {"sweep_figure", "pct_figure", "ab_figure",
                                         "kernels_figure"}
        assert "run_id=run_id" in code and "eb.flex_frame(sides, run_id=run_id)" in code
        assert "eb.ab_frame(sweep, run_id)" in code  # the A/B table, held to the run too
        # issue 12: bad lora_modes / variants fail before any point runs, every point profiled
        assert code.index("fc.plan_configs(") < code.index("fc.run_configs(")
        assert "batches[-1]" not in code, f"{path.name}: a profile of the last batch only"
