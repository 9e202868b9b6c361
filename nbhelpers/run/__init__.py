"""The papermill runner behind ``python -m nbhelpers run``.

``runner`` (notebook resolution, per-GPU fan-out into ``executed/``, interrupts), ``params``
(profiles and ``-p`` checks before anything runs), ``index`` (``executed/INDEX.md`` from the
sidecars). Nothing heavy at import.
"""
