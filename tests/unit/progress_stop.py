"""Test helper (no tests here): trainer callbacks that stop a phase-2 backend's spawned child
after a given number of steps, as a device call's time cap does (``test_grpo_progress.py``).
They travel to the child pickled through ``run_backends(callbacks=[...])``; the child imports
this module from the test session's ``sys.path`` (``spawn`` passes it on)."""

from __future__ import annotations

import os
import signal
import threading

from transformers import TrainerCallback


class InterruptParentAfter(TrainerCallback):
    """Before step ``steps + 1`` (so after step ``steps`` was logged and its progress line
    written): SIGINT to the parent, which raises ``KeyboardInterrupt`` there as a notebook stop
    does; the child then waits until the parent stops it."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.steps:
            os.kill(os.getppid(), signal.SIGINT)
            threading.Event().wait()  # the parent's SIGTERM ends this process


class KillSelfAfter(TrainerCallback):
    """Before step ``steps + 1``: SIGKILL to this process (an OOM kill, a crash). With
    ``note``, first writes TRL's ``output_dir`` there (the test checks it is gone afterwards)."""

    def __init__(self, steps: int, note: str = "") -> None:
        self.steps, self.note = steps, note

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.steps:
            if self.note:
                with open(self.note, "w") as f:
                    f.write(args.output_dir)
            os.kill(os.getpid(), signal.SIGKILL)
