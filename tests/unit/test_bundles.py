"""Offline bundle sets and tools: pin consistency, split/join, bin packing, repack, manifest, closure.

CPU only, no network (wheels here are tiny zips made in tmp_path)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from nbhelpers.bundles import build as bundles
from nbhelpers.bundles import cli as bundles_cli
from nbhelpers.bundles import parts as bundle_parts
from nbhelpers.bundles import verify as bundle_verify
from nbhelpers.bundles.sets import SETS, BundleSet


def _name(pin: str) -> str:
    return pin.split("==")[0].lower().replace("_", "-")


def test_every_set_pins_each_name_once() -> None:
    for bset in SETS.values():
        names = [_name(p) for p in bset.pins]
        assert len(names) == len(set(names)), bset.name


def test_sets_sharing_a_site_agree_on_versions() -> None:
    assert bundle_verify.all_pins_consistent() == []


def test_vllm_and_fa4_clash_so_they_get_separate_sites() -> None:
    tvm = {n: next(p for p in SETS[n].pins if _name(p) == "apache-tvm-ffi") for n in ("vllm", "fa4")}
    assert tvm["vllm"] != tvm["fa4"]
    assert SETS["vllm"].site != SETS["fa4"].site


def test_with_sets_share_the_site() -> None:
    for bset in SETS.values():
        assert all(SETS[w].site == bset.site for w in bset.with_sets), bset.name


def test_bad_pin_and_packing_are_rejected() -> None:
    with pytest.raises(ValueError, match="name==version"):
        BundleSet(name="x", pins=("trl>=1",), packing="wheels", site="/tmp/x", imports=())
    with pytest.raises(ValueError, match="packing"):
        BundleSet(name="x", pins=("trl==1",), packing="zip", site="/tmp/x", imports=())


def test_split_join_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "blob.bin"
    data = os.urandom(300_007)
    src.write_bytes(data)
    parts = bundle_parts.split_file(src, 65_536, tmp_path / "parts")
    assert len(parts) == 5
    assert all(p.stat().st_size <= 65_536 for p in parts)
    assert [p.name for p in parts] == sorted(p.name for p in parts)  # `cat part*` order
    assert bundle_parts.join_parts(parts, tmp_path / "joined").read_bytes() == data
    with pytest.raises(ValueError, match="> 0"):
        bundle_parts.split_file(src, 0, tmp_path / "p0")


def test_pack_bins_respects_the_limit() -> None:
    sizes = {f"w{i}": s for i, s in enumerate([50, 30, 30, 20, 20, 10, 5])}
    bins = bundle_parts.pack_bins(sizes, 60)
    assert sorted(n for b in bins for n in b) == sorted(sizes)
    assert all(sum(sizes[n] for n in b) <= 60 for b in bins)
    assert len(bins) == 3  # 165 bytes need at least 3 bins of 60
    with pytest.raises(ValueError, match="site-xz"):
        bundle_parts.pack_bins({"huge": 61}, 60)


def _tiny_wheel(path: Path, name: str, requires: list[str], members: dict[str, bytes]) -> Path:
    dist = f"{name}-1.0.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {**members, f"{dist}/METADATA": meta.encode()}
    record = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    whl = path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f, data in files.items():
            z.writestr(f, data)
        z.writestr(f"{dist}/RECORD", record)
    return whl


def test_repack_wheel_drops_members_and_their_record_lines(tmp_path: Path) -> None:
    src = _tiny_wheel(tmp_path, "pkg", [], {"pkg/__init__.py": b"", "studio/ui.js": b"x" * 100})
    out = tmp_path / "out"
    out.mkdir()
    whl = bundles.repack_wheel(src, out, ("studio/*",))
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert "studio/ui.js" not in names and "pkg/__init__.py" in names
    assert "studio/" not in record and "pkg/__init__.py" in record


def test_find_wheel_picks_the_target_python(tmp_path: Path) -> None:
    for tag in ("cp311-cp311", "cp312-cp312"):
        (tmp_path / f"foo-1.0-{tag}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    hit = bundles.find_wheel(tmp_path, "foo==1.0", "3.12")
    assert hit is not None and "cp312" in hit.name
    assert bundles.find_wheel(tmp_path, "foo==2.0", "3.12") is None


def test_manifest_for_a_wheels_set(tmp_path: Path) -> None:
    bset = BundleSet(name="mini", pins=("pkg==1.0",), packing="wheels", site="/tmp/site",
                     imports=("import pkg",), env=(("HF_HUB_OFFLINE", "1"),))
    whl = _tiny_wheel(tmp_path, "pkg", ["numpy>=1"], {"pkg/__init__.py": b""})
    m = bundles.make_manifest(bset, [whl], [tmp_path], None, tmp_path, "3.12", 55, 0.5)
    path = bundles.write_manifest(m, tmp_path / "mini" / "manifest.json")
    back = json.loads(path.read_text())
    assert back["wheels"][0]["bytes"] == whl.stat().st_size
    assert len(back["wheels"][0]["sha256"]) == 64
    begin = back["device"]["calls"][0]["begin"]
    assert "--target /tmp/site" in begin and "PYTHONPATH=/tmp/site" in begin
    assert back["device"]["calls"][0]["carry"] == ["."]


def test_device_commands_for_a_split_site() -> None:
    parts = [f".bundles/fa4/parts/fa4_site.tar.xz.part{i:02d}" for i in range(2)]
    cmds = bundles.device_commands(SETS["fa4"], parts, "ab" * 32)
    assert [c["carry"] for c in cmds["calls"]] == [[p] for p in parts]
    last = cmds["calls"][-1]["begin"]
    assert "xz -d | tar -x -C /tmp/fa4_site" in last and "ab" * 32 in last
    assert "/tmp/fa4_site/nvidia_cutlass_dsl/dsl_packages" in cmds["after"]


def test_closure_sorts_requirements() -> None:
    records = {"a": ("1.0", ["b>=2", "torch==2.11.0", "numpy<2.5", "xxhash", "zzz-missing",
                             "xformers", "winonly; sys_platform == 'win32'", "dev; extra == 'x'"]),
               "b": ("2.1", [])}
    out = bundle_verify.closure(records, excluded=("xformers",))
    assert out["ok"] == ["a -> b>=2", "a -> torch==2.11.0"]
    assert out["conflict"] == ["a -> numpy<2.5 (have 2.5.2)"]
    assert out["image_unknown"] == ["a -> xxhash"]
    assert out["missing"] == ["a -> zzz-missing"]
    assert out["excluded"] == ["a -> xformers"]


def test_unknown_set_names_the_choices() -> None:
    with pytest.raises(SystemExit, match="choose one of"):
        bundles_cli.main(["verify", "nope"])


@pytest.mark.parametrize("argv", [["verify", "nope"], ["commands", "trl", "nope"],
                                  ["build", "nope"]])
def test_every_subcommand_names_the_choices_for_an_unknown_set(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match=r"unknown set 'nope': choose one of \['fa4', "):
        bundles_cli.main(argv)


@pytest.mark.parametrize("argv", [["verify", "trl"], ["commands", "trl"]])
@pytest.mark.parametrize("before", [True, False])
def test_unbuilt_set_says_build_it_first_wherever_out_is_given(tmp_path: Path, argv: list[str],
                                                               before: bool) -> None:
    out = ["--out", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        bundles_cli.main(out + argv if before else argv + out)
    assert str(info.value) == (f"set 'trl' is not built under {tmp_path}/: build it first: "
                               f"python -m nbhelpers.bundles build trl --out {tmp_path}")


@pytest.mark.parametrize("before", [True, False])
def test_list_reads_the_out_folder_wherever_out_is_given(tmp_path: Path, capsys,
                                                         before: bool) -> None:
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl/manifest.json").write_text(json.dumps(
        {"wheels_bytes": 3 * 2**20, "parts": [{"bytes": 2**20}]}))
    out = ["--out", str(tmp_path)]
    assert bundles_cli.main(out + ["list"] if before else ["list"] + out) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["trl"].endswith("wheels 3.0 MiB, parts 1.0 MiB")
    assert lines["vllm"].endswith("not built")


def test_resplit_rechunks_a_site_set_without_changing_its_bytes(tmp_path: Path,
                                                                monkeypatch) -> None:
    import hashlib
    monkeypatch.chdir(tmp_path)
    root = Path(".bundles/fa4")
    (root / "wheels").mkdir(parents=True)
    blob = os.urandom(5000)
    src = tmp_path / "fa4_site.tar.xz"
    src.write_bytes(blob)
    old_parts = bundle_parts.split_file(src, 2600, root / "parts")
    src.unlink()
    whole = hashlib.sha256(blob).hexdigest()
    bundles.write_manifest({"packing": "site-xz", "python": "3.12", "build_s": 1.0,
                            "whole_sha256": whole,
                            "parts": [{"path": str(p)} for p in old_parts]},
                           root / "manifest.json")
    m = bundles.resplit("fa4", part_mib=1200 / bundle_parts.MIB)
    new = [Path(p["path"]) for p in m["parts"]]
    assert len(old_parts) == 2 and len(new) == 5 and all(p.stat().st_size <= 1200 for p in new)
    assert b"".join(p.read_bytes() for p in new) == blob and m["whole_sha256"] == whole
    assert len(m["device"]["calls"]) == 5 and whole in m["device"]["calls"][-1]["begin"]
    assert json.loads((root / "manifest.json").read_text())["parts"] == m["parts"]
    new[0].write_bytes(b"corrupt")
    with pytest.raises(ValueError, match="do not join to whole_sha256"):
        bundles.resplit("fa4", part_mib=2000 / bundle_parts.MIB)
