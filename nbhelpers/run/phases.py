"""The lab's phases and their notebook folders: the one place that says which phase a notebook
belongs to.

Contract: :data:`PHASE_DIRS` maps a phase (``phase0``...) to its folder under ``notebooks/``;
:func:`phase_of` gives a notebook's phase from the folder it sits in (never from its file name:
a ``2x_`` notebook moved to another folder belongs to that folder's phase), ``None`` for a
notebook outside the phase folders; :func:`is_compare` marks a phase's comparison notebook
(``19_compare``, ``29_compare``), which reads the sidecars its phase's other notebooks write.
Stdlib only.
"""

from __future__ import annotations

from pathlib import Path

PHASE_DIRS = {"phase0": "phase0_reference", "phase1": "phase1_rollout",
              "phase2": "phase2_grpo", "phase3": "phase3_flex"}
"""``run <phase>`` runs every ``notebooks/<dir>/*.ipynb`` in name order (``19_compare`` last)."""


def phase_of(notebook: Path) -> str | None:
    """``phase0``..``phase3`` for a notebook in ``<any>/phaseN_<name>/``, else ``None``."""
    by_dir = {folder: phase for phase, folder in PHASE_DIRS.items()}
    return by_dir.get(Path(notebook).parent.name)


def is_compare(notebook: Path) -> bool:
    """Whether ``notebook`` is its phase's comparison notebook (``<NN>_compare.ipynb``): it reads
    only the sidecars of the phase's other notebooks, so a phase run starts it after them and
    skips it when one of them failed (:func:`nbhelpers.run.runner.run`)."""
    return phase_of(notebook) is not None and Path(notebook).stem.endswith("_compare")
