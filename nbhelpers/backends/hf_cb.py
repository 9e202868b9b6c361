"""``hf_cb``: transformers continuous batching (``model.generate_batch``) with a persistent manager.

Contract (DESIGN.md "Backend contract"): vanilla HF model (+ unmerged PEFT LoRA); every call goes
through ``generate_batch(..., persistent_manager=True)`` so the paged cache, the scheduler and the
captured CUDA graphs are built once and reused; ``close`` destroys the manager.

The ``ContinuousBatchingConfig`` is sized from the workload (:func:`cb_sizing`), never left at the
small defaults that choke decode (Unsloth PR #5108 README, "known integration notes" 2). The
backend sizes itself from the first ``generate`` call, or earlier through
:meth:`HFCBBackend.size_for_workload` (the harness calls it before the warm-up so a short warm-up
does not shrink the cache).

Engine options: ``attn_implementation`` (``paged|sdpa`` default; ``paged|flash_attention_4`` needs
the ``fa4`` extra), ``use_cuda_graph`` (default: True on CUDA, False on CPU; a bool, or a
``[varlen, decode]`` pair of bools for transformers' two CB paths, its own tuple form since
transformers PR #45323: prefill/mixed batches and decode-only batches), ``block_size`` (256),
``q_padding_interval_size`` (32), ``kv_padding_interval_size`` (2048), ``headroom`` (1.25),
``num_blocks`` / ``max_batch_tokens`` / ``max_requests_per_batch`` (override the sizing),
``allow_block_sharing`` (False), ``device``, ``adapter_path``, ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nbhelpers.backends import _common
from nbhelpers.backends.base import Completion
from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams, resolve_sampling
from nbhelpers.engine.llm_checks import check_generate_kwargs


def cuda_graph_setting(value: Any, name: str = "hf_cb") -> bool | tuple[bool, bool]:
    """``use_cuda_graph`` as transformers' ``ContinuousBatchingConfig`` takes it: a bool (both
    paths) or a ``(varlen, decode)`` pair (a list from a YAML/``-p`` value becomes a tuple).

    The pair exists for FlashAttention-4 on Hopper: phase 1's workload W with CUDA graphs on
    died in the sampler (NaN probabilities, then a device-side assert) while the same run with
    graphs off finished (``scripts/device/fa4_probe.py``, H100, 2026-12-07); graphs on one path
    only says which path's replay is wrong. Raises ``ValueError`` naming the accepted forms."""
    if isinstance(value, bool):
        return value
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, bool) for v in value)):
        return (value[0], value[1])
    raise ValueError(f"{name}: use_cuda_graph={value!r}: use true, false or a [varlen, decode] "
                     "pair of booleans, e.g. [false, true] for graphs on decode batches only.")


