"""The decode MLP in one launch (runner option ``mlp_block``): which calls it serves, its buffers.

Contract: :class:`MlpBlock` is the engine side of :mod:`nbhelpers.engine.kernels.mlp_block`.
``EngineModel.forward`` (decode) calls :meth:`MlpBlock.begin` once a step with the step's row
count, then, for every layer, :meth:`MlpBlock.__call__` with the post-attention norm's output
``h [1, T, H]`` and the layer's gate_up / down :class:`~nbhelpers.engine.lora.LiveGroup`. Where
it serves the call it returns the MLP output as an fp32 ``[1, T, H]`` accumulator (the down
GEMM's unrounded sum, down's LoRA already added in PEFT's order) that the next add+RMSNorm
rounds to the model dtype (``kernels/fused_norm.add_norm``); else ``None`` and the caller runs
the gate_up GEMM, SiLU x up and down GEMM as before.

It serves: decode steps of at most :data:`ROUTE_MAX_ROWS` (16) rows on
CUDA (or CPU tensors under ``TRITON_INTERPRET=1``), a SiLU MLP (Llama / Qwen3), fused gate/up
weights without bias, the Triton elementwise kernels (``fused_elementwise="triton"``: the fp32
accumulator needs the add+RMSNorm kernel that rounds it), not inside ``torch.compile``, and
either no LoRA or one adapter on gate, up and down (ranks up to ``kernels/mlp_block.MAX_RANK``):
PEFT's fp32 adapters read as they are (``lora_dtype="adapter"``), their 16-bit shadows (the
CUDA default ``lora_dtype="model"``) or 16-bit adapters, A's rows read from the GEMM buffer
where ``LiveGroup`` keeps them there (its ``ext`` layout). Partial targets (LoRA on some of
gate/up/down) keep the unfused path.

Launches per layer: without LoRA one (the block) where the unfused path runs three (gate_up
GEMM, SiLU x up, down GEMM); with LoRA three (gate/up's LoRA A: ``lora_shrink`` for fp32 A, a
small GEMM for 16-bit A; the block with down's LoRA A inside; down's LoRA B
``lora_expand(round_to=...)``) where it runs four to six. Plus one memset a step (:meth:`begin`: every layer's accumulator and down-``xa``
buffer, ``L x T x (H + 64)`` fp32). The accumulator's atomic adds make the last fp32 bits of
the MLP output vary run to run (``kernels/mlp_block.py``); greedy tokens of the tiny fp32
models match the unfused path (``tests/engine/test_mlp_block_engine.py``).

Why: at batch 4 the three launches cost 45.9 us a layer on the H200 against 36.0 us of weight
bytes (``docs/decode_floor_plan.md``); the one-launch probe ran 56.1 us against 64.3 (cuBLAS)
and 65.2 (skinny) on an H100 at 4 rows (2026-12-08, ``scripts/device/ab_mlp_block.py``,
``executed/phase3_flex/bench/ab_mlp_block_20261208_h100_bb16c1e/``). Off by default until the
engine A/B (``scripts/bench_flex.py`` variant ``{"mlp_block": "triton"}``) says it wins.
"""

from __future__ import annotations

import warnings
from typing import Any

ROUTE_MAX_ROWS = 16
"""Most decode rows the engine routes to the block (the probe's measured range; the kernel takes
up to ``kernels/mlp_block.MAX_ROWS``)."""

MLP_BLOCK_MODES = ("off", "triton")
"""``RunnerOptions.mlp_block`` values: the unfused MLP, or one Triton launch at decode."""


def check_mlp_block(mode: Any, owner: str = "mlp_block") -> str:
    """``mode`` if it is one of :data:`MLP_BLOCK_MODES`, else ``ValueError`` naming them."""
    if mode not in MLP_BLOCK_MODES:
        raise ValueError(f"{owner}={mode!r}: use one of {MLP_BLOCK_MODES} ('triton': the decode "
                         "MLP as one Triton launch, engine/mlp_block.py).")
    return mode


