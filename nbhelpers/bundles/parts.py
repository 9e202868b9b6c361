"""Byte-level helpers of the bundle builder: split a file into parts, join them, pack wheels into
parts by size, hash a file.

Contract: parts are ``<name>.partNN`` files of at most ``part_bytes`` bytes whose name order is
their ``cat`` order (the device joins them with ``cat``); :func:`pack_bins` is first-fit
decreasing; sizes are bytes, ``MIB`` = 2**20 bytes. Stdlib only (the bundle tools run before
anything is installed).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

MIB = 2**20


def split_file(path: Path, part_bytes: int, out_dir: Path) -> list[Path]:
    """Split ``path`` into ``out_dir/<name>.partNN`` files of at most ``part_bytes`` bytes each."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be > 0 bytes, got {part_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts: list[Path] = []
    with path.open("rb") as src:
        while chunk := src.read(part_bytes):
            part = out_dir / f"{path.name}.part{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def join_parts(parts: list[Path], dst: Path) -> Path:
    """Concatenate ``parts`` in order into ``dst`` (the device side does the same with ``cat``)."""
    with dst.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 16 * MIB)
    return dst


def pack_bins(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """First-fit-decreasing groups of names whose sizes (bytes) sum to <= ``limit``.

    Raises ValueError naming an item larger than ``limit`` (ship that set as ``site-xz``)."""
    big = [n for n, s in sizes.items() if s > limit]
    if big:
        raise ValueError(f"{big} exceed the part size {limit} B: use packing='site-xz'")
    bins: list[tuple[int, list[str]]] = []
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        slot = next((i for i, (used, _) in enumerate(bins) if used + sizes[name] <= limit), None)
        if slot is None:
            bins.append((0, []))
            slot = len(bins) - 1
        bins[slot] = (bins[slot][0] + sizes[name], bins[slot][1] + [name])
    return [names for _, names in bins]


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 * MIB):
            h.update(block)
    return h.hexdigest()
