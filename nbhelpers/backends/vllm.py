"""``vllm``: in-process vLLM ``LLM`` (TRL's colocate style) with ``enable_lora`` and a LoRARequest.

Contract (DESIGN.md "Backend contract"): ``load`` builds ``LLM`` on the registry model's folder
(``nbhelpers.models.model_folder(name, with_weights=False)`` + ``load_format="dummy"`` for random
weights), ``generate`` sends token-id prompts with one ``vllm.SamplingParams`` and the canonical
adapter as ``LoRARequest``, ``sleep``/``wake_up`` free and restore the GPU between rollouts (as
TRL's ``vllm_enable_sleep_mode``), ``close`` shuts the engine down.

Defaults reproduce the H200 run in DESIGN.md "The H200 machine": ``dtype=bfloat16,
max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=False, max_num_seqs=32,
max_lora_rank=32``, env ``VLLM_USE_FLASHINFER_SAMPLER=0`` (flashinfer's sampler would JIT with
nvcc: research/gpu_stack.md), ``VLLM_NO_USAGE_STATS=1``, ``HF_HUB_OFFLINE=1``.
Engine options: any ``vllm.LLM`` keyword (they override the defaults) plus ``adapter_path`` and
``logprobs`` (bool, default False).

Needs the ``vllm`` extra (``pip install -e '.[vllm]'``); without it ``load`` raises
``BackendNotInstalled``. The translation functions below are pure and tested on the CPU.
"""

from __future__ import annotations

import os
from typing import Any

from nbhelpers.backends import _common
from nbhelpers.backends.base import Completion
from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams, resolve_sampling
from nbhelpers.engine.llm_checks import check_generate_kwargs

VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
LLM_DEFAULTS: dict[str, Any] = {"dtype": "bfloat16", "max_model_len": 1024,
                                "gpu_memory_utilization": 0.5, "enforce_eager": False,
                                "max_num_seqs": 32, "seed": 0}


def vllm_sampling_kwargs(sampling: SamplingParams, logprobs: bool = False) -> dict[str, Any]:
    """``vllm.SamplingParams`` kwargs for ``sampling``: same meanings, ``max_tokens`` for
    ``max_new_tokens``, top_k disabled as 0 (vLLM prefers 0 and quietly accepts -1),
    ``logprobs=0`` asks for the sampled token's logprob only."""
    kw = {"n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p,
          "top_k": max(0, sampling.top_k), "min_p": sampling.min_p,
          "seed": sampling.seed, "max_tokens": sampling.max_new_tokens,
          "ignore_eos": sampling.ignore_eos, "stop_token_ids": list(sampling.stop_token_ids)}
    if logprobs:
        kw["logprobs"] = 0
    return kw


def llm_kwargs(folder: str, model: ModelSpec, lora: LoraSpec | None,
               options: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` kwargs: defaults < LoRA settings < ``options``; dummy weights for random
    models. Raises ``ValueError`` when ``max_lora_rank`` is below the adapter's rank."""
    kw = {**LLM_DEFAULTS, "model": folder, "dtype": model.dtype}
    if model.kind == "random":
        kw["load_format"] = "dummy"
    if lora is not None:
        kw.update(enable_lora=True, max_lora_rank=lora.rank, max_loras=1)
    kw.update({k: v for k, v in options.items() if k not in ("adapter_path", "logprobs")})
    if lora is not None and kw.get("max_lora_rank", 0) < lora.rank:
        raise ValueError(f"vllm max_lora_rank={kw['max_lora_rank']} < adapter rank {lora.rank}: "
                         "raise max_lora_rank or drop it from engine_options.")
    return kw


def completions_from_vllm(prompts: list[list[int]], outputs: list[Any]) -> list[Completion]:
    """Prompt-major Completions from vLLM ``RequestOutput``s (``output.outputs`` has n samples)."""
    done = []
    for prompt, req in zip(prompts, outputs, strict=True):
        for sample in req.outputs:
            lps = None
            if sample.logprobs is not None:
                lps = [float(d[t].logprob) for t, d in zip(sample.token_ids, sample.logprobs)]
            reason = "length" if sample.finish_reason == "length" else "stop"
            done.append(Completion(prompt_ids=list(prompt), token_ids=list(sample.token_ids),
                                   logprobs=lps, finish_reason=reason))
    return done


class VLLMBackend:
    """vLLM colocate-style engine (see the module docstring)."""

    name = "vllm"

    def __init__(self) -> None:
        self.llm: Any = None
        self.lora_request: Any = None
        self.info: dict[str, Any] = {}

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None:
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        vllm = _common.require("vllm", self.name, "vllm")
        from nbhelpers import adapters as lora_mod
        from nbhelpers import models

        folder = str(models.model_folder(model.name, with_weights=model.kind != "random"))
        kw = llm_kwargs(folder, model, lora, engine_options)
        self.logprobs = bool(engine_options.get("logprobs", False))
        self.llm = vllm.LLM(**kw)
        if lora is not None:
            from vllm.lora.request import LoRARequest

            path = engine_options.get("adapter_path") or lora_mod.canonical_adapter(model.name, lora)
            self.lora_request = LoRARequest("canonical", 1, str(path))
        self.info = {"vllm_args": {k: v for k, v in kw.items() if k != "model"}}

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None, *,
                 sampling_params: SamplingParams | None = None,
                 **unexpected: Any) -> list[Completion]:
        """vLLM's completions (``sampling_params=``, vLLM's own name, is an alias)."""
        check_generate_kwargs(unexpected, owner=self.name)  # vLLM names: TypeError naming the fix
        sampling = resolve_sampling(self.name, sampling, sampling_params)
        if self.llm is None:
            raise RuntimeError(f"{self.name}.generate before load(): call load(model, lora) first.")
        _common.validate_prompts(prompts)
        from vllm import SamplingParams as VSamplingParams

        params = VSamplingParams(**vllm_sampling_kwargs(sampling, self.logprobs))
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, params, lora_request=self.lora_request,
                                    use_tqdm=False)
        return completions_from_vllm(prompts, outputs)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1 also offloads weights to CPU; needs ``enable_sleep_mode``)."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
        _common.free_device_memory()