class MlpBlock:
    """Routes decode MLPs to the one-launch kernel (module docstring).

    ``mode``: :data:`MLP_BLOCK_MODES`; ``num_layers``, ``hidden``: the model's; ``device``,
    ``silu``: whether the MLP's activation is SiLU (else nothing is served). The buffer
    (``num_layers x ROUTE_MAX_ROWS x (hidden + MAX_RANK)`` fp32: 6.0 MB at Qwen3-4B) is
    allocated here, outside any CUDA graph capture, when the mode is on and the device can run
    the kernel.
    """

    def __init__(self, mode: str = "off", num_layers: int = 0, hidden: int = 0,
                 device: Any = None, silu: bool = True):
        self.mode = check_mlp_block(mode)
        self.hidden, self.num_layers = hidden, num_layers
        self.enabled = mode == "triton" and silu and _runs_on(device)
        self.rows = 0  # this step's rows (begin); 0: nothing served
        self.skipped: set[str] = set()  # why a call was not served (warned once each)
        self._buf: Any = None
        if self.enabled:
            import torch

            from nbhelpers.engine.kernels import lora_expand, mlp_block
            self._kernel, self._expand = mlp_block, lora_expand
            self._width = hidden + mlp_block.MAX_RANK
            self._buf = torch.zeros(num_layers * ROUTE_MAX_ROWS * self._width,
                                    dtype=torch.float32, device=device)

    def begin(self, rows: int) -> None:
        """Start a decode step of ``rows`` rows: zero the accumulators it will use (one memset),
        or serve nothing this step when ``rows`` is above the kernel's bound."""
        import torch
        self.rows = 0
        if not self.enabled or rows > ROUTE_MAX_ROWS or torch.compiler.is_compiling():
            return
        self.rows = rows
        self._buf[:self.num_layers * rows * self._width].zero_()

    def _views(self, i: int, rows: int, rank: int) -> tuple[Any, Any]:
        """Layer ``i``'s ``(acc [rows, H], xa_down [rows, rank])``: one ``rows x (H + MAX_RANK)``
        region each, zeroed by :meth:`begin`."""
        base = i * rows * self._width
        acc = self._buf[base:base + rows * self.hidden].view(rows, self.hidden)
        start = base + rows * self.hidden
        return acc, self._buf[start:start + rows * rank].view(rows, rank)

    def __call__(self, i: int, h: Any, gate_up: Any, down: Any, fx: Any) -> Any:
        """Layer ``i``'s MLP output for ``h [1, T, H]``: fp32 ``[1, T, H]`` (module docstring),
        or ``None`` where the block does not serve this call (a step above the row bound
        silently; any other reason with a ``UserWarning`` once per reason, kept in
        ``skipped``)."""
        t = h.shape[-2] if h.dim() == 3 else h.shape[0]
        if not self.rows or t != self.rows or not getattr(fx, "takes_lora", False):
            return None
        fg, fd = gate_up._buffers(), down._buffers()
        plan = _plan(fg, fd, h, self.hidden)
        if isinstance(plan, str):  # once per reason: the option is on and does not serve
            if plan not in self.skipped:
                self.skipped.add(plan)
                warnings.warn(f"mlp_block='triton' does not serve layer {i}'s MLP ({plan}); "
                              "the unfused path runs there.", stacklevel=2)
            return None
        h2 = h.reshape(-1, self.hidden)
        acc, xa_down = self._views(i, t, plan["r_d"])
        lora = None
        if plan["r_d"]:
            xa = gate_up._lora_a(h2, plan["a_gu"])  # [T, r_g + r_u] in A's dtype
            lora = self._kernel.MlpLora(xa, plan["b_g"], plan["b_u"], float(fg["scaling"]),
                                        plan["a_d"], xa_down)
        self._kernel.mlp_block(h2, plan["wgu"], plan["wd"], out=acc, lora=lora)
        if lora is not None:  # down's B: rnd(rnd(acc) + s * rnd_B(xa_down) @ B^T), in fp32
            import torch
            round_to = None if h.dtype == torch.float32 else h.dtype
            self._expand.lora_expand(acc, xa_down, [plan["b_d"]], [self.hidden], [plan["r_d"]],
                                     float(fd["scaling"]), round_to=round_to)
        return acc.view(1, t, self.hidden)


