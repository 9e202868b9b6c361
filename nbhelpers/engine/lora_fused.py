"""Fused base + LoRA GEMM path of :class:`nbhelpers.engine.lora.LiveGroup` (``lora_fused``).

With ``lora_fused="triton"`` decode calls (at most ``lora_gemm.MAX_ROWS`` rows) run the base GEMM
and its LoRA as one kernel (:mod:`nbhelpers.engine.kernels.lora_gemm`) where the per-shape tuner
(:mod:`nbhelpers.engine.kernels.lora_gemm_tune`) found it faster than the group's cuBLAS path.
:class:`LoraFusedGemm` holds the kernel modules and the tuned choice per shape; the group passes
its fused buffers ``f`` (see ``LiveGroup._buffers``), part sizes, ranks and cuBLAS path per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LORA_FUSED_MODES = ("off", "triton")
"""Whether decode GEMMs may run as one base + LoRA Triton kernel (``lora_gemm``)."""


def check_kernel_mode(option: str, mode: str, modes: tuple[str, ...]) -> str:
    """``mode`` if it is one of ``modes`` (``modes[0]`` is the torch path, ``"triton"`` needs
    the triton package). Raises ``ValueError`` naming the accepted values or the install."""
    import importlib.util
    if mode not in modes:
        raise ValueError(f"{option}={mode!r}: use one of {modes}.")
    if mode == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"{option}='triton' needs the triton package (pip install triton); "
                         f"use {option}={modes[0]!r}.")
    return mode


def check_lora_fused(mode: str) -> str:
    """``mode`` if valid (:func:`check_kernel_mode` over :data:`LORA_FUSED_MODES`)."""
    return check_kernel_mode("lora_fused", mode, LORA_FUSED_MODES)


class LoraFusedGemm:
    """One group's fused-GEMM state: kernel modules (``None`` when off) and tuned configs.

    ``choices`` maps a ``lora_gemm_tune.shape_key`` to the tuned :class:`lora_gemm.Config`, or
    ``None`` for cuBLAS; it survives :meth:`set_mode`.
    """

    def __init__(self) -> None:
        self.gemm: Any = None
        self.tune: Any = None
        self.choices: dict[str, Any] = {}

    @property
    def enabled(self) -> bool:
        return self.gemm is not None

    def set_mode(self, mode: str) -> str:
        """Load (``"triton"``) or drop (``"off"``) the kernel modules; returns ``mode``.
        Raises ``ValueError`` as :func:`check_lora_fused`."""
        mode = check_lora_fused(mode)
        self.gemm = self.tune = None
        if mode == "triton":  # imported here, not per call (traced decode steps)
            from nbhelpers.engine.kernels import lora_gemm, lora_gemm_tune
            self.gemm, self.tune = lora_gemm, lora_gemm_tune
        return mode

    def operands(self, x2: Any, f: dict[str, Any], sizes: list[int],
                 ranks: Callable[[], list[int]]) -> tuple | None:
        """``(W, A, Bs, ranks)`` for :func:`lora_gemm.lora_gemm` (A and Bs ``None`` without
        LoRA; with ``ext`` A is W's last rows), or ``None`` when it does not serve them."""
        n = f["n_out"]
        w = f["W"][:n] if f["ext"] else f["W"]
        a = (f["W"][n:] if f["ext"] else f["A"]) if f["lora"] else None
        bs, rs = (f["B"], ranks()) if f["lora"] else (None, None)
        ok = self.gemm.supported(x2, w, sizes, a, bs, rs)
        return (w, a, bs, rs) if ok else None

    def __call__(self, x2: Any, f: dict[str, Any], sizes: list[int],
                 ranks: Callable[[], list[int]], cublas: Callable[[Any, dict], Any]) -> Any:
        """``y [N, sum(out)]`` from one :mod:`lora_gemm` launch, or ``None``: unsupported operands
        (e.g. more than ``MAX_ROWS`` rows: prefill) or the tuner picked cuBLAS for this shape.
        ``cublas(x2, f)`` is the group's cuBLAS path (a tuning candidate)."""
        ops = self.operands(x2, f, sizes, ranks)
        if ops is None:
            return None
        w, a, bs, rs = ops
        cfg = self.config(x2, f, ops, sizes, cublas)
        if cfg is None:
            return None
        return self.gemm.lora_gemm(x2, w, sizes, f["bias"], a, bs, rs, f.get("scaling", 1.0), cfg)

    def config(self, x2: Any, f: dict[str, Any], ops: tuple, sizes: list[int],
               cublas: Callable[[Any, dict], Any]) -> Any:
        """The tuned :class:`lora_gemm.Config` for this shape, ``None`` for cuBLAS. Tunes at the
        shape's first eager CUDA call (module :mod:`lora_gemm_tune`) over the configs that fit
        the device's shared memory (``lora_gemm.configs_for``); on the CPU, while capturing or
        tracing: ``default_config`` (not recorded, so a later eager call still tunes)."""
        import torch
        w, a, bs, ranks = ops
        lg, tune = self.gemm, self.tune
        key = tune.shape_key(x2.device, x2.shape[0], sizes, x2.shape[1], w.dtype,
                             None if a is None else a.dtype, ranks, f["bias"] is not None)
        if key in self.choices:
            return self.choices[key]
        fit = lg.fit_args(x2, a, ranks)  # candidates within the device's shared memory
        default = lg.default_config(x2.shape[0], w.shape[0], x2.shape[1], sizes, **fit)
        if (not x2.is_cuda or torch.compiler.is_compiling()
                or torch.cuda.is_current_stream_capturing()):
            return default
        cfgs = {tune.config_name(c): c
                for c in (default, *lg.configs_for(x2.shape[0], sizes, **fit))}
        launch = {n: (lambda c=c: lg.lora_gemm(x2, w, sizes, f["bias"], a, bs, ranks,
                                               f.get("scaling", 1.0), c)) for n, c in cfgs.items()}
        launch[tune.CUBLAS] = lambda: cublas(x2, f)
        choice = tune.tuner().choose(key, launch)
        self.choices[key] = cfgs.get(choice)  # None: cuBLAS
        return self.choices[key]
