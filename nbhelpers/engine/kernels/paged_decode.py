"""Paged split-KV ("flash-decoding") decode attention in Triton, GQA-grouped.

What: one query token per row (``q: [B, H, D]``, any strides with unit last stride) against the
engine's paged KV pool (``k_cache, v_cache: [1, H_kv, num_slots, D]``, slot = ``page * page_size +
offset``, see ``kv_cache.py``) through ``block_table [B, max_pages]``; row ``b`` sees logical
positions ``[max(0, L_b - sliding_window), L_b)`` with ``L_b = seq_lens[b] = pos_b + 1``.
Output ``[B, H, D]`` in q's dtype. Logits are ``scale * q.k`` then, when ``soft_cap`` is set,
``soft_cap * tanh(logits / soft_cap)`` (Gemma-2 logit soft-cap, flex's ``score_mod`` order).

How: stage 1 runs one program per ``(row, kv head, split)``; the program holds all ``H / H_kv``
query heads of its KV head as the rows of one ``tl.dot`` tile (padded to ``BLOCK_H >= 16``), walks
its share of the row's ``BLOCK_N``-token tiles with the online softmax, and writes the normalised
partial output ``[B, H, S, D]`` and its log-sum-exp ``[B, H, S]`` (fp32). Stage 2 merges the ``S``
splits per ``(row, head)``: ``out = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m)``. This is the
design of vLLM's ``vllm/attention/ops/triton_decode_attention.py`` (``_fwd_grouped_kernel_stage1``,
``_fwd_kernel_stage2``; after SGLang and LightLLM, Apache-2.0), rewritten for this pool layout
(head-major ``[H_kv, slots, D]``), per-row windows and tile-aligned splits.

Two split policies over the same stage-1 program (``kernel=``): ``"v1"`` spreads each row's tiles
evenly over ``num_splits`` (:func:`choose_num_splits`, from ``max_model_len``) and always runs
stage 2; ``"v2"`` sizes the grid to the SMs (:func:`plan_num_splits`: ``B * H_kv * S >= 2 x
SMs``), gives every split of a row at least ``min_split_tokens`` (short rows use fewer splits, as
SGLang's ``python/sglang/srt/layers/attention/triton_ops/decode_attention.py`` with per-request
``num_kv_splits`` and ``MIN_BLOCK_KV``) and, at ``S == 1``, writes the output from stage 1 (no
stage 2, no workspace). ``"fused"`` (opt-in, :mod:`.paged_decode_fused`): one launch at any
split count, the splits merged in-kernel by the last program of each (row, kv head), splits from
:func:`plan_num_splits_fused` (one wave of resident programs). Default :data:`DEFAULT_KERNEL` =
"auto": v1 for small batch buckets, v2 from :data:`V2_MIN_BATCH` rows (:func:`pick_kernel`; the
H200 numbers are in its docstring). Head dims up to 512 (Gemma-4 full layers):
``BLOCK_D`` = next power of two, ``BLOCK_N`` from :func:`default_block_n`.

CUDA graphs: no host sync; shapes (hence grid and workspace) depend only on ``B``, ``H``, ``D`` and
``num_splits`` (static per batch bucket); :class:`PagedDecode` keeps one workspace per
``(B, num_splits)`` shared by all layers (they run in order on one stream).

Modules: this one holds the engine-facing :class:`PagedDecode` and :func:`build_paged_decode` and
re-exports the rest; the Triton programs and the launcher :func:`paged_decode_attention` are in
:mod:`.paged_decode_kernel`, the split planning in :mod:`.paged_decode_plan`.

Run: ``TRITON_INTERPRET=1 pytest tests/engine/test_paged_decode.py`` (CPU interpreter).
Requires ``triton`` (imported at module import: the engine imports this file only when
``RunnerOptions.decode_attention == "triton"``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from nbhelpers.engine.kernels import paged_decode_kernel as _split
from nbhelpers.engine.kernels.paged_decode_fused import new_counters, paged_decode_fused
from nbhelpers.engine.kernels.paged_decode_kernel import (  # noqa: F401 (re-exported)
    _paged_attention_stage1,
    _paged_attention_stage2,
    new_workspace,
)
from nbhelpers.engine.kernels.paged_decode_plan import (  # noqa: F401 (re-exported)
    DEFAULT_KERNEL,
    KERNEL_OPTIONS,
    KERNELS,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    MIN_SPLIT_TOKENS_V2,
    PROGRAMS_PER_SM,
    RESIDENT_PROGRAMS,
    TARGET_WAVES,
    V2_MIN_BATCH,
    check_shared_prefix,
    choose_num_splits,
    default_block_n,
    pick_kernel,
    plan_num_splits,
    plan_num_splits_fused,
    plan_prefix_groups,
    resident_programs,
)
from nbhelpers.engine.kernels.paged_decode_prefix import (
    GROUP_MAX,
    PrefixGroups,
    clear_groups,
    load_groups,
    new_prefix_groups,
    paged_decode_prefix,
)


def paged_decode_attention(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any,
                           scale: float, page_size: int, num_splits: int,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           workspace: tuple[Any, Any] | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int = 2, kernel: str = "v1",
                           min_split_tokens: int | None = None, counters: Any = None,
                           groups: PrefixGroups | None = None) -> Any:
    """Decode attention of ``q [B, H, D]`` over the paged pool; returns ``[B, H, D]``. Arguments,
    shapes and errors as :func:`.paged_decode_kernel.paged_decode_attention` (kernels ``"v1"``,
    ``"v2"``); ``kernel="fused"`` launches :func:`.paged_decode_fused.paged_decode_fused` (one
    launch, the splits merged in-kernel; ``counters``: its ``int32 [B * H_kv]`` zeros,
    :func:`new_counters`, ``None`` = allocate here). ``groups`` (kernels "v1", "v2", no
    window): each group's shared prompt pages are attended once for all its rows by
    :func:`.paged_decode_prefix.paged_decode_prefix` first, the rest per row (ValueError with
    "fused" or a ``sliding_window``). Here, not in the kernel module, because the fused and
    prefix launchers import that module's helpers (import-linter's acyclic contract)."""
    if groups is not None and kernel == "fused":
        raise ValueError("paged decode: shared-prefix groups need kernel 'v1' or 'v2' (or "
                         "'auto'), not 'fused'; drop decode_kernel_options['shared_prefix'] or "
                         "the 'fused' kernel.")
    if kernel != "fused":
        prefix = None
        if groups is not None:
            if sliding_window:
                raise ValueError("paged decode: shared-prefix groups with a sliding window; "
                                 "pass groups=None for windowed layers.")
            paged_decode_prefix(q, k_cache, v_cache, block_table, groups, scale, page_size,
                                soft_cap, block_n, num_warps, num_stages)
            prefix = (groups.row_prefix, groups.pre_o, groups.pre_lse)
        return _split.paged_decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, scale, page_size, num_splits,
            sliding_window, soft_cap, workspace, block_n, num_warps, num_stages, kernel,
            min_split_tokens, prefix)
    block_n = block_n or default_block_n(q.shape[2])
    _split._check(q, k_cache, v_cache, q.shape[1], k_cache.shape[1], block_n, kernel)
    return paged_decode_fused(q, k_cache, v_cache, block_table, seq_lens, scale, page_size,
                              num_splits, sliding_window, soft_cap, workspace, counters, block_n,
                              num_warps, num_stages, min_split_tokens or block_n)


def build_paged_decode(model: Any, options: Any) -> PagedDecode | None:
    """:class:`PagedDecode` for an engine model and ``RunnerOptions``, or ``None`` (with a warning)
    when the model keeps its own attention (``model.decode_kernels`` lacks ``"triton"``).

    Raises:
        ValueError: see :class:`PagedDecode`; CPU tensors without ``TRITON_INTERPRET=1`` set
            before this module was imported (Triton reads it when the kernels are decorated).
    """
    if "triton" not in model.decode_kernels:
        warnings.warn(f"decode_attention='triton': {type(model).__name__} keeps flex_attention "
                      "for decode.", stacklevel=3)
        return None
    if model.device.type == "cpu" and type(_paged_attention_stage1).__name__ != "InterpretedFunction":
        raise ValueError("decode_attention='triton' on the CPU runs in Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before importing nbhelpers.engine.kernels.paged_decode.")
    kv_heads = getattr(model, "num_kv_heads", None) or model.config.num_key_value_heads
    return PagedDecode(model.spec, len(model.layers), kv_heads, options.page_size,
                       options.max_model_len, model.device, options.decode_kernel_options)


class PagedDecode:
    """The engine's decode attention when ``RunnerOptions.decode_attention == "triton"``.

    Reads each layer's sliding window and the soft-cap from the :class:`ArchSpec` (the factories
    of ``attention.py`` tag their closures with ``window`` / ``cap``), picks ``num_splits`` per
    batch bucket and layer shape (kernel "v1": :func:`choose_num_splits`; "v2":
    :func:`plan_num_splits`; "fused": :func:`plan_num_splits_fused`; or
    ``options["num_splits"]``) and keeps one workspace per ``(B, H, S, D)`` (and, for "fused",
    one ticket counter buffer per ``(B, H_kv)``). ``options``
    (``RunnerOptions.decode_kernel_options``): ``kernel`` (default :data:`DEFAULT_KERNEL`),
    ``num_splits``, ``BLOCK_N``, ``num_warps``, ``num_stages``,
    ``programs_per_sm`` (v1; "fused": default :func:`resident_programs` of the head dim),
    ``waves`` (v2), ``min_split_tokens`` (v2, "fused") and ``shared_prefix`` (bool, default
    off; not with "fused"): the samples of one prompt read its shared pages once
    (:mod:`.paged_decode_prefix`; the runner loads each window's groups with
    :meth:`load_groups`; windowed layers keep the per-row path).

    Raises:
        ValueError: an unknown option or kernel, or a layer mask / score_mod the kernel cannot
            express (anything but ``sliding_window`` and ``soft_cap``).
    """

    def __init__(self, spec: Any, num_layers: int, num_kv_heads: int, page_size: int,
                 max_model_len: int, device: Any, options: dict | None = None):
        opts = dict(options or {})
        unknown = sorted(set(opts) - set(KERNEL_OPTIONS))
        if unknown:
            raise ValueError(f"decode_attention='triton': unknown decode_kernel_options "
                             f"{unknown}; accepted: {list(KERNEL_OPTIONS)}.")
        self.windows = [_window(spec.mask_for_layer(i), i) for i in range(num_layers)]
        self.soft_cap = _soft_cap(spec.attn_score_mod)
        self.page_size, self.max_model_len = page_size, max_model_len
        self.num_kv_heads = num_kv_heads
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if torch.device(device).type == "cuda" else 1)
        self.kernel = opts.pop("kernel", DEFAULT_KERNEL)
        pick_kernel(self.kernel, 1)  # ValueError for an unknown kernel, before any launch
        check_shared_prefix({"kernel": self.kernel, **opts})  # ValueError naming the fix
        self.shared_prefix = opts.pop("shared_prefix", False)
        self.groups: dict[tuple, PrefixGroups] = {}  # (B, H, D, device) -> table + partials
        self.plans: dict[int, tuple] = {}  # B -> the current window's plan_prefix_groups
        self.num_splits = opts.pop("num_splits", None)
        self.programs_per_sm = opts.pop("programs_per_sm", None)
        self.waves = opts.pop("waves", TARGET_WAVES)
        self.launch = {"block_n": opts.pop("BLOCK_N", None), **opts}
        self.workspaces: dict[tuple, tuple[Any, Any]] = {}
        self.counters: dict[tuple, Any] = {}

    def splits_for(self, batch: int, num_kv_heads: int | None = None, head_dim: int = 128) -> int:
        """Grid splits for a batch bucket (and a layer's KV heads, default the model's, and
        head dim, which sets the fused kernel's resident programs and tile)."""
        kv_heads = num_kv_heads or self.num_kv_heads
        if self.num_splits:
            return self.num_splits
        kernel = pick_kernel(self.kernel, batch)
        if kernel == "v1":
            return choose_num_splits(batch, kv_heads, self.max_model_len, self.num_sms,
                                     self.programs_per_sm or PROGRAMS_PER_SM)
        if kernel == "fused":
            return plan_num_splits_fused(batch, kv_heads, self.max_model_len, self.num_sms,
                                      self.programs_per_sm or resident_programs(head_dim),
                                      self.launch.get("block_n") or default_block_n(head_dim))
        return plan_num_splits(batch, kv_heads, self.max_model_len, self.num_sms, self.waves,
                               self.launch.get("min_split_tokens", MIN_SPLIT_TOKENS_V2))

    def load_groups(self, batch: int, keys: list[tuple[int, int] | None]) -> None:
        """This window's groups for the ``batch``-row bucket from the rows' ``(first page,
        shared pages)`` keys (:func:`.paged_decode_plan.plan_prefix_groups`); ``keys=[]``
        clears them (graph capture). Tables made later (a layer's first call) get the same."""
        plan = plan_prefix_groups(keys, GROUP_MAX, self.page_size)
        if self.plans.get(batch) == plan:  # most windows keep the grouping: no copies then
            return
        self.plans[batch] = plan
        with torch.inference_mode():  # the tables were made in a step (inference tensors)
            for key, groups in self.groups.items():
                if key[0] == batch:
                    load_groups(groups, plan) if plan[0] else clear_groups(groups)

    def _groups(self, bsz: int, heads: int, dim: int, device: Any) -> PrefixGroups:
        key = (bsz, heads, dim, str(device))
        if key not in self.groups:
            self.groups[key] = new_prefix_groups(bsz, heads, dim, device)
            if self.plans.get(bsz, ([],))[0]:
                load_groups(self.groups[key], self.plans[bsz])
        return self.groups[key]

    def bind(self, block_table: Any, seq_lens: Any) -> Callable[..., Any]:
        """``fn(layer, q [B, H, D], k_cache, v_cache, scale) -> [B, H, D]`` for this step."""
        return functools.partial(self._layer, block_table, seq_lens)

    def _layer(self, block_table: Any, seq_lens: Any, i: int, q: Any, k_cache: Any,
               v_cache: Any, scale: float) -> Any:
        bsz, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        splits = self.splits_for(bsz, kv_heads, dim)
        kernel = pick_kernel(self.kernel, bsz)
        key = (bsz, heads, splits, dim, str(q.device))
        if key not in self.workspaces and not (kernel in ("v2", "fused") and splits == 1):
            self.workspaces[key] = new_workspace(bsz, heads, splits, dim, q.device)
        extra = {}
        if kernel == "fused":  # tickets shared by all layers (they run in order on one stream)
            ckey = (bsz, kv_heads, str(q.device))
            if ckey not in self.counters:
                self.counters[ckey] = new_counters(bsz, kv_heads, q.device)
            extra["counters"] = self.counters[ckey]
        if self.shared_prefix and self.windows[i] is None:
            extra["groups"] = self._groups(bsz, heads, dim, q.device)
        return paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                                      self.page_size, splits, self.windows[i], self.soft_cap,
                                      self.workspaces.get(key), kernel=kernel, **self.launch,
                                      **extra)


def _window(mask: Any, layer: int) -> int | None:
    if mask is None:
        return None
    if getattr(mask, "window", None) is None:
        raise ValueError(f"decode_attention='triton': layer {layer} has a mask the Triton kernel "
                         "cannot express (only sliding_window); use decode_attention='flex'.")
    return int(mask.window)


def _soft_cap(score_mod: Any) -> float | None:
    if score_mod is None:
        return None
    if getattr(score_mod, "cap", None) is None:
        raise ValueError("decode_attention='triton': the architecture's score_mod is not "
                         "soft_cap; use decode_attention='flex'.")
    return float(score_mod.cap)
