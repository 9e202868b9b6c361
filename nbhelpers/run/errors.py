"""The runner's user-facing errors: the CLI prints ``error: <message>`` and exits 2 for these,
without a traceback (``nbhelpers/__main__.py``). Stdlib only."""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad input from the user (phase, profile, notebook, ``-p``, config, ``--gpus``): the CLI
    prints ``error: <message>`` and exits 2, without a traceback."""


class MissingInputError(UserInputError, FileNotFoundError):
    """A file the user named (notebook, ``configs/<stem>.<profile>.yaml``) does not exist."""
