"""PTX arithmetic fingerprints for comparing two builds of one kernel (``test_pdl_early_ptx.py``).

:func:`stores` value-numbers a kernel's PTX: every register gets a hash of its defining opcode
and its sources' hashes (operands of commutative ops sorted, a ``mov`` is its source), and each
store (``st``/``red``/``atom``) contributes the hash of its address and value. A global or
shared load is a leaf named by the innermost source location (``.loc`` line and column of the
``tl.load``), its opcode and its immediate offset, not by its address or predicate, so a load
that moved (before ``griddepcontrol.wait``) or whose pointer is selected differently keeps its
name. Two builds with equal :func:`stores` compute every stored value by the same tree of PTX
arithmetic (same ops, same rounding modifiers, same FMA contractions, same reduction tree) from
the same loads. ``griddepcontrol`` and branches are ignored; PTX is read in order, so a loop
body counts once (kernels with a peeled loop: :func:`arith_ops`).

Shared memory is a staging buffer whose layout (base, swizzle, vector width) the compiler picks
per build: Triton 3.6 lays the early build's tiles out differently from the off build's. So a
``st.shared`` is fingerprinted by its value only, and every shared load of one source line is
one leaf, whatever its offset, width or lane. What that cannot see: a permutation of the
elements one ``tl.load`` staged through shared memory (e.g. the order of the k terms of an fp32
FMA chain over a staged tile); the chain's length, its ops and rounding are still compared, and
the values by the GPU parity test (``test_pdl_builds.py``). Packed ``bf16x2`` / ``f16x2`` ops are
fingerprinted lane by lane as their scalar ops, so LLVM's choice to vectorise a pair of values
does not count either.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter

COMMUTATIVE = ("add.", "mul.", "fma.", "mad.", "min.", "max.", "and.", "or.", "xor.")
_LOC = re.compile(r"^\s*\.loc\s+\d+\s+(\d+)\s+(\d+)")
_INSN = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.]*)\s*(.*?);\s*$")
_SKIP = ("griddepcontrol", "bra", "ret", "bar.", "exit", "barrier")
_ARITH = re.compile(r"^(fma|mul|add|sub|cvt|shfl|mma|wgmma|rsqrt|sqrt|ex2|lg2|rcp|div|neg|"
                    r"max|min|abs|tanh)\.")
_FLOAT = re.compile(r"\.(f32|f16|bf16|f16x2|bf16x2|f64)\b|^(shfl|mma|wgmma)\.")


def _h(*parts: object) -> str:
    return hashlib.blake2s(repr(parts).encode(), digest_size=8).hexdigest()


def _split(ops: str) -> list[str]:
    """Top-level comma split (braces and brackets kept whole)."""
    out, depth, cur = [], 0, ""
    for ch in ops:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def _regs(operand: str) -> list[str]:
    return [r.strip() for r in operand.strip("{} ").split(",") if r.strip()]


def _lanes(v: object) -> tuple:
    """A 32-bit value as two 16-bit lanes (low, high)."""
    return v if isinstance(v, tuple) else (_h("lane", 0, v), _h("lane", 1, v))


def _flat(v: object) -> str:
    return _h("pair", *v) if isinstance(v, tuple) else v


def stores(ptx: str) -> Counter:
    """Multiset of store fingerprints of ``ptx`` (module docstring). Packed 16-bit pairs
    (``mov.b32 %r, {lo, hi}``, ``cvt.rn.bf16x2.f32``, ``*.bf16x2`` ops) are followed lane by
    lane, so which pair a value was packed into does not matter."""
    val: dict[str, object] = {}
    loc = ("?", "?")
    out: Counter = Counter()
    ranks = _offset_ranks(ptx)

    def src(op: str) -> object:
        op = op.strip()
        if op.startswith("{"):
            return tuple(src(r) for r in _regs(op))
        if op.startswith("["):
            inner = op.strip("[] ")
            m = re.match(r"(%\w+)\s*\+?\s*(-?\w+)?$", inner)
            return _h("addr", _flat(src(m.group(1))), m.group(2) or "0") if m else \
                _h("sym", inner)
        if op.startswith("%"):
            return val.get(op, _h("reg", op))
        return _h("imm", op)

    for line in ptx.splitlines():
        line = line.split("//")[0]
        m = _LOC.match(line)
        if m:
            loc = (m.group(1), m.group(2))
            continue
        m = _INSN.match(line)
        if not m or m.group(2).startswith(_SKIP):
            continue
        opc, operands = m.group(2), _split(m.group(3))
        if not operands:
            continue
        if opc.startswith(("st.", "red.")):
            if opc.startswith("st.shared"):  # a staging buffer's layout may differ (its
                operands = ["[smem]", *operands[1:]]  # base, its swizzle): no address
            vals = [src(o) for o in operands]
            out[_h(opc, vals[0], *[_lanes(v) if ".b32" in opc and ".v" not in opc else v
                                   for v in vals[1:]])] += 1
            continue
        dests, srcs = _regs(operands[0]), operands[1:]
        if opc.startswith(("ld.", "ldmatrix")) and not opc.startswith("ld.param"):
            if opc.startswith("ldmatrix") or ".shared" in opc:
                # a shared load: its offset, width (v4 or scalar) and lane follow the layout
                # the compiler chose for the staging buffer (the early build may lay tiles out
                # otherwise), not which value it reads; named by its source line only, as a
                # st.shared is stored without address (module docstring: what this misses)
                for d in dests:
                    val[d] = _h("ld.shared", loc)
                continue
            off = ranks[(loc, opc)].index(_offset(srcs))  # tells elements apart (x1 vs x2)
            for i, d in enumerate(dests):
                val[d] = _h("ld", opc, loc, off, i)
            continue
        hs = [src(o) for o in srcs]
        imms = {src(o) for o in srcs if not o.startswith(("%", "{", "["))}
        if opc.startswith("mov.") and len(dests) == 1 and len(hs) == 1:
            val[dests[0]] = hs[0]  # a copy, or a pack {lo, hi} -> (lo, hi)
            continue
        if opc.startswith("mov.") and len(dests) == 2 and len(hs) == 1:
            val[dests[0]], val[dests[1]] = _lanes(hs[0])  # unpack
            continue
        if re.search(r"\.(bf16|f16)x2\b", opc) and not opc.startswith("cvt."):
            lanes = [v if isinstance(v, tuple) else (v, v) if v in imms else _lanes(v)
                     for v in hs]
            val[dests[0]] = tuple(_op(opc, [ln[i] for ln in lanes]) for i in range(2))
            continue
        if opc.startswith("cvt.") and re.search(r"\.(bf16|f16)x2\.", opc) and len(hs) == 2:
            val[dests[0]] = (_op(opc, [hs[1]]), _op(opc, [hs[0]]))  # d = {cvt(b), cvt(a)}
            continue
        hs = [_flat(v) for v in hs]
        if opc.startswith("atom."):
            out[_h(opc, *hs)] += 1
        pred = _flat(src(m.group(1).strip().lstrip("@!"))) if m.group(1) else ""
        for i, d in enumerate(dests):
            prev = _flat(val.get(d, "")) if pred else ""
            val[d] = _h(opc, i, pred, prev, *_commute(opc, hs))
    return out


def _offset(srcs: list[str]) -> int:
    m = re.search(r"\+\s*(-?\d+)\s*\]", srcs[0]) if srcs else None
    return int(m.group(1)) if m else 0


def _offset_ranks(ptx: str) -> dict:
    """Per (source location, load opcode): its loads' immediate offsets, sorted. A global
    load is named by its offset's rank there, so the same elements loaded through another
    base register name alike."""
    loc, seen = ("?", "?"), {}
    for line in ptx.splitlines():
        line = line.split("//")[0]
        m = _LOC.match(line)
        if m:
            loc = (m.group(1), m.group(2))
            continue
        m = _INSN.match(line)
        if m and m.group(2).startswith(("ld.", "ldmatrix")) and not m.group(2).startswith("ld.param"):
            seen.setdefault((loc, m.group(2)), set()).add(_offset(_split(m.group(3))[1:]))
    return {k: sorted(v) for k, v in seen.items()}


def _commute(opc: str, hs: list) -> list:
    return sorted(hs[:2]) + hs[2:] if opc.startswith(COMMUTATIVE) and len(hs) >= 2 else hs


def _op(opc: str, hs: list) -> str:
    """One lane of a packed op: named as the scalar op (``mul.rn.bf16x2`` lane =
    ``mul.rn.bf16``, ``cvt.rn.bf16x2.f32`` lane = ``cvt.rn.bf16.f32``: the same rounding), so
    whether LLVM vectorised a pair of values does not change their fingerprint."""
    opc = re.sub(r"\.(bf16|f16)x2\b", r".\1", opc)
    return _h(opc, 0, "", "", *_commute(opc, hs))  # the scalar form of stores()


def arith_ops(ptx: str) -> list[str]:
    """The floating-point arithmetic opcodes of ``ptx`` in order (``fma.rn.f32``,
    ``cvt.rn.bf16.f32``, ``shfl.sync.bfly.b32``, ``mma.sync...``; integer and address ops
    left out)."""
    ops = []
    for line in ptx.splitlines():
        m = _INSN.match(line.split("//")[0])
        if m and _ARITH.match(m.group(2)) and _FLOAT.search(m.group(2)):
            ops.append(m.group(2))
    return ops


def peeled(off: list[str], early: list[str]) -> bool:
    """Whether ``early`` is ``off`` with one block of ops inserted that is itself a run of
    ``off`` starting where it was inserted (the first loop iteration peeled: its ops are the
    loop body's, in the same order)."""
    n = len(early) - len(off)
    return n > 0 and any(early[:i] == off[:i] and early[i + n:] == off[i:]
                         and early[i:i + n] == off[i:i + n] for i in range(len(off) - n + 1))


def loop_body(ptx: str) -> str:
    """The PTX lines of the first loop (from a label to the last branch back to it), or ``""``."""
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", line.strip())
        if m:
            back = [j for j in range(i + 1, len(lines))
                    if re.search(r"\bbra(\.uni)?\s+" + re.escape(m.group(1)) + ";", lines[j])]
            if back:
                return "\n".join(lines[i:back[-1] + 1])
    return ""