def _runs_on(device: Any) -> bool:
    """Whether the kernel runs on ``device``: CUDA with triton, or the CPU under the
    interpreter."""
    import importlib.util
    if device is None or importlib.util.find_spec("triton") is None:
        return False
    import torch
    dev = torch.device(device)
    if dev.type == "cuda":
        return True
    from nbhelpers.engine.kernels.skinny_gemm import INTERPRETED
    return dev.type == "cpu" and INTERPRETED


def _plan(fg: Any, fd: Any, h: Any, hidden: int) -> dict[str, Any] | str:
    """The kernel's operands for these group buffers (``LiveGroup._buffers``) and ``h``:
    ``{"wgu", "wd", "r_d"}`` plus, with LoRA, ``"a_gu", "b_g", "b_u", "a_d", "b_d"`` (A's rows
    are the tail of the GEMM buffer in the ``ext`` layout: adapters of the base dtype and the
    ``lora_dtype="model"`` shadows), or ``None`` where it does not serve them (module
    docstring): then why, as a string."""
    import torch
    if fg is None or fd is None:
        return "LoRA on some of gate/up only, or mixed dtypes (per-part projections)"
    if fg["bias"] is not None or fd["bias"] is not None:
        return "an MLP bias"
    if fg["lora"] != fd["lora"]:
        return "LoRA on gate/up but not down, or the reverse"
    wgu, wd = fg["W"][:fg["n_out"]], fd["W"][:fd["n_out"]]  # ext: A's rows follow
    inter = wd.shape[1] if wd.dim() == 2 else 0
    if h.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{h.dtype} (no such tiles in the kernel)"  # fp64: 34's exact parity model
    if (tuple(wgu.shape) != (2 * inter, hidden) or tuple(wd.shape) != (hidden, inter)
            or not h.dtype == wgu.dtype == wd.dtype or wgu.stride(1) != 1 or wd.stride(1) != 1
            or wgu.device != h.device):
        return "a gate_up / down layout other than [2I, H] / [H, I] on the input's device"
    plan = {"wgu": wgu, "wd": wd, "r_d": 0}
    if not fg["lora"]:
        return plan
    from nbhelpers.engine.kernels.mlp_block import MAX_RANK
    a_gu = fg["W"][fg["n_out"]:] if fg["ext"] else fg["A"]
    a_d = fd["W"][fd["n_out"]:] if fd["ext"] else fd["A"]
    (b_g, b_u), (b_d,) = fg["B"], fd["B"]
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if not (a_gu.dtype == b_g.dtype == b_u.dtype in floats and a_d.dtype == b_d.dtype in floats
            and all(t.is_contiguous() and t.device == h.device
                    for t in (a_gu, b_g, b_u, a_d, b_d))):
        return "LoRA A/B of mixed dtypes or non-contiguous"
    r_g, r_u, r_d = b_g.shape[1], b_u.shape[1], a_d.shape[0]
    shapes_ok = (tuple(a_gu.shape) == (r_g + r_u, hidden) and b_g.shape[0] == inter
                 and b_u.shape[0] == inter and tuple(a_d.shape) == (r_d, inter)
                 and tuple(b_d.shape) == (hidden, r_d) and hidden % 16 == 0)
    if not shapes_ok or not all(0 < r <= MAX_RANK for r in (r_g, r_u, r_d)):
        return f"LoRA ranks {(r_g, r_u, r_d)} (1-{MAX_RANK} served)"
    plan.update(a_gu=a_gu, b_g=b_g, b_u=b_u, a_d=a_d, b_d=b_d, r_d=r_d)
    return plan
