"""Split planning of the paged decode kernel (:mod:`.paged_decode`): pure host-side policy.

Constants and the ``num_splits`` / ``BLOCK_N`` heuristics of kernels "v1", "v2" and "fused"; no
torch or triton import, so the planners can be called (and tested) without them.
"""

from __future__ import annotations

PROGRAMS_PER_SM = 4
"""Stage-1 programs per SM the split heuristic aims at (a guess to measure on the H200)."""
MIN_SPLIT_TOKENS = 64
"""Split count upper bound: no split shorter than this many tokens of ``max_model_len``."""
MAX_SPLITS = 16
TARGET_WAVES = 2.0
"""Kernel "v2": stage-1 programs per SM the grid aims at (``B * H_kv * S >= 2 * num_SMs``)."""
MIN_SPLIT_TOKENS_V2 = 128
"""Kernel "v2": fewest tokens per split of a row (2 pages of 64 on the H200 configs)."""
KERNELS = ("v1", "v2", "fused")
DEFAULT_KERNEL = "auto"
"""The engine's choice per batch bucket (:func:`pick_kernel`): "v1" under
:data:`V2_MIN_BATCH` rows, "v2" from there."""
V2_MIN_BATCH = 16
"""Smallest batch bucket that gets kernel "v2" under ``kernel="auto"``. H200, 2026-12-01,
Qwen3-4B shapes, context ~400: ``scripts/device/ab_paged_decode.py`` gave v2 11 % faster at
batch 32-64 (20.7 vs 23.2 us a layer) and 7 % slower at batch 4; in the whole decode step
(``scripts/bench_flex.py``, profile) attention took 0.26 ms (v1) vs 0.30 (v2) at batch 4, 0.80 vs
0.73 at batch 32 and 1.24 vs 1.12 at batch 64. Batches 8 and 16 were not measured: 16 is the
midpoint, to be checked."""
KERNEL_OPTIONS = ("kernel", "num_splits", "BLOCK_N", "num_warps", "num_stages",
                  "programs_per_sm", "waves", "min_split_tokens", "shared_prefix")
RESIDENT_PROGRAMS = ((128, 5), (256, 4), (512, 3))
"""Kernel "fused": ``(max head dim, programs resident per SM)`` on the H200 at the default
``BLOCK_N``, 4 warps, 2 stages, from the sm_90 builds of ``_paged_attention_fused`` under
Triton 3.6 (the H200 image's; ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` and its
bundled ``ptxas -v``, no GPU; 2026-12-02): D 128 (BLOCK_N 64): 78-96 registers, 38.9 KB shared
-> 5 (65,536 / (96 x 128) registers; 5 x 39.9 KB of 228 KB); D 256 (BLOCK_N 32): 101-111
registers, 42.0 KB -> 4; D 512 (BLOCK_N 16): 140-144 registers, 49.7 KB -> 3. Stage 1 of v1/v2
gives the same counts. Re-derive after a Triton upgrade or another ``BLOCK_N``/``num_warps``."""


def check_shared_prefix(options: dict, decode_attention: str = "triton") -> None:
    """``decode_kernel_options["shared_prefix"]`` (absent: off): a bool, not with the "fused"
    kernel (:mod:`.paged_decode_prefix`), and only for the Triton decode kernel: with
    ``decode_attention`` "flex" or "sdpa" it would do nothing ("auto" is checked where it
    resolves: ``ModelRunner`` warns when it does not resolve to "triton").

    Raises:
        ValueError: naming the fix.
    """
    shared = options.get("shared_prefix", False)
    if shared is True and decode_attention in ("flex", "sdpa"):
        raise ValueError(f"decode_kernel_options shared_prefix=True is an option of the Triton "
                         f"decode kernel; decode_attention={decode_attention!r} would ignore it: "
                         "use decode_attention='triton' (or 'auto' on CUDA), or drop it.")
    if not isinstance(shared, bool):
        raise ValueError(  # noqa: TRY004 (every engine option error is a ValueError)
            f"decode_kernel_options['shared_prefix']={shared!r}: must be True or False.")
    if shared and options.get("kernel") == "fused":
        raise ValueError("decode_kernel_options: shared_prefix=True needs kernel 'auto', "
                         "'v1' or 'v2', not 'fused'.")


