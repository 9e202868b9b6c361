"""A/B of flex engine options, one process per configuration (``scripts/bench_flex.py --points``).

Contract: a *point* is ``shape:lora:batch`` (shape ``qwen3-4b`` | ``tiny`` | a
:mod:`nbhelpers.model_configs` function such as ``llama_3_2_3b``; lora ``none`` | ``bf16`` (the
model's dtype, as Unsloth keeps it) | ``fp32`` (PEFT's default upcast, TRL's GRPO); batch rows),
a *variant* a named dict of :class:`~nbhelpers.engine.runner_options.RunnerOptions` fields.
:func:`run_ab` runs every (point, variant) in a fresh ``python scripts/bench_flex.py --one ...``
process (no allocator, autotune or graph state carried between them), each writing one schema-v1
sidecar with ``floor``, ``pct_of_floor`` and the kernel-class breakdown, all under one
``run_id``; a child that fails leaves a sidecar with ``error``. :func:`lora_mode`,
:func:`check_variants` and :func:`check_engine_options` are the checks notebook 33 shares
(:mod:`nbhelpers.bench.flex_configs`): a bad mode, variant or option fails before any child runs.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LORA_MODES = ("none", "bf16", "fp32")
"""No LoRA; LoRA r32 in the model's dtype (``attach_lora(adapter_dtype="model")``); fp32 LoRA."""
ADAPTER_DTYPE = {"bf16": "model", "fp32": "float32"}
"""LoRA mode -> :func:`nbhelpers.bench.flex_sweep.attach_lora`'s ``adapter_dtype``."""


@dataclass(frozen=True)
class Point:
    """One measured configuration's workload: model shape, adapter dtype mode, batch rows."""

    shape: str
    lora: str
    batch: int

    @property
    def tag(self) -> str:
        return f"{self.shape}_{self.lora}_b{self.batch}"


def point_shapes() -> list[str]:
    """The shapes a point may name: ``qwen3-4b``, ``tiny`` (the tiny Qwen3, the only one run on
    the CPU) and the builders of :mod:`nbhelpers.model_configs` (``-`` or ``_`` between words)."""
    from nbhelpers import model_configs
    return ["qwen3-4b", "tiny", *sorted(
        n for n, f in vars(model_configs).items() if callable(f) and not n.startswith("_")
        and getattr(f, "__module__", None) == model_configs.__name__)]


def parse_points(text: str) -> list[Point]:
    """``"qwen3-4b:fp32:4,qwen3-4b:none:32"`` -> points.

    Raises:
        ValueError: an entry not ``shape:lora:batch``, a shape not in :func:`point_shapes`, a
            lora not in :data:`LORA_MODES` or a batch < 1 (the message names the fix).
    """
    out, shapes = [], point_shapes()
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        if len(bits) != 3 or bits[1] not in LORA_MODES or not bits[2].isdigit():
            raise ValueError(f"--points entry {part!r}: write shape:lora:batch with lora one of "
                             f"{LORA_MODES}, e.g. qwen3-4b:fp32:4.")
        if bits[0] not in shapes and bits[0].replace("-", "_") not in shapes:
            close = difflib.get_close_matches(bits[0], shapes, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--points entry {part!r}: unknown shape {bits[0]!r}{hint}; use one "
                             f"of {shapes}.")
        if int(bits[2]) < 1:
            raise ValueError(f"--points entry {part!r}: batch {bits[2]} must be >= 1 (rows per "
                             "step), e.g. qwen3-4b:fp32:4.")
        out.append(Point(bits[0], bits[1], int(bits[2])))
    return out


def parse_json_parts(text: str, flag: str, example: str) -> list[Any]:
    """``text`` split on ``';'``, each non-empty part read as JSON.

    Raises:
        ValueError: a part that is not JSON; the message names ``flag`` and shows ``example``.
    """
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            out.append(json.loads(part))
        except json.JSONDecodeError as err:
            raise ValueError(f"{flag}: {part!r} is not JSON ({err.msg}); give ';'-separated "
                             f"JSON objects, e.g. {flag} '{example}'.") from None
    return out


