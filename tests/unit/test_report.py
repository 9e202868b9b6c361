"""nbhelpers.run.report on a small executed set made in tmp: an ok notebook with a PNG plot, a
failed one with an error output (sidecars as make_sidecar / runner.mark_failed write them), a
backend's sidecar-only run and a notebook without a sidecar."""

import base64
import io
import os
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from nbhelpers.__main__ import main
from nbhelpers.run.index import index_rows
from nbhelpers.run.report import write_site
from nbhelpers.stats import make_sidecar, write_sidecar

pytest.importorskip("nbconvert", reason="the report needs nbconvert: pip install -e '.[notebooks]'")

ERROR_LINE = "RuntimeError: boom in cell 3"


class _Tags(HTMLParser):
    """Collects every ``<a href>`` and ``<img src>`` / ``<script src>`` of a page."""

    def __init__(self):
        super().__init__()
        self.links, self.imgs, self.scripts = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag == "img":
            self.imgs.append(attrs.get("src", ""))
        if tag == "script" and attrs.get("src"):
            self.scripts.append(attrs["src"])


def _tags(page: Path) -> _Tags:
    parser = _Tags()
    parser.feed(page.read_text())
    return parser


def _png() -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1, 2], [1, 3, 2])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _write_nb(path: Path, outputs: list) -> None:
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("plot()", execution_count=1, outputs=outputs)
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), code]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    executed, out = root / "executed", root / "site"
    folder = executed / "phase1_rollout/10_lora_rollout"
    png = nbformat.v4.new_output("display_data", data={"image/png": _png(),
                                                       "text/plain": "<Figure>"})
    _write_nb(folder / "20261201T000000Z_cpu_aaaaaaa.ipynb", [png])
    write_sidecar(make_sidecar(phase="phase1", backend="hf_generate",
                               extra={"headline": {"tok_s": 12.5}}),
                  folder / "20261201T000000Z_cpu_aaaaaaa.json")
    err = nbformat.v4.new_output("error", ename="RuntimeError", evalue="boom in cell 3",
                                 traceback=["Traceback (most recent call last)", ERROR_LINE])
    _write_nb(folder / "20261201T010000Z_cpu_bbbbbbb.ipynb", [err])
    failed = make_sidecar(phase="phase1", backend="hf_cb", error=f"{ERROR_LINE}\npartial "
                          "notebook: executed/...", extra={"notebook": "10_lora_rollout.ipynb"})
    failed["status"] = "failed"  # as runner.mark_failed writes it
    write_sidecar(failed, folder / "20261201T010000Z_cpu_bbbbbbb.json")
    write_sidecar(make_sidecar(phase="phase1", backend="hf_cb", rounds=[
        {"wall_s": 2.0, "new_tokens": 20, "prompt_tokens": 0}]),
        folder / "20261201T000000Z_cpu_aaaaaaa_backends/20261201T000001Z_cpu_hf_cb.json")
    _write_nb(executed / "phase3_flex/34_gemma4/20261201T020000Z_h200_ccccccc.ipynb", [png])
    pages = write_site(executed, out)
    return executed, out, pages


def test_one_page_per_notebook_and_sidecar_only_run_plus_index(site):
    executed, out, pages = site
    assert pages[0] == out / "index.html"
    htmls = sorted(p.relative_to(out) for p in out.rglob("*.html"))
    assert len(htmls) == len(pages) == 1 + 3 + 1  # index, 3 notebooks, 1 sidecar-only run
    nb_pages = {p.relative_to(executed).with_suffix(".html") for p in executed.rglob("*.ipynb")}
    assert nb_pages <= set(htmls)


def test_every_page_links_back_to_the_index(site):
    _, out, pages = site
    for page in pages[1:]:
        back = [h for h in _tags(page).links
                if (page.parent / h).resolve() == (out / "index.html").resolve()]
        assert back, f"{page} has no link to index.html"


def test_every_index_link_resolves_and_rows_match_index_md(site):
    executed, out, _ = site
    links = _tags(out / "index.html").links
    assert len(links) == len(index_rows(executed)) + 1  # + the notebook without a sidecar
    for href in links:
        assert (out / href).is_file(), href


