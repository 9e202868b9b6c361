"""Checks of ``scripts/bench_flex.py``'s arguments, all done before anything is built or written.

Contract: :func:`check_args` takes the parsed ``argparse.Namespace`` and adds the parsed values
(``point_list``, ``variant_list``, ``sweep_batches``, ``skip_stages``, ``decode_variant_list``)
or raises ``ValueError`` (``TypeError``: a JSON part of the wrong kind) with a message naming
the flag and the fix; the script prints it as one ``error: ...`` line and exits 2 (no model
built, no ``--out`` folder created, no sidecar written). Stages, counts, JSON values, engine
options (RunnerOptions' own checks) and the host (a CUDA GPU for every shape but the tiny one)
are checked here.

Run: ``python scripts/bench_flex.py --help``; tests: ``tests/unit/test_bench_flex_args.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

from nbhelpers.bench import flex_ab as ab

STAGES = ("parity_tiny", "parity", "w", "sweep")
"""The staged run's stages, the names ``--skip`` takes."""
COUNTS = ("rounds", "sweep_rounds", "max_new_tokens", "prompt_tokens", "sync_every")
"""Integer arguments that must be >= 1 (``--rounds`` ... as attribute names)."""
KOPTS_EXAMPLE = '{"num_warps": 8};{"decode_attention": "triton", "num_splits": 4}'
"""A ``--decode-kernel-options`` value, shown in its error messages."""


def parse_sweep(text: str) -> list[int]:
    """``"8,32,64"`` -> ``[8, 32, 64]``. Raises ``ValueError``: an entry not an int >= 1."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if bad := [p for p in parts if not p.isdigit() or int(p) < 1]:
        raise ValueError(f"--sweep {text!r}: {bad[0]!r} is no batch size; give comma-separated "
                         "ints >= 1, e.g. --sweep 8,32,64 (or --skip sweep).")
    return [int(p) for p in parts]


def parse_skip(text: str) -> set[str]:
    """``"parity,sweep"`` -> ``{"parity", "sweep"}``. Raises ``ValueError``: a name not in
    :data:`STAGES` (a typo would otherwise run the stage)."""
    names = {p.strip() for p in text.split(",") if p.strip()}
    if unknown := sorted(names - set(STAGES)):
        raise ValueError(f"--skip {text!r}: unknown stage(s) {unknown}; the stages are "
                         f"{','.join(STAGES)}, e.g. --skip parity,sweep.")
    return names


def check_counts(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` for any of :data:`COUNTS` < 1."""
    for name in COUNTS:
        if (value := getattr(args, name)) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: must be >= 1 (a run of 0 measures nothing), "
                             f"e.g. {flag} {3 if 'rounds' in name else 32}.")


def decode_variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Extra W LoRA stages as ``{"decode_attention", "lora_expand", "decode_kernel_options",
    "tag"}``: one for ``--decode-attention``, one for ``--lora-expand``, one per ``;``-separated
    JSON dict of ``--decode-kernel-options`` (its ``decode_attention`` / ``lora_expand`` keys are
    runner options, the rest kernel options), each checked as RunnerOptions.

    Raises:
        ValueError: a part that is not JSON, or options RunnerOptions refuses. TypeError: a
            part that is not a JSON object (each message names the flag and the fix).
    """
    out, where = [], []
    if args.decode_attention:
        where.append("--decode-attention")
        out.append({"decode_attention": args.decode_attention, "lora_expand": "addmm",
                    "decode_kernel_options": None, "tag": f"w_lora_{args.decode_attention}"})
    if args.lora_expand:
        where.append("--lora-expand")
        out.append({"decode_attention": "flex", "lora_expand": args.lora_expand,
                    "decode_kernel_options": None, "tag": f"w_lora_expand_{args.lora_expand}"})
    flag = "--decode-kernel-options"
    for i, kopts in enumerate(ab.parse_json_parts(args.decode_kernel_options, flag,
                                                  KOPTS_EXAMPLE)):
        if not isinstance(kopts, dict):
            raise TypeError(f"{flag}: each ';'-separated part must be a JSON object, got "
                             f"{kopts!r}; e.g. {flag} '{KOPTS_EXAMPLE}'.")
        kopts = dict(kopts)
        where.append(f"{flag} part {i}")
        out.append({"decode_attention": kopts.pop("decode_attention", "flex"),
                    "lora_expand": kopts.pop("lora_expand", "addmm"),
                    "decode_kernel_options": kopts or None,
                    "tag": "w_lora_kopts" + (f"_{i}" if i else "")})
    for var, flag_at in zip(out, where, strict=True):
        ab.check_engine_options({k: v for k, v in var.items() if k != "tag"}, flag_at)
    return out


def cuda_available() -> bool:
    """``torch.cuda.is_available()`` (torch imported only here, when a check needs it)."""
    import torch
    return torch.cuda.is_available()


def check_host(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` when the run needs a CUDA GPU and torch sees none: an A/B point of
    any shape but ``tiny`` (its child builds the model on ``cuda``), or the staged run without
    ``--cpu-smoke`` (Qwen3-4B on ``cuda``)."""
    if args.point_list:
        big = [p for p in args.point_list if p.shape != "tiny"]
        if big and not cuda_available():
            raise ValueError(f"--points {big[0].shape}:{big[0].lora}:{big[0].batch}: shape "
                             f"{big[0].shape!r} needs a CUDA GPU and torch sees none here; use "
                             "the tiny shape here, e.g. --points tiny:fp32:2,tiny:none:2.")
    elif not args.cpu_smoke and not cuda_available():
        raise ValueError("the staged run builds Qwen3-4B on a CUDA GPU and torch sees none "
                         "here; use --cpu-smoke (the tiny shape on the CPU) on this host.")


def check_num_generations(args: argparse.Namespace) -> None:
    """``--num-generations`` (default 1): at least 1, above 1 only in the A/B mode, and a
    divisor of every point's batch (``batch / g`` prompts with ``n = g`` samples each).

    Raises:
        ValueError: naming the flag and the fix.
    """
    g = getattr(args, "num_generations", 1)
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"--num-generations {g!r}: must be an int >= 1 (samples per prompt).")
    if g > 1 and not args.point_list:
        raise ValueError(f"--num-generations {g} is the A/B mode's and needs --points, e.g. "
                         f"--points qwen3-4b:fp32:64 --num-generations 8.")
    bad = [p.tag for p in args.point_list if p.batch % g]
    if bad:
        raise ValueError(f"--num-generations {g}: points {bad} have a batch that is not a "
                         f"multiple of {g}; use batches k x {g}.")


def check_args(args: argparse.Namespace, host: bool = True) -> argparse.Namespace:
    """``args`` with the parsed values added (module docstring), every check passed;
    ``host=False`` leaves out :func:`check_host` (``--check-only``: a device step's command line
    checked on a host without the GPU it will run on).

    Raises:
        ValueError, TypeError: the first bad argument (the message names the flag and the fix).
    """
    check_counts(args)
    args.skip_stages = parse_skip(args.skip)
    args.sweep_batches = parse_sweep(args.sweep)
    args.point_list = ab.parse_points(args.points)
    if args.variants and not args.point_list:
        raise ValueError("--variants is the A/B mode's and needs --points, e.g. --points "
                         f"tiny:fp32:2 --variants '{ab.VARIANTS_EXAMPLE}'.")
    args.variant_list = ab.parse_variants(args.variants)
    check_num_generations(args)
    args.decode_variant_list = decode_variants(args)
    if host:
        check_host(args)
    return args
