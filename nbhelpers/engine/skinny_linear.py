"""Decode GEMMs through the split-K Triton kernel (runner option ``skinny_gemm``).

Contract: one :class:`SkinnyLinear` per engine model, shared by every
:class:`~nbhelpers.engine.lora.LiveGroup` (its base GEMM: ``F.linear(x2, W, bias)`` where ``W`` may
carry LoRA A's rows, the ``ext`` layout, so ``y`` and ``x A^T`` still come out of one GEMM) and by
the LM head (``layers.EngineModel.logits``). Calling it is ``F.linear(x2, w, bias)``: in mode
``"triton"``, inside :meth:`decoding` (the runner's decode step body: warm-up, capture, eager
steps, the profiler's steps) and for operands :func:`.kernels.skinny_gemm.supported` serves
(at most ``max_rows`` rows, 16/32-bit, CUDA or the interpreter) it launches
:func:`.kernels.skinny_gemm.skinny_gemm` with the config the tuner chose for the shape, or keeps
``F.linear`` where cuBLAS won (:mod:`.kernels.skinny_gemm_tune`). Prefill, more rows,
torch.compile tracing (``compile_decode``) and unsupported operands keep ``F.linear``. Weights
are passed per call (live LoRA: nothing is copied or cached but the choice).

:func:`nbhelpers.engine.lora_pending.defer` (``lora_expand="consumer"``) calls the group's
``_base_gemm``, so the pending-LoRA record is built on this GEMM's output the same way.
With ``lora_expand="epilogue"`` a group's ``ext`` GEMM asks :meth:`SkinnyLinear.lora_epilogue`
first: the same routing and tuned config, LoRA B added inside the kernel
(:mod:`.kernels.skinny_lora_epilogue`).

``cublas="never"`` (runner option ``skinny_gemm_cublas``, an A/B knob) leaves cuBLAS out of the
tuner's candidates: every shape served runs the fastest correct Triton config (tuned under its own
``|nocublas`` key), so no cuBLAS launch breaks the decode step's PDL chain.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from nbhelpers.engine.lora_fused import check_kernel_mode

SKINNY_GEMM_MODES = ("off", "triton")
"""Whether decode GEMMs of at most ``max_rows`` rows may run as the split-K Triton kernel."""
SKINNY_GEMM_MAX_ROWS = (16, 32, 64)
"""Allowed ``max_rows`` (runner option ``skinny_gemm_max_rows``): 32 (the default: the 32-row tile
serves 17-32 rows), 16 (one 16-row tile) or 64 (the 64-row tile also serves 33-64 rows: opt-in,
not yet measured on a GPU) (:class:`SkinnyLinear`)."""


SKINNY_GEMM_CUBLAS = ("auto", "never")
"""Whether the tuner may keep cuBLAS for a shape (``"auto"``: where it is fastest) or never."""


def check_skinny_gemm_cublas(value: str, owner: str = "SkinnyLinear.cublas") -> str:
    """``value`` if it is in :data:`SKINNY_GEMM_CUBLAS`; else ``ValueError`` naming ``owner``
    and the allowed values."""
    if not isinstance(value, str) or value not in SKINNY_GEMM_CUBLAS:
        raise ValueError(f"{owner}={value!r}: must be one of {SKINNY_GEMM_CUBLAS}.")
    return value


def check_skinny_gemm(mode: str) -> str:
    """``mode`` if valid (:func:`~nbhelpers.engine.lora_fused.check_kernel_mode` over
    :data:`SKINNY_GEMM_MODES`); raises ``ValueError`` naming the allowed values."""
    return check_kernel_mode("skinny_gemm", mode, SKINNY_GEMM_MODES)


def check_skinny_gemm_max_rows(rows: int, owner: str = "SkinnyLinear.max_rows") -> int:
    """``rows`` if it is an int in :data:`SKINNY_GEMM_MAX_ROWS`; else ``ValueError`` naming
    ``owner`` and the allowed values."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows not in SKINNY_GEMM_MAX_ROWS:
        raise ValueError(f"{owner}={rows!r}: must be one of {SKINNY_GEMM_MAX_ROWS}.")
    return rows