def test_every_image_is_embedded_and_nothing_is_loaded_from_elsewhere(site):
    _, out, pages = site
    ok = out / "phase1_rollout/10_lora_rollout/20261201T000000Z_cpu_aaaaaaa.html"
    assert len(_tags(ok).imgs) == 1
    for page in pages:
        tags = _tags(page)
        assert all(src.startswith("data:image/png;base64,") for src in tags.imgs), page
        assert not [s for s in tags.scripts if "://" in s], page
        assert not [h for h in tags.links if h.startswith(("http://", "https://"))], page


def test_failed_run_page_shows_its_error_and_the_index_marks_it(site):
    _, out, _ = site
    page = (out / "phase1_rollout/10_lora_rollout/20261201T010000Z_cpu_bbbbbbb.html").read_text()
    assert "failed run: error: RuntimeError: boom in cell 3" in page  # the banner
    assert "boom in cell 3" in page.split("nbh-failed", 1)[1].split("</div>", 1)[1]  # the output
    index = (out / "index.html").read_text()
    row = next(r for r in index.split("<tr")
               if "20261201T010000Z_cpu_bbbbbbb" in r and "10_lora_rollout.html" not in r)
    assert 'class="failed"' in row and "status-failed" in row


def test_cli_report_writes_the_site_and_refuses_an_out_inside_the_archive(site, tmp_path, capsys):
    executed, _, _ = site
    assert main(["report", "--executed", str(executed), "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s/index.html").is_file() and "pages in" in capsys.readouterr().out
    assert main(["report", "--executed", str(executed), "--out", str(executed / "x")]) == 2
    assert "inside the archive" in capsys.readouterr().err
    missing = os.fspath(tmp_path / "nope")
    assert main(["report", "--executed", missing, "--out", str(tmp_path / "t")]) == 2


def test_cli_report_names_files_where_folders_are_needed(site, tmp_path, capsys):
    executed, _, _ = site
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert main(["report", "--executed", str(executed), "--out", str(a_file)]) == 2
    assert "is an existing file" in capsys.readouterr().err
    assert main(["report", "--executed", str(a_file), "--out", str(tmp_path / "t")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_an_empty_notebook_is_skipped_by_name_and_the_rest_is_exported(tmp_path, capsys):
    executed, out = tmp_path / "executed", tmp_path / "site"
    folder = executed / "phase1_rollout/10_lora_rollout"
    _write_nb(folder / "20261201T000000Z_cpu_aaaaaaa.ipynb", [])
    empty = folder / "20261201T010000Z_cpu_bbbbbbb.ipynb"
    empty.write_bytes(b"")  # an interrupted phase run's notebook, linked from INDEX.md
    for nb in (folder / "20261201T000000Z_cpu_aaaaaaa.ipynb", empty):
        write_sidecar(make_sidecar(phase="phase1", backend="hf_generate"), nb.with_suffix(".json"))
    assert main(["report", "--executed", str(executed), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"skipped {empty}: 0 bytes" in err
    assert (out / "phase1_rollout/10_lora_rollout/20261201T000000Z_cpu_aaaaaaa.html").is_file()
    assert not (out / "phase1_rollout/10_lora_rollout/20261201T010000Z_cpu_bbbbbbb.html").exists()
    index = (out / "index.html").read_text()
    assert "20261201T010000Z_cpu_bbbbbbb (not exported: 0 bytes" in index
    assert "Notebooks not exported" in index
    for href in _tags(out / "index.html").links:
        assert (out / href).is_file(), href


def test_cli_report_names_the_fix_for_an_unwritable_out(site, tmp_path, capsys):
    executed, _, _ = site
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where --out needs a folder's parent
    assert main(["report", "--executed", str(executed), "--out", str(blocker / "s")]) == 2
    err = capsys.readouterr().err
    assert f"--out {blocker / 's'}: cannot write the site there" in err
    assert "pick a writable folder" in err and "Traceback" not in err
