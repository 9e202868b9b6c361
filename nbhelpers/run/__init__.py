"""The papermill runner behind ``python -m nbhelpers run``.

``runner`` (notebook resolution, per-GPU fan-out into ``executed/``, interrupts), ``execute``
(one notebook's papermill child, kernelspec, failure record), ``params`` (profiles, configs and
``-p`` type checks before anything runs), ``values`` (value checks: config dataclass fields,
counts, names), ``phases`` (phase <-> notebook folder), ``errors`` (``UserInputError``),
``index`` (``executed/INDEX.md`` from the sidecars). Nothing heavy at import.
"""
