"""Checks for the offline bundles built by ``nbhelpers.bundles.build``: metadata closure and imports.

Contract: :func:`closure` reads every wheel's (or installed dist-info's) ``Requires-Dist``,
evaluates markers for CPython 3.12 on linux x86_64 with no extras, and sorts each requirement into
``ok`` (a set wheel or an image package of known version satisfies it), ``image_unknown`` (the image
has the name, version not recorded: ``bundle_sets.IMAGE_VERSIONS``), ``excluded`` (left out on
purpose by the set), ``conflict`` (a version that does not satisfy the specifier) or ``missing``.
:func:`import_check` runs each of the set's import statements in a fresh interpreter with the
set's PYTHONPATH. :func:`verify` prints both and returns 1 when anything is missing or fails.
A set that is not built yet (no ``OUT/SET/manifest.json``) exits with the build command to run.
Run: ``python -m nbhelpers.bundles verify SET [--installed SITE --python-exe python3]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from email.parser import Parser
from pathlib import Path

from nbhelpers.bundles.sets import IMAGE_PACKAGES, IMAGE_VERSIONS, SETS, BundleSet

MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "extra": ""}


def require_sets(names: list[str] | tuple[str, ...], out: Path | None = None) -> None:
    """Exit with a message naming the fix unless every set is known (and, given ``out``, built).

    Raises:
        SystemExit: ``unknown set ...: choose one of [...]`` or ``set ... is not built under
            OUT/: build it first: python -m nbhelpers.bundles build SET`` (exit status 1).
    """
    for name in names:  # every name first: a typo is reported before a missing build
        if name not in SETS:
            raise SystemExit(f"unknown set {name!r}: choose one of {sorted(SETS)}")
    for name in names:
        if out is not None and not (out / name / "manifest.json").is_file():
            flag = "" if out == Path(".bundles") else f" --out {out}"
            raise SystemExit(f"set {name!r} is not built under {out}/: build it first: "
                             f"python -m nbhelpers.bundles build {name}{flag}")


def _meta_text(source: Path) -> str:
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            return z.read(name).decode()
    return (source / "METADATA").read_text()


def read_records(sources: list[Path]) -> dict[str, tuple[str, list[str]]]:
    """``{canonical name: (version, [Requires-Dist lines])}`` from wheels or dist-info dirs."""
    from packaging.utils import canonicalize_name

    records = {}
    for src in sources:
        msg = Parser().parsestr(_meta_text(src), headersonly=True)
        records[canonicalize_name(msg["Name"])] = (msg["Version"], msg.get_all("Requires-Dist")
                                                   or [])
    return records


def closure(records: dict[str, tuple[str, list[str]]], excluded: tuple[str, ...] = (),
            owners: set[str] | None = None) -> dict:
    """Sort the active requirements of ``owners`` (default: all of ``records``), each satisfied by
    any record or the image (see module docstring). Returns ``{kind: [str]}``."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    skip = {canonicalize_name(e) for e in excluded}
    out: dict[str, list[str]] = {k: [] for k in ("ok", "image_unknown", "excluded", "conflict",
                                                 "missing")}
    for owner, (_, reqs) in sorted(records.items()):
        if owners is not None and owner not in owners:
            continue
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
                continue
            name = canonicalize_name(req.name)
            have = records[name][0] if name in records else IMAGE_VERSIONS.get(name)
            kind = ("excluded" if name in skip and name not in records else
                    "ok" if have is not None and req.specifier.contains(have, prereleases=True)
                    else "conflict" if have is not None else
                    "image_unknown" if name in IMAGE_PACKAGES else "missing")
            detail = f"{owner} -> {req.name}{req.specifier}"
            out[kind].append(detail + (f" (have {have})" if kind == "conflict" else ""))
    return out


