"""FlashAttention-4 prefill (``RunnerOptions.prefill_attention="fa4"``): the packed prompt tokens
through ``flash_attn.cute.flash_attn_varlen_func`` (flash-attn-4 4.0.0b36, the ``fa4`` bundle of
``nbhelpers/bundles/sets.py``) instead of flex_attention over a paged BlockMask.

What: :func:`fa4_prefill_plan` builds one :class:`Fa4Prefill` per distinct layer mask of a
prefill step (it stands in ``AttnBatch.block_masks`` like ``attention.SdpaMask``;
``attention.paged_attention`` routes it here by its ``kernel == "fa4"`` tag). The K/V write path
is unchanged: each layer writes the step's K/V into the paged pool first, then
:meth:`Fa4Prefill.attend` gathers every request's keys ``0 .. start + len - 1`` from the pool
through its block table into one packed ``[total_k, H_kv, D]`` pair (one ``index_select`` each)
and calls the varlen kernel with ``cu_seqlens_q/k``, ``causal=True`` (FlashAttention's causal mask
is aligned to the bottom right when ``seqlen_q < seqlen_k``, so cached context, were the engine to
prefill from ``start > 0``, is attended too: there is nothing to fall back to flex for),
``softmax_scale``, GQA by head counts (``H % H_kv == 0``), ``window_size=(w - 1, 0)`` for a
``sliding_window(w)`` layer (keys ``q - w < kv <= q``) and ``softcap`` for a ``soft_cap`` score_mod.
Today's engine prefills every request from position 0 (``runner_batches.pack_prefill``: no prefix
cache, no chunked prefill; a preempted request re-prefills all its tokens), so ``total_k ==
total_q``. FA4's own paged path (``page_table`` + ``seqused_k``, b36) would read the pool without
the gather, but it wants ``[num_pages, page_size, H_kv, D]`` pages (the pool is ``[1, H_kv, S,
D]``) and TMA pages of exactly the kernel's tile; the gather is the version that runs first.

Refused (``ValueError`` at ``LLM`` construction, naming ``prefill_attention='flex'``): a model off
CUDA or on a GPU whose compute capability is not 9 (Hopper) or 10 (Blackwell), a dtype other than
bf16/fp16, a head_dim FA4 has no kernel for (sm_90: 8..256, multiples of 8; sm_100: 8..128 or
256; b36 ``interface._validate_head_dims``; so Gemma-4 E2B, whose full layers have head_dim 512,
is refused, not silently run half on flex), or a score_mod other than ``soft_cap``. Missing FA4:
``ImportError`` naming :data:`STAGE_FA4`. ``"auto"`` never picks ``"fa4"`` (``runner_options``).

Source of the call: Dao-AILab/flash-attention ``flash_attn/cute/interface.py`` at 4.0.0b36
(``flash_attn_varlen_func`` returns ``(out, lse)``, ``lse`` ``None`` without ``return_lse``);
transformers 5.17.0's ``paged|flash_attention_4`` calls it the same way (contiguous packed K/V).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

FA4_MODULE = "flash_attn.cute"
FA4_CAPABILITIES = (9, 10)
"""Compute-capability majors with FA4 forward kernels used here: sm_90 (H100/H200), sm_100."""
FA4_DTYPES = ("bfloat16", "float16")
"""Model dtypes FA4's forward takes (``torch.<name>``)."""
STAGE_FA4 = (
    "stage the fa4 bundle (nbhelpers/bundles/sets.py FA4, its own site dir /tmp/fa4_site, "
    "carry parts of <= 22 MiB): build it here with `python -m nbhelpers.bundles build fa4` and "
    "`resplit fa4 --part-mib 22` (three parts: each with the 33 MB tree under the 64 MiB a "
    "call carries), print the "
    "carry list and command prefixes with `python -m nbhelpers.bundles commands fa4`, send the "
    "parts in back-to-back calls of one warm device machine (the last one untars the site), and "
    "export PYTHONPATH=/tmp/fa4_site:/tmp/fa4_site/nvidia_cutlass_dsl/dsl_packages (cutlass is "
    "found through a .pth file that PYTHONPATH skips); on a GPU host with network: "
    "pip install -e '.[fa4]'")


