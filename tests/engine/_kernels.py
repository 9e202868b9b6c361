"""Shared by the Triton-kernel tests (``test_lora_expand``, ``test_lora_shrink``): the device, the
module-level skip, a tiny PEFT model and the sm_90 AOT build check. On CPU hosts
``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _tiny import tiny_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def skip_unless_runnable(kernel_module: Any) -> None:
    """Module-level skip when the kernels can run neither compiled (CUDA) nor interpreted."""
    if not (kernel_module.INTERPRETED or torch.cuda.is_available()):
        pytest.skip("triton imported without TRITON_INTERPRET=1 and no CUDA device",
                    allow_module_level=True)


def peft_tiny(dtype: Any, autocast_adapter_dtype: bool = True) -> Any:
    """Tiny Qwen3 in ``dtype`` with PEFT LoRA r=4 on every projection, random A and B; adapters
    fp32 with PEFT's default ``autocast_adapter_dtype=True``, else in ``dtype``."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    model = tiny_model("qwen3").to(dtype=dtype, device=DEV)
    return get_peft_model(model, cfg, autocast_adapter_dtype=autocast_adapter_dtype).eval()


def inplace_lora_step(model: Any) -> None:
    """What an optimizer step does to the adapters, for live-update tests: every LoRA A and B
    changed in place (same storage, version counters bumped), A by x(-4) and B by +0.05."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(-4.0)
            if "lora_B" in name:
                p.add_(0.05)


def assert_compiles_for_sm90(aot_source: str) -> None:
    """Run ``aot_source`` (builds kernels with ``triton.compile(..., GPUTarget("cuda", 90, 32))``
    and prints ``compiled``) in a compiled-mode subprocess: no GPU needed, triton's bundled ptxas.
    Skips when no usable ptxas is found."""
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", aot_source], env=env, capture_output=True,
                          text=True, check=False, timeout=1200)  # bounds a hang, not a busy host
    if proc.returncode and "ptxas" in proc.stderr:
        pytest.skip(f"no usable ptxas: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def fp32_interpreter_dots(monkeypatch: Any) -> None:
    """Triton's CPU interpreter stores bf16 as uint16 and its ``create_dot`` multiplies those bit
    patterns (triton-lang/triton#11584, "not supported yet"); cast bf16 dot operands to fp32
    (exact) there, so the kernel code under test is the GPU's unchanged. Call it from an
    autouse fixture on CPU hosts only."""
    import triton.language as tl
    from triton.runtime import interpreter
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, *args):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
                for x in (a, b))
        return original(self, a, b, *args)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def decode_step_launches(llm: Any, min_rows: int = 4) -> Any:
    """``Counter`` of Triton kernel names launched by one eager decode step
    (``bench.profile._count_step``) of ``llm``'s first batch bucket of at least ``min_rows``
    rows, counted through the interpreter (``TRITON_INTERPRET=1``); call after a ``generate``
    that built the bucket."""
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    from nbhelpers.bench import profile
    st = next(s for (b, _), s in sorted(llm.runner.states.items()) if b >= min_rows)
    count: Counter = Counter()
    real = InterpretedFunction.run

    def run(self, *a, **k):
        count[self.fn.__name__] += 1
        return real(self, *a, **k)
    InterpretedFunction.run = run
    try:
        profile._count_step(llm.runner, st)
    finally:
        InterpretedFunction.run = real
    return count