class SkinnyLinear:
    """``F.linear`` with the skinny kernel for decode (module docstring).

    ``choices`` maps a ``skinny_gemm_tune.shape_key`` to the chosen ``skinny_gemm.Config`` or
    ``None`` (cuBLAS). ``max_rows``: decode GEMMs of at most this many rows are served, 32 (the
    default: 17-32 rows run the kernel's 32-row tile) or 16 (one 16-row tile). Why 32: the
    engine A/B on the H200 (``scripts/bench_flex.py --variants`` with ``skinny_gemm_max_rows:
    32``, 2026-12-01, step ``n8s``): Qwen3-4B batch 32 decode step 4.50 -> 4.40 ms (bf16
    adapters) and 4.00 -> 3.89 ms (no LoRA); the cold-weight GEMMs alone: cuBLAS 2.79 ms vs a
    split-K sweep 2.65 ms (``/work/shared/tools/gemv_roofline.py``).
    ``cublas``: ``"auto"`` (cuBLAS kept where the tuner finds it fastest) or ``"never"`` (the
    fastest Triton config for every shape served; module docstring).
    Raises ``ValueError`` for a mode outside :data:`SKINNY_GEMM_MODES`, ``max_rows`` outside
    :data:`SKINNY_GEMM_MAX_ROWS` or ``cublas`` outside :data:`SKINNY_GEMM_CUBLAS`.
    """

    def __init__(self, mode: str = "off", max_rows: int = 32, cublas: str = "auto"):
        self.mode = check_skinny_gemm(mode)
        self.max_rows = check_skinny_gemm_max_rows(max_rows)
        self.cublas = check_skinny_gemm_cublas(cublas)
        self.decode = False
        self.choices: dict[str, Any] = {}
        self.kernel = self.tune = self.epilogue = None
        if mode == "triton":  # imported here, not per call (traced decode steps)
            from nbhelpers.engine.kernels import (
                skinny_gemm,
                skinny_gemm_tune,
                skinny_lora_epilogue,
            )
            self.kernel, self.tune = skinny_gemm, skinny_gemm_tune
            self.epilogue = skinny_lora_epilogue

    @property
    def enabled(self) -> bool:
        return self.kernel is not None

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Within this block the GEMMs are decode GEMMs (the runner's decode windows)."""
        old, self.decode = self.decode, True
        try:
            yield
        finally:
            self.decode = old

    def serves(self, x2: Any, w: Any, bias: Any = None) -> bool:
        """Whether this call would run the kernel (mode on, decoding, not traced, operands)."""
        import torch
        return (self.kernel is not None and self.decode and x2.dim() == 2
                and x2.shape[0] <= self.max_rows and not torch.compiler.is_compiling()
                and self.kernel.supported(x2, w, bias))

    def __call__(self, x2: Any, w: Any, bias: Any = None) -> Any:
        """``x2 [M, K] @ w [N, K]^T (+ bias [N])`` -> ``[M, N]`` in x2's dtype."""
        import torch.nn.functional as F
        if not self.serves(x2, w, bias):
            return F.linear(x2, w, bias)
        cfg = self.config(x2, w, bias)
        return F.linear(x2, w, bias) if cfg is None else self.kernel.skinny_gemm(x2, w, bias, cfg)

    def lora_epilogue(self, x2: Any, f: dict[str, Any], sizes: list[int],
                      ranks: list[int]) -> Any:
        """``y [M, n_out]`` of a LiveGroup's ``ext`` buffers ``f`` (``W [n_out + sum(r), K]``,
        live ``B`` list, ``scaling``) with LoRA B added in the skinny kernel's epilogue, one
        launch; ``None`` where this call is not served (not decoding, operands, cuBLAS chosen
        for the shape, or ``n_out`` not a multiple of the config's ``block_n``): the caller
        keeps its GEMM + expand path."""
        w, ep = f["W"], self.epilogue
        if ep is None or f["bias"] is not None or not self.serves(x2, w):
            return None
        cfg = self.config(x2, w, None)  # the shape's tuned config (plain kernel's timing)
        if cfg is None or not ep.supported(x2, w, f["n_out"], f["B"], sizes, ranks, None,
                                           cfg.block_n):
            return None
        return ep.skinny_lora_gemm(x2, w, f["n_out"], f["B"], sizes, ranks, f["scaling"],
                                   None, cfg)

    def config(self, x2: Any, w: Any, bias: Any) -> Any:
        """The tuned config for this shape, ``None`` for cuBLAS. Tunes at the shape's first
        eager CUDA call; on the CPU (interpreter) or while capturing: ``default_config``, not
        recorded (a later eager call still tunes)."""
        import torch
        key = self.key(x2, w, bias)
        if key in self.choices:
            return self.choices[key]
        if not x2.is_cuda or torch.cuda.is_current_stream_capturing():
            return self.kernel.default_config(w.shape[0], x2.shape[1])
        limit = getattr(torch.cuda.get_device_properties(x2.device),
                        "shared_memory_per_block_optin", 232448)  # H200's when torch lacks it
        return self.tune_shape(x2, w, bias, limit)

    def tune_shape(self, x2: Any, w: Any, bias: Any, limit_bytes: int) -> Any:
        """Time this call's shape now (the tuner's candidates that fit ``limit_bytes`` of shared
        memory, cuBLAS among them unless ``cublas="never"``), record and return the choice
        (``None``: cuBLAS). :meth:`config` calls it at a shape's first eager CUDA call."""
        sg, tune = self.kernel, self.tune
        (m, k), n = x2.shape, w.shape[0]
        key = self.key(x2, w, bias)
        cfgs = tune.candidates(m, n, k, w.element_size(), limit_bytes)  # pruned at BLOCK_M
        choice = tune.tuner().choose_gemm(key, x2, w, bias, cfgs, sg.skinny_gemm,
                                          cublas=self.cublas == "auto")
        self.choices[key] = cfgs.get(choice)  # None: cuBLAS
        return self.choices[key]

    def key(self, x2: Any, w: Any, bias: Any) -> str:
        """The tuner's key for this call (``|nocublas`` with ``cublas="never"``)."""
        return self.tune.shape_key(x2.device, x2.shape[0], w.shape[0], x2.shape[1], w.dtype,
                                   bias is not None, cublas=self.cublas == "auto")
