"""Engine options (:class:`RunnerOptions`) and the static device buffers of one decode batch
bucket (:class:`DecodeState`); used by ``model_runner.py``. What ``"auto"`` resolves to:
:mod:`nbhelpers.engine.runner_resolve`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from nbhelpers.engine.kernels import pdl as pdl_launch  # pure python, no triton at import
from nbhelpers.engine.kernels.paged_decode_plan import (  # pure python, no triton
    check_shared_prefix,
    pick_kernel,
)
from nbhelpers.engine.l2_prefetch import check_l2_prefetch  # pure python, no torch at import
from nbhelpers.engine.lora import (
    LORA_DTYPES,
    LORA_EXPAND_MODES,
    LORA_FUSED_MODES,
    check_lora_dtype,
    check_lora_expand,
    check_lora_fused,
)
from nbhelpers.engine.lora_pending import CONSUMER_MAX_ROWS  # pure python, no torch at import
from nbhelpers.engine.mlp_block import check_mlp_block  # pure python, no torch at import
from nbhelpers.engine.prefill_fa4 import check_fa4_importable  # pure python, no torch
from nbhelpers.engine.runner_option_hints import check_kernel_option_keys, with_yaml_bool_hint
from nbhelpers.engine.sampler import check_sample_kernel  # torch imported lazily there
from nbhelpers.engine.skinny_linear import (
    SKINNY_GEMM_MODES,
    check_skinny_gemm,
    check_skinny_gemm_cublas,
    check_skinny_gemm_max_rows,
)

FUSED_ELEMENTWISE = ("auto", "compile", "triton", "off")
PREFILL_ELEMENTWISE = ("off", "triton")
DECODE_ATTENTION = ("auto", "flex", "triton", "sdpa")
PREFILL_ATTENTION = ("auto", "flex", "sdpa", "fa4")
PREFILL_GRAPHS = ("off", "on", "auto")


@dataclass
class RunnerOptions:
    """Engine options. ``use_cuda_graphs``/``compile_attention``: ``None`` = on iff CUDA
    (``use_cuda_graphs=True`` for a model off CUDA: ``LLM`` raises ValueError at construction).

    ``compile_decode``: torch.compile the whole decode step (needs ``compile_attention``);
    ``decode_attention``: ``"flex"`` (flex_attention over a paged BlockMask), ``"triton"``
    (split-KV kernel of ``engine/kernels/paged_decode.py``; prefill stays flex) or ``"auto"`` (triton on
    CUDA when the triton package imports, else flex); ``decode_kernel_options``:
    the decode kernel's options (flex: e.g. DESIGN.md's ``num_warps``; triton:
    ``paged_decode.KERNEL_OPTIONS``);
    ``compile_layers``: torch.compile the decode step's norm/RoPE/SwiGLU pieces and sampler
    (``None`` = on iff CUDA; see ``engine/fused.py``); ``lora_expand``: LoRA B per projection
    group as ``"addmm"`` (one ``addmm_`` per part), ``"triton"`` (one kernel per group on CUDA,
    ``engine/kernels/lora_expand.py``; falls back to ``addmm`` for unsupported shapes; fp32 adapters on a
    16-bit base also get LoRA A as one kernel, ``engine/kernels/lora_shrink.py``) or ``"auto"``
    (``"consumer"`` on CUDA with triton, else addmm; H200 A/B with ``pdl="early"`` in
    :attr:`pdl`: batch 4 fp32 adapters 3.52 -> 3.29 ms a step; the first consumer design, all
    four groups deferred, had lost at batch 4, step ``n1c``, 2026-12-01), or ``"consumer"``:
    ``"triton"``, except that decode groups of at most
    ``lora_pending.CONSUMER_MAX_ROWS`` rows leave LoRA B to the kernel that reads the projection
    next (SiLU x up for gate_up, q/k norm + RoPE + KV write for qkv; add+RMSNorm for o/down
    only from :attr:`lora_consumer_one_part_rows` rows), removing two expand launches a decode
    layer (four there); it needs
    ``fused_elementwise="triton"`` (else, and for prefill, Gemma-4 and unsupported shapes, it
    runs as ``"triton"``: same result), or ``"epilogue"`` (opt-in, not yet measured on the
    H200): ``"triton"``, except that decode groups whose ``ext`` GEMM the skinny kernel serves
    add LoRA B in that kernel's epilogue, one launch a group
    (``engine/kernels/skinny_lora_epilogue.py``); ``lora_fused``: decode GEMMs (<= 64 rows) as one
    base + LoRA Triton kernel per projection group, ``engine/kernels/lora_gemm.py``, each shape
    tuned once against the cuBLAS path and the choice cached on disk
    (``engine/kernels/lora_gemm_tune.py``): ``"triton"``, ``"off"`` (the default) or ``"auto"``,
    which resolves to ``"off"``: in the H200 A/B (``scripts/device/ab_lora_gemm.py``,
    2026-12-01) the 36 layers' fused GEMMs took 10.0-11.0 ms at batch 4 against 3.02 ms for
    cuBLAS + LoRA shrink/expand, so it stays off until a faster kernel wins there.

    Why ``auto`` picks triton on CUDA: H200 A/B at workload W with LoRA r32, 2026-11-30
    (``executed/phase3_flex/bench/ab_20261130T084802Z``): flex+addmm 5,066 tok/s, triton decode
    5,346, triton LoRA-B 5,347, both 5,759 (+13.7 %), every variant with identical greedy tokens
    to HF/PEFT on a tiny fp32 model (max |dlogprob| 4.8e-7).
    """

    page_size: int = 128
    num_pages: int = 256
    max_model_len: int = 2048
    sync_every: int = 32
    use_cuda_graphs: bool | None = None
    compile_attention: bool | None = None
    fuse_lora_a: bool = True
    prefill_pad: int = 128
    compile_decode: bool = False
    compile_layers: bool | None = None
    fused_elementwise: str = "auto"
    """Decode's norm/RoPE/SwiGLU pieces: ``"compile"`` (torch.compiled, ``engine/fused.py``),
    ``"triton"`` (``engine/fused.py`` ``triton_*`` over ``engine/kernels/fused_norm.py`` and
    ``qk_rope_cache.py``: add+RMSNorm, q/k norm + RoPE + KV
    write and SiLU x up, one launch each; CUDA, or the CPU under ``TRITON_INTERPRET=1``),
    ``"off"`` (eager) or ``"auto"``: ``"triton"`` on CUDA when triton imports, else
    ``"compile"`` iff ``compile_layers`` resolves on, else ``"off"``. Why triton on CUDA: H200
    A/B, 2026-12-01, Qwen3-4B random bf16 weights, 256 new tokens, triton elementwise + decode
    v2 against compile + decode v1 (``scripts/bench_flex.py``, step ``m1`` of
    ``scripts/device/step_table.py``): batch 4 fp32 adapters 5.93 -> 5.63 ms a step (elementwise
    0.72 -> 0.41 ms, 1,020 -> 912 kernels), batch 32 bf16 adapters 4.89 -> 4.49 ms, batch 64 no
    LoRA 4.92 -> 4.39 ms; greedy tokens identical to eager for Qwen3, Llama and Gemma-4 on the
    GPU (``tests/engine/test_fused_kernels.py``)."""
    prefill_elementwise: str = "off"
    """Prefill's norm/RoPE/SwiGLU pieces: ``"off"`` (the default: eager torch ops, ``fused.py``,
    bit-identical to the HF modules) or ``"triton"`` (opt-in: the decode set's Triton kernels,
    ``fused_elementwise="triton"``'s add+RMSNorm, q/k norm + RoPE + KV write and SiLU x up, one
    launch each at any token count; CUDA, or the CPU under ``TRITON_INTERPRET=1``; Gemma-4's
    prefill keeps its modules). Why ask: a Qwen3-4B-shaped prefill with PEFT r32 adapters runs
    2,205 aten ops, 1,664 of them these pieces (26 a layer for q/k norm + RoPE, 18 for the two
    add+RMSNorms; ``scripts/count_prefill_ops.py``, CPU, 2026-12-02), about 180 with the kernels;
    prefill is eager, so each op is a host launch (H200 phase 2: ~0.10 s a prefill). Not the
    default: no H200 A/B yet, and the kernels equal the torch ops up to rounding only."""
    prefill_graphs: str = "auto"
    """Prefill as one CUDA graph per bucket (padded token count, prompt count, flex kernel;
    ``engine/prefill_graphs.py``): ``"auto"`` (the default: on wherever it can run, i.e. CUDA
    graphs in use (a CUDA model, ``use_cuda_graphs`` None or True) and compiled flex prefill
    (``compile_attention`` None or True: eager flex copies from the host), else off;
    and off for good after the first :meth:`~nbhelpers.engine.LLM.sleep`, which drops the graphs:
    re-capturing every rollout costs more than it saves), ``"on"`` (``ValueError`` at
    construction without CUDA graphs or flex prefill, or with :attr:`prefill_graph_max_tokens`
    below :attr:`prefill_pad` (no padded prefill would fit); with uncompiled flex it tries, and
    the capture fails with a warning and prefills eagerly (torch's eager flex copies from the
    host); kept after a sleep) or ``"off"`` (eager prefill). Why: an eager prefill is ~2,200
    host-bound launches; on the H200 (2026-12-03, step ``s13f``, Qwen3-4B, 4 GRPO prompts, PEFT
    fp32 adapters) the graph took a rollout's prefill from 56 to 27 ms (rollout 0.938 -> 0.907
    s), same tokens (``tests/engine/test_prefill_graphs.py``). Buckets over
    :attr:`prefill_graph_max_tokens` prefill eagerly."""
    prefill_graph_max_tokens: int = 4096
    """Largest padded prefill (tokens) served by a CUDA graph; larger ones run eagerly. Why a
    cap: a captured bucket's activations stay reserved in the engine's private graph pool (the
    trainer's allocations cannot reuse them, unlike eager prefill's freed blocks), ~58 KB a token
    for Qwen3-4B's MLP alone (2 x 9,728 bf16 gate/up + the product), so 4,096 tokens ~ 0.25 GB;
    and a long prefill is compute-bound, where the graph saves little. int >= 1; with
    ``prefill_graphs="on"`` at least :attr:`prefill_pad` (``"auto"`` leaves a smaller cap as
    "capture nothing")."""
    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    """``"flex"`` (packed document-causal BlockMask), ``"sdpa"`` (per-request causal SDPA over
    the request's own pages, ``attention.prefill_sdpa_mask``) or ``"auto"`` (sdpa on the CPU
    when the model's score_mod/masks allow it, else flex). Decode ``"sdpa"``: the rows' pages
    gathered into ``[B, H_kv, L, D]`` + SDPA (CPU; needs ``use_cuda_graphs`` off). Why auto
    picks sdpa on the CPU: eager flex_attention scores the whole pool (SmolLM2-135M fp32, one
    69-token prompt, 32 tokens: 140 s vs HF 1.9 s; ``scripts/cpu_speed.py``). ``"fa4"``:
    FlashAttention-4's varlen kernel over the packed prompts (``engine/prefill_fa4.py``; CUDA
    compute capability 9/10, bf16/fp16, FA4 head dims, so not Gemma-4 E2B; ImportError naming
    how to stage the fa4 bundle when ``flash_attn.cute`` is missing). ``"auto"`` stays flex on
    CUDA until an H200 A/B (notebook 33) shows FA4's prefill faster."""
    decode_kernel_options: dict | None = None
    lora_expand: str = "auto"
    lora_fused: str = "off"
    lora_dtype: str = "auto"
    """What LoRA is computed in (``engine/lora.py`` ``LiveGroup.set_lora_dtype``): ``"adapter"``
    (PEFT's dtype order on the trainer's own tensors: TRL's fp32 adapters read as fp32 every
    decode step), ``"model"`` (fp32 adapters on a 16-bit base computed in the base dtype from
    shadow copies re-copied whenever the trainer's tensors changed: vLLM likewise runs LoRA in
    the model dtype) or ``"auto"``: ``"model"`` on CUDA, ``"adapter"`` elsewhere (CPU models are
    fp32, nothing to shadow). Why: fp32 adapters cost +2.1 ms a decode step over cuBLAS alone at
    batch 4 on the H200 against +0.5 ms for bf16 ones (``scripts/device/ab_lora_gemm.py``,
    2026-12-01)."""
    lora_consumer_one_part_rows: int = 0
    """With ``lora_expand="consumer"`` (or ``"auto"`` resolving to it): the one-part groups
    (o_proj, down_proj) also leave LoRA B to the add+RMSNorm kernel that reads their output next
    (``kernels/fused_norm.py`` ``add_norm(lora=...)``) in decode batches of at least this many
    rows and at most ``lora_pending.CONSUMER_MAX_ROWS`` (64); ``0`` (the default): never, they
    keep their expand launch (``lora_pending.DEFER_MIN_PARTS``). An int >= 0; no effect with
    another ``lora_expand``. Why ask: Qwen3-4B, LoRA r32, bf16 adapters, batch 64 (H200, git
    2052410, 33_flex_vs_baselines, 2026-12-07): the LoRA kernels cost +0.45 ms a decode step,
    0.21 ms of it the 72 ``_lora_expand_gemm`` launches of o_proj and down_proj. Their
    add+RMSNorm runs one program per row, each reading all of B, which lost 0.9 ms a step at
    batch 4 (issue 12, the first consumer mode); at 32-64 rows the programs are many and the
    trade may flip. It did not on the H100 (step ``n23ab``, git 8d7b0e1, 2026-12-07, PEFT fp32
    adapters, one process per variant): batch 32 decode step 5.107 -> 5.392 ms (72 expand
    launches fewer, GEMM class -0.19 ms, but add+RMSNorm +0.49 ms), batch 64 5.964 -> 6.285 ms,
    batch 4 unchanged; so the default stays 0."""
    skinny_gemm: str = "auto"
    """Decode GEMMs of at most 16 rows (every projection group's base GEMM, LoRA A's ``ext``
    rows included, and the LM head; 16/32-bit weights, CUDA or ``TRITON_INTERPRET=1``) as one
    split-K Triton launch each (``engine/kernels/skinny_gemm.py``, ``engine/skinny_linear.py``),
    each shape tuned once with cold weights against cuBLAS and the choice cached on disk
    (``engine/kernels/skinny_gemm_tune.py``; cuBLAS kept where it wins): ``"triton"``, ``"off"``
    or ``"auto"`` (the default): ``"triton"`` on CUDA for 16/32-bit models when the triton
    package imports, else ``"off"``. Why: the engine A/B on the H200 (``scripts/bench_flex.py
    --points qwen3-4b:fp32:4,qwen3-4b:none:4``, one process per variant, 256 new tokens,
    2026-12-01, step ``n1d`` of ``docs/h200_runbook.md``): Qwen3-4B batch 4 decode step 3.99 ->
    3.77 ms with PEFT fp32 adapters and 3.47 -> 3.26 ms without LoRA, 624 -> 551 and 480 -> 407
    kernels a step. Prefill, more than ``skinny_gemm_max_rows`` rows and ``compile_decode``
    keep cuBLAS."""
    skinny_gemm_max_rows: int = 32
    """Most rows a decode GEMM may have for ``skinny_gemm``: 32 (the default: the kernel's
    32-row tile serves 17-32 rows), 16, or 64 (its 64-row tile serves 33-64 rows too, against
    cuBLAS in the tuner; opt-in, added 2026-12-07 and not yet A/B'd on a GPU: step ``n24r``). Why 32: the engine A/B on the H200 (``scripts/
    bench_flex.py --points qwen3-4b:bf16:32,qwen3-4b:none:32 --variants ...
    {"skinny_gemm_max_rows": 32}``, one process per variant, 256 new tokens, 2026-12-01, step
    ``n8s`` of ``docs/h200_runbook.md``): Qwen3-4B batch 32 decode step 4.50 -> 4.40 ms with bf16
    adapters and 4.00 -> 3.89 ms without LoRA (GEMM class 3.15 -> 3.06 and 2.69 -> 2.58 ms).
    ``engine/skinny_linear.py`` ``SkinnyLinear``."""
    skinny_gemm_cublas: str = "auto"
    """Whether ``skinny_gemm``'s tuner may keep cuBLAS for a shape: ``"auto"`` (the default:
    where it times fastest) or ``"never"`` (an A/B knob: every shape the skinny path serves runs
    its fastest correct Triton config, tuned under its own cache key; no cuBLAS launch breaks
    the ``pdl`` chain). Why ask: on the H200 (2026-12-02 profile, Qwen3-4B) the tuner kept
    cuBLAS for qkv at batch 4 and o/down_proj at batch 32. A/B (steps ``n15a``/``n15b``,
    2026-12-02, 256 new tokens, one process per variant): batch 4 fp32 adapters 3.67 -> 3.63 ms,
    batch 4 no LoRA 3.20 -> 3.22, batch 32 bf16 adapters 4.40 -> 4.42: within noise, so
    ``"auto"`` stays the default. With
    ``skinny_gemm="off"`` ``"never"`` is refused (``ValueError``); where ``"auto"`` resolves the
    skinny path off (the CPU) it has no effect (``tuner_tables.resolved_kernels`` records it)."""
    pdl: str = "auto"
    """Programmatic Dependent Launch of the decode step's Triton kernels (skinny GEMM, LoRA
    shrink/expand, add+RMSNorm, act x up, q/k norm + RoPE + KV write, paged decode stages 1 and
    2; ``engine/kernels/pdl.py``): each may start while the kernel before it finishes, waits
    (``griddepcontrol.wait``) before touching what that kernel may write, and lets the next one
    start after its main loop. ``"on"``, ``"off"``, ``"early"``, ``"prefetch"`` (opt-in, below)
    or ``"auto"`` (the default) = ``"early"``: ``"on"`` plus the weights (LoRA B, RMSNorm and q/k-norm weights) of
``lora_expand``, add+RMSNorm, q/k norm + RoPE and the gate_up consumer loaded before the wait
(``PREWAIT``, ``pdl.py``'s kernel rules). H200 A/B (step ``n16d``, 2026-12-02,
``scripts/bench_flex.py``, one process per variant, 256 new tokens): batch 4 PEFT fp32 adapters
3.54 -> 3.41 ms (3.32 with ``lora_expand="consumer"``), batch 32 bf16 adapters 4.22 -> 4.14
(4.11), batch 4 no LoRA 3.04 -> 3.04; again at f9ebd10 (step ``n17a``) with
``lora_expand="consumer"`` against the old defaults (``"on"``, ``"triton"``): batch 4 fp32
adapters 3.52 -> 3.29 ms, batch 32 bf16 adapters 4.21 -> 4.09, batch 4 no LoRA 3.03 -> 3.04
(noise). The default since that run, whose GPU suite passed ``test_gpu_pdl_early_matches_on``
(greedy tokens equal and logprobs within 1e-6 of ``"on"`` under CUDA graphs, bf16 + fp32
adapters and fp32, consumer and triton) after the fix of the bf16 gap seen in ``n16a`` (up to
1.9e-3: LLVM had contracted the other RoPE product into the bf16 fma in the early build of
``qk_rope_cache``, now launched without contraction, ``qk_rope_cache.FP_FUSION``). Why ``"on"``:
    the engine A/B on the H200 (``scripts/bench_flex.py --points qwen3-4b:fp32:4,qwen3-4b:none:4
    --variants ... {"pdl": "on"}``, one process per variant, 256 new tokens, 2026-12-01, step
    ``n8p`` of ``docs/h200_runbook.md``): Qwen3-4B batch 4 decode step 3.77 -> 3.65 ms with PEFT
    fp32 adapters and 3.27 -> 3.24 ms without LoRA. PDL needs compute capability >= 9 (Hopper)
    at runtime and applies to decode steps only (warm-up, CUDA-graph capture, eager steps;
    prefill keeps ordinary launches); on the CPU, under ``TRITON_INTERPRET=1``, on older GPUs
    and with ``compile_decode`` (torch.compile's Triton wrapper takes no ``launch_pdl``) both
    ``"on"``, ``"early"`` and ``"auto"`` resolve to off without an error (:func:`resolve_pdl`).
    ``"prefetch"`` (opt-in: slower on the H200): ``"early"`` plus the weight prefetch of
    ``pdl.py``'s last section: add+RMSNorm, act x up (and its LoRA consumer) and both paged
    decode stages let the next kernel launch at their start, and the skinny GEMM pulls the next
    K tiles of its weights into L2 before its wait (:attr:`pdl_prefetch_mib` per GEMM); same
    tokens and logprobs as ``"early"``. It resolves to off where ``"early"`` does. H200 A/B
    (step ``s16p``, 2026-12-03, fc11f32, one process per variant, 256 new tokens): batch 4 PEFT
    fp32 adapters 3.31 ms (``"early"``) -> 3.40 ms (16 MiB; 3.34 at 8, 3.53 at 32, 3.32 with
    the triggers alone), batch 32 bf16 adapters 4.09 -> 4.13, batch 4 no LoRA 3.05 -> 3.11
    (``executed/phase3_flex/bench/ab_20261203T182613Z/table.md``); no variant faster than
    ``"early"``, 8 MiB and the triggers alone within the +-0.02 ms between processes."""
    pdl_prefetch_mib: int = 8
    """With ``pdl="prefetch"``: the L2 budget of one skinny GEMM's prefetch before its wait, in
    MiB (an int in [0, 1024]; 0 keeps the early launches without the prefetch), split over its
    programs (``kernels/skinny_gemm.py`` ``prefetch_tiles``). Why 8: the H200 A/B (:attr:`pdl`,
    run with 16 as the default then) found 8 within noise of no prefetch and 16 and 32 slower;
    ~8 MB is about what HBM delivers (~4 TB/s) in the ~2 us before a decode GEMM's wait. Ignored
    with any other ``pdl``."""
    sample_kernel: str = "auto"
    """Decode sampling: ``"torch"`` (``engine/sampler.py`` ``sample``, compiled with the decode
    pieces when ``compile_layers``), ``"triton"`` (steps whose rows use no top-k/top-p,
    ``use_sort=False``: GRPO's min_p sampling, run the split-vocabulary kernel pair of
    ``engine/kernels/vocab_sample.py``, same tokens and logprobs, on CUDA or under
    ``TRITON_INTERPRET=1``) or ``"auto"`` (the default): ``"triton"`` on CUDA when the triton
    package imports, else ``"torch"``. Other steps, other devices and ``compile_decode`` keep
    ``"torch"`` (:func:`resolve_sample_kernel`). Why: the H200 A/B (``scripts/bench_flex.py
    --points qwen3-4b:fp32:4,qwen3-4b:none:4`` and ``qwen3-4b:bf16:32``, one process per variant,
    256 new tokens, 2026-12-02, steps ``n15a``/``n15b`` of ``docs/h200_runbook.md``): the decode
    step 3.67 -> 3.52 ms (batch 4, PEFT fp32 adapters), 3.20 -> 3.05 ms (batch 4, no LoRA), 4.40
    -> 4.24 ms (batch 32, bf16 adapters); the sampler 0.137 -> 0.017 ms a step at batch 4 (one
    77 us compiled row reduction and ~10 kernels -> 2 launches); its GPU parity tests passed in
    the same session (``n14a``)."""
    mlp_block: str = "off"
    """``"off"`` (the default) or ``"triton"`` (opt-in): decode MLPs of at most 16 rows
    (gate_up GEMM, SiLU x up, down GEMM; no LoRA or one adapter on gate, up and down: fp32,
    its bf16 shadows, or 16-bit) as one Triton launch, the down GEMM split over the intermediate
    columns into an fp32 accumulator that the next add+RMSNorm rounds (``engine/mlp_block.py``,
    ``engine/kernels/mlp_block.py``). Needs the Triton elementwise kernels (``fused_elementwise``
    "triton", or "auto" on CUDA); serves nothing with ``compile_decode``, above 16 rows or for a
    non-SiLU MLP (Gemma-4), and warns once per reason for layers it cannot serve (partial LoRA
    targets, an MLP bias, rank > 64), where the unfused path runs. Why ask: the kernel alone ran 56.1 us against 64.3
    (cuBLAS) and 65.2 (the skinny kernels) at Qwen3-4B's MLP, 4 rows, cold weights (H100,
    2026-12-08, ``scripts/device/ab_mlp_block.py``); the engine A/B is
    ``scripts/bench_flex.py --variants '{"name": "mlp_block", "options": {"mlp_block":
    "triton"}}'``."""
    l2_prefetch: str = "off"
    """``"off"`` (the default) or ``"o_proj"`` (opt-in; it loses on the H200, below): in each
    decode step, after layer ``i``'s qkv GEMM a side stream reads layer ``i``'s o_proj weight
    buffer (``[W; A]`` when LoRA A rides in the GEMM) into L2 while attention runs, joined
    before o_proj (``engine/l2_prefetch.py``, ``engine/kernels/l2_prefetch.py``). Why: at batch 4
    on the H200 (2026-12-02 profile, Qwen3-4B) o_proj took 9.1 us for 21.2 MB with cold weights
    while the ~9 us of q/k norm + RoPE and paged attention before it read ~4.5 MB; at batch >=
    32 attention is bandwidth-bound itself, so expect no gain there. Measured (step ``n15a``,
    2026-12-02, ``scripts/bench_flex.py``, one process per variant): batch 4 decode step 3.67 ->
    4.16 ms with PEFT fp32 adapters and 3.20 -> 3.67 ms without LoRA; o_proj's GEMM time fell
    (GEMM class 3.01 -> 2.91 ms) but the 36 prefetch launches took 0.84 ms (elementwise class
    0.30 -> 1.14 ms) and did not hide behind attention. Runs on CUDA only (decode
    warm-up, capture and eager steps; not prefill, Gemma-4's own attention block, the CPU,
    ``TRITON_INTERPRET=1`` or ``compile_decode``), silently off elsewhere
    (:func:`resolve_l2_prefetch`)."""
    pause_gc: bool = False
    """Automatic Python garbage collection off during ``LLM.generate``'s scheduling loop
    (restored after it, exception or not; ``engine/gc_watch.py``). Every call reports the loop's
    collections either way (``gc_s``, ``gc_collections``, ``gc_gen2`` in ``LLM.last_stats``).
    Why ask: single timed rounds of the H200 run of 2026-12-07 (33, git 2052410) took 0.2-0.3 s
    longer than their twin with no kernel to show for it; vLLM freezes its heap after warm-up
    against such pauses (``vllm/utils/gc_utils.py`` ``freeze_gc_heap``). H100 A/B (step
    ``n23ab``, git 8d7b0e1, 2026-12-07): the slow rounds were full collections of 0.32-0.48 s;
    with ``pause_gc`` no round held one (batch 32 rounds 2.857 / 2.821 s against 3.148 / 2.837 s),
    the decode step unchanged, but the collection only moves after ``generate``: see
    ``freeze_gc``, which removes the work. Off by default."""
    freeze_gc: bool = False
    """After the first ``LLM.generate`` of this engine (its warm-up: kernels compiled, decode
    graphs captured, the pool built), freeze the process's Python heap as vLLM's engine core
    does once it is built (``engine/gc_watch.py`` :func:`~nbhelpers.engine.gc_watch.
    freeze_gc_heap`: collect every generation, then ``gc.freeze()``), so later full collections
    no longer walk the model's, the trainer's and the libraries' long-lived objects. Once per
    ``LLM``; that call's ``last_stats`` gets ``gc_frozen`` (objects frozen) and ``gc_freeze_s``.
    Why ask: a full collection held 0.32-0.48 s of single timed rounds on the H100 (33, git
    8d7b0e1, 2026-12-07; numbers in ``gc_watch.py``), and vLLM colocate runs with its heap frozen.
    Process-wide: reference cycles among objects alive at that moment are never collected. Off
    by default until an A/B on the H200 (step ``n24g`` of ``scripts/device/step_table.py``)."""
    prefill_kernel_options: dict | None = field(default_factory=lambda: {
        "BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4})
    """flex prefill tiles on CUDA: the default config needed 256 KiB shared memory for head_dim 128
    on the H200 (limit 227 KiB; measured 2026-11-30), so smaller tiles."""

    def __post_init__(self) -> None:
        import dataclasses
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        try:
            check_kernel_option_keys(values, values)
            self._check()
        except ValueError as err:  # a YAML boolean where a word was meant: say how to quote it
            strings = [f.name for f in dataclasses.fields(self) if isinstance(f.default, str)]
            if (hinted := with_yaml_bool_hint(str(err), values, strings)) == str(err):
                raise
            raise ValueError(hinted) from None

    def _check(self) -> None:
        import dataclasses
        for f in dataclasses.fields(self):  # a string such as 'no' is truthy: it would mean True
            value, optional = getattr(self, f.name), f.type == "bool | None"
            if f.type in ("bool", "bool | None") and not (
                    isinstance(value, bool) or optional and value is None):
                raise TypeError(f"RunnerOptions.{f.name}={value!r}: pass True or False"
                                f"{' (or None: the default, decided by the device)' if optional else ''}"
                                f"; got {type(value).__name__}"
                                f"{', and any non-empty string counts as True' if isinstance(value, str) else ''}.")
        # page 0 is the null page, so a usable pool needs at least 2
        for name, low in (("page_size", 1), ("num_pages", 2), ("max_model_len", 1),
                          ("sync_every", 1), ("prefill_pad", 1),
                          ("prefill_graph_max_tokens", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"RunnerOptions.{name}={value!r}: must be an int >= {low}.")
        if self.prefill_graphs == "on" and self.prefill_graph_max_tokens < self.prefill_pad:
            raise ValueError(f"RunnerOptions.prefill_graph_max_tokens="
                             f"{self.prefill_graph_max_tokens} < prefill_pad={self.prefill_pad}: "
                             "every padded prefill is larger than the cap, so "
                             "prefill_graphs='on' would capture nothing; raise "
                             "prefill_graph_max_tokens (or use prefill_graphs='auto' / 'off').")
        if self.compile_decode and self.compile_attention is False:
            raise ValueError("RunnerOptions.compile_decode=True compiles the whole step with "
                             "flex_attention inside: leave compile_attention None or True.")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"RunnerOptions.decode_attention={self.decode_attention!r}: must be "
                             f"one of {DECODE_ATTENTION}.")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"RunnerOptions.prefill_attention={self.prefill_attention!r}: must "
                             f"be one of {PREFILL_ATTENTION}.")
        if self.prefill_attention == "fa4":
            check_fa4_importable()  # before any weights load (backends/flex.py _preflight)
        if self.decode_attention == "triton" and importlib.util.find_spec("triton") is None:
            raise ImportError("RunnerOptions.decode_attention='triton' needs triton: "
                              "pip install triton (GPU hosts: the gpu extra pins it).")
        for name, modes, check in (("lora_expand", LORA_EXPAND_MODES, check_lora_expand),
                                   ("lora_fused", LORA_FUSED_MODES, check_lora_fused),
                                   ("lora_dtype", LORA_DTYPES, check_lora_dtype),
                                   ("skinny_gemm", SKINNY_GEMM_MODES, check_skinny_gemm)):
            value = getattr(self, name)
            if value not in ("auto", *modes):
                raise ValueError(f"RunnerOptions.{name}={value!r}: must be one of "
                                 f"{('auto', *modes)}.")
            if value != "auto":
                check(value)
        for name in ("decode_kernel_options", "prefill_kernel_options"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"RunnerOptions.{name}={value!r}: must be a dict of kernel "
                                 "options or None, e.g. {'kernel': 'v2'} or {'num_warps': 8}.")
        if self.decode_kernel_options and "kernel" in self.decode_kernel_options:
            pick_kernel(self.decode_kernel_options["kernel"], 1)  # ValueError naming the choices
        check_shared_prefix(self.decode_kernel_options or {}, self.decode_attention)
        rows = self.lora_consumer_one_part_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"RunnerOptions.lora_consumer_one_part_rows={rows!r}: must be an int "
                             ">= 0 (decode rows from which o_proj/down_proj leave LoRA B to "
                             "add+RMSNorm with lora_expand='consumer'), e.g. 16; 0 (the "
                             "default) keeps their expand launch.")
        if rows and self.lora_expand not in ("auto", "consumer"):  # an A/B would measure nothing
            raise ValueError(f"RunnerOptions.lora_consumer_one_part_rows={rows} with "
                             f"lora_expand={self.lora_expand!r}: only the consumer mode defers "
                             "LoRA B; use lora_expand='consumer' (or 'auto'), or drop "
                             "lora_consumer_one_part_rows.")
        if rows > CONSUMER_MAX_ROWS:
            raise ValueError(f"RunnerOptions.lora_consumer_one_part_rows={rows}: above "
                             f"lora_pending.CONSUMER_MAX_ROWS={CONSUMER_MAX_ROWS}, the most rows "
                             f"any group defers for, so it would never apply; use 1-"
                             f"{CONSUMER_MAX_ROWS} (or 0: never).")
        check_skinny_gemm_max_rows(self.skinny_gemm_max_rows, "RunnerOptions.skinny_gemm_max_rows")
        check_skinny_gemm_cublas(self.skinny_gemm_cublas, "RunnerOptions.skinny_gemm_cublas")
        if self.skinny_gemm_cublas == "never" and self.skinny_gemm == "off":
            raise ValueError("RunnerOptions.skinny_gemm_cublas='never' with skinny_gemm='off': "
                             "the skinny path is off, so every decode GEMM is cuBLAS; use "
                             "skinny_gemm='auto' (or 'triton'), or drop skinny_gemm_cublas.")
        if self.pdl not in ("auto", *pdl_launch.PDL_MODES):
            raise ValueError(f"RunnerOptions.pdl={self.pdl!r}: must be one of "
                             f"{('auto', *pdl_launch.PDL_MODES)}.")
        if (isinstance(self.pdl_prefetch_mib, bool) or not isinstance(self.pdl_prefetch_mib, int)
                or not 0 <= self.pdl_prefetch_mib <= 1024):
            raise ValueError(f"RunnerOptions.pdl_prefetch_mib={self.pdl_prefetch_mib!r}: must be "
                             "an int in [0, 1024] (MiB of L2 prefetch per decode GEMM; 16 is the "
                             "default, the H200's L2 is 50 MB).")
        check_l2_prefetch(self.l2_prefetch, "RunnerOptions.l2_prefetch")
        check_mlp_block(self.mlp_block, "RunnerOptions.mlp_block")
        _needs_triton("mlp_block", self.mlp_block, "off")
        if self.mlp_block == "triton" and self.fused_elementwise in ("compile", "off"):
            raise ValueError(f"RunnerOptions.mlp_block='triton' with fused_elementwise="
                             f"{self.fused_elementwise!r}: the block's fp32 output is rounded "
                             "by the Triton add+RMSNorm kernel; use fused_elementwise='triton' "
                             "(or 'auto' on CUDA), or mlp_block='off'.")
        check_sample_kernel(self.sample_kernel, "RunnerOptions.sample_kernel")
        _needs_triton("sample_kernel", self.sample_kernel, "torch")
        _one_of("prefill_elementwise", self.prefill_elementwise, PREFILL_ELEMENTWISE)
        _one_of("prefill_graphs", self.prefill_graphs, PREFILL_GRAPHS)
        _needs_triton("prefill_elementwise", self.prefill_elementwise, "off")
        _one_of("fused_elementwise", self.fused_elementwise, FUSED_ELEMENTWISE)
        _needs_triton("fused_elementwise", self.fused_elementwise, "compile")


