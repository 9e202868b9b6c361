"""CUDA-graph capture of one decode step and its eager fallbacks (used by ``model_runner.py``).

Contract: :func:`capture_graph` warms a step up on a side stream and captures it (errors
propagate). :func:`capture_or_eager` turns a failure into a fallback, each with a warning: first
once more with the model's eager elementwise pieces (``model.fx_eager``) when the compiled ones
(``model.fx_decode``) were in use, then no graph at all, so the runner steps eagerly (same tokens,
slower). Every engine model has ``fx_eager``/``fx_decode`` (``layers.EngineModel``).
Pattern: torch's "whole-network capture" recipe (docs ``notes/cuda.html#cuda-graphs``: warm up on
a side stream, then ``torch.cuda.graph``), as vLLM's ``CUDAGraphRunner``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

WARMUP_STEPS = 3
"""Eager calls before capture: compile flex/inductor kernels, create cuBLAS handles."""


def capture_graph(step: Callable[[], None], reset: Callable[[], None], pool: Any = None) -> Any:
    """A ``torch.cuda.CUDAGraph`` of ``step()``: ``WARMUP_STEPS`` calls on a side stream (each
    followed by ``reset()``), then one captured call in memory pool ``pool`` (``None``: the
    graph's own; share ``graph.pool()`` between graphs). Raises whatever warm-up or capture raise.
    """
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(WARMUP_STEPS):
            step()
            reset()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
        step()
    return graph


def capture_or_eager(capture: Callable[[], Any], model: Any, rows: int) -> Any:
    """``capture()``; on an error, retried with ``model.fx_eager`` if the compiled pieces were
    on, else ``None`` (decode eagerly). ``rows``: the batch bucket, for the warning."""
    try:
        return capture()
    except Exception as err:  # noqa: BLE001 -- capture is an optimisation; eager = same tokens
        if model.fx_decode.compiled:  # retry once without the compiled pieces
            warnings.warn(f"flex engine: decode step with compiled norm/RoPE/SwiGLU failed "
                          f"({type(err).__name__}: {err}); using the eager pieces.", stacklevel=3)
            model.fx_decode = model.fx_eager
            return capture_or_eager(capture, model, rows)
        warnings.warn(f"flex engine: CUDA graph capture failed for batch bucket {rows} "
                      f"({type(err).__name__}: {err}); decoding eagerly.", stacklevel=3)
        return None
