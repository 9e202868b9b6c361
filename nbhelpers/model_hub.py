"""Hugging Face hub access for hub-id models: reachability, cache-only loading, folders, errors.

Contract: :func:`hub_kwargs` gives ``from_pretrained`` kwargs for a :class:`ModelSpec` of kind
``hub`` (``local_files_only`` when huggingface.co is unreachable but the files are cached) or
raises :class:`ModelAssetsMissing` at once; :func:`hub_folder` downloads (or finds) its folder;
:func:`hub_error` is the message for a failed ``from_pretrained``. ``known`` is the registry's
names (``nbhelpers.models.list_models()``), listed as the alternative. Used by
:mod:`nbhelpers.models`; nothing heavy at import.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from nbhelpers.assets import ModelAssetsMissing
from nbhelpers.config import ModelSpec


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """True when a TCP connection to huggingface.co:443 opens within ``timeout_s`` seconds."""
    import socket
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def hub_kwargs(spec: ModelSpec, known: list[str]) -> dict[str, Any]:
    """``from_pretrained`` kwargs for a hub id: ``local_files_only`` when the hub is unreachable
    but the files are cached (no retries against the network); ``{}`` online, offline
    (``HF_HUB_OFFLINE``) or for a local folder.

    Raises:
        ModelAssetsMissing: a hub id that is not cached while huggingface.co is unreachable
            (answers in seconds, not after transformers' ~30 s of retries).
    """
    if spec.kind != "hub" or Path(spec.name).expanduser().is_dir():
        return {}
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or hub_reachable():
        return {}
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(spec.name, "config.json"), str):
        return {"local_files_only": True}
    raise ModelAssetsMissing(f"{spec.name!r} is not in the local Hugging Face cache and "
                             "huggingface.co is unreachable from here: download it where there "
                             f"is access (`huggingface-cli download {spec.name}`) and copy the "
                             "cache, pass a local folder, or use a registry model "
                             f"({known}).")


def hub_error(spec: ModelSpec, err: Exception, known: list[str]) -> str:
    return (f"Could not load {spec.name!r} with from_pretrained ({type(err).__name__}: {err}). "
            f"This machine may have no Hugging Face hub access: use a registry model "
            f"({known}) or a local folder with config.json + tokenizer files.")


def hub_folder(spec: ModelSpec, with_weights: bool, known: list[str]) -> Path:
    if Path(spec.name).expanduser().is_dir():
        return Path(spec.name).expanduser()
    from huggingface_hub import snapshot_download

    patterns = None if with_weights else ["*.json", "*.jinja", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(spec.name, allow_patterns=patterns))
    except Exception as err:  # hub errors come in many types; all mean "no folder"
        raise RuntimeError(hub_error(spec, err, known)) from err