VARIANTS_EXAMPLE = '{"name": "old", "options": {"lora_expand": "addmm"}};{"name": "new"}'
"""A ``--variants`` value, shown in its error messages."""


def parse_variants(text: str) -> list[dict[str, Any]]:
    """``';'``-separated JSON objects ``{"name": ..., "options": {...}}`` (default one variant
    ``default`` with no options), checked by :func:`check_variants` (before any child runs).

    Raises:
        ValueError: a part that is not JSON or no such object, a repeated name or bad options
            (the message names ``--variants`` and the fix).
    """
    parts = parse_json_parts(text, "--variants", VARIANTS_EXAMPLE) or [{"name": "default"}]
    return check_variants(parts, "--variants", example=f"--variants '{VARIANTS_EXAMPLE}'")


def lora_mode(value: Any, where: str = "lora_modes") -> str:
    """One of :data:`LORA_MODES` from a mode name or the old boolean of notebook 33 (``True``:
    LoRA in the model's dtype, ``"bf16"``; ``False``: ``"none"``).

    Raises:
        ValueError: anything else (the message lists the allowed values).
    """
    if isinstance(value, bool):
        return "bf16" if value else "none"
    if isinstance(value, str) and value in LORA_MODES:
        return value
    raise ValueError(f"{where}: {value!r} is no LoRA mode; use one of {list(LORA_MODES)} "
                     "('bf16': the adapter in the model's dtype, bf16 on the GPU; 'fp32': PEFT's "
                     "default fp32 upcast, as TRL trains) or true / false for bf16 / none.")


def attach_mode(model: Any, lora: Any, mode: str) -> Any:
    """``model`` with a PEFT LoRA ``lora`` attached per ``mode`` (:data:`LORA_MODES`; ``"none"``:
    ``model`` unchanged), through :func:`nbhelpers.bench.flex_sweep.attach_lora`."""
    from nbhelpers.bench import flex_sweep as eb
    if lora_mode(mode, "attach_mode") == "none":
        return model
    return eb.attach_lora(model, lora, adapter_dtype=ADAPTER_DTYPE[mode])


