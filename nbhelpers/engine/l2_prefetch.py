"""L2 prefetch of each layer's o_proj weight during its attention (runner option ``l2_prefetch``).

What: in a decode step, after layer ``i``'s qkv GEMM is issued, a side stream forked from the
current stream reads the buffer layer ``i``'s o_proj GEMM will read (its weight, or the
``LiveGroup``'s ``[W; A]`` ``ext`` buffer when LoRA A rides in the GEMM) into L2 with
:func:`nbhelpers.engine.kernels.l2_prefetch.l2_prefetch`, while the main stream runs the
latency-bound q/k norm + RoPE + KV write and the paged attention stages (HBM mostly idle); the
current stream joins the side stream before o_proj, which then reads its weight from L2. The
overlap a persistent megakernel gets (Hazy Research, "Look Ma, No Bubbles!", 2025; CUTLASS
example 63 prefetches weights before its PDL wait). Measured motivation (H200, Qwen3-4B batch 4,
2026-12-02): o_proj 9.1 us for 21.2 MB with cold weights (2.3 TB/s), ~9 us of attention-side
kernels before it.

Contract: one :class:`L2Prefetch` per runner. :meth:`L2Prefetch.fork` ``(group)`` and
:meth:`L2Prefetch.join` are no-ops unless the prefetch is enabled (mode ``"o_proj"`` on a CUDA
device with compiled Triton: :func:`runs_on`) and inside :meth:`L2Prefetch.decoding` (the
runner's decode step body: warm-up, CUDA-graph capture and eager steps alike, so the graph and
the eager path issue the same work); prefill, the CPU and ``TRITON_INTERPRET=1`` never prefetch,
so their tokens are unchanged by construction. Multi-stream capture: the side stream forks from
the capturing stream (``side.wait_stream(cur)``) and joins back (``cur.wait_stream(side)``)
within the same layer, torch's documented pattern (docs "CUDA Graphs", "Usage with multiple
streams"). One side stream per device (:func:`side_stream`), one int32 scratch per runner,
allocated at construction (nothing is allocated during capture).

Why the join keeps o_proj correct: o_proj's inputs (the attention output) come from the main
stream only; the side stream only reads weights (never written during decode) and writes its
own scratch, which nothing else reads. The join only orders the prefetch before o_proj (so the
lines are in L2, and every fork is joined before the capture ends). PDL (:mod:`.kernels.pdl`):
the prefetch kernel has no ``griddepcontrol`` and is launched without ``launch_pdl``; in a graph
o_proj then depends on attention's last kernel and on the prefetch, and o_proj's
``griddepcontrol.wait`` (or its plain launch) waits for both before it reads the attention
output, so the chain of waits the PDL contract relies on still holds.

Tests: ``tests/engine/test_l2_prefetch.py`` (kernel, option, routing on the CPU) and
``tests/engine/test_l2_prefetch_gpu.py`` (the H200 suite: same tokens and logprobs as ``"off"``
under captured CUDA graphs).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

L2_PREFETCH_MODES = ("off", "o_proj")
"""``RunnerOptions.l2_prefetch`` values: no prefetch, or each layer's o_proj weight."""

_SIDE: dict[int, Any] = {}
"""One side stream per CUDA device index (:func:`side_stream`)."""


def check_l2_prefetch(mode: Any, owner: str = "l2_prefetch") -> str:
    """``mode`` if it is one of :data:`L2_PREFETCH_MODES`, else ``ValueError`` naming them."""
    if not isinstance(mode, str) or mode not in L2_PREFETCH_MODES:
        raise ValueError(f"{owner}={mode!r}: must be one of {L2_PREFETCH_MODES}.")
    return mode


def runs_on(device: Any) -> bool:
    """Whether the prefetch can run on ``device``: CUDA, the triton package, no interpreter."""
    if getattr(device, "type", str(device)) != "cuda" or importlib.util.find_spec(
            "triton") is None:
        return False
    from nbhelpers.engine.kernels import pdl
    return not pdl.interpreted()


def side_stream(device: Any) -> Any:
    """The prefetch side stream of CUDA ``device`` (created on first use, then reused)."""
    import torch
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


class L2Prefetch:
    """The per-runner prefetch state (module docstring).

    ``mode``: a resolved :data:`L2_PREFETCH_MODES` value (``RunnerOptions.l2_prefetch`` after
    ``runner_options.resolve_l2_prefetch``); ``device``: the model's device; ``programs``: the
    kernel's grid (``kernels.l2_prefetch.DEFAULT_PROGRAMS``). ``enabled`` is ``mode ==
    "o_proj"`` and :func:`runs_on` ``(device)``; ``launches`` counts prefetch launches (host
    side; for tests and the profiler's eye). Raises ``ValueError`` for a bad mode.
    """

    def __init__(self, mode: str, device: Any, programs: int | None = None):
        self.mode = check_l2_prefetch(mode)
        self.enabled = self.mode == "o_proj" and runs_on(device)
        self.scratch: Any = None
        self._kernel: Any = None
        self._active = False
        self._side: Any = None  # the side stream of the open fork, until its join
        self.launches = 0
        if self.enabled:
            import torch

            from nbhelpers.engine.kernels import l2_prefetch as kernel
            self._kernel = kernel.l2_prefetch
            self.scratch = torch.zeros(programs or kernel.DEFAULT_PROGRAMS, dtype=torch.int32,
                                       device=device)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Within this block :meth:`fork` prefetches (when enabled); restores the state after."""
        old, self._active = self._active, self.enabled
        try:
            yield
        finally:
            self._active = old

    def fork(self, group: Any) -> None:
        """Prefetch ``group``'s GEMM weight (``LiveGroup.gemm_weight``) on the side stream,
        forked from the current stream; no-op when inactive or the group has no single buffer.
        Call after the qkv GEMM is issued; :meth:`join` before the o_proj GEMM."""
        if not self._active:
            return
        weight = group.gemm_weight()  # host-side refresh on the current stream first
        if weight is None or not weight.is_contiguous():
            return
        self._launch(weight)
        self.launches += 1

    def _launch(self, weight: Any) -> None:
        import torch
        side = side_stream(weight.device)
        side.wait_stream(torch.cuda.current_stream(weight.device))  # after the qkv GEMM
        with torch.cuda.stream(side):
            self._kernel(weight, self.scratch)
        self._side = side

    def join(self) -> None:
        """Make the current stream wait for the open fork's prefetch (no-op without one)."""
        if self._side is not None:
            self._wait(self._side)
            self._side = None

    def _wait(self, side: Any) -> None:
        import torch
        torch.cuda.current_stream(self.scratch.device).wait_stream(side)
