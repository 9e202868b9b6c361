"""``flex``: the lab's own rollout engine (:mod:`nbhelpers.engine`) behind the backend contract.

Contract (DESIGN.md "Backend contract"): ``load`` builds the HF model (+ unmerged PEFT adapter, as
the trainer holds it) exactly like ``hf_generate`` and wraps it in :class:`nbhelpers.engine.LLM`,
which runs on the model's own parameters (no copy, LoRA live). ``generate`` returns the tokens and
sampled-token logprobs the engine produced; ``close`` frees the KV pool, the graphs and the model.

Engine options (``load(**engine_options)``): ``device``, ``adapter_path``, ``seed`` (random-init
weights), ``kv_tokens`` (KV pool size in tokens, default 32 * 1024), and the
:class:`~nbhelpers.engine.model_runner.RunnerOptions` / ``LLM`` fields ``page_size`` (default 128
on CUDA, 16 on CPU), ``max_model_len`` (1024, or the model's context when shorter; above the
context only with ``allow_long_max_model_len=True``), ``sync_every``, ``use_cuda_graphs``,
``compile_attention``, ``fuse_lora_a``, ``max_num_seqs``, ``max_prefill_tokens``, ``share_prefix``,
``decode_attention`` (``"flex"`` | ``"triton"``), ``decode_kernel_options``,
``lora_expand`` (``"addmm"`` | ``"triton"``), ``adapter_dtype``: ``"peft"`` (default: the adapter
as ``PeftModel.from_pretrained`` loads it, fp32 on a bf16 base, as TRL trains it) or ``"model"``
(LoRA A/B cast once at load to the base dtype, as vLLM holds adapters; A then joins the base GEMM).
Why it matters: at GRPO's batch 4 on the H200 a Qwen3-4B decode step took 5.89 ms with fp32
adapters (LoRA-shrink kernel) and 4.33 ms with bf16 ones
(``executed/phase2_grpo/bench/diag_grpo_rollout*/``).
"""

from __future__ import annotations

import difflib
from typing import Any

from nbhelpers.backends import _common
from nbhelpers.backends.base import Completion
from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams, resolve_sampling
from nbhelpers.engine.llm_checks import check_generate_kwargs
from nbhelpers.engine.runner_options import option_names

_LOAD_OPTIONS = {"device", "adapter_path", "seed", "kv_tokens", "adapter_dtype"}
ADAPTER_DTYPES = ("peft", "model")
_LLM_OPTIONS = (option_names() - {"num_pages"}  # build_llm sizes the pool from kv_tokens
                | {"max_num_seqs", "max_prefill_tokens", "share_prefix",
                   "allow_long_max_model_len"})


class FlexBackend:
    """The flex engine. Raises ``RuntimeError`` when used before ``load``."""

    name = "flex"

    def __init__(self) -> None:
        self.model: Any = None
        self.llm: Any = None
        self.info: dict[str, Any] = {}
        self.tokenizer: Any = None
        self.adapter_path: str | None = None

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None:
        _common.require("torch", self.name, "cpu")
        _preflight(model, engine_options)  # bad names and values fail before the weights load
        adapter_dtype = engine_options.get("adapter_dtype", "peft")
        self.model, self.tokenizer, self.adapter_path = _common.load_hf(
            model, lora, device=engine_options.get("device"),
            adapter_path=engine_options.get("adapter_path"), seed=engine_options.get("seed", 0))
        if adapter_dtype == "model":
            cast_adapters_to_base_dtype(self.model)
        self.llm = build_llm(self.model, _common.eos_ids(self.model, self.tokenizer),
                             **{k: v for k, v in engine_options.items() if k not in
                                _LOAD_OPTIONS - {"kv_tokens"}})
        runner = self.llm.runner
        self.info = {"adapter_dtype": adapter_dtype,
                     "decode_attention": runner.decode_attention,  # "auto" resolved
                     "lora_expand": runner.lora_expand, "page_size": self.llm.opt.page_size,
                     "num_pages": self.llm.opt.num_pages}

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None, *,
                 sampling_params: SamplingParams | None = None,
                 **unexpected: Any) -> list[Completion]:
        """The engine's completions (``sampling_params=``: vLLM's name, an alias)."""
        check_generate_kwargs(unexpected, owner=self.name)  # vLLM names: TypeError naming the fix
        sampling = resolve_sampling(self.name, sampling, sampling_params)
        if self.llm is None:
            raise RuntimeError(f"{self.name}.generate before load(): call load(model, lora) first.")
        _common.validate_prompts(prompts)
        return self.llm.generate(prompts, sampling)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.sleep()
        self.llm, self.model = None, None
        _common.free_device_memory()