def pick_kernel(kernel: str, batch: int) -> str:
    """``"v1"`` or ``"v2"`` for one batch bucket: ``kernel`` itself unless it is ``"auto"``,
    which gives ``"v2"`` iff ``batch >= V2_MIN_BATCH``.

    Raises:
        ValueError: ``kernel`` is none of ``"auto"``, ``"v1"``, ``"v2"``.
    """
    if kernel == "auto":
        return "v2" if batch >= V2_MIN_BATCH else "v1"
    if kernel not in KERNELS:
        raise ValueError(f"decode_kernel_options['kernel']={kernel!r}: choose one of "
                         f"{['auto', *KERNELS]}.")
    return kernel


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Kernel "v1" splits per row: enough stage-1 programs to fill the GPU, none under 64 tokens.

    ``ceil(programs_per_sm * num_sms / (batch * num_kv_heads))``, clipped to
    ``[1, min(MAX_SPLITS, ceil(max_seq_len / MIN_SPLIT_TOKENS))]``. Qwen3-4B (8 KV heads) on the
    H200 (132 SMs) at batch 32: 3 splits (768 programs); batch 1, 1024 tokens: 16.
    """
    want = -(-programs_per_sm * num_sms // max(1, batch * num_kv_heads))
    return max(1, min(want, MAX_SPLITS, -(-max_seq_len // MIN_SPLIT_TOKENS)))


def plan_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                    waves: float = TARGET_WAVES,
                    min_split_tokens: int = MIN_SPLIT_TOKENS_V2) -> int:
    """Kernel "v2" grid splits: ``batch * num_kv_heads * S >= waves * num_sms`` programs.

    ``S = ceil(waves * num_sms / (batch * num_kv_heads))`` clipped to ``[1, min(MAX_SPLITS,
    ceil(max_seq_len / min_split_tokens))]``; ``S == 1`` runs without stage 2. The grid is static
    (CUDA graphs), the work is not: each row spreads its visible tiles over at most
    ``ceil(L_b / min_split_tokens)`` of the ``S`` splits (``MIN_SPLIT_TILES`` in the kernel), so
    a short row leaves its other programs empty. Follows SGLang's ``get_num_kv_splits`` (splits
    from batch x heads vs the device's SM count, per request from its length). H200 (132 SMs):
    Qwen3-4B (8 KV heads) at ``max_seq_len`` 1024: batch 32 -> 2, batch 64 -> 1, batch 4 -> 8
    (9 wanted, 1024 / 128 caps it); Gemma-4 E2B (1 KV head) batch 32 -> 8.
    """
    if batch < 1 or num_kv_heads < 1 or max_seq_len < 1 or num_sms < 1 or min_split_tokens < 1:
        raise ValueError(f"plan_num_splits: batch={batch}, num_kv_heads={num_kv_heads}, "
                         f"max_seq_len={max_seq_len}, num_sms={num_sms}, min_split_tokens="
                         f"{min_split_tokens}: all must be >= 1.")
    want = int(-(-waves * num_sms // (batch * num_kv_heads)))
    return max(1, min(want, MAX_SPLITS, -(-max_seq_len // min_split_tokens)))


def resident_programs(head_dim: int) -> int:
    """Programs of kernel "fused" an H200 SM holds at once at ``head_dim``
    (:data:`RESIDENT_PROGRAMS`)."""
    return next((n for d, n in RESIDENT_PROGRAMS if head_dim <= d), RESIDENT_PROGRAMS[-1][1])


def plan_num_splits_fused(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                       programs_per_sm: int, block_n: int) -> int:
    """Kernel "fused" splits: as many as one wave of resident programs holds, >= 1 tile each.

    ``S = floor(programs_per_sm * num_sms / (batch * num_kv_heads))`` clipped to ``[1,
    min(MAX_SPLITS, ceil(max_seq_len / block_n))]``: the grid never needs a second wave (a
    second wave of short programs is the tail that v1's ``4 x SMs`` target pays: 768 programs
    for 660 slots at batch 32), and below one wave more splits mean shorter serial chains per
    program (the small-batch case is latency-bound), while the in-kernel merge costs 4 B x D per
    extra split and head, not a launch. FlashInfer's decode planner does the same
    (``max_grid_size = num_blocks_per_sm * num_sm`` from the occupancy API, no split when
    ``batch * num_kv_heads >= max_grid_size``, else chunks sized so the work fits one grid;
    ``include/flashinfer/attention/scheduler.cuh``). H200 (132 SMs, 5 programs per SM at D 128:
    660 slots), Qwen3-4B (8 KV heads), ``max_seq_len`` 726 (workload W), ``block_n`` 64:
    batch 4 -> 12 (ceil(726 / 64) caps 20), 8 -> 10, 16 -> 5, 32 -> 2, 64 and up -> 1.

    Raises:
        ValueError: an argument below 1.
    """
    args = (batch, num_kv_heads, max_seq_len, num_sms, programs_per_sm, block_n)
    if min(args) < 1:
        raise ValueError(f"plan_num_splits_fused: batch, num_kv_heads, max_seq_len, num_sms, "
                         f"programs_per_sm, block_n = {args}: all must be >= 1.")
    fit = programs_per_sm * num_sms // (batch * num_kv_heads)
    return max(1, min(fit, MAX_SPLITS, -(-max_seq_len // block_n)))


def default_block_n(head_dim: int) -> int:
    """Keys per tile: 64 up to D 128, 32 at D 256, 16 above (shared memory per stage: K and V
    tiles ``2 * BLOCK_N * BLOCK_D * 2`` bytes = 32 KiB at bf16 for all three, so 2 stages fit
    the H200's 227 KiB with room for q and the layout conversions)."""
    return 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16


def plan_prefix_groups(keys: list[tuple[int, int] | None], group_max: int, page_size: int
                       ) -> tuple[list[list[int]], list[int], list[int]]:
    """The shared-prefix group table of one decode window (:mod:`.paged_decode_prefix`).

    ``keys[b]``: ``(first page, shared pages)`` of row ``b``'s prompt group (the samples of one
    prompt share its first ``shared pages`` full pages, ``scheduler._allocate_group``), or
    ``None`` (a row that shares nothing: a prompt with ``n == 1``, a resumed sequence, a padded
    row). Rows with the same key form a group; a group of one active row is no group (its row
    attends to all its keys in the split-KV kernel); a group of more than ``group_max`` rows is
    split into ``ceil(n / group_max)`` slots of near-equal size (9 -> 5 + 4), each reading the
    prefix once. Returns ``(group_rows, group_len, row_prefix)``: member rows per slot in row
    order, shared tokens per slot (``shared pages x page_size``), and per row its slot's shared
    tokens (0 outside any slot).

    With ``group_max >= 4`` every slot has at least 2 rows, so ``B // 2`` slots always hold
    the plan (:func:`.paged_decode_prefix.new_prefix_groups`).

    Raises:
        ValueError: ``group_max < 4`` or ``page_size < 1``.
    """
    if group_max < 4 or page_size < 1:
        raise ValueError(f"plan_prefix_groups: group_max={group_max}, page_size={page_size}; "
                         "need group_max >= 4 and page_size >= 1.")
    members: dict[tuple[int, int], list[int]] = {}
    for b, key in enumerate(keys):
        if key is not None and key[1] > 0:
            members.setdefault(key, []).append(b)
    group_rows, group_len, row_prefix = [], [], [0] * len(keys)
    for (_, pages), rows in members.items():
        if len(rows) < 2:
            continue
        n_slots = -(-len(rows) // group_max)
        size, extra = divmod(len(rows), n_slots)
        start = 0
        for s in range(n_slots):
            chunk = rows[start:start + size + (s < extra)]
            start += len(chunk)
            group_rows.append(chunk)
            group_len.append(pages * page_size)
            for b in chunk:
                row_prefix[b] = pages * page_size
    return group_rows, group_len, row_prefix
