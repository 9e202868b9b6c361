"""What the engine's GEMM tuners chose in this process, per shape, for benchmark sidecars.

Contract: :func:`tuner_tables` takes a :class:`~nbhelpers.engine.model_runner.ModelRunner` and
returns ``{"skinny_tuner": table, "lora_gemm_tuner": table}``, each table ``{shape key:
{"choice": name, "ms": {candidate: ms per GEMM}}}`` over the keys this runner chose a config for
(``SkinnyLinear.choices``; every ``LiveGroup``'s ``lora_fused`` choices), the times read from the
tuner's table (:mod:`.kernels.skinny_gemm_tune`, :mod:`.kernels.lora_gemm_tune`: timed in this
process or served from the JSON cache file). ``{}`` where a path is off or chose nothing (on the
CPU nothing is tuned: the fixed default config runs). ``inf`` times (a candidate that failed) stay
``inf`` here; the sidecar writer turns them into ``None``.

:func:`resolved_kernels` says what the runner runs once ``"auto"`` and the silent device
fallbacks are resolved (``sample_kernel="triton"`` is the torch sampler on the CPU without
``TRITON_INTERPRET=1``; ``skinny_gemm_cublas`` means nothing with the skinny path off): a
variant's options say what was asked, this what ran (fresh-user trial, 2026-12-02).

Run: ``scripts/bench_flex.py`` records both under ``breakdown`` (``nbhelpers.bench.flex_sweep``);
tests: ``tests/engine/test_skinny_gemm_cublas.py``, ``tests/engine/test_resolved_kernels.py``.
"""

from __future__ import annotations

from typing import Any


def _names(choices: dict[str, Any], tune: Any) -> dict[str, str]:
    """``{key: candidate name}``: ``tune.CUBLAS`` for ``None``, else ``tune.config_name``."""
    return {key: tune.CUBLAS if cfg is None else tune.config_name(cfg)
            for key, cfg in choices.items()}


def skinny_table(skinny: Any) -> dict[str, dict]:
    """The ``SkinnyLinear``'s chosen shapes with the tuner's times (module docstring)."""
    if skinny is None or skinny.tune is None or not skinny.choices:
        return {}
    return skinny.tune.tuner().entries(_names(skinny.choices, skinny.tune))


def lora_gemm_table(groups: Any) -> dict[str, dict]:
    """The ``lora_fused`` shapes chosen by any of ``groups`` (``LiveGroup``s), with times."""
    choices, tune = {}, None
    for group in groups:
        fused = group._lora_gemm  # the group's LoraFusedGemm (engine-internal, as lora_pending)
        if fused.tune is not None and fused.choices:
            tune = fused.tune
            choices.update(fused.choices)
    return tune.tuner().entries(_names(choices, tune)) if tune is not None else {}


def tuner_tables(runner: Any) -> dict[str, dict]:
    """``{"skinny_tuner": ..., "lora_gemm_tuner": ...}`` of ``runner`` (module docstring)."""
    return {"skinny_tuner": skinny_table(getattr(runner, "skinny", None)),
            "lora_gemm_tuner": lora_gemm_table(runner.model.live_groups())}


def resolved_kernels(runner: Any) -> dict[str, Any]:
    """``runner``'s kernels after resolution (module docstring): ``decode_attention``,
    ``prefill_attention``, ``lora_expand`` (the groups' mode; unsupported shapes still fall back
    to ``addmm`` per call), ``skinny_gemm`` (``"triton"`` / ``"off"``), ``skinny_gemm_cublas``
    (``None`` with the skinny path off), ``pdl`` (bool), ``pdl_mode`` (``"off"`` / ``"on"`` /
    ``"early"`` / ``"prefetch"``), ``pdl_prefetch_mib`` (the budget in MiB where ``pdl_mode`` is
    ``"prefetch"``, else ``None``), ``sample_kernel`` and ``prefill_graphs`` (what ran: ``"off"``; ``"on"``;
    ``"on_eager"`` when the option was on but every bucket tried so far prefilled eagerly, its
    capture having failed or the ``MAX_BUCKETS`` cap reached: ``prefill_graph_replays`` 0)."""
    skinny = runner.skinny
    return {"decode_attention": runner.decode_attention,
            "prefill_attention": runner.prefill_attention, "lora_expand": runner.lora_expand,
            "skinny_gemm": skinny.mode if skinny.enabled else "off",
            "skinny_gemm_cublas": skinny.cublas if skinny.enabled else None,
            "pdl": bool(runner.pdl), "pdl_mode": getattr(runner, "pdl_mode", "off"),
            "pdl_prefetch_mib": (runner.opt.pdl_prefetch_mib
                                 if getattr(runner, "pdl_mode", "off") == "prefetch" else None),
            "sample_kernel": runner.sample_kernel,
            "prefill_graphs": _prefill_graphs_ran(runner)}


def _prefill_graphs_ran(runner: Any) -> str:
    """``"off"`` / ``"on"`` / ``"on_eager"`` (:func:`resolved_kernels`)."""
    pg = getattr(runner, "prefill_graphs", None)
    if pg is None:
        return "off"
    tried = bool(pg.buckets) or runner.timings.get("prefill_graph_replays", 0) > 0
    return "on_eager" if tried and runner.timings.get("prefill_graph_replays", 0) == 0 else "on"
