"""Model runner: packed prefill and CUDA-graph decode windows over the paged KV cache.

Contract: :class:`ModelRunner` owns the KV pool and the per-bucket decode state. ``prefill(groups)``
packs every admitted prompt into one query sequence (document-causal paged BlockMask), computes the
LM head only on each prompt's last token, forks the ``n`` samples of a group (copy-on-write of the
partly filled last page) and samples their first tokens. ``decode(seqs, steps)`` runs ``steps``
decode steps for the running batch: every step (all layers, live LoRA, sampler, slot_mapping, block
mask, position/token updates) is one CUDA graph per batch-size bucket; token ids stay on the device
and the host reads the tokens once per window (``steps``), not per step. When capture fails, the
same step runs eagerly with a warning (same tokens). On the CPU everything runs eagerly. With
``prefill_graphs`` resolved on (``"auto"``, the default, with CUDA graphs and compiled flex prefill;
or ``"on"``) the prefill forward replays a CUDA graph per bucket (``prefill_graphs.py``).

Timing: ``self.timings`` accumulates ``prefill_s``, ``decode_s`` (graph replays + the end-of-window
readback) and ``host_s`` (Python bookkeeping), in seconds, and counts ``decode_steps``,
``prefill_tokens``, ``graph_captures`` (decode), ``prefill_graph_captures`` and
``prefill_graph_replays``; CUDA-synchronised only when ``profile=True`` (a sync per window costs
nothing extra: the readback already syncs).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from nbhelpers.engine.attention import (
    decode_block_mask,
    decode_sdpa_mask,
    paged_attention,
    sdpa_supports,
)
from nbhelpers.engine.decode_graphs import capture_graph, capture_or_eager
from nbhelpers.engine.fused import Elementwise
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kv_cache import check_page_size, phys_to_logical, slot_mapping
from nbhelpers.engine.l2_prefetch import L2Prefetch
from nbhelpers.engine.layers import AttnBatch, flex_attention_fn
from nbhelpers.engine.lora_shadow import refresh_all
from nbhelpers.engine.models import build_engine_model
from nbhelpers.engine.prefill_fa4 import check_fa4_prefill
from nbhelpers.engine.prefill_graphs import PrefillGraphs
from nbhelpers.engine.runner_batches import (
    layer_masks,
    pack_prefill,
    prefill_attention_batch,
)
from nbhelpers.engine.runner_options import (  # noqa: F401 (re-exported: public names)
    DECODE_ATTENTION,
    DecodeState,
    RunnerOptions,
)
from nbhelpers.engine.runner_resolve import (
    resolve_fused_elementwise,
    resolve_kernels,
    resolve_l2_prefetch,
    resolve_lora_dtype,
    resolve_lora_fused,
    resolve_pdl_mode,
    resolve_prefill,
    resolve_prefill_graphs,
    resolve_sample_kernel,
    resolve_skinny_gemm,
)
from nbhelpers.engine.sampler import sample
from nbhelpers.engine.sampling_tensors import sampling_tensors, sampling_values, uses_sort
from nbhelpers.engine.scheduler import Sequence
from nbhelpers.engine.skinny_linear import SkinnyLinear

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
class ModelRunner:
    """See the module docstring. ``model`` is an HF causal LM (PEFT-wrapped or not)."""

    def __init__(self, model: Any, options: RunnerOptions | None = None):
        import torch
        self.opt = opt = options or RunnerOptions()
        on_cuda = next(iter(model.parameters())).is_cuda
        self.use_graphs = on_cuda if opt.use_cuda_graphs is None else opt.use_cuda_graphs
        compile_attn = on_cuda if opt.compile_attention is None else opt.compile_attention
        compile_layers = on_cuda if opt.compile_layers is None else opt.compile_layers
        check_page_size(opt.page_size, "cuda" if on_cuda else "cpu", bool(compile_attn),
                        opt.prefill_kernel_options)
        flex = flex_attention_fn(compile_attn, dynamo_limits=compile_attn or compile_layers)
        # torch 2.13's CPU inductor flex template fails to build for decode BlockMasks of 1 or 2
        # rows ((B, 1, 1, S), B < 4): "'full_kv_num_blocks' was not declared in this scope"
        # (g++; measured here 2026-11-30 with SmolLM2-135M: B=1 and 2 fail, 4 and 8 build; the
        # tiny test model builds at any B). So CPU decode with compiled attention pads to at least
        # 4 rows (tests/engine/test_cpu_compiled_decode.py); CUDA keeps the 1-row bucket.
        self.min_rows = 4 if compile_attn and not on_cuda else 1
        # packed prefill is padded to prefill_pad multiples wherever a shape costs a compile
        self.pad_prefill = on_cuda or bool(compile_attn)
        self.model = build_engine_model(model, fuse_lora_a=opt.fuse_lora_a,
                                        flex_fn=paged_attention(flex))
        # "auto" picks the Triton kernels only for 16/32-bit models: a float64 model (34's exact
        # parity check) keeps flex decode and eager elementwise ops (tl.dot has no fp64 tiles
        # in our kernels: Triton 3.6 fails "m_i ... fp64 in loop", H200 run of 2026-12-01)
        self.kernels_ok = on_cuda and next(model.parameters()).dtype != torch.float64
        self._resolve_attention(on_cuda, bool(compile_attn))
        lora_fused = resolve_lora_fused(opt, on_cuda)  # lora_gemm kernels (runner_options)
        lora_dtype = resolve_lora_dtype(opt, on_cuda)
        for group in self.model.live_groups():
            group.set_lora_expand(self.lora_expand, opt.lora_consumer_one_part_rows)
            group.set_lora_fused(lora_fused)
            group.set_lora_dtype(lora_dtype)
        self.skinny = SkinnyLinear(resolve_skinny_gemm(opt, self.kernels_ok),  # decode GEMMs
                                   opt.skinny_gemm_max_rows, opt.skinny_gemm_cublas)
        self.pdl_mode = resolve_pdl_mode(opt, next(iter(model.parameters())).device)
        self.pdl = self.pdl_mode != "off"  # decode kernels PDL-launched ("on", "early"...)
        self.pdl_budget = opt.pdl_prefetch_mib << 20  # bytes; used by pdl="prefetch" only
        self.model.set_skinny_gemm(self.skinny if self.skinny.enabled else None)
        self.l2 = self.model.l2 = L2Prefetch(resolve_l2_prefetch(opt, self.model.device),
                                             self.model.device)  # o_proj weights into L2
        fused_mode = resolve_fused_elementwise(opt, compile_layers, self.kernels_ok)
        self.sample_kernel = resolve_sample_kernel(opt, on_cuda)  # decode steps' sampler
        if fused_mode != "off" or self.sample_kernel != "torch":
            self.model.compile_elementwise(fused_mode, compile_sample=compile_layers,
                                           sample_kernel=self.sample_kernel)
        if fused_mode == "triton":  # the block's fp32 output needs the Triton add+RMSNorm
            self.model.set_mlp_block(opt.mlp_block)
        if opt.mlp_block == "triton" and not self.model.mlp_block.enabled:
            warnings.warn(f"mlp_block='triton' serves nothing here: it needs CUDA (or "
                          f"TRITON_INTERPRET=1 on the CPU), a SiLU MLP (Llama / Qwen3) and the "
                          f"Triton elementwise kernels (fused_elementwise resolved to "
                          f"{fused_mode!r}); the unfused MLP runs.", stacklevel=3)
        if opt.prefill_elementwise == "triton":  # prefill's pieces as one launch each
            self.model.fx_prefill = Elementwise(kind="triton")
        self.paged_decode: Any = None  # PagedDecode when decode_attention="triton"
        if self.decode_attention == "triton":
            from nbhelpers.engine.kernels.paged_decode import build_paged_decode
            self.paged_decode = build_paged_decode(self.model, opt)
        # flex's kernel_options: without the Triton kernel's shared_prefix (PagedDecode's)
        self.flex_decode_options = {k: v for k, v in (opt.decode_kernel_options or {}).items()
                                    if k != "shared_prefix"} or None
        if (opt.decode_kernel_options or {}).get("shared_prefix") and self.paged_decode is None:
            warnings.warn(f"decode_kernel_options shared_prefix=True: decode_attention "
                          f"resolved to {self.decode_attention!r} here, which does not read "
                          "shared prompt pages once; the option does nothing (it needs the "
                          "Triton decode kernel: decode_attention='triton').", stacklevel=3)
        self.device = self.model.device
        self.prefill_graphs: PrefillGraphs | None = None  # prefill_graphs resolved on (prefill_graphs.py)
        if resolve_prefill_graphs(opt, self.use_graphs, self.prefill_attention,
                                  compiled=bool(compile_attn)):  # eager flex: no capture
            self.prefill_graphs, self.pad_prefill = PrefillGraphs(self), True  # few buckets
        self.kv: Any = None  # KVCache, or None while asleep
        self.max_pages = -(-opt.max_model_len // opt.page_size) + 1
        self.window_pages = self.max_pages  # pages an SDPA decode window reads (decode())
        self.states: dict[tuple[int, bool], DecodeState] = {}
        self.graph_pool: Any = None
        self.weights_checked = False  # begin_generate() / end_generate()
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "host_s": 0.0, "decode_steps": 0,
                        "prefill_tokens": 0, "graph_captures": 0, "prefill_graph_captures": 0,
                        "prefill_graph_replays": 0}
        self.profile = False
        # whole decode step through inductor (fuses the norm/RoPE/sampler elementwise chains);
        # the CUDA graph is still captured by us (no cudagraph trees inside a manual capture)
        self._decode_compiled = (torch.compile(self._decode_compute, dynamic=False)
                                 if opt.compile_decode and compile_attn else None)
        self.allocate_kv()

    def _resolve_attention(self, on_cuda: bool, compiled: bool) -> None:
        """Set ``decode_attention``, ``prefill_attention``, ``lora_expand`` and
        ``attention_note`` (why ``"auto"`` kept flex on the CPU, else ``None``). Asking for
        ``compile_attention=True`` keeps compiled flex under ``"auto"``; ``use_cuda_graphs=True``
        keeps flex decode.

        Raises:
            ValueError: ``"sdpa"`` asked for a model whose score_mod/masks SDPA cannot express,
                SDPA decode with CUDA graphs (its gather width is sized on the host), or
                ``prefill_attention="fa4"`` for a model or GPU FA4 cannot serve
                (``prefill_fa4.check_fa4_prefill``; ImportError when FA4 is missing).
        """
        spec = self.model.spec
        why = sdpa_supports(spec.attn_score_mod,
                            [spec.mask_for_layer(i) for i in range(len(self.model.layers))])
        self.attention_note = None if why is None or on_cuda else f"flex on the CPU: {why}"
        ok = why is None and not compiled
        self.decode_attention, self.lora_expand = resolve_kernels(  # graphs: not sdpa (below)
            self.opt, self.kernels_ok, self.model.decode_kernels,
            sdpa_ok=ok and not self.use_graphs and not on_cuda)
        self.prefill_attention = resolve_prefill(self.opt, on_cuda, sdpa_ok=ok)
        if self.prefill_attention == "fa4":
            check_fa4_prefill(self.model)
        if why is not None and "sdpa" in (self.decode_attention, self.prefill_attention):
            raise ValueError(f"attention 'sdpa' cannot run this model: {why}; use 'flex'.")
        if self.decode_attention == "sdpa" and self.use_graphs:
            raise ValueError("decode_attention='sdpa' sizes its page gather on the host per "
                             "window: set use_cuda_graphs=False, or use 'triton'/'flex'.")

    def allocate_kv(self) -> None:
        self.kv = self.model.allocate_kv(self.opt.num_pages, self.opt.page_size)

    def free_kv(self) -> None:
        """Drop the KV pool and captured graphs (they point into it). Under
        ``prefill_graphs="auto"`` prefill stays eager from here on (a runner that sleeps between
        rollouts would re-capture every rollout: warm-up + capture cost more than a replay
        saves); ``"on"`` re-captures."""
        self.kv, self.states, self.graph_pool = None, {}, None
        if self.prefill_graphs is not None:
            self.prefill_graphs.clear()
            if self.opt.prefill_graphs == "auto":
                self.prefill_graphs = None

    # ---------------------------------------------------------------- prefill
    def refresh_weights(self) -> None:
        """Re-fuse projection groups whose storage was replaced and re-copy changed shadows, all in
        one ``_foreach_copy_`` (``lora_shadow.refresh_all``, ``LiveGroup.refresh``)."""
        refresh_all(self.model.live_groups())

    def begin_generate(self) -> None:
        """:meth:`refresh_weights` once for a whole ``LLM.generate`` call (timed as ``host_s``):
        weights cannot change inside one synchronous call, and the check walks every projection
        group's tensors (~3 ms a call for 36 layers x 4 groups with PEFT r32 adapters: cProfile on
        a 2-core CPU host, 2026-12-03, a 36-layer hidden-64 Qwen3), which before ran
        before every prefill and every decode window (8 windows a 256-token rollout at
        ``sync_every=32``). Until :meth:`end_generate`, :meth:`prefill` and :meth:`decode` skip
        their own refresh, and so do the projection groups' eager forwards (``LiveGroup.checked``;
        CUDA-graph replays run no Python at all); called directly (without this), they refresh
        each time, as before."""
        t0 = time.perf_counter()
        self.refresh_weights()
        self._set_checked(True)
        self._tick("host_s", t0)

    def end_generate(self) -> None:
        """End of the ``LLM.generate`` call: the next prefill/decode refreshes again."""
        self._set_checked(False)

    def _set_checked(self, value: bool) -> None:
        """The runner's flag and every group's (``LiveGroup.checked``: its eager forwards skip
        their own per-call refresh, ``LiveGroup._buffers``)."""
        self.weights_checked = value
        for group in self.model.live_groups():
            group.checked = value

    def _refresh_unless_checked(self) -> None:
        if not self.weights_checked:
            self.refresh_weights()

    def prefill(self, groups: list[list[Sequence]], sampling: Any) -> None:
        """Prefill each group's leader, fork followers, sample every member's next token."""
        import torch
        t0 = time.perf_counter()
        self._refresh_unless_checked()
        leaders = [g[0] for g in groups]
        ids, pos, rows, slots = pack_prefill(leaders, self.opt, self.pad_prefill)
        logits = (None if self.prefill_graphs is None else  # None: this bucket runs eagerly
                  self.prefill_graphs.run(leaders, ids, pos, rows, slots))
        if logits is None:
            attn = prefill_attention_batch(self.model, self.opt, leaders, rows, pos,
                                           self.prefill_attention, self.max_pages, self.kv)
            logits = self._prefill_run(ids, pos, slots, leaders, attn)
        members = [s for g in groups for s in g]
        rep = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=self.device)
        self._fork(groups)
        toks, lps = self._sample(logits[rep], members, sampling)
        lps = lps.cpu()  # [N, 2]: filtered, full (flat float lists: Sequence.out_logprobs)
        for seq, t, lp, full in zip(members, toks.tolist(), lps[:, 0].tolist(),
                                    lps[:, 1].tolist()):
            seq.append(t, lp, full)
        self.timings["prefill_tokens"] += len(ids)
        self._tick("prefill_s", t0)

    def _prefill_run(self, ids: list[int], pos: list[int], slots: list[int],
                     seqs: list[Sequence], attn: AttnBatch) -> Any:
        """Packed forward (K/V into the pool) and fp32 logits of each prompt's last token."""
        import torch
        dev, n_rows = self.device, len(seqs)
        q_pos = torch.tensor(pos, device=dev)
        with torch.inference_mode():
            hidden = self.model.forward(torch.tensor(ids, device=dev), q_pos,
                                        torch.tensor(slots, device=dev), attn, self.kv)
            last = torch.tensor([sum(s.num_tokens for s in seqs[:i + 1]) - 1
                                 for i in range(n_rows)], device=dev)
            return self.model.logits(hidden[last])

    def _fork(self, groups: list[list[Sequence]]) -> None:
        """Copy-on-write: followers copy the leader's partly filled last page."""
        ps = self.opt.page_size
        self.kv.copy_pages([(g[0].block_table[-1], seq.block_table[-1]) for g in groups
                            if g[0].num_tokens % ps for seq in g[1:]])

    def _sample(self, logits: Any, seqs: list[Sequence], sampling: Any) -> tuple[Any, Any]:
        import torch
        dev = self.device
        with torch.inference_mode():
            return sample(logits, *sampling_tensors(sampling, len(seqs), dev),
                          torch.tensor([s.seed for s in seqs], device=dev),
                          torch.tensor([len(s.out_ids) for s in seqs], device=dev),
                          use_sort=uses_sort(sampling), full_logprobs=True)

    def _tick(self, key: str, t0: float) -> None:
        if self.profile and self.device.type == "cuda":
            import torch
            torch.cuda.synchronize()
        self.timings[key] += time.perf_counter() - t0

    # ---------------------------------------------------------------- decode
    def decode(self, seqs: list[Sequence], steps: int, sampling: Any) -> None:
        """Run ``steps`` decode steps for ``seqs`` (pages already reserved) and append tokens."""
        t0 = time.perf_counter()
        self._refresh_unless_checked()
        st = self._state(len(seqs), uses_sort(sampling))
        last = max(s.num_tokens for s in seqs) + steps - 2  # highest position this window
        self.window_pages = min(self.max_pages, last // self.opt.page_size + 1)
        self._load_state(st, seqs, sampling)
        self._tick("host_s", t0)
        t1 = time.perf_counter()
        for _ in range(steps):
            self._step(st)
        toks, lps = st.out_tok[:len(seqs), :steps].tolist(), st.out_lp[:len(seqs), :steps].cpu()
        self._tick("decode_s", t1)
        t2 = time.perf_counter()  # flat float lists per row, no pair list per token (Sequence)
        for seq, row_t, row_lp, row_full in zip(seqs, toks, lps[..., 0].tolist(),
                                                lps[..., 1].tolist()):
            seq.extend(row_t, row_lp, row_full)  # up to the token that finishes it
            seq.num_cached = seq.num_tokens - 1
        self.timings["decode_steps"] += steps
        self._tick("host_s", t2)

    def _state(self, n: int, use_sort: bool) -> DecodeState:
        bucket = next((b for b in BUCKETS if b >= max(n, self.min_rows)), None)
        if bucket is None:
            raise ValueError(f"decode batch {n} > {BUCKETS[-1]}: lower max_num_seqs.")
        key = (bucket, use_sort)
        if key not in self.states:
            self.states[key] = DecodeState(bucket, self.max_pages, self.opt.sync_every,
                                           self.device)
        st = self.states[key]
        st.use_sort = use_sort
        if self.use_graphs and st.signature != self.model.signature():  # new, or weights moved
            self._capture(st, use_sort)
        return st

    def _load_state(self, st: DecodeState, seqs: list[Sequence], sampling: Any) -> None:
        import torch
        n, rows = len(seqs), st.rows
        pad = rows - n
        width = self.max_pages  # one tensor from padded lists, not a tensor + slice per row
        bt = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
                          + [[0] * width] * pad, dtype=torch.long)
        host = {
            "tokens": [s.out_ids[-1] for s in seqs] + [0] * pad,
            "pos": [s.num_tokens - 1 for s in seqs] + [0] * pad,
            "gen_idx": [len(s.out_ids) for s in seqs] + [0] * pad,
            "seeds": [s.seed for s in seqs] + [0] * pad,
            "is_pad": [False] * n + [True] * pad,
        }
        for name, vals in host.items():
            getattr(st, name).copy_(torch.tensor(vals), non_blocking=True)
        st.block_table.copy_(bt, non_blocking=True)
        if self.paged_decode is not None and self.paged_decode.shared_prefix:
            self.paged_decode.load_groups(rows, [(s.block_table[0], s.shared_pages)
                                                 if s.shared_pages else None for s in seqs])
        for buf, value in zip((st.temperature, st.min_p, st.top_k, st.top_p),
                              sampling_values(sampling)):
            buf.fill_(value)  # as sampling_tensors(sampling, rows), without 4 new tensors
        st.col.zero_()

    def _step(self, st: DecodeState) -> None:
        if st.graph is not None:
            st.graph.replay()
        else:
            import torch
            with torch.inference_mode():
                self._step_body(st, st.use_sort)

    def _step_body(self, st: DecodeState, use_sort: bool) -> None:
        compute = self._decode_compiled or self._decode_compute
        # decode GEMMs (skinny_gemm option; prefill: cuBLAS); PDL launches (pdl option): the
        # same body runs warm-up, capture and eager steps, so graph and eager launch alike;
        # l2_prefetch option: o_proj weights into L2 on a side stream (decode only)
        with self.skinny.decoding(), pdl.scope(self.pdl_mode, self.pdl_budget), \
                self.l2.decoding():
            tok, lp = compute(st.tokens, st.pos, st.block_table, st.is_pad, st.temperature,
                              st.min_p, st.top_k, st.top_p, st.seeds, st.gen_idx, use_sort)
        st.out_tok.index_copy_(1, st.col, tok.unsqueeze(1))
        st.out_lp.index_copy_(1, st.col, lp.unsqueeze(1))
        st.col.add_(1)
        st.tokens.copy_(tok)
        st.pos.add_(1)
        st.gen_idx.add_(1)

    def _decode_compute(self, tokens: Any, pos: Any, block_table: Any, is_pad: Any,
                        temperature: Any, min_p: Any, top_k: Any, top_p: Any, seeds: Any,
                        gen_idx: Any, use_sort: bool) -> tuple[Any, Any]:
        """One decode step for ``[B]`` rows: slots, paged block mask, forward, sample."""
        import torch
        ps, m = self.opt.page_size, self.model
        slots = slot_mapping(block_table, pos, ps)
        if self.decode_attention == "sdpa":  # the rows' pages only (attention.SdpaMask)
            attn = layer_masks(m, lambda extra: decode_sdpa_mask(
                block_table, pos, self.window_pages, ps, extra), is_decode=True)
        elif self.paged_decode is not None:  # padded rows: all-null block_table, pos + 1 slots
            attn = AttnBatch([None] * len(m.layers), True,
                             paged_decode=self.paged_decode.bind(block_table, pos + 1))
        else:
            used = pos // ps + 1
            p2l = phys_to_logical(block_table, used, self.opt.num_pages)
            p2l[:, 0] = torch.where(is_pad, 0, -1)  # padded rows read only the null page
            attn = layer_masks(m, lambda extra: decode_block_mask(
                p2l, block_table, used, pos, ps, self.kv.num_slots, extra), is_decode=True,
                kernel_options=self.flex_decode_options)
        hidden = m.forward(tokens, pos, slots, attn, self.kv)
        return m.fx_decode.sample(
            m.logits(hidden, upcast=False), temperature, min_p, top_k, top_p, seeds, gen_idx,
            use_sort=use_sort,
            full_logprobs=True)  # lp [B, 2]: (filtered, full softmax), sampler docstring

    def _capture(self, st: DecodeState, use_sort: bool) -> None:
        """Capture this bucket's step (:mod:`.decode_graphs`); ``st.graph`` stays ``None``
        (eager steps, same tokens) when capture fails, until the weights' storage changes."""
        st.is_pad.fill_(True)
        st.block_table.zero_()
        if self.paged_decode is not None and self.paged_decode.shared_prefix:
            self.paged_decode.load_groups(st.rows, [])  # capture with no groups

        def reset() -> None:
            st.col.zero_()
            st.pos.zero_()
        st.graph = capture_or_eager(lambda: capture_graph(
            lambda: self._step_body(st, use_sort), reset, self.graph_pool), self.model, st.rows)
        st.signature = self.model.signature()
        if st.graph is not None:
            self.graph_pool = self.graph_pool or st.graph.pool()  # one pool for every bucket
            self.timings["graph_captures"] += 1
