"""Engine-side live LoRA: projections that read the HF / PEFT modules' own tensors at call time.

Contract: :class:`LiveLinear` wraps one ``nn.Linear`` or one PEFT ``lora.Linear``. It holds the
module, not its tensors, and reads ``base_layer.weight``, ``lora_A[adapter].weight`` ``[r, in]`` and
``lora_B[adapter].weight`` ``[out, r]`` on every call, so an in-place optimizer update is seen by
the next rollout with no merge and no copy. The arithmetic is PEFT's ``lora.Linear.forward``
(peft/tuners/lora/layer.py): ``y = base(x); y = y + lora_B(lora_A(x.to(A.dtype))) * scaling`` cast
back to the base output dtype. Dropout is off (inference). One adapter only.

:class:`LiveGroup` serves projections that read the same input (q/k/v, gate/up): base GEMMs stay
separate (the HF weights are used in place; a fused QKV weight would be a copy), and the A matrices
are concatenated *per call* (``r x in x 3`` elements, a tiny copy that never goes stale, also inside
a CUDA graph) so one GEMM computes all ``x @ A^T``.

:func:`storage_signature` lists the ``data_ptr`` of every tensor a captured graph reads; the runner
re-captures when it changes (an optimizer or ``load_state_dict`` that replaced storage).
"""

from __future__ import annotations

from typing import Any


def _adapter_of(module: Any) -> str | None:
    if not hasattr(module, "lora_A"):
        return None
    active = list(getattr(module, "active_adapters", []) or [])
    if len(active) != 1:
        raise ValueError(f"flex engine: LoRA module has active adapters {active}; exactly one "
                         "adapter is supported (set_adapter(name) first).")
    return active[0] if active[0] in module.lora_A else None


class LiveLinear:
    """``y = x @ W^T (+ bias) (+ scaling * (x @ A^T) @ B^T)`` on the module's live tensors.

    Shapes: ``x [..., in]`` -> ``[..., out]``.
    """

    def __init__(self, module: Any):
        self.module = module
        self.adapter = _adapter_of(module)
        self.base = module.base_layer if self.adapter is not None else module

    @property
    def has_lora(self) -> bool:
        m = self.module
        return (self.adapter is not None and not getattr(m, "merged", False)
                and not getattr(m, "disable_adapters", False))

    def lora_tensors(self) -> tuple[Any, Any, float]:
        m, a = self.module, self.adapter
        return m.lora_A[a].weight, m.lora_B[a].weight, float(m.scaling[a])

    def base_out(self, x: Any) -> Any:
        import torch.nn.functional as F
        return F.linear(x, self.base.weight, self.base.bias)

    def add_lora(self, y: Any, xa: Any) -> Any:
        """``y + B(xa) * scaling`` in PEFT's dtype order; ``xa = x @ A^T`` ``[..., r]``."""
        import torch.nn.functional as F
        _, b, scaling = self.lora_tensors()
        return (y + F.linear(xa, b) * scaling).to(y.dtype)

    def __call__(self, x: Any) -> Any:
        import torch.nn.functional as F
        y = self.base_out(x)
        if not self.has_lora:
            return y
        a, _, _ = self.lora_tensors()
        return self.add_lora(y, F.linear(x.to(a.dtype), a))

    def tensors(self) -> list[Any]:
        out = [self.base.weight] + ([self.base.bias] if self.base.bias is not None else [])
        return out + (list(self.lora_tensors()[:2]) if self.has_lora else [])


class LiveGroup:
    """Several :class:`LiveLinear` on one input; one GEMM for their concatenated LoRA A."""

    def __init__(self, modules: list[Any], fuse_lora_a: bool = True):
        self.parts = [LiveLinear(m) for m in modules]
        self.fuse_lora_a = fuse_lora_a

    def _fusable(self) -> bool:
        if not self.fuse_lora_a or not all(p.has_lora for p in self.parts):
            return False
        dtypes = {p.lora_tensors()[0].dtype for p in self.parts}
        return len(dtypes) == 1

    def __call__(self, x: Any) -> list[Any]:
        if not self._fusable():
            return [p(x) for p in self.parts]
        import torch
        import torch.nn.functional as F
        a_list = [p.lora_tensors()[0] for p in self.parts]
        xa = F.linear(x.to(a_list[0].dtype), torch.cat(a_list, 0))  # [..., sum(r)]
        pieces = xa.split([a.shape[0] for a in a_list], dim=-1)
        return [p.add_lora(p.base_out(x), xa_i) for p, xa_i in zip(self.parts, pieces)]

    def tensors(self) -> list[Any]:
        return [t for p in self.parts for t in p.tensors()]


def storage_signature(groups: list[Any]) -> tuple[int, ...]:
    """``data_ptr`` of every tensor the projections read (changes when storage is replaced)."""
    return tuple(t.data_ptr() for g in groups for t in g.tensors())