def fa4_importable() -> bool:
    """True when ``flash_attn.cute`` is in ``sys.modules`` or can be found (no import: cheap)."""
    if sys.modules.get(FA4_MODULE) is not None:
        return True
    try:
        return importlib.util.find_spec(FA4_MODULE) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def check_fa4_importable(owner: str = "RunnerOptions.prefill_attention='fa4'") -> None:
    """Raise ``ImportError`` naming :data:`STAGE_FA4` when ``flash_attn.cute`` cannot be found."""
    if not fa4_importable():
        raise ImportError(f"{owner} needs FlashAttention-4 ({FA4_MODULE}, flash-attn-4 "
                          f"4.0.0b36): {STAGE_FA4}; or use prefill_attention='flex'.")


def head_dim_ok(head_dim: int, major: int) -> bool:
    """Whether FA4 b36 has a forward kernel for ``head_dim`` (= head_dim_v) on ``major``."""
    aligned = head_dim % 8 == 0
    if major == 9:
        return aligned and 8 <= head_dim <= 256
    return aligned and (8 <= head_dim <= 128 or head_dim == 256)


def _capability(device: Any) -> tuple[int, int] | None:
    """``torch.cuda.get_device_capability(device)`` on CUDA, else ``None`` (tests patch it)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch
    return torch.cuda.get_device_capability(device)


def fa4_problem(model: Any) -> str | None:
    """Why the FA4 prefill cannot serve ``model`` (a ``layers.EngineModel``), or ``None``."""
    cap = _capability(model.device)
    if cap is None or cap[0] not in FA4_CAPABILITIES:
        where = "not on CUDA" if cap is None else f"on compute capability {cap[0]}.{cap[1]}"
        return (f"FA4 runs on CUDA compute capability {' or '.join(map(str, FA4_CAPABILITIES))} "
                f"(Hopper H100/H200, Blackwell), the model is {where}")
    dtype = str(model.dtype).removeprefix("torch.")
    if dtype not in FA4_DTYPES:
        return f"FA4 takes {'/'.join(FA4_DTYPES)} models, this one is {dtype}"
    dims = sorted(set(getattr(model, "head_dims", None) or [model.head_dim]))
    if bad := [d for d in dims if not head_dim_ok(d, cap[0])]:
        return (f"FA4 on sm_{cap[0]}0 has no kernel for head_dim {bad} (model head dims "
                f"{dims}; sm_90: 8..256, multiples of 8)")
    score_mod = model.spec.attn_score_mod
    if score_mod is not None and not hasattr(score_mod, "cap"):
        return f"score_mod {getattr(score_mod, '__name__', score_mod)!r} has no FA4 form"
    bad_masks = [m for m in map(model.spec.mask_for_layer, range(len(model.layers)))
                 if m is not None and not hasattr(m, "window")]
    return f"mask {bad_masks[0]!r} is not a sliding window" if bad_masks else None


def check_fa4_prefill(model: Any) -> None:
    """Raise when ``prefill_attention='fa4'`` cannot run ``model`` (at ``LLM`` construction).

    Raises:
        ValueError: :func:`fa4_problem`'s reason, naming ``prefill_attention='flex'``.
        ImportError: ``flash_attn.cute`` is missing or fails to import (cutlass off the path),
            naming :data:`STAGE_FA4`.
    """
    if why := fa4_problem(model):
        raise ValueError(f"prefill_attention='fa4': {why}; use prefill_attention='flex' (or "
                         "'auto').")
    check_fa4_importable("prefill_attention='fa4'")
    try:
        importlib.import_module(FA4_MODULE)
    except Exception as err:  # cutlass-dsl / tvm-ffi missing or clashing: say how to stage
        raise ImportError(f"prefill_attention='fa4': import {FA4_MODULE} failed ({err!r}): "
                          f"{STAGE_FA4}.") from err


class Fa4Prefill:
    """One prefill step's FA4 varlen plan for the layers sharing one logical mask.

    Fields: ``slots [total_k]`` physical pool slots of every request's keys (request-major);
    ``cu_q``/``cu_k [R + 1]`` int32 cumulative query/key lengths; ``max_q``/``max_k`` host ints;
    ``num_q`` real (unpadded) packed query tokens; ``window`` the sliding window or ``None``.
    """

    kernel = "fa4"  # attention.paged_attention routes block masks with this tag here

    def __init__(self, slots: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, num_q: int,
                 window: int | None):
        self.slots, self.cu_q, self.cu_k = slots, cu_q, cu_k
        self.max_q, self.max_k, self.num_q, self.window = max_q, max_k, num_q, window

    def attend(self, q: Any, k_cache: Any, v_cache: Any, scale: float,
               score_mod: Any = None) -> Any:
        """``q [1, H, T, D]`` (T >= ``num_q``: padding rows get 0, as flex gives them), caches
        ``[1, H_kv, S, D]`` -> ``[1, H, T, D]``. ``score_mod``: ``None`` or ``soft_cap``.

        Raises:
            ValueError: a score_mod without ``.cap`` (:func:`check_fa4_prefill` refuses it first).
        """
        import torch
        cap = getattr(score_mod, "cap", None)
        if score_mod is not None and cap is None:
            raise ValueError("prefill_attention='fa4' applies only a soft_cap score_mod: use "
                             "prefill_attention='flex'.")
        cute = importlib.import_module(FA4_MODULE)
        n = self.num_q
        qt = q[0, :, :n].transpose(0, 1).contiguous()  # [n, H, D]
        k = k_cache[0].transpose(0, 1).index_select(0, self.slots)  # [total_k, H_kv, D]
        v = v_cache[0].transpose(0, 1).index_select(0, self.slots)
        w = self.window
        out = cute.flash_attn_varlen_func(
            qt, k, v, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, max_seqlen_q=self.max_q,
            max_seqlen_k=self.max_k, softmax_scale=scale, causal=True,
            window_size=(w - 1, 0) if w is not None else (None, None),
            softcap=float(cap) if cap is not None else 0.0)
        out = out[0] if isinstance(out, tuple) else out  # b36: (out, lse or None)
        if q.shape[2] > n:
            out = torch.cat([out, out.new_zeros(q.shape[2] - n, *out.shape[1:])])
        return out.transpose(0, 1).unsqueeze(0)


def fa4_prefill_plan(block_tables: list[list[int]], spans: list[tuple[int, int]],
                     starts: list[int], page_size: int, device: Any,
                     extra: Any = None) -> Fa4Prefill:
    """The FA4 plan of one prefill step, in ``attention.prefill_sdpa_mask``'s signature:
    request ``r``'s queries are packed tokens ``spans[r]`` at positions ``starts[r] ..``; its keys
    are positions ``0 .. starts[r] + len - 1`` read through ``block_tables[r]`` (this step's K/V
    are in the pool by then). ``extra``: ``None`` or a ``sliding_window`` mask (``.window``).

    Raises:
        ValueError: ``extra`` without ``.window`` (FA4 has no general mask_mod path here), or
            ``spans`` that do not tile the packed tokens from 0 in order.
    """
    import torch
    if [s for s, _ in spans] != [0] + [e for _, e in spans[:-1]]:
        raise ValueError(f"fa4_prefill_plan: spans {spans} must tile the packed tokens from 0 "
                         "in request order (runner_batches.pack_prefill packs them so).")
    window = getattr(extra, "window", None)
    if extra is not None and window is None:
        raise ValueError(f"prefill_attention='fa4': mask {extra!r} is not a sliding window; use "
                         "prefill_attention='flex'.")
    q_lens = [e - s for s, e in spans]
    k_lens = [st + n for st, n in zip(starts, q_lens)]
    slots = []
    for bt, n in zip(block_tables, k_lens):
        slots += [bt[p // page_size] * page_size + p % page_size for p in range(n)]

    def cumulative(lens: list[int]) -> Any:
        return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return Fa4Prefill(torch.tensor(slots, dtype=torch.long, device=device), cumulative(q_lens),
                      cumulative(k_lens), max(q_lens), max(k_lens), sum(q_lens), window)
