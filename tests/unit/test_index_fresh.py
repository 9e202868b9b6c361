"""The committed ``executed/INDEX.md`` is what ``python -m nbhelpers index`` writes from the
committed ``executed/`` tree (CPU, reads only: the fresh index goes to a temporary file).

A run committed without regenerating the index (the lead once found seven runs missing) fails
here with the command that fixes it.
"""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

from nbhelpers.run.index import index_rows, render_index, write_index

REPO = Path(__file__).resolve().parents[2]
EXECUTED = REPO / "executed"


def test_committed_index_equals_a_fresh_one(tmp_path):
    fresh = write_index(EXECUTED, out=tmp_path / "INDEX.md")
    committed = (EXECUTED / "INDEX.md").read_text()
    new = fresh.read_text()
    diff = "".join(list(difflib.unified_diff(committed.splitlines(True), new.splitlines(True),
                                             "executed/INDEX.md (committed)", "fresh"))[:40])
    assert new == committed, ("executed/INDEX.md is stale: run `python -m nbhelpers index` "
                              f"and commit executed/INDEX.md.\n{diff}")


def test_writing_elsewhere_leaves_executed_untouched(tmp_path):
    before = (EXECUTED / "INDEX.md").stat().st_mtime_ns
    write_index(EXECUTED, out=tmp_path / "INDEX.md")
    assert (EXECUTED / "INDEX.md").stat().st_mtime_ns == before
    assert not list(EXECUTED.glob("INDEX.md.tmp*"))


def _sidecar(folder: Path, stem: str, utc: str) -> None:
    from nbhelpers.stats import make_sidecar, write_sidecar
    side = make_sidecar(phase="phase0", backend="hf", extra={"notebook": "00_x.ipynb"})
    side["env"] = {**side["env"], "utc": utc, "gpu": "cpu", "git_sha": "abc"}
    write_sidecar(side, folder / f"{stem}.json")


def test_the_index_depends_on_the_files_only_and_same_second_runs_sort_by_name(tmp_path):
    """Same-second runs: descending run name (``_1`` first); the order and text do not change
    with the order the files were written in (directory order) or with a copy of the tree."""
    first = tmp_path / "a" / "phase0_reference" / "00_x"
    first.mkdir(parents=True)
    stems = ["20261201T100000Z_cpu_abc", "20261201T100000Z_cpu_abc_1",
             "20261201T100000Z_h200_abc", "20261130T090000Z_cpu_abc"]
    for stem in stems:
        _sidecar(first, stem, stem[:16])
    second = tmp_path / "b" / "phase0_reference" / "00_x"
    second.mkdir(parents=True)
    for stem in reversed(stems):
        shutil.copy(first / f"{stem}.json", second / f"{stem}.json")
    rows = index_rows(tmp_path / "a")
    assert [r["_key"] for r in rows] == ["20261201T100000Z_h200_abc",
                                         "20261201T100000Z_cpu_abc_1",
                                         "20261201T100000Z_cpu_abc", "20261130T090000Z_cpu_abc"]
    assert render_index(rows) == render_index(index_rows(tmp_path / "b"))
