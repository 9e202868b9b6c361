"""The ``"auto"`` resolution of :class:`~nbhelpers.engine.runner_options.RunnerOptions`: which
kernel, dtype or launch mode each option means on this device (CUDA or not, triton importable,
compute capability), one ``resolve_*`` function per option; used by ``model_runner.py``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from nbhelpers.engine.kernels import pdl as pdl_launch  # pure python, no triton at import

if TYPE_CHECKING:
    from nbhelpers.engine.runner_options import RunnerOptions


def resolve_kernels(opt: RunnerOptions, on_cuda: bool,
                    decode_kernels: tuple[str, ...] = ("flex", "triton"),
                    sdpa_ok: bool = False) -> tuple[str, str]:
    """``(decode_attention, lora_expand)`` with ``"auto"`` resolved: the Triton kernels on CUDA
    when the triton package imports (decode attention only where the model's
    ``decode_kernels`` lists ``"triton"``: Gemma-4 keeps flex); on the CPU decode ``"sdpa"``
    when ``sdpa_ok`` (the model's score_mod/masks have an SDPA form,
    ``attention.sdpa_supports``), else ``"flex"``; LoRA B ``"consumer"`` on CUDA (``"triton"``
    plus B deferred to the q/k-rope and act x up kernels; H200 A/B in
    :attr:`RunnerOptions.pdl`), ``"addmm"`` off CUDA."""
    triton_ok = on_cuda and importlib.util.find_spec("triton") is not None
    cpu = "sdpa" if sdpa_ok and not on_cuda else "flex"
    attn = opt.decode_attention if opt.decode_attention != "auto" else (
        "triton" if triton_ok and "triton" in decode_kernels else cpu)
    expand = opt.lora_expand if opt.lora_expand != "auto" else (
        "consumer" if triton_ok else "addmm")
    return attn, expand


def resolve_prefill(opt: RunnerOptions, on_cuda: bool, sdpa_ok: bool) -> str:
    """``opt.prefill_attention`` with ``"auto"`` resolved: ``"sdpa"`` on the CPU when
    ``sdpa_ok`` (see :func:`resolve_kernels`), else ``"flex"``."""
    if opt.prefill_attention != "auto":
        return opt.prefill_attention
    return "sdpa" if sdpa_ok and not on_cuda else "flex"


def resolve_prefill_graphs(opt: RunnerOptions, use_graphs: bool, prefill_attention: str,
                           compiled: bool = True) -> bool:
    """Whether prefill runs as CUDA graphs (``prefill_graphs.py``): ``"on"`` -> True (or raises),
    ``"auto"`` -> True where it can run (``use_graphs``, ``prefill_attention == "flex"`` and
    ``compiled``: the resolved ``compile_attention``), ``"off"`` -> False. Uncompiled flex
    cannot be captured: torch's eager flex (``_math_attention_inner``) builds its ``-inf`` fill
    with ``torch.tensor(-inf, device=scores.device)`` on every call, a pageable host-to-device
    copy that CUDA-graph capture refuses (H200 suite of 2026-12-03, ``tests/unit/
    test_ab_flex_is.py`` with ``flex_compile_attention="off"``); ``"on"`` still tries (a failed
    capture warns and prefills eagerly).

    Raises:
        ValueError: ``"on"`` without CUDA graphs (``use_graphs``: the resolved
            ``use_cuda_graphs``, off on the CPU) or with ``prefill_attention`` (resolved) not
            ``"flex"`` (SDPA/FA4 plans size their gathers on the host per batch).
    """
    if opt.prefill_graphs == "auto":
        return bool(use_graphs) and prefill_attention == "flex" and bool(compiled)
    if opt.prefill_graphs != "on":
        return False
    if not use_graphs:
        raise ValueError("RunnerOptions.prefill_graphs='on' needs CUDA graphs: a CUDA model with "
                         "use_cuda_graphs None or True; on the CPU use prefill_graphs='off' (or "
                         "'auto', which is off there).")
    if prefill_attention != "flex":
        raise ValueError(f"RunnerOptions.prefill_graphs='on' captures the flex prefill only, "
                         f"prefill_attention resolved to {prefill_attention!r} (its plan is "
                         f"sized on the host per batch): set prefill_attention='flex', or "
                         f"prefill_graphs='off'.")
    return True


def resolve_lora_fused(opt: RunnerOptions, on_cuda: bool) -> str:
    """``opt.lora_fused`` with ``"auto"`` resolved to ``"off"`` (the fused kernel lost the H200
    A/B of ``scripts/device/ab_lora_gemm.py``, see :class:`RunnerOptions`; ``on_cuda`` is where
    a faster one would pick ``"triton"``)."""
    del on_cuda  # auto -> off on every device for now
    return "off" if opt.lora_fused == "auto" else opt.lora_fused


def resolve_skinny_gemm(opt: RunnerOptions, kernels_ok: bool) -> str:
    """``opt.skinny_gemm`` with ``"auto"`` resolved: ``"triton"`` when ``kernels_ok`` (CUDA and a
    16/32-bit model, ``ModelRunner.kernels_ok``) and the triton package imports, else ``"off"``
    (the H200 A/B is in :attr:`RunnerOptions.skinny_gemm`)."""
    if opt.skinny_gemm != "auto":
        return opt.skinny_gemm
    return "triton" if kernels_ok and importlib.util.find_spec("triton") is not None else "off"


def resolve_pdl(opt: RunnerOptions, device: Any) -> bool:
    """Whether the decode kernels launch with PDL: ``opt.pdl`` is ``"on"``, ``"early"`` or
    ``"auto"`` (the H200 A/B is in :attr:`RunnerOptions.pdl`), ``device`` supports it
    (``pdl.supported``: CUDA with compute capability >= 9, triton, no interpreter) and
    ``compile_decode`` is off; anything else is off, silently (the option is a speed knob)."""
    return opt.pdl != "off" and not opt.compile_decode and pdl_launch.supported(device)


def resolve_pdl_mode(opt: RunnerOptions, device: Any) -> str:
    """The resolved ``pdl`` mode (one of ``pdl.PDL_MODES``): ``"off"`` where
    :func:`resolve_pdl` is False, else ``opt.pdl``, with ``"auto"`` = ``"early"`` (the H200
    A/B and GPU parity tests of 2026-12-02 in :attr:`RunnerOptions.pdl`)."""
    if not resolve_pdl(opt, device):
        return "off"
    return "early" if opt.pdl == "auto" else opt.pdl


def resolve_l2_prefetch(opt: RunnerOptions, device: Any) -> str:
    """``opt.l2_prefetch``, kept ``"o_proj"`` only where it runs (``l2_prefetch.runs_on``:
    CUDA, triton, no interpreter) and without ``compile_decode`` (a whole-step trace has no
    side stream); else ``"off"``, silently (the option is a speed knob)."""
    from nbhelpers.engine.l2_prefetch import runs_on
    keep = opt.l2_prefetch == "o_proj" and not opt.compile_decode and runs_on(device)
    return "o_proj" if keep else "off"


def resolve_sample_kernel(opt: RunnerOptions, on_cuda: bool) -> str:
    """``opt.sample_kernel`` resolved to what the decode steps run: ``"auto"`` is ``"triton"`` on
    CUDA when the triton package imports, else ``"torch"`` (the interpreter is a test tool, not
    a CPU fast path); ``"triton"`` is kept only on CUDA or under the interpreter
    (``pdl.interpreted``); with ``compile_decode`` both give ``"torch"`` (a whole-step trace
    keeps the torch sampler, as it keeps cuBLAS). Silent: the option is a speed knob."""
    if opt.compile_decode or opt.sample_kernel == "torch":
        return "torch"
    if opt.sample_kernel == "auto":
        return "triton" if on_cuda and importlib.util.find_spec("triton") is not None else "torch"
    return "triton" if on_cuda or pdl_launch.interpreted() else "torch"


def resolve_lora_dtype(opt: RunnerOptions, on_cuda: bool) -> str:
    """``opt.lora_dtype`` with ``"auto"`` resolved: ``"model"`` on CUDA, else ``"adapter"``."""
    if opt.lora_dtype != "auto":
        return opt.lora_dtype
    return "model" if on_cuda else "adapter"


def resolve_fused_elementwise(opt: RunnerOptions, compile_layers: bool,
                              on_cuda: bool = False) -> str:
    """``opt.fused_elementwise`` with ``"auto"`` resolved: ``"triton"`` on CUDA when the triton
    package imports (the H200 A/B is in :attr:`RunnerOptions.fused_elementwise`), else
    ``"compile"`` when ``compile_layers`` (resolved) else ``"off"``."""
    if opt.fused_elementwise != "auto":
        return opt.fused_elementwise
    if on_cuda and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "compile" if compile_layers else "off"
