"""Offline install bundles for the air-gapped H200: build, verify and list pinned wheel sets.

Contract: ``build SET`` downloads the pins of ``bundle_sets.SETS[SET]`` (cp312 manylinux x86_64,
``pip download --no-deps --only-binary=:all:``) into a wheel cache outside the repo, repacks wheels
that have trims, and writes ``.bundles/SET/``: ``wheels/`` (or ``parts/pNN/`` when the set is over
``--part-mib``) for ``wheels`` sets; for ``site-xz`` sets an unpacked, trimmed ``site/`` tarred with
``tar --sort=name --mtime=@1700000000 | xz -9`` and split into ``parts/SET_site.tar.xz.partNN`` of
at most ``--part-mib`` MiB (1 MiB = 2**20 bytes); and ``manifest.json`` (pins, sha256, sizes, parts,
device carry + command lines). ``verify SET`` checks the Requires-Dist closure against the set and
the image list (``bundle_sets.IMAGE_PACKAGES``) and, with ``--installed SITE``, imports the set.

Run: ``python -m nbhelpers.bundles build vllm --part-mib 55``; ``... verify notebooks --installed
/tmp/site --python python3.12``; ``... list``; ``... commands notebooks trl unsloth``.
Recipe source: ``shared/research/gpu_stack.md`` and ``.library/device/README.md`` "Notes".
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from nbhelpers.bundles.parts import MIB, join_parts, pack_bins, sha256, split_file
from nbhelpers.bundles.sets import SETS, BundleSet

DEFAULT_CACHE = Path(os.environ.get("NBH_WHEEL_CACHE", "/tmp/nbh_wheels"))
_MANYLINUX = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35, 38, 39)]
PLATFORMS = _MANYLINUX + ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def _canon(name: str) -> str:
    from packaging.utils import canonicalize_name
    return canonicalize_name(name)


def _pin(pin: str) -> tuple[str, str]:
    name, version = pin.split("==")
    return _canon(name), version


def pip_target_args(python: str) -> list[str]:
    """pip flags selecting cp``python`` manylinux x86_64 binary wheels (device README Notes)."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", *plats]


def find_wheel(cache: Path, pin: str, python: str) -> Path | None:
    """The cached wheel for ``name==version`` whose tags run on cp``python`` linux x86_64."""
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    pyver = tuple(int(x) for x in python.split("."))
    ok = set(cpython_tags(pyver, platforms=PLATFORMS)) | set(compatible_tags(pyver, "cp" + "".join(
        python.split(".")), PLATFORMS))
    name, version = _pin(pin)
    for path in sorted(cache.glob("*.whl")):
        wname, wver, _, tags = parse_wheel_filename(path.name)
        if wname == name and wver == Version(version) and tags & ok:
            return path
    return None


