"""The gated MLP's activation as a Triton device function, shared by :mod:`.fused_norm`'s
``act x up`` kernel and :mod:`.lora_act_mul` (its own module so neither imports the other).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def act_fn(g, ACT: tl.constexpr):
    """SiLU (``ACT`` 0) or GELU-tanh (1) of fp32 ``g``: gelu tanh 0.5 g (1 + tanh(z)) =
    g * sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3) (HF ``gelu_pytorch_tanh``)."""
    if ACT == 0:
        return g * tl.sigmoid(g)
    return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