def check_cb_options(options: dict[str, Any], name: str = "hf_cb", *, cuda: bool,
                     extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Check continuous-batching engine options before any model loads; returns them with
    ``use_cuda_graph`` normalised (:func:`cuda_graph_setting`).

    ``cuda``: whether the model will be on a CUDA device; ``extra``: keys a driver adds to
    :data:`CB_OPTIONS` (``cb_sync``'s ``watchdog_s``). Used by :meth:`HFCBBackend.load` and by
    phase 1's pre-launch check (``nbhelpers.run.host_checks.check_cb_backend_options``: a bad
    option used to start a kernel and archive a failed run 15-20 s later, helper-16's trial).

    Raises:
        ValueError: an unknown key (with the closest known one), a bad ``use_cuda_graph``, CUDA
            graphs asked for off CUDA, or an unknown ``attn_implementation``.
        BackendNotInstalled: ``paged|flash_attention_4`` without the fa4 extra.
    """
    import difflib
    known = CB_OPTIONS | extra
    unknown = sorted(set(options) - known)
    if unknown:
        hints = [f"{k!r}: did you mean {c[0]!r}?" for k in unknown
                 if (c := difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.7))]
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise ValueError(f"{name}: unknown engine options {unknown}{hint}; use {sorted(known)}.")
    out = dict(options)
    if "attn_implementation" in out:
        check_attn(out["attn_implementation"])
    if "use_cuda_graph" in out:
        graphs = out["use_cuda_graph"] = cuda_graph_setting(out["use_cuda_graph"], name)
        if (any(graphs) if isinstance(graphs, tuple) else graphs) and not cuda:
            raise ValueError(f"{name}: use_cuda_graph={options['use_cuda_graph']!r} needs a CUDA "
                             "device (use_cuda_graph=True needs a CUDA device); pass "
                             "use_cuda_graph=False on the CPU.")
    return out


CB_OPTIONS = {"attn_implementation", "use_cuda_graph", "block_size", "q_padding_interval_size",
              "kv_padding_interval_size", "headroom", "num_blocks", "max_batch_tokens",
              "max_requests_per_batch", "allow_block_sharing", "device", "adapter_path", "seed"}
ATTN_CHOICES = ("paged|sdpa", "paged|eager", "paged|flash_attention_4")


@dataclass(frozen=True)
class CBSizing:
    """Cache and batch limits for one workload (the :func:`cb_sizing` result)."""

    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int


def cb_sizing(prompt_lens: list[int], max_new_tokens: int, *, block_size: int = 256,
              q_padding_interval_size: int = 32, headroom: float = 1.25) -> CBSizing:
    """Size the paged cache so the whole workload runs at once.

    - ``max_batch_tokens`` = sum of prompt tokens rounded up to ``q_padding_interval_size``: every
      prompt is prefilled in one step.
    - ``num_blocks`` = ceil(headroom * n_requests * ceil((max prompt + max_new_tokens) /
      block_size)): every request holds its worst-case blocks at once, plus headroom.
    - ``max_requests_per_batch`` = n_requests (decode all requests in one step).

    Workload W (32 prompts, lengths 132-169, sum 4835, 512 new tokens, block 256) gives
    num_blocks=120, max_batch_tokens=4864, max_requests_per_batch=32: the settings that produced the
    H200 numbers in DESIGN.md "The H200 machine" (research/measurements/gold_hf_h200_2026-11-30.json).

    Raises:
        ValueError: empty ``prompt_lens`` or non-positive sizes.
    """
    if not prompt_lens or min(prompt_lens) < 1 or max_new_tokens < 1 or block_size < 1:
        raise ValueError("cb_sizing needs >= 1 prompt of >= 1 token, max_new_tokens >= 1 and "
                         "block_size >= 1.")
    q_pad = max(1, q_padding_interval_size)
    blocks_per_request = math.ceil((max(prompt_lens) + max_new_tokens) / block_size)
    return CBSizing(num_blocks=math.ceil(headroom * len(prompt_lens) * blocks_per_request),
                    max_batch_tokens=q_pad * math.ceil(sum(prompt_lens) / q_pad),
                    max_requests_per_batch=len(prompt_lens))


def _fits(have: CBSizing, need: CBSizing) -> bool:
    return (have.num_blocks >= need.num_blocks and have.max_batch_tokens >= need.max_batch_tokens
            and have.max_requests_per_batch >= need.max_requests_per_batch)


def check_attn(attn: str) -> None:
    """Raise ``ValueError`` for an unknown paged attention, BackendNotInstalled without FA4."""
    if attn not in ATTN_CHOICES:
        raise ValueError(f"hf_cb attn_implementation={attn!r}: use one of {ATTN_CHOICES}.")
    if attn.endswith("flash_attention_4"):
        _common.require_fa4("hf_cb (paged|flash_attention_4)")


class HFCBBackend:
    """transformers continuous batching with a persistent ``ContinuousBatchingManager``."""

    name = "hf_cb"

    def __init__(self) -> None:
        self.model: Any = None
        self.sizing: CBSizing | None = None
        self.info: dict[str, Any] = {}
        self.cache_zero_fill: bool | None = None
        self._cached_key: Any = None

    def load(self, model: ModelSpec, lora: LoraSpec | None, **engine_options: Any) -> None:
        _common.require("transformers.generation.continuous_batching", self.name, "cpu")
        opts = {"attn_implementation": "paged|sdpa", "block_size": 256, "headroom": 1.25,
                "q_padding_interval_size": 32, "kv_padding_interval_size": 2048,
                "allow_block_sharing": False, **engine_options}
        device = opts.get("device") or _common.default_device()  # where load_hf puts it
        opts = check_cb_options(opts, self.name, cuda=device.startswith("cuda"))  # before loading
        from nbhelpers.shims import transformers_cb_cache_zero

        self.cache_zero_fill = transformers_cb_cache_zero.apply()  # NaN-free warm-up
        self.model, self.tokenizer, self.adapter_path = _common.load_hf(
            model, lora, device=opts.get("device"), attn_implementation=opts["attn_implementation"],
            adapter_path=opts.get("adapter_path"), seed=opts.get("seed", 0))
        is_cuda = next(self.model.parameters()).device.type == "cuda"
        opts.setdefault("use_cuda_graph", is_cuda)  # a given value was checked before loading
        self.options = opts
        self.info = self._common_info()
        self.eos = _common.eos_ids(self.model, self.tokenizer)
        self.pad_id = _common.pad_id_of(self.tokenizer, self.eos)

    def size_for_workload(self, prompts: list[list[int]], sampling: SamplingParams) -> CBSizing:
        """Fix the cache size for ``prompts`` x ``sampling.n`` (call before the warm-up)."""
        o = self.options
        need = cb_sizing([len(p) for p in prompts for _ in range(sampling.n)],
                         sampling.max_new_tokens, block_size=o["block_size"],
                         q_padding_interval_size=o["q_padding_interval_size"],
                         headroom=o["headroom"])
        if self.sizing is None or not _fits(self.sizing, need):
            self.sizing = CBSizing(o.get("num_blocks", need.num_blocks),
                                   o.get("max_batch_tokens", need.max_batch_tokens),
                                   o.get("max_requests_per_batch", need.max_requests_per_batch))
        return self.sizing

    def cb_config(self, sampling: SamplingParams) -> Any:
        """The ``ContinuousBatchingConfig`` for the current sizing (seed = ``sampling.seed``)."""
        from transformers import ContinuousBatchingConfig

        o, s = self.options, self.sizing
        return ContinuousBatchingConfig(
            block_size=o["block_size"], num_blocks=s.num_blocks, max_batch_tokens=s.max_batch_tokens,
            max_requests_per_batch=s.max_requests_per_batch,
            allow_block_sharing=o["allow_block_sharing"],
            q_padding_interval_size=o["q_padding_interval_size"],
            kv_padding_interval_size=o["kv_padding_interval_size"],
            use_cuda_graph=o["use_cuda_graph"], seed=sampling.seed or 0)

    def _manager_key(self, prompts: list[list[int]], sampling: SamplingParams) -> tuple:
        """What a cached manager depends on (its logits processors and cache are fixed at
        creation): the sampling settings and the workload sizing (recomputed here)."""
        self.size_for_workload(prompts, sampling)
        return (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p,
                sampling.ignore_eos, sampling.stop_token_ids, self.sizing)

    def _ensure_manager(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        """Drop the cached manager when sampling or sizing changed."""
        key = self._manager_key(prompts, sampling)
        if key != self._cached_key:
            self.model.destroy_cached_continuous_batching_manager()
            self._cached_key = key

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None, *,
                 sampling_params: SamplingParams | None = None,
                 **unexpected: Any) -> list[Completion]:
        """Continuous-batching completions (``sampling_params=``: vLLM's name, an alias)."""
        import torch

        check_generate_kwargs(unexpected, owner=self.name)  # vLLM names: TypeError naming the fix
        sampling = resolve_sampling(self.name, sampling, sampling_params)
        if self.model is None:
            raise RuntimeError(f"{self.name}.generate before load(): call load(model, lora) first.")
        _common.validate_prompts(prompts)
        self._ensure_manager(prompts, sampling)
        rows = _common.expand_prompts(prompts, sampling.n)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        return completions_from_cb(rows, self._run_rows(rows, sampling), sampling, self.eos)

    def _run_rows(self, rows: list[list[int]], sampling: SamplingParams) -> list[Any]:
        """``GenerationOutput`` per row, through transformers' own ``generate_batch``."""
        gen_cfg = _common.generation_config(sampling, self.eos, self.pad_id)
        out = self.model.generate_batch(rows, generation_config=gen_cfg,
                                        continuous_batching_config=self.cb_config(sampling),
                                        persistent_manager=True, progress_bar=False)
        self._record_info()
        return list(out.values())

    def _common_info(self) -> dict[str, Any]:
        """Engine info every CB driver records: attention, CUDA graphs, sizing, the cache shim."""
        return {"attn": self.options["attn_implementation"],
                "use_cuda_graph": (list(self.options["use_cuda_graph"])
                                   if isinstance(self.options["use_cuda_graph"], tuple)
                                   else self.options["use_cuda_graph"]),
                "sizing": vars(self.sizing) if self.sizing else None,
                "cb_cache_zero_fill": self.cache_zero_fill}

    def _record_info(self) -> None:
        mgr = getattr(self.model, "_cached_continuous_batching_manager", None)
        cfg = getattr(mgr, "continuous_batching_config", None)
        self.info = {**self._common_info(),
                     "cb_resolved": None if cfg is None else {
                         k: getattr(cfg, k, None) for k in
                         ("num_blocks", "max_batch_tokens", "max_requests_per_batch",
                          "use_async_batching", "max_blocks_per_request")}}

    def close(self) -> None:
        if self.model is not None:
            self.model.destroy_cached_continuous_batching_manager()
        self.model = None
        _common.free_device_memory()


def completions_from_cb(rows: list[list[int]], outputs: list[Any], sampling: SamplingParams,
                        eos: list[int]) -> list[Completion]:
    """Completions from ``GenerationOutput``s (ordered like ``rows``).

    Raises:
        RuntimeError: a request is missing or failed (the engine's error text is included).
    """
    if len(outputs) != len(rows):
        raise RuntimeError(f"continuous batching returned {len(outputs)} of {len(rows)} requests; "
                           "see the ContinuousBatchingLogger errors above.")
    done = []
    for prompt, res in zip(rows, outputs):
        if getattr(res, "error", None):
            raise RuntimeError(f"request {res.request_id} failed: {res.error}")
        done.append(_common.trim_completion(prompt, list(res.generated_tokens), sampling, eos))
    return done