RESERVED_OPTIONS = ("max_model_len", "sync_every", "num_pages", "max_num_seqs")
"""Set per point by :func:`nbhelpers.bench.flex_sweep.run_flex_point` (from the batch and the
workload); a variant cannot override them."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_engine_options(options: Any, where: str) -> dict[str, Any]:
    """``options`` as a dict once it is a valid set of RunnerOptions overrides (field names and
    values, :class:`nbhelpers.engine.runner_options.RunnerOptions`' own checks).

    Raises:
        TypeError: not a dict. ValueError: a reserved or unknown field, or a bad value (the
            message names the fix).
    """
    from nbhelpers.engine.runner_option_hints import kernel_option_hint
    from nbhelpers.engine.runner_options import RunnerOptions, option_names
    if not isinstance(options, dict):
        raise TypeError(f"{where}: options must be a dict of RunnerOptions fields, e.g. "
                        f"{{'decode_attention': 'flex'}}, got {options!r}.")
    if reserved := sorted(set(options) & set(RESERVED_OPTIONS)):
        raise ValueError(f"{where}: {reserved} are set per point by the sweep (batch and "
                         "workload); drop them from the options.")
    if unknown := sorted(set(options) - option_names()):
        close = {u: difflib.get_close_matches(u, option_names(), n=1) for u in unknown}
        hint = "".join(f" ({kernel_option_hint(u)})" if kernel_option_hint(u) else
                       f" ({u!r}: did you mean {c[0]!r}?)" for u, c in close.items()
                       if c or kernel_option_hint(u))
        raise ValueError(f"{where}: unknown RunnerOptions field(s) {unknown}{hint}; the fields: "
                         f"{sorted(option_names() - set(RESERVED_OPTIONS))}.")
    try:
        RunnerOptions(**options)
    except (TypeError, ValueError, ImportError) as err:
        raise ValueError(f"{where}: {err}") from err
    return dict(options)


def check_variants(parts: Any, where: str = "variants", base: dict[str, Any] | None = None,
                   example: str | None = None) -> list[dict[str, Any]]:
    """``[{"name", "options"}]`` checked before anything runs: each part a dict with a unique
    ``name`` (letters, digits, ``_.-``: it names files) and optional ``options`` (RunnerOptions
    overrides, :func:`check_engine_options`), laid over ``base`` (notebook 33's
    ``engine_options``); ``example``: the form its messages show (default notebook 33's list;
    ``--variants`` shows its ``;``-separated objects, which a JSON list is not).

    Raises:
        ValueError: not a non-empty list of such dicts (an unknown key named), a repeated name
            or bad options.
    """
    example = example or ('[{"name": "default", "options": {}}, {"name": "previous", '
                          '"options": {...}}]')
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError(f"{where}: give a non-empty list like {example}, got {parts!r}.")
    out = []
    for i, part in enumerate(parts):
        name = part.get("name") if isinstance(part, dict) else None
        extra = sorted(set(part) - {"name", "options"}) if isinstance(part, dict) else []
        if (not isinstance(name, str) or not _NAME.fullmatch(name) or extra
                or not isinstance(part.get("options") or {}, dict)):
            why = f" has unknown key(s) {extra}" if extra else ""
            raise ValueError(f"{where}[{i}] = {part!r}{why}: each variant is a dict with a "
                             f"'name' (letters, digits, _ . -) and optional 'options', e.g. "
                             f"{example}.")
        opts = check_engine_options({**(base or {}), **(part.get("options") or {})},
                                    f"{where}[{i}] ({name!r})")
        out.append({"name": name, "options": opts})
    names = [v["name"] for v in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: variant names must be unique, got {names}.")
    return out


def random_model(shape: str, device: str) -> Any:
    """A random-weight model of ``shape`` (bf16 on CUDA, fp32 on the CPU) on ``device``."""
    import torch
    import transformers

    from nbhelpers import model_configs
    from nbhelpers.bench import flex_sweep as eb
    dtype = "bfloat16" if device == "cuda" else "float32"
    if shape in ("qwen3-4b", "tiny"):
        return eb.random_qwen3(eb.QWEN3_4B_SHAPE if shape == "qwen3-4b" else
                               eb.TINY_QWEN3_SHAPE, dtype=dtype, device=device)
    if shape.replace("-", "_") not in point_shapes():
        raise ValueError(f"point shape {shape!r}: use one of {point_shapes()}.")
    make = getattr(model_configs, shape.replace("-", "_"))
    cfg = make()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = getattr(transformers, cfg.architectures[0])(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def run_config(point: Point, variant: dict[str, Any], settings: dict[str, Any], run_id: str,
               out: Path, device: str) -> dict[str, Any]:
    """One configuration in this process: model, LoRA r32 (alpha 64) per ``point.lora``,
    ``run_flex_point(profile=True, floor_gemms=True)``, sidecar written under ``out``."""
    from nbhelpers.bench import flex_sweep as eb
    from nbhelpers.config import LoraSpec
    from nbhelpers.stats import write_sidecar
    model, lora = random_model(point.shape, device), None
    info = {"name": point.shape, "architecture": type(model).__name__, "weights": "random",
            "n_params": sum(p.numel() for p in model.parameters())}
    if point.lora != "none":
        lora = LoraSpec(rank=32, alpha=64)
        model = attach_mode(model, lora, point.lora)
    res = eb.run_flex_point(model, point.batch, settings["prompt_tokens"],
                            settings["max_new_tokens"], rounds=settings["rounds"],
                            sync_every=settings["sync_every"], profile=True,
                            floor_gemms=settings.get("floor_gemms", True),
                            num_generations=settings.get("num_generations", 1),
                            **variant["options"])
    side = eb.flex_sidecar(f"{point.tag}_{variant['name']}", info, lora, point.batch,
                           settings["prompt_tokens"], settings["max_new_tokens"], res,
                           extra={"variant": variant, "point": asdict(point)}, run_id=run_id,
                           num_generations=settings.get("num_generations", 1))
    write_sidecar(side, out / f"{run_id}_{point.tag}_{variant['name']}.json")
    return side


def run_ab(points: list[Point], variants: list[dict[str, Any]], settings: dict[str, Any],
           run_id: str, out: Path, script: str, timeout_s: float = 1800) -> list[dict]:
    """Every (point, variant) in its own ``python script --one ...`` process; returns the
    sidecars (an error sidecar for a child that failed or wrote none)."""
    sides = []
    for point in points:
        for var in variants:
            job = json.dumps({"point": asdict(point), "variant": var, "settings": settings,
                              "run_id": run_id})
            proc = subprocess.run([sys.executable, script, "--one", job, "--out", str(out)],
                                  capture_output=True, text=True, timeout=timeout_s, check=False)
            path = out / f"{run_id}_{point.tag}_{var['name']}.json"
            if proc.returncode == 0 and path.exists():
                sides.append(json.loads(path.read_text()))
            else:
                sides.append(_error_sidecar(point, var, settings, run_id, out, proc))
    return sides


def _error_sidecar(point: Point, var: dict, settings: dict, run_id: str, out: Path,
                   proc: Any) -> dict[str, Any]:
    from nbhelpers.bench import flex_sweep as eb
    from nbhelpers.stats import write_sidecar
    err = f"child exit {proc.returncode}: {(proc.stderr or '')[-2000:]}"
    side = eb.flex_sidecar(f"{point.tag}_{var['name']}", {"name": point.shape}, None,
                           point.batch, settings["prompt_tokens"], settings["max_new_tokens"],
                           None, error=err, extra={"variant": var, "point": asdict(point)},
                           run_id=run_id)
    write_sidecar(side, out / f"{run_id}_{point.tag}_{var['name']}.json")
    return side


def ab_table(sides: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: point, variant, tok/s, ms/step, % of floor, floor ms, GEMM / attention /
    elementwise / sampling ms and kernels per step (profile), cuBLAS cold GEMM ms per step; a
    variant whose options this host ran otherwise says what ran (:func:`~nbhelpers.bench.
    flex_ab_figures.not_applied`, e.g. ``early (ran pdl=off)``)."""
    from nbhelpers.bench.flex_ab_figures import not_applied
    fmt = lambda x, f=".2f": "-" if x is None else format(x, f)
    ran = lambda s: ", ".join(f"{k}={got}" for k, (_, got) in not_applied(s).items())
    lines = [("| point | variant | tok/s | ms/step | % floor | floor ms | GEMM | attn | elem | "
              "sample | kernels/step | cuBLAS GEMM ms |"), ("|---" * 12) + "|"]
    for s in sides:
        b, fl = s.get("breakdown") or {}, s.get("floor") or {}
        kb = b.get("kernel_breakdown") or {}
        lines.append(
            f"| {s['point']['shape']} {s['point']['lora']} b{s['point']['batch']} | "
            f"{s['variant']['name']}{f' (ran {ran(s)})' if ran(s) else ''} | "
            f"{fmt(s.get('decode_tok_per_s_median'), '.0f')} | "
            f"{fmt(b.get('decode_step_ms'))} | {fmt(s.get('pct_of_floor'), '.1f')} | "
            f"{fmt(fl.get('floor_ms_per_step'))} | {fmt(kb.get('gemm_ms'))} | "
            f"{fmt(kb.get('attention_ms'))} | {fmt(kb.get('elementwise_ms'))} | "
            f"{fmt(kb.get('sampling_ms'))} | {fmt(kb.get('kernels_per_step'), '.0f')} | "
            f"{fmt(fl.get('gemm_ms_per_step_cublas'))} |" + (" ERROR" if s.get("error") else ""))
    return lines