def check_engine_options(options: dict[str, Any], name: str = "flex") -> None:
    """The option checks of ``load`` that need neither the model nor its config: every name
    known (``ValueError`` naming the valid ones), ``adapter_dtype`` one of
    :data:`ADAPTER_DTYPES` and every :class:`RunnerOptions` value (its ``ValueError`` /
    ``TypeError``; ``ImportError`` for a kernel whose package is missing). The runner calls it
    for phase 1's ``engine_options["flex"]`` before the notebook starts
    (:mod:`nbhelpers.run.host_checks`)."""
    from nbhelpers.engine.runner_options import RunnerOptions
    unknown = set(options) - _LOAD_OPTIONS - _LLM_OPTIONS
    if unknown:
        close = {u: difflib.get_close_matches(u, _LOAD_OPTIONS | _LLM_OPTIONS, n=1)
                 for u in sorted(unknown)}
        hint = "".join(f" ({u!r}: did you mean {c[0]!r}?)" for u, c in close.items() if c)
        raise ValueError(f"{name}: unknown engine options {sorted(unknown)}{hint}; use "
                         f"{sorted(_LOAD_OPTIONS | _LLM_OPTIONS)}.")
    adapter_dtype = options.get("adapter_dtype", "peft")
    if adapter_dtype not in ADAPTER_DTYPES:
        raise ValueError(f"{name}: adapter_dtype={adapter_dtype!r}: use one of "
                         f"{ADAPTER_DTYPES}.")
    fields = option_names() - {"num_pages"}
    RunnerOptions(**{k: v for k, v in options.items() if k in fields})


def _preflight(model: ModelSpec, options: dict[str, Any]) -> None:
    """Check the engine options before ``load_hf`` reads the weights (a 4B model is ~8 GB):
    :func:`check_engine_options` (names and values, each error naming the fix), then an explicit
    ``max_model_len`` against the model's context from its config alone
    (:func:`llm_checks.fit_max_model_len`, vLLM's rule). ``LLM`` checks them again, on the model."""
    from nbhelpers.engine.llm_checks import fit_max_model_len
    check_engine_options(options)
    if "max_model_len" in options:
        from nbhelpers import models
        fit_max_model_len(models.build_config(model.name),
                          {"max_model_len": options["max_model_len"]},
                          options.get("allow_long_max_model_len", False))


def cast_adapters_to_base_dtype(model: Any) -> int:
    """Cast every LoRA A/B parameter of ``model`` to its base layer's weight dtype, in place
    (``param.data``: same Parameter objects). Returns how many were cast."""
    import torch
    n = 0
    with torch.no_grad():
        for module in model.modules():
            base = getattr(module, "base_layer", None)
            if base is None or not hasattr(module, "lora_A"):
                continue
            for sub in (*module.lora_A.values(), *module.lora_B.values()):
                for p in sub.parameters():
                    if p.dtype != base.weight.dtype:
                        p.data = p.data.to(base.weight.dtype)
                        n += 1
    return n


def build_llm(model: Any, eos: list[int], kv_tokens: int = 32 * 1024, **options: Any) -> Any:
    """An :class:`nbhelpers.engine.LLM` over ``model`` with a pool of ``kv_tokens`` slots.

    Defaults: page 128 tokens on CUDA (one flex KV block per page), 16 on the CPU;
    ``max_model_len`` 1024, or the model's context when shorter (``max_position_embeddings``;
    a larger explicit value needs ``allow_long_max_model_len=True``).
    """
    from nbhelpers.engine import LLM
    from nbhelpers.engine.llm_checks import model_context_len
    on_cuda = next(iter(model.parameters())).is_cuda
    page_size = options.pop("page_size", 128 if on_cuda else 16)
    options.setdefault("max_model_len", min(1024, model_context_len(model.config) or 1024))
    num_pages = -(-kv_tokens // page_size) + 1
    return LLM(model, eos_token_id=eos, page_size=page_size, num_pages=num_pages, **options)
