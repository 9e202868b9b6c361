"""``SamplingParams`` -> the sampler's per-row parameter tensors (one function for every caller).

Contract: :func:`sampling_tensors` gives ``temperature, min_p, top_k, top_p`` as ``[B]`` tensors
in the order :func:`nbhelpers.engine.sampler.sample` and ``filtered_probs`` take them (fp32, top_k
int64); prefill samples from them, decode copies them into its static graph buffers and the
sampler reports (``bench/engine_report.py``) draw with them. :func:`uses_sort` says whether the
sampler needs its sorted path (top-k or top-p on).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class SamplingTensors(NamedTuple):
    """Per-row sampler parameters, each ``[B]`` (``top_k`` int64, the rest fp32)."""

    temperature: Any
    min_p: Any
    top_k: Any
    top_p: Any


def sampling_values(sampling: Any) -> tuple[float, float, int, float]:
    """``(temperature, min_p, top_k, top_p)`` of ``sampling`` as the sampler's row values
    (floats, and ``top_k`` an int)."""
    return (float(sampling.temperature), float(sampling.min_p), int(sampling.top_k),
            float(sampling.top_p))


def sampling_tensors(sampling: Any, num_rows: int, device: Any = None) -> SamplingTensors:
    """``sampling`` (a :class:`nbhelpers.config.SamplingParams`) repeated over ``num_rows`` rows."""
    import torch
    t, mp, k, p = sampling_values(sampling)

    def full(value: Any, dtype: Any = torch.float32) -> Any:
        return torch.full((num_rows,), value, dtype=dtype, device=device)
    return SamplingTensors(full(t), full(mp), full(k, torch.long), full(p))


def uses_sort(sampling: Any) -> bool:
    """True when top-k or top-p is on (the sampler's sorted path; otherwise min_p only)."""
    return 0 < sampling.top_k or sampling.top_p < 1.0