def option_names() -> frozenset[str]:
    """The :class:`RunnerOptions` field names (what ``LLM(**options)`` accepts besides its own
    ``max_num_seqs``, ``max_prefill_tokens``, ``share_prefix``)."""
    import dataclasses
    return frozenset(f.name for f in dataclasses.fields(RunnerOptions))


class DecodeState:
    """Static device buffers of one batch bucket (inputs and outputs of the captured graph)."""

    def __init__(self, rows: int, max_pages: int, window: int, device: Any):
        import torch
        z = {"device": device}
        self.rows = rows
        self.tokens = torch.zeros(rows, dtype=torch.long, **z)
        self.pos = torch.zeros(rows, dtype=torch.long, **z)
        self.gen_idx = torch.zeros(rows, dtype=torch.long, **z)
        self.seeds = torch.zeros(rows, dtype=torch.long, **z)
        self.block_table = torch.zeros(rows, max_pages, dtype=torch.long, **z)
        self.is_pad = torch.ones(rows, dtype=torch.bool, **z)
        self.temperature = torch.ones(rows, **z)
        self.min_p = torch.zeros(rows, **z)
        self.top_p = torch.ones(rows, **z)
        self.top_k = torch.zeros(rows, dtype=torch.long, **z)
        self.out_tok = torch.zeros(rows, window, dtype=torch.long, **z)
        self.out_lp = torch.zeros(rows, window, 2, **z)  # (filtered, full) logprob, sampler.sample
        self.col = torch.zeros(1, dtype=torch.long, **z)
        self.graph: Any = None
        self.use_sort = True
        self.signature: tuple = ()


def _one_of(name: str, value: Any, choices: tuple) -> None:
    """``ValueError`` naming ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"RunnerOptions.{name}={value!r}: must be one of {choices}.")


def _needs_triton(name: str, value: Any, fallback: str) -> None:
    """``ImportError`` naming the fix when ``value`` asks for ``"triton"`` and it is not
    installed (``"auto"`` values fall back silently where they resolve)."""
    if value == "triton" and importlib.util.find_spec("triton") is None:
        raise ImportError(f"RunnerOptions.{name}='triton' needs triton: pip install triton, or "
                          f"use {name}='{fallback}'.")