def _sources(bset: BundleSet, out: Path, installed: str | None) -> list[Path]:
    if installed:
        return sorted(Path(installed).glob("*.dist-info"))
    files: list[Path] = []
    for name in (*bset.with_sets, bset.name):
        site = out / name / "site"
        files += sorted(site.glob("*.dist-info")) if site.is_dir() else \
            sorted((out / name / "wheels").glob("*.whl"))
    return files


def import_check(bset: BundleSet, site: str, python_exe: str) -> list[tuple[str, bool, str]]:
    """Run each import statement of ``bset`` with PYTHONPATH at ``site``: (stmt, ok, last line)."""
    paths = [site, *(f"{site}/{p}" for p in bset.pythonpath_extra)]
    env = {**os.environ, **dict(bset.env), "PYTHONPATH": ":".join(paths)}
    results = []
    for stmt in bset.imports:
        proc = subprocess.run([python_exe, "-c", stmt], check=False, env=env, capture_output=True, text=True)
        tail = (proc.stderr.strip().splitlines() or ["ok"])[-1]
        results.append((stmt, proc.returncode == 0, tail))
    return results


def verify(bset: BundleSet, out: Path, installed: str | None, python_exe: str) -> int:
    """Print the closure and (with ``installed``) import results; 1 if anything is wrong.

    Raises:
        SystemExit: without ``installed``, the set or one of its ``with_sets`` is not built.
    """
    from packaging.utils import canonicalize_name

    if not installed:
        require_sets((*bset.with_sets, bset.name), out)

    sets = [SETS[n] for n in (*bset.with_sets, bset.name)]
    owners = {canonicalize_name(p.split("==")[0]) for s in sets for p in s.pins}
    excluded = tuple(e for s in sets for e in s.excluded)
    report = closure(read_records(_sources(bset, out, installed)), excluded, owners)
    counts = {k: len(v) for k, v in report.items()}
    print(f"[{bset.name}] closure: {json.dumps(counts)}")
    for kind in ("missing", "conflict", "image_unknown", "excluded"):
        for item in report[kind]:
            print(f"  {kind:13s} {item}")
    bad = bool(report["missing"])
    if installed:
        for stmt, ok, tail in import_check(bset, installed, python_exe):
            print(f"  import {'OK  ' if ok else 'FAIL'} {stmt}" + ("" if ok else f"\n    {tail}"))
            bad |= not ok
    else:
        print("  imports not run: pass --installed SITE (on the device: the restored site dir)")
    return int(bad)


def combined_commands(names: list[str], out: Path) -> str:
    """One device call for several built ``wheels`` sets sharing a site: carry list + prefix.

    Raises:
        SystemExit: an unknown or unbuilt set, or sets that cannot share one call.
    """
    require_sets(names, out)
    manifests = [json.loads((out / n / "manifest.json").read_text()) for n in names]
    if len({m["site"] for m in manifests}) != 1 or any(len(m["parts"]) != 1 for m in manifests):
        raise SystemExit(f"{names}: only single-part sets with one site can share a call")
    carry = [m["parts"][0]["path"] for m in manifests]
    site = manifests[0]["site"]
    env = " ".join(f"{k}={v}" for k, v in {k: v for m in manifests
                                           for k, v in m["env"].items()}.items())
    total = sum(m["wheels_bytes"] for m in manifests) / 2**20
    pip = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
           f"--target {site} " + " ".join(f"{c}/*.whl" for c in carry))
    return (f"carry: {json.dumps(carry)}  ({total:.1f} MiB of wheels)\n"
            f"begin: {pip} && export PYTHONPATH={site} {env} || exit;".rstrip())


def all_pins_consistent() -> list[str]:
    """Names pinned at two versions within one device site (must be empty)."""
    by_site: dict[str, dict[str, set[str]]] = {}
    for bset in SETS.values():
        for pin in bset.pins:
            name, version = pin.split("==")
            key = name.lower().replace("_", "-")
            by_site.setdefault(bset.site, {}).setdefault(key, set()).add(version)
    return [f"{site}: {n} {sorted(v)}" for site, names in by_site.items()
            for n, v in names.items() if len(v) > 1]
