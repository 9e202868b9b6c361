"""CUDA-graph prefill (runner option ``prefill_graphs``: ``"auto"``, the default, or ``"on"``),
used by ``model_runner.py``.

Contract: :class:`PrefillGraphs` serves ``ModelRunner.prefill``'s packed forward + LM head of the
prompts' last tokens as one CUDA graph per bucket :func:`bucket_key` = ``(T, R, kernel)``: ``T``
the padded token count (``runner_batches.pack_prefill``, padded to ``prefill_pad`` multiples:
the runner turns padding on with this option), ``R`` the number of prompts, ``kernel`` the
prefill attention (always ``"flex"``: SDPA/FA4 plans are sized on the host per batch,
``runner_resolve.resolve_prefill_graphs`` refuses them). Per bucket, :class:`PrefillBucket` holds
static device buffers: token ids, positions, KV slots ``[T]``, the last-token index per prompt
``[R]`` and the flex BlockMask's tensors (``runner_batches.flex_prefill_tensors``: ``p2l [R + 1,
num_pages]``, ``q_row [T]``, ``counts [ceil(T / 128)]``, ``lists [ceil(T / 128), num_pages]``;
``q_pos`` is the positions buffer). Every shape depends on ``(T, R)`` and the pool only, never on
the content: the page lists are already padded by the host to ``num_pages`` entries with the null
page, so nothing needs padding beyond what the eager path builds.

Each prefill builds those tensors on the host exactly as the eager path does (outside the
graph), copies them into the bucket's buffers (``copy_``) and replays; the BlockMasks are built
once per bucket from views of the buffers (``BlockMask.from_kv_blocks`` only views its inputs),
and the logits ``[R, vocab]`` fp32 come out of a buffer allocated before capture (not in the
shared graph pool, so another graph's replay cannot overwrite them). Capture:
``decode_graphs.capture_graph`` (eager warm-up on a side stream with the current batch loaded:
the K/V it writes are the values the replay writes again) in the runner's shared pool; again when
``model.signature()`` (weight storage) changes. A capture that raises: a warning, and that bucket
prefills eagerly (the runner's unchanged eager path: same tokens) until the signature changes.
At most ``MAX_BUCKETS`` buckets are captured; batches past them, and batches of more than
``RunnerOptions.prefill_graph_max_tokens`` padded tokens, prefill eagerly.
Counters: ``timings["prefill_graph_captures"]`` and ``timings["prefill_graph_replays"]``.
"""

from __future__ import annotations

import warnings
from typing import Any

from nbhelpers.engine.decode_graphs import capture_graph
from nbhelpers.engine.runner_batches import flex_prefill_masks, flex_prefill_tensors
from nbhelpers.engine.scheduler import Sequence

MAX_BUCKETS = 32
"""Most prefill buckets captured per runner (each holds its graph and ``[R, vocab]`` logits)."""


def bucket_key(n_tokens: int, n_rows: int, attention: str) -> tuple[int, int, str]:
    """``(T, R, kernel)`` of a packed prefill of ``n_tokens`` (padded) over ``n_rows`` prompts.

    Raises:
        ValueError: ``attention`` is not ``"flex"`` (only flex prefill is captured), or empty.
    """
    if attention != "flex":
        raise ValueError(f"prefill graphs capture flex prefill only, got {attention!r}: use "
                         "prefill_attention='flex' or prefill_graphs='off'.")
    if n_tokens < 1 or n_rows < 1:
        raise ValueError(f"empty prefill batch ({n_tokens} tokens, {n_rows} prompts).")
    return n_tokens, n_rows, attention


def host_inputs(seqs: list[Sequence], ids: list[int], pos: list[int], rows: list[int],
                slots: list[int], opt: Any, max_pages: int) -> dict[str, Any]:
    """The host (CPU) tensors of one packed prefill (``ids``/``pos``/``rows``/``slots`` from
    ``pack_prefill`` of ``seqs``): ``ids``, ``pos``, ``slots`` ``[T]`` int64, ``last [R]`` int64
    (each prompt's last packed token) and :func:`~nbhelpers.engine.runner_batches.
    flex_prefill_tensors`'s five (``q_pos`` equals ``pos``, so it is not repeated)."""
    import torch
    ends, total = [], 0
    for s in seqs:
        total += s.num_tokens
        ends.append(total - 1)
    t = flex_prefill_tensors(opt, seqs, rows, pos, max_pages, "cpu")
    del t["q_pos"]
    return {"ids": torch.tensor(ids), "pos": torch.tensor(pos), "slots": torch.tensor(slots),
            "last": torch.tensor(ends), **t}