def fetch_wheels(pins: tuple[str, ...], cache: Path, python: str) -> list[Path]:
    """Cached wheels for ``pins``; downloads only the missing ones. Raises RuntimeError on failure."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [p for p in pins if find_wheel(cache, p, python) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pip_target_args(python),
               "-d", str(cache), *missing]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise RuntimeError(f"pip download failed for {missing}: check the pins and network")
    found = {p: find_wheel(cache, p, python) for p in pins}
    lost = [p for p, w in found.items() if w is None]
    if lost:
        raise RuntimeError(f"no cp{python} manylinux wheel for {lost}: extend PLATFORMS or repin")
    return [w for w in found.values() if w is not None]


def repack_wheel(src: Path, dst_dir: Path, drop: tuple[str, ...]) -> Path:
    """Copy of wheel ``src`` into ``dst_dir`` without members matching ``drop`` (RECORD updated)."""
    dst = dst_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        kept = [i for i in zin.infolist() if not any(fnmatch.fnmatch(i.filename, g) for g in drop)]
        for info in kept:
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                names = {i.filename for i in kept}
                lines = data.decode().splitlines()
                data = "".join(x + "\n" for x in lines if x.split(",")[0] in names).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dst


def _trimmed(bset: BundleSet, wheels: list[Path], dst: Path) -> list[Path]:
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    trims = {_canon(t.package): t.drop for t in bset.trims}
    out = []
    for w in wheels:
        name = _canon(w.name.split("-")[0])
        out.append(repack_wheel(w, dst, trims[name]) if name in trims else
                   Path(shutil.copy2(w, dst / w.name)))
    return out


def _site_xz(bset: BundleSet, wheels: list[Path], root: Path, python: str) -> Path:
    site = root / "site"
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
           "--target", str(site), *pip_target_args(python), *map(str, wheels)]
    subprocess.run(cmd, check=True)
    for pattern in bset.site_remove:
        for hit in site.glob(pattern):
            shutil.rmtree(hit) if hit.is_dir() else hit.unlink()
    tarball = root / f"{bset.name}_site.tar.xz"
    tar = f"tar --sort=name --mtime=@1700000000 --owner=0 --group=0 -C {site} -cf - ."
    subprocess.run(f"set -o pipefail; {tar} | xz -9 -T2 > {tarball}", shell=True, check=True,
                   executable="/bin/bash")
    return tarball


def _pythonpath(bset: BundleSet) -> str:
    return ":".join([bset.site, *(f"{bset.site}/{p}" for p in bset.pythonpath_extra)])


def device_commands(bset: BundleSet, parts: list[str], whole_sha: str | None) -> dict:
    """What to carry per device call and what each command line begins with (paths repo-relative).

    The wheels recipe is the device README's; the site-xz one appends parts under /tmp in
    back-to-back calls of one warm machine, then checks the sha256 and untars."""
    env = " ".join(f"{k}={v}" for k, v in bset.env)
    export = f"export PYTHONPATH={_pythonpath(bset)}{':$PYTHONPATH' if bset.with_sets else ''}"
    export += f" {env}" if env else ""
    if bset.packing == "wheels":
        pip = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
               f"--upgrade --target {bset.site}")
        if len(parts) == 1:
            return {"calls": [{"carry": parts, "begin": f"{pip} {parts[0]}/*.whl && {export} "
                                                       "|| exit;"}], "after": f"{export};"}
        stage = f"/tmp/{bset.name}_wheels"
        calls = [{"carry": [p], "begin": f"mkdir -p {stage} && cp {p}/*.whl {stage}/ || exit;"}
                 for p in parts]
        calls[-1]["begin"] = calls[-1]["begin"][:-len(" || exit;")] + \
            f" && {pip} {stage}/*.whl && {export} || exit;"
        return {"calls": calls, "after": f"{export};"}
    calls = [{"carry": [p], "begin": f"cp {p} /tmp/ || exit;"} for p in parts]
    stem = Path(parts[0]).name.rsplit(".part", 1)[0]
    restore = (f"test \"$(cat /tmp/{stem}.part* | sha256sum | cut -c1-64)\" = {whole_sha} && "
               f"mkdir -p {bset.site} && cat /tmp/{stem}.part* | xz -d | tar -x -C {bset.site} "
               f"&& {export} || {{ echo 'restore failed: a part is missing or corrupt (sha256 "
               f"check); send every part again in back-to-back calls'; exit 1; }};")
    calls[-1]["begin"] = f"cp {parts[-1]} /tmp/ && {restore}"
    return {"calls": calls, "after": f"{export};"}


def get_set(name: str) -> BundleSet:
    """``SETS[name]``; exits naming the choices for an unknown set (``require_sets``)."""
    from nbhelpers.bundles.verify import require_sets
    require_sets([name])
    return SETS[name]


def build(name: str, python: str = "3.12", out: Path = Path(".bundles"), part_mib: float = 55,
          cache: Path = DEFAULT_CACHE) -> dict:
    """Build set ``name`` under ``out/name`` and return its manifest (also written as JSON)."""
    bset = get_set(name)
    t0 = time.perf_counter()
    root = out / name
    wheels = _trimmed(bset, fetch_wheels(bset.pins, cache, python), root / "wheels")
    limit = int(part_mib * MIB)
    whole_sha = None
    if bset.packing == "wheels":
        parts = _wheel_parts(wheels, root, limit)
    else:
        tarball = _site_xz(bset, wheels, root, python)
        whole_sha = sha256(tarball)
        shutil.rmtree(root / "parts", ignore_errors=True)
        parts = split_file(tarball, limit, root / "parts")
        tarball.unlink()
    manifest = make_manifest(bset, wheels, parts, whole_sha, Path.cwd(), python, part_mib,
                             time.perf_counter() - t0)
    write_manifest(manifest, root / "manifest.json")
    return manifest


def resplit(name: str, part_mib: float, out: Path = Path(".bundles")) -> dict:
    """Re-chunk a built ``site-xz`` set into parts of at most ``part_mib`` MiB without rebuilding:
    the parts are joined, checked against the manifest's ``whole_sha256``, split again, and the
    manifest (parts, device commands) rewritten; the bytes the device restores are unchanged.
    Why: every device call also carries the working tree, which grows with ``executed/``
    (6.5 MiB at the end of session 3 pushed a 55 MiB part over the 64 MiB limit).

    Raises:
        ValueError: the set is not ``site-xz``, or the joined parts do not match the sha256.
        FileNotFoundError: the set is not built under ``out``.
    """
    bset = get_set(name)
    root = out / name
    old = json.loads((root / "manifest.json").read_text())
    if old["packing"] != "site-xz":
        raise ValueError(f"resplit {name}: only site-xz sets have one tarball to re-chunk; "
                         f"rebuild with: python -m nbhelpers.bundles build {name} --part-mib N")
    olds = [Path(p["path"]) for p in old["parts"]]
    tarball = root / olds[0].name.rsplit(".part", 1)[0]
    join_parts(olds, tarball)
    if sha256(tarball) != old["whole_sha256"]:
        tarball.unlink()
        raise ValueError(f"resplit {name}: the parts do not join to whole_sha256 "
                         f"{old['whole_sha256']}: rebuild the set.")
    for part in olds:
        part.unlink()
    parts = split_file(tarball, int(part_mib * MIB), root / "parts")
    tarball.unlink()
    wheels = sorted((root / "wheels").glob("*.whl"))
    manifest = make_manifest(bset, wheels, parts, old["whole_sha256"], Path.cwd(), old["python"],
                             part_mib, old.get("build_s", 0.0))
    write_manifest(manifest, root / "manifest.json")
    return manifest


def _wheel_parts(wheels: list[Path], root: Path, limit: int) -> list[Path]:
    shutil.rmtree(root / "parts", ignore_errors=True)
    if sum(w.stat().st_size for w in wheels) <= limit:
        return [root / "wheels"]
    groups = pack_bins({w.name: w.stat().st_size for w in wheels}, limit)
    parts = []
    for i, group in enumerate(groups):
        part = root / "parts" / f"p{i:02d}"
        part.mkdir(parents=True)
        for fname in group:
            shutil.copy2(root / "wheels" / fname, part / fname)
        parts.append(part)
    return parts


def make_manifest(bset: BundleSet, wheels: list[Path], parts: list[Path], whole_sha: str | None,
                  repo: Path, python: str, part_mib: float, build_s: float) -> dict:
    """The manifest dict: wheels (file, sha256, bytes), parts, device commands, PYTHONPATH.

    ``repo`` is the repo root (the device runs commands there); part paths are made relative
    to it."""
    rel = [os.path.relpath(p, repo) for p in parts]  # carry paths are repo-root relative
    part_bytes = [sum(f.stat().st_size for f in p.glob("*.whl")) if p.is_dir() else p.stat().st_size
                  for p in parts]
    return {"set": bset.name, "python": python, "packing": bset.packing, "site": bset.site,
            "pins": list(bset.pins), "with_sets": list(bset.with_sets),
            "wheels": [{"file": w.name, "sha256": sha256(w), "bytes": w.stat().st_size}
                       for w in wheels],
            "wheels_bytes": sum(w.stat().st_size for w in wheels), "part_mib": part_mib,
            "parts": [{"path": r, "bytes": b, "sha256": None if Path(p).is_dir() else sha256(p)}
                      for r, b, p in zip(rel, part_bytes, parts)],
            "whole_sha256": whole_sha, "pythonpath": _pythonpath(bset), "env": dict(bset.env),
            "trims": [{"package": t.package, "drop": list(t.drop), "why": t.why}
                      for t in bset.trims], "site_remove": list(bset.site_remove),
            "device": device_commands(bset, rel, whole_sha), "note": bset.note,
            "build_s": round(build_s, 1), "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                       time.gmtime())}


def write_manifest(manifest: dict, path: Path) -> Path:
    """Write ``manifest`` as indented JSON at ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path
