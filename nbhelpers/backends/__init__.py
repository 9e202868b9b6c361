"""Rollout-backend registry: ``get_backend(name) -> RolloutBackend``.

Contract: every backend lives in its own module (heavy imports inside it) and is found here by
module path, lazily, so ``import nbhelpers.backends`` costs nothing and a missing engine only fails
when that backend is asked for (``BackendNotInstalled`` names the pip extra).

Variants (``VARIANTS``) are registered names that map onto a backend plus default engine options,
so sidecars can tell them apart (``hf_cb`` vs ``hf_cb_nograph``).

Run: ``python -c "from nbhelpers.backends import BACKENDS; print(BACKENDS)"``.
"""

from __future__ import annotations

import importlib
from typing import Any

from nbhelpers.backends.base import BackendNotInstalled, Completion, RolloutBackend

_REGISTRY: dict[str, str] = {
    "hf_generate": "nbhelpers.backends.hf_generate:HFGenerateBackend",
    "hf_cb": "nbhelpers.backends.hf_cb:HFCBBackend",
    "cb_sync": "nbhelpers.backends.cb_sync:CBSyncBackend",
    "unsloth": "nbhelpers.backends.unsloth:UnslothBackend",
    "vllm": "nbhelpers.backends.vllm:VLLMBackend",
    "flex": "nbhelpers.backends.flex:FlexBackend",
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "hf_cb_nograph": ("hf_cb", {"use_cuda_graph": False}),
    "hf_cb_fa4": ("hf_cb", {"attn_implementation": "paged|flash_attention_4"}),
    # FA4 with CUDA graphs off: on Hopper, phase 1's workload W finishes this way and dies in
    # the sampler with graphs on (fa4_probe.py, H100, 2026-12-07)
    "hf_cb_fa4_nograph": ("hf_cb", {"attn_implementation": "paged|flash_attention_4",
                                    "use_cuda_graph": False}),
    "cb_sync_nograph": ("cb_sync", {"use_cuda_graph": False}),
}
BACKENDS: tuple[str, ...] = tuple(_REGISTRY) + tuple(VARIANTS)
"""Every name :func:`get_backend` accepts (engines, then variants)."""

__all__ = ["BACKENDS", "VARIANTS", "BackendNotInstalled", "Completion", "RolloutBackend",
           "get_backend", "resolve"]


def resolve(name: str) -> tuple[str, dict[str, Any]]:
    """``(engine name, default engine options)`` of a registered name or variant.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name in _REGISTRY:
        return name, {}
    if name in VARIANTS:
        base, opts = VARIANTS[name]
        return base, dict(opts)
    raise ValueError(f"unknown backend {name!r}: use one of {list(BACKENDS)}.")


def get_backend(name: str) -> RolloutBackend:
    """A fresh, unloaded backend instance; its ``name`` is ``name`` (variant names kept).

    Variant default options are in ``backend.default_options``; pass them to ``load`` (the
    benchmark worker does). Raises ``ValueError`` for unknown names and ``ImportError`` when the
    backend module itself is missing (e.g. ``flex`` before the engine lands).
    """
    engine, opts = resolve(name)
    module_name, cls_name = _REGISTRY[engine].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        raise ImportError(f"backend {name!r}: module {module_name} is not in this checkout "
                          "yet; pick another backend from nbhelpers.backends.BACKENDS.") from err
    backend = getattr(module, cls_name)()
    backend.name = name
    backend.default_options = opts
    return backend
