"""Shared by the pre-launch refusal tests (test_bad_input_phase1_host.py,
test_bad_input_phase2_host.py): plan a run into a fresh archive and expect one refusal line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nbhelpers.run.params import UserInputError
from nbhelpers.run.runner import plan_jobs

REPO = Path(__file__).resolve().parents[2]


def refused(nb: str, over: dict, want: str, tmp_path: Path, exact: bool = False) -> str:
    """``plan_jobs`` of ``nb`` with ``-p`` ``over`` raises one line (equal to ``want`` when
    ``exact``, else containing it) and writes nothing: no notebook, sidecar or INDEX.md.
    Returns the message."""
    out = tmp_path / "executed"
    with pytest.raises(UserInputError) as err:
        plan_jobs(nb, "cpu", over, None, out, REPO)
    message = str(err.value)
    assert message == want if exact else want in message, message
    assert "\n" not in message
    assert not out.exists()
    return message


def write_sidecar(path: Path, phase: str, backend: str, model: str, gpu: str = "cpu",
                  **extra) -> Path:
    """A minimal schema-v1 sidecar at ``path`` (its folder made): the keys every sidecar has,
    ``extra`` merged on top (e.g. phase 1's ``engine``, phase 2's ``grpo_steps``). Returns the
    folder."""
    side = {"schema": 1, "run_id": "20261203T140000Z", "phase": phase, "backend": backend,
            "model": {"name": model}, "lora": None, "workload": None, "rounds": [],
            "decode_tok_per_s_median": None, "prompt_tok_per_s_median": None,
            "wall_s_median": None, "peak_mem_allocated_gib": None, "peak_mem_device_gib": None,
            "env": {"gpu": gpu}, "error": None} | extra
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(side))
    return path.parent
