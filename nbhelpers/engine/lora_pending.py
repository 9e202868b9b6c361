"""LoRA B of a projection group: added in place after the GEMM, or deferred to the consumer kernel.

Contract: :func:`add_lora_b` is :class:`~nbhelpers.engine.lora.LiveGroup`'s B step
(``y[:, part i] += scaling * xa[:, ranks of i] @ B_i^T`` for every part, PEFT's dtype order: in
B's dtype, rounded once to ``y``'s): one Triton launch (:mod:`.kernels.lora_expand`) where it is
enabled and serves the operands, else one ``addmm_`` per part.

With ``lora_expand="consumer"``, :func:`defer` runs only the group's GEMM(s) and returns the base
outputs plus a :class:`PendingLora` record (views of the GEMM output and ``xa``, the B tensors,
sizes, ranks, scaling). The caller hands it to the kernel that reads the projection next (the
add+RMSNorm of ``o_proj``/``down_proj``, the SiLU x up of ``gate_up``, the q/k norm + RoPE + KV
write of ``qkv``; ``engine/fused.py`` ``triton_*``), which computes ``y = y_base + scaling *
sum_r xa[row, r] * B[col, r]`` in fp32 wherever it read ``y`` (one rounding to the model dtype,
the same order as :func:`add_lora_b`), so the expand launch disappears. Where that kernel cannot
serve it, the caller calls :meth:`PendingLora.apply` first (the same result as without the mode).
B is the module's own ``lora_B`` (or ``lora_shadow``'s copies), read at call time: live LoRA.
No host sync and no allocation: capturable in a CUDA graph.

Deferral applies to at most :data:`CONSUMER_MAX_ROWS` rows (decode batches). Groups of
:data:`DEFER_MIN_PARTS` parts or more always defer there: q/k/v (``qk_rope_cache``: one program
per (row, head), all r ranks of a half in one load; B re-read per row from L2, 0.8 MB fp32 /
0.4 MB bf16 a row a layer at Qwen3-4B) and gate_up (``lora_act_mul``: column blocks over all
rows, B read once). o_proj and down_proj (one part) keep their expand launch by default: their
consumer is add+RMSNorm, a reduction over the whole row, so its kernel runs one program per row
and each of those R programs reads all of B (2560 x 32: 328 KB fp32) on its own SM; at batch 4
that is 4 of the 132 SMs reading 1.3 MB where the expand kernel spreads 0.33 MB over 40
programs (issue 12: the first consumer mode, all four groups deferred, lost 0.9 ms a step at
batch 4 in the elementwise class; the per-kernel reckoning is in ``kernels/lora_act_mul.py`` and
the session report). At 32-64 rows those programs are many, so the trade may flip: with the
runner option ``lora_consumer_one_part_rows`` above 0 (the group's ``one_part_rows``,
``LiveGroup.set_lora_expand``) one-part groups also defer from that many rows up to
:data:`CONSUMER_MAX_ROWS` (:func:`defers_rows`; 0, the default, never: until an H200 A/B says
otherwise). Above the row bound, and for prefill (eager elementwise ops), the group adds B
itself as in ``lora_expand="triton"``. Whether 64 is the right bound is for the H200 A/B to say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONSUMER_MAX_ROWS = 64
"""Most rows a group defers its LoRA B for (the decode batch range the consumer mode is for)."""

DEFER_MIN_PARTS = 2
"""Fewest parts a group needs to defer at any row count up to :data:`CONSUMER_MAX_ROWS` (q/k/v
3, gate_up 2); one-part groups (o_proj, down_proj) feed add+RMSNorm, which cannot spread B's
read over the GPU at few rows (module docstring), so they defer only from their group's
``one_part_rows`` rows (runner option ``lora_consumer_one_part_rows``; 0: never).
``fused_norm.add_norm(lora=...)`` serves a one-part record (tested)."""


def add_lora_b(y: Any, xa: Any, bs: list[Any], sizes: list[int], ranks: list[int],
               scaling: float, expand: Any = None) -> Any:
    """``y`` with LoRA B added for every part: in place when B has ``y``'s dtype or the
    ``expand`` kernel module (:mod:`.kernels.lora_expand`, or ``None``) serves the operands,
    else a new tensor (fp32 B on a 16-bit ``y``: added in an fp32 copy, cast back once).

    Shapes: ``y [N, sum(sizes)]`` (unit column stride), ``xa [N, sum(ranks)]``,
    ``bs[i] [sizes[i], ranks[i]]``.
    """
    if expand is not None and expand.supported(y, xa, bs, sizes, ranks):
        expand.lora_expand(y, xa, bs, sizes, ranks, scaling)
        return y
    acc = y if bs[0].dtype == y.dtype else y.to(bs[0].dtype)  # PEFT: add in B's dtype
    for y_i, xa_i, b_i in zip(acc.split(sizes, -1), xa.split(ranks, -1), bs):
        y_i.addmm_(xa_i, b_i.t(), alpha=scaling)  # y_i += s * xa_i @ B_i^T, in place
    return acc.to(y.dtype)


@dataclass
class PendingLora:
    """LoRA B not yet added to a group's base output ``y [N, sum(out)]`` (see module docstring).

    ``xa [N, sum(r)]`` = ``x @ A^T``; ``bs[i] [sizes[i], ranks[i]]``; ``expand``: the
    :mod:`.kernels.lora_expand` module or ``None`` (what :meth:`apply` uses).
    """

    y: Any
    xa: Any
    bs: list[Any]
    sizes: list[int]
    ranks: list[int]
    scaling: float
    expand: Any = None

    def apply(self) -> None:
        """Add LoRA B into ``y`` in place (the fallback where no consumer kernel takes it)."""
        out = add_lora_b(self.y, self.xa, self.bs, self.sizes, self.ranks, self.scaling,
                         self.expand)
        if out is not self.y:
            self.y.copy_(out)

    def reads(self, t: Any, part: int = 0) -> bool:
        """Whether ``t`` (any shape) views part ``part``'s columns of ``y`` row for row: what a
        consumer kernel checks before it reads ``t`` as ``y_base``."""
        n, width = self.y.shape[0], self.sizes[part]
        if t.numel() != n * width:
            return False
        t2 = t.reshape(n, width)  # a view for the group's outputs (a copy fails the test)
        return (t2.stride(1) == 1 and (n == 1 or t2.stride(0) == self.y.stride(0))
                and t2.data_ptr() == self.y[:, sum(self.sizes[:part]):].data_ptr())


def defers_rows(num_parts: int, rows: int, one_part_rows: int = 0) -> bool:
    """Whether a group of ``num_parts`` parts defers LoRA B for ``rows`` rows: at most
    :data:`CONSUMER_MAX_ROWS`, and for fewer than :data:`DEFER_MIN_PARTS` parts only when
    ``0 < one_part_rows <= rows`` (runner option ``lora_consumer_one_part_rows``)."""
    if num_parts >= DEFER_MIN_PARTS:
        return rows <= CONSUMER_MAX_ROWS
    return 0 < one_part_rows <= rows <= CONSUMER_MAX_ROWS


def defer(group: Any, x: Any) -> tuple[list[Any], PendingLora | None]:
    """``group(x)`` split as its ``__call__``, with LoRA B left out and returned as a
    :class:`PendingLora` when the group is in ``lora_expand="consumer"`` mode, has LoRA on every
    part through one fused buffer (or its one part's live tensors), runs the cuBLAS or skinny
    path (``lora_fused`` off), is not being traced by torch.compile, and ``x``'s row count
    passes :func:`defers_rows` (at most :data:`CONSUMER_MAX_ROWS`; a group of fewer than
    :data:`DEFER_MIN_PARTS` parts also needs ``group.one_part_rows`` > 0 and at least that many
    rows); else ``(group(x), None)``. ``x [..., in]``."""
    import torch
    x2 = x.reshape(-1, x.shape[-1])
    if group.lora_expand != "consumer" or group._lora_gemm.enabled \
            or not defers_rows(len(group.sizes), x2.shape[0], group.one_part_rows) \
            or torch.compiler.is_compiling():
        return group(x), None
    f = group._buffers()
    if f is None or not f["lora"]:
        return group(x), None
    y = group._base_gemm(x2, f)  # cuBLAS or the skinny kernel: [N, sum(out)] (+ [N, sum(r)])
    n = f["n_out"]
    y, xa = (y[:, :n], y[:, n:]) if f["ext"] else (y, group._lora_a(x2, f["A"]))
    pending = PendingLora(y, xa, f["B"], group.sizes, group._ranks(), f["scaling"],
                          group._expand)
    return group.split_out(y, x.shape), pending
