"""What the engine's GEMM tuners chose in this process, per shape, for benchmark sidecars.

Contract: :func:`tuner_tables` takes a :class:`~nbhelpers.engine.model_runner.ModelRunner` and
returns ``{"skinny_tuner": table, "lora_gemm_tuner": table}``, each table ``{shape key:
{"choice": name, "ms": {candidate: ms per GEMM}}}`` over the keys this runner chose a config for
(``SkinnyLinear.choices``; every ``LiveGroup``'s ``lora_fused`` choices), the times read from the
tuner's table (:mod:`.kernels.skinny_gemm_tune`, :mod:`.kernels.lora_gemm_tune`: timed in this
process or served from the JSON cache file). ``{}`` where a path is off or chose nothing (on the
CPU nothing is tuned: the fixed default config runs). ``inf`` times (a candidate that failed) stay
``inf`` here; the sidecar writer turns them into ``None``.

Run: ``scripts/bench_flex.py`` records it under ``breakdown`` (``nbhelpers.bench.flex_sweep``);
tests: ``tests/engine/test_skinny_gemm_cublas.py``.
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