class PrefillBucket:
    """Static device buffers of one bucket (shapes of :func:`host_inputs`), its graph
    (``None``: not captured, or capture failed), the weight ``signature`` it was captured at,
    ``attn`` (BlockMasks over the buffers) and ``logits`` (``[R, vocab]``, set at warm-up)."""

    def __init__(self, key: tuple[int, int, str], host: dict[str, Any], device: Any):
        self.key = key
        self.bufs = {name: value.to(device) for name, value in host.items()}
        self.graph: Any = None
        self.signature: tuple | None = None
        self.attn: Any = None
        self.logits: Any = None

    def fill(self, host: dict[str, Any]) -> None:
        """Copy a batch's :func:`host_inputs` into the buffers (same shapes: same bucket)."""
        for name, value in host.items():
            self.bufs[name].copy_(value, non_blocking=True)

    def mask_tensors(self) -> dict[str, Any]:
        """The buffers as ``flex_prefill_tensors``' dict (``q_pos`` is the positions)."""
        b = self.bufs
        return {"p2l": b["p2l"], "q_row": b["q_row"], "q_pos": b["pos"], "counts": b["counts"],
                "lists": b["lists"]}


class PrefillGraphs:
    """Per-bucket prefill graphs of one :class:`~nbhelpers.engine.model_runner.ModelRunner`
    (its ``model``, ``kv``, ``opt``, ``max_pages``, ``graph_pool``, ``timings``)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.buckets: dict[tuple[int, int, str], PrefillBucket] = {}

    def clear(self) -> None:
        """Drop every bucket (the KV pool they point into is gone: ``free_kv``)."""
        self.buckets = {}

    def run(self, seqs: list[Sequence], ids: list[int], pos: list[int], rows: list[int],
            slots: list[int]) -> Any:
        """Logits ``[R, vocab]`` fp32 of each prompt's last token (K/V written into the pool),
        from the bucket's graph; ``None`` when the bucket has no graph (capture failed,
        ``MAX_BUCKETS`` reached, or more than ``opt.prefill_graph_max_tokens`` padded tokens):
        then the caller prefills eagerly. The tensor is the bucket's
        buffer: read it before the next prefill."""
        r = self.runner
        if len(ids) > r.opt.prefill_graph_max_tokens:
            return None  # large prefill: eager (RunnerOptions.prefill_graph_max_tokens)
        key = bucket_key(len(ids), len(seqs), r.prefill_attention)
        b, sig = self.buckets.get(key), r.model.signature()
        if b is None and len(self.buckets) >= MAX_BUCKETS:
            return None
        if b is not None and b.graph is None and b.signature == sig:
            return None  # its capture failed at these weights: eager, no second warning
        host = host_inputs(seqs, ids, pos, rows, slots, r.opt, r.max_pages)
        if b is None:
            b = self.buckets[key] = PrefillBucket(key, host, r.device)
            b.attn = flex_prefill_masks(r.model, r.opt, b.mask_tensors(), r.kv)
        else:
            b.fill(host)
        if b.signature != sig:
            b.signature = sig
            b.graph = self._capture(b)
        if b.graph is None:
            return None
        b.graph.replay()
        r.timings["prefill_graph_replays"] += 1
        return b.logits

    def _body(self, b: PrefillBucket) -> None:
        """The captured work: packed forward over the buffers, LM head of the last tokens."""
        m, bufs = self.runner.model, b.bufs
        hidden = m.forward(bufs["ids"], bufs["pos"], bufs["slots"], b.attn, self.runner.kv)
        logits = m.logits(hidden[bufs["last"]])  # as ModelRunner._prefill_run
        if b.logits is None:  # first warm-up call: outside the capture and the graph pool
            import torch
            b.logits = torch.empty_like(logits)
        b.logits.copy_(logits)

    def _capture(self, b: PrefillBucket) -> Any:
        """The bucket's graph, or ``None`` with a warning when warm-up or capture raise."""
        r = self.runner
        try:
            graph = capture_graph(lambda: self._body(b), lambda: None, r.graph_pool)
        except Exception as err:  # noqa: BLE001 -- capture is an optimisation; eager = same tokens
            warnings.warn(f"flex engine: CUDA graph capture of the prefill bucket {b.key[:2]} "
                          f"(tokens, prompts) failed ({type(err).__name__}: {err}); prefilling "
                          f"this bucket eagerly.", stacklevel=4)
            return None
        r.graph_pool = r.graph_pool or graph.pool()  # one pool for decode and prefill graphs
        r.timings["prefill_graph_captures"] += 1
        return graph
