"""Programmatic Dependent Launch (PDL) of the engine's decode kernels (runner option ``pdl``).

What: on Hopper and later (compute capability 9.0+) a kernel launched with the
programmatic-stream-serialization attribute may start while the kernel before it in the stream
is still running. It must execute ``griddepcontrol.wait`` before it reads anything the previous
kernel wrote *and* before it writes anything (a buffer it writes may still be read there); the
previous kernel may execute ``griddepcontrol.launch_dependents`` to let the next one start
before its own epilogue. Decode launches ~550 small latency-bound kernels a step back to back,
so each launch's ramp-up can overlap the previous kernel's tail. Sources: CUDA C++ Programming
Guide, section "Programmatic Dependent Launch and Synchronization"; CUTLASS
``media/docs/cpp/dependent_kernel_launch.md`` (a PDL kernel waits for the prior kernel's memory
flush before it touches what that kernel may write; its example 63,
``63_hopper_gemm_with_weight_prefetch``, prefetches the weights, which no earlier kernel
writes, before the wait: :mod:`.skinny_gemm` loads its first W tile there); Triton's tutorial
``python/tutorials/11-programmatic-dependent-launch.py``.

Contract: every launcher of a decode kernel here (``skinny_gemm``, ``lora_expand``,
``lora_shrink``, ``fused_norm``'s add+RMSNorm and act x up, ``qk_rope_cache``, the two paged
decode stages, ``vocab_sample``'s two sampler kernels) passes ``**pdl.launch_kwargs()``: ``{"USE_GDC": False}`` normally (the kernel
compiles to the code it had before this option: the ``USE_GDC`` branches are pruned, and the
launch keeps Triton's default ``launch_pdl=False``), ``{"USE_GDC": True, "launch_pdl": True}``
inside :func:`scope` ``(True)`` (or ``("on")``). One flag for both, so no kernel is PDL-launched
without its wait. ``scope("early")`` is ``"on"`` plus ``PREWAIT``: the launchers of
``lora_expand``, ``fused_norm``'s add+RMSNorm, ``qk_rope_cache`` and ``lora_act_mul`` pass
``**pdl.launch_kwargs(prewait=True)``, which adds ``"PREWAIT": early()`` (``False`` outside
``"early"``, so those kernels then compile to their ``"on"`` / ``"off"`` code); every other
launcher's kwargs are unchanged. The runner enters ``scope(self.pdl_mode)`` around its decode
step body, which warm-up, CUDA-graph
capture, eager steps and the profiler all run, so the captured graph and the eager path launch
the same way; prefill and everything outside see off. The flag is a module global read at
launch (the engine decodes from one thread), not a ContextVar, so a torch.compile trace of a
launcher reads a plain constant.

Kernel rules (each kernel says where it follows them): ``gdc_wait()`` unconditionally in every
program, before any store and any load of an activation (weights, never written during decode,
may be read before it); ``gdc_launch_dependents()`` once the program's main loop is done (what
remains is its epilogue: the next kernel's programs can take free SM slots and run their
prologue up to their own wait). A wait in *every* program matters: ``griddepcontrol.wait``
waits for the kernel right before, which completes only after each of its programs passed its
own wait, so the guarantee chains back through a run of PDL kernels; one program that skipped
its wait would break the chain. Kernels launched without the attribute (cuBLAS, torch, inductor)
start only after the previous kernel completed, as always.

Weights before the wait (``PREWAIT``, mode ``"early"``; the skinny GEMM always with
``USE_GDC``): a program may load, before its wait, only tensors no decode kernel writes (the
projection weights, LoRA B, RMSNorm weights, Gemma's ``layer_scalar``; ``ModelRunner.
refresh_weights`` rewrites shadows with torch copies *between* steps, and a PDL launch overlaps
only the kernel right before it), and only at addresses computed from its program id and
scalar arguments, never from a loaded index (slots, positions, block tables: those are
activations). Nothing else moves: the same operations in the same order on the same values, so
the interpreter gives bit-identical results, and the sm_90 build stores the same tree of PTX
arithmetic (``tests/engine/test_pdl_early_ptx.py``). The H200 once gave bf16 logprobs up to
1.9e-3 apart (2026-12-02, step ``n16a``): with FMA contraction on, ``qk_rope_cache``'s RoPE sum
of two rounded products became one ``fma``, and which product it fused followed where the
weight loads sat; that kernel now launches without contraction (``qk_rope_cache.FP_FUSION``),
and loads its LoRA B tiles at one point in every build (loaded in its branches, the early build
got other layouts and summed the q/k norm's squares in another order at head_dim 128).
``"early"`` stays opt-in until the H200 suite confirms the parity.
Only the weights' HBM round trip (cold every step: 8 GB
of weights stream through the 50 MB L2) overlaps the previous kernel's tail instead of following
the wait. A dummy pointer (a kernel's unused weight slot, given an activation tensor) is never
loaded early: every early load sits under the constexpr that says the weight exists.

Triton API (3.6 on the H200 image, 3.9 on the CPU host): ``tl.extra.cuda.gdc_wait()`` /
``gdc_launch_dependents()`` (inline PTX ``griddepcontrol.wait`` / ``.launch_dependents`` in 3.6,
``triton/language/extra/cuda/gdc.py``; a builtin op in 3.9; both no-ops when the launch had no
PDL attribute) and the launch keyword ``launch_pdl=True`` (``CUDAOptions.launch_pdl`` of
``triton/backends/nvidia/compiler.py``; the driver launcher then sets
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, ``backends/nvidia/driver.py``).
Neither exists in the interpreter, so :func:`scope` stays off under ``TRITON_INTERPRET=1``.

Weight prefetch (``scope("prefetch")``, runner option ``pdl="prefetch"``; opt-in: it lost the
H200 A/B, below). Why it was tried: at batch 4 each decode GEMM pays ~3.5 us beyond bytes / bandwidth (the
tuner's cold timings on the H200, 2026-12-03: o_proj 8.9 us for 21 MB, qkv 11.6 us for 32 MB),
while the small kernels between GEMMs (add+RMSNorm, act x up, the two attention stages) leave
HBM idle. Two pieces: (1) ``EARLY_TRIGGER`` (launchers passing ``launch_kwargs(trigger=True)``:
add+RMSNorm, act x up and its LoRA consumer, both paged decode stages) moves
``griddepcontrol.launch_dependents`` to the first instruction of every program, so the next
kernel (a GEMM, or stage 2 and then o_proj) launches while they run, not once their loads are
done; (2) the skinny GEMM, before its wait, issues ``prefetch.global.L2`` for the next
``PREFETCH`` K tiles of its W slice (one per 128-byte line; :func:`prefetch_bytes` split over
its programs, ``skinny_gemm.prefetch_tiles``), so that HBM streams W into L2 during that
window and the K loop after the wait reads it from L2. CUTLASS example 63
(``63_hopper_gemm_with_weight_prefetch``) prefetches a GEMM's weights before its PDL wait the
same way (TMA ``cp.async.bulk.prefetch``); a persistent megakernel gets the overlap for free
(Hazy Research, "Look Ma, No Bubbles!", 2025). Sound: a trigger only lets the next grid be
scheduled; its ``griddepcontrol.wait`` still waits for this grid to complete and flush, and a
grid triggers only once all its programs are resident, so no program waits on one that cannot
run. Prefetches read weights only (the rule above) and change no value: results are bit-identical
to ``"early"``. Cost: waiting programs hold SM slots earlier.

Measured (H200, fc11f32, 2026-12-03, step ``s16p``: ``scripts/bench_flex.py --rounds 2
--max-new-tokens 256``, one process per variant, Qwen3-4B random bf16 weights;
``executed/phase3_flex/bench/ab_20261203T182613Z/table.md``): decode step at batch 4 with PEFT
fp32 adapters 3.31 ms under ``"early"``; the triggers alone 3.32; with the prefetch 3.34 (8
MiB), 3.40 (16), 3.53 (32); batch 32 bf16 adapters 4.09 -> 4.13; batch 4 without LoRA 3.05 ->
3.11; with qkv moved off cuBLAS onto the PDL chain (16 MiB) 3.32. One process a variant: the 8
MiB and triggers-only rows are within the +-0.02 ms seen between processes, 16 and 32 MiB are
clearly slower. At 8 MiB the GEMMs' own time fell 0.05 ms a step while the step did not: our
hypothesis (no L2 counters were measured) is that the prefetched lines compete with loads
already in flight (``"early"`` loads each program's first W tile before the wait, so HBM is
not idle in those windows) and that larger budgets evict lines before the K loop reads them.
Same tokens and logprobs as ``"early"`` on the H200 for the triggers (engine GPU test, tiny
model: its K fits one tile, so no prefetch) and for the prefetch at the kernel level
(``test_gpu_skinny_gemm_prefetch_is_exact``); the engine test with prefetching shapes
(``test_gpu_engine_prefetches_and_matches_early``) was added after that window.

Tests: ``tests/engine/test_pdl.py`` (option resolution, the ``USE_GDC`` branches in the
interpreter), ``tests/engine/test_pdl_early.py`` (``PREWAIT`` against its absence, bit for bit),
``tests/engine/test_pdl_builds.py`` (sm_90 PTX of every kernel, and on a GPU greedy parity of
``pdl="on"`` against ``"off"`` and of ``"early"`` against ``"on"`` under CUDA graphs),
``tests/engine/test_pdl_prefetch.py`` (``"prefetch"``: options, interpreter, sm_90 PTX, GPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

PDL_MODES = ("off", "on", "early", "prefetch")
"""Resolved values of ``RunnerOptions.pdl`` (``"auto"`` resolves to one of them). ``"early"`` is
``"on"`` plus weights loaded before the wait in the kernels whose launcher asks for ``PREWAIT``
(:func:`launch_kwargs`). ``"prefetch"`` is ``"early"`` plus the weight prefetch of the module
docstring's last section: the kernels before a GEMM let it launch at their start
(``EARLY_TRIGGER``) and the skinny GEMM pulls more of its W slice into L2 before its wait."""

PREFETCH_BYTES = 8 << 20
"""Default L2 budget of one skinny GEMM's prefetch before its wait, in bytes (runner option
``pdl_prefetch_mib``, 8 MiB): a fraction of the H200's 50 MB L2, about what HBM delivers in the
~2-6 us the kernels before a decode GEMM run (~4 TB/s); the least slow budget of the H200 A/B
below (16 and 32 MiB were slower)."""

MIN_CAPABILITY = 9
"""Compute capability major version with PDL (Hopper, sm_90)."""

_ON = False
_EARLY = False
_PREFETCH = 0  # bytes; > 0 only inside scope("prefetch")
_TRIGGER = False  # EARLY_TRIGGER: inside scope("prefetch")


def check_pdl(mode: str) -> str:
    """``mode`` if it is one of :data:`PDL_MODES`, else ``ValueError`` naming them."""
    if mode not in PDL_MODES:
        raise ValueError(f"pdl={mode!r}: must be one of {PDL_MODES} (or 'auto' in "
                         "RunnerOptions).")
    return mode


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``); False without
    the triton package."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton
    return bool(triton.knobs.runtime.interpret)


def supported(device: Any) -> bool:
    """Whether kernels on ``device`` (a ``torch.device``) can be PDL-launched: a CUDA device of
    compute capability >= :data:`MIN_CAPABILITY`, the triton package, no interpreter."""
    if getattr(device, "type", str(device)) != "cuda" or importlib.util.find_spec(
            "triton") is None or interpreted():
        return False
    import torch
    return torch.cuda.get_device_capability(device)[0] >= MIN_CAPABILITY


def active() -> bool:
    """Whether launches now are PDL launches (inside :func:`scope` ``(True)``, ``("on")``,
    ``("early")`` or ``("prefetch")``)."""
    return _ON


def early() -> bool:
    """Whether launches now load weights before the wait (inside :func:`scope` ``("early")`` or
    ``("prefetch")``)."""
    return _EARLY


def prefetch_bytes() -> int:
    """The skinny GEMM's L2 prefetch budget now, in bytes: > 0 only inside :func:`scope`
    ``("prefetch")`` (and never under the interpreter, where PDL stays off)."""
    return _PREFETCH


@contextlib.contextmanager
def scope(mode: bool | str, budget_bytes: int = PREFETCH_BYTES) -> Iterator[None]:
    """Within this block the kernels above launch with PDL iff ``mode`` is ``True``, ``"on"``,
    ``"early"`` or ``"prefetch"`` (a resolved value: the caller checked :func:`supported`), the
    ``PREWAIT`` kernels load their weights before the wait iff it is ``"early"`` or
    ``"prefetch"``, and with ``"prefetch"`` the ``EARLY_TRIGGER`` kernels let the next kernel
    launch at their start and the skinny GEMM prefetches up to ``budget_bytes`` bytes (int >=
    0; 0: the early triggers alone; :func:`prefetch_bytes`) of its weights into L2 before its
    wait; ``False`` / ``"off"``: ordinary launches. Under the interpreter it stays off.
    Restores the previous state on exit (nesting is fine).

    Raises:
        ValueError: a string that is not one of :data:`PDL_MODES`, or ``budget_bytes`` not an
            int >= 0.
    """
    global _ON, _EARLY, _PREFETCH, _TRIGGER
    name = ("on" if mode else "off") if isinstance(mode, bool) else check_pdl(mode)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"pdl.scope: budget_bytes={budget_bytes!r} must be an int >= 0 (bytes "
                         "of L2 prefetch per skinny GEMM).")
    on = name != "off" and not interpreted()
    old = (_ON, _EARLY, _PREFETCH, _TRIGGER)
    _ON, _EARLY, _TRIGGER = on, on and name in ("early", "prefetch"), on and name == "prefetch"
    _PREFETCH = budget_bytes if _TRIGGER else 0
    try:
        yield
    finally:
        _ON, _EARLY, _PREFETCH, _TRIGGER = old


def launch_kwargs(prewait: bool = False, trigger: bool = False) -> dict[str, bool]:
    """Keyword arguments for a kernel launch: ``USE_GDC`` (the kernel's constexpr) and, when on,
    ``launch_pdl=True`` (module docstring). ``prewait``: the kernel also takes the ``PREWAIT``
    constexpr (weights before the wait), given :func:`early`; ``trigger``: it also takes the
    ``EARLY_TRIGGER`` constexpr (``griddepcontrol.launch_dependents`` first in every program),
    true inside :func:`scope` ``("prefetch")``; launchers without them keep the keys above."""
    kw = {"USE_GDC": True, "launch_pdl": True} if _ON else {"USE_GDC": False}
    if prewait:
        kw["PREWAIT"] = _EARLY
    if trigger:
        kw["EARLY_TRIGGER"] = _TRIGGER
    return kw
