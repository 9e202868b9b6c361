"""The flex engine's Triton kernels, one file each, each citing the public kernel it follows.

``paged_decode`` (split-KV GQA paged decode attention), ``lora_shrink`` (LoRA A, one launch per
projection group), ``lora_expand`` (LoRA B, one launch per group), ``lora_prologue`` (LoRA B
inside the consumer kernels of ``fused_norm`` / ``qk_rope_cache``, ``lora_expand="consumer"``),
``lora_act_mul`` (gate_up's LoRA B + SiLU x up, the consumer mode's MLP kernel).
Each module imports triton at import time, so import them only where a kernel runs; each exposes
``supported(...)`` telling whether it can run on the given tensors (CUDA, or Triton's interpreter
on the CPU).
"""
