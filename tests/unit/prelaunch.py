"""Shared by the pre-launch refusal tests (test_bad_input_phase1_host.py,
test_bad_input_phase2_host.py): plan a run into a fresh archive and expect one refusal line."""

from __future__ import annotations

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
