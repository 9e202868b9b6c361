"""Test-session environment: headless matplotlib, no hub access, quiet tokenizers.

No fixtures or skips live here: GPU tests skip with their own ``pytest.mark.skipif``.
"""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    import torch  # imports no triton (transformers and peft do)
    return torch.cuda.is_available()


# CPU-only hosts run Triton kernels (engine/kernels/paged_decode.py) in Triton's interpreter. It must be on
# before anything imports triton (read when kernels are decorated and when they run), hence here.
# TRL's Triton log-prob kernel is kept out on CPU hosts by shims/trl_fused_logprob_cpu.py.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
