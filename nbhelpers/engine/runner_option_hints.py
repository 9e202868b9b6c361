"""Two user mistakes :class:`~nbhelpers.engine.runner_options.RunnerOptions` names with the fix
(fresh-user trial, 2026-12-02), used by its ``__post_init__``:

* :func:`with_yaml_bool_hint`: a string option holding a boolean. YAML 1.1 (PyYAML, which
  ``python -m nbhelpers run -p`` and ``configs/*.yaml`` use) reads an unquoted ``on`` / ``off`` /
  ``yes`` / ``no`` as ``True`` / ``False``, so ``-p engine_options '{pdl: on}'`` reached the
  engine as ``pdl=True`` and was refused as "must be one of ('auto', 'off', 'on', 'early')",
  naming the very word that was typed.
* :func:`check_kernel_option_keys`: a RunnerOptions field inside ``decode_kernel_options`` /
  ``prefill_kernel_options`` (``scripts/bench_flex.py --decode-kernel-options '{"pdl":
  "early"}'``): flex's kernel options ignored it on the CPU, so the run measured the default.

Tests: ``tests/engine/test_runner_option_hints.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

KERNEL_OPTION_FIELDS = ("decode_kernel_options", "prefill_kernel_options")
"""The RunnerOptions fields that hold a kernel's own options (a dict)."""


def with_yaml_bool_hint(message: str, values: dict[str, Any],
                        string_fields: Iterable[str]) -> str:
    """``message`` (a RunnerOptions ``ValueError``'s text) plus, when it names one of
    ``string_fields`` (options whose default is a string) holding a bool in ``values``
    (``{field: value}``) as ``<field>=True`` / ``=False``, how to quote the word."""
    for name in string_fields:
        value = values.get(name)
        if isinstance(value, bool) and f"{name}={value!r}" in message:
            word = "on" if value else "off"
            return (f"{message} {name} got a boolean: YAML (-p values, configs/*.yaml) reads an "
                    f"unquoted on/off/yes/no/true/false as one, so quote the word, e.g. "
                    f"{{{name}: '{word}'}} rather than {{{name}: {word}}}.")
    return message


def check_kernel_option_keys(values: dict[str, Any], fields: Iterable[str]) -> None:
    """Raises ``ValueError`` when a dict in ``values[KERNEL_OPTION_FIELDS]`` has a key that is one
    of ``fields`` (the RunnerOptions field names): an engine option, not a kernel's."""
    names = set(fields)
    for where in KERNEL_OPTION_FIELDS:
        opts = values.get(where)
        if isinstance(opts, dict) and (misplaced := sorted(names & set(opts))):
            example = ", ".join(f"{k}={opts[k]!r}" for k in misplaced)
            raise ValueError(
                f"RunnerOptions.{where}={opts!r}: {misplaced} are engine options, not kernel "
                f"options: pass them as options of their own (LLM(model, {example}); "
                "scripts/bench_flex.py: --points ... --variants '{\"name\": \"x\", \"options\": "
                "{...}}'; -p engine_options) and keep only the kernel's options here.")


def kernel_option_hint(name: str) -> str | None:
    """Where ``name`` goes when it is one of the Triton decode kernel's options
    (``paged_decode_plan.KERNEL_OPTIONS``) typed as an engine option (``LLM(model,
    shared_prefix=True)``, a bench variant's ``options``), else ``None`` (helper-25's trial,
    2026-12-07: the message suggested ``share_prefix``, another option)."""
    from nbhelpers.engine.kernels.paged_decode_plan import KERNEL_OPTIONS
    if name not in KERNEL_OPTIONS:
        return None
    return (f"{name!r} is an option of the Triton decode kernel: pass "
            f"decode_attention='triton', decode_kernel_options={{{name!r}: ...}}")
