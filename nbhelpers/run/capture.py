"""The papermill child's stderr, which its kernel inherits: on the terminal until the runner's
stop signal, then into the run's log file.

Contract: :class:`StderrCapture` points file descriptor 2 of this process at a pipe, so every
later writer (papermill's cell bar and the cells' streamed stderr in this process, the kernel
that jupyter_client starts later and that inherits fd 2) writes into it; a thread copies the pipe
to the original stderr. :meth:`StderrCapture.divert` (from the SIGINT handler) sends what comes
after it to ``log_path`` instead, created only when something comes: after an interrupt the
kernel's shutdown noise (e.g. ipykernel's ``ZMQError: Socket operation on non-socket`` traceback
when its reply meets a socket closed by the shutdown, 2026-12-01) lands in the log, while a
genuine error before the interrupt stays on the terminal; the one line every normal kernel
shutdown logs as an error (:data:`SHUTDOWN_INTERRUPT_LINE`) is left out of the terminal copy.
:meth:`StderrCapture.close` puts fd 2 back and drains the pipe. Used by
:func:`nbhelpers.run.child._execute_in_child`.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import BinaryIO

DRAIN_S = 2.0
"""How long :meth:`StderrCapture.close` waits for the pipe's last writers (a kernel still
exiting, a subprocess of it) before it leaves the copy thread to the process exit."""


SHUTDOWN_INTERRUPT_LINE = b"[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel.\n"
"""ipykernel's log line (``kernelbase.py``) for the SIGINT that jupyter_client 8.x sends every
kernel it shuts down, before the shutdown request (``KernelManager._async_shutdown_kernel``:
"the kernel will be immediately sent an interrupt (SIGINT)"), so it ended every successful run
on the terminal as an ERROR (seen 2026-12-07, jupyter_client 8.10, ipykernel 7). Dropped from
the terminal copy only; after :meth:`StderrCapture.divert` the log keeps everything."""

MARKER = b"\x00nbhelpers-stderr-divert\x00"
"""Written into the pipe by :meth:`StderrCapture.divert`: what precedes it in the pipe was
written before the signal (to the terminal), what follows it after (to the log). One write
below ``PIPE_BUF``, so no other writer's bytes land inside it."""


class StderrCapture:
    """fd 2 through a pipe: to the original stderr, after :meth:`divert` to ``log_path``."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._closed = False
        self._log: BinaryIO | None = None
        sys.stderr.flush()
        self._terminal = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read_fd = read_fd
        self._thread = threading.Thread(target=self._copy, name="stderr-capture", daemon=True)
        self._thread.start()

    def divert(self) -> None:
        """From now on, what reaches fd 2 goes to :attr:`log_path`; what was written before
        still goes to the terminal (the switch travels through the pipe as :data:`MARKER`).
        Meant for the SIGINT handler; a second call does nothing."""
        if not self._closed:
            os.write(2, MARKER)

    def close(self) -> None:
        """Put the original stderr back on fd 2 and copy what is left in the pipe (waiting at
        most :data:`DRAIN_S` for writers that still hold it); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        sys.stderr.flush()
        os.dup2(self._terminal, 2)
        self._thread.join(DRAIN_S)

    def _copy(self) -> None:
        """Copy the pipe until every writer closed it: to the terminal up to :data:`MARKER`,
        then to the log. A failed write (terminal gone, log not writable) drops those bytes
        but keeps reading: a pipe nobody reads would block its writers once it is full."""
        held, diverted = b"", False
        while chunk := os.read(self._read_fd, 65536):
            data = held + chunk
            if not diverted:
                cut = data.find(MARKER)
                if cut < 0:  # a marker or the shutdown line may straddle two reads: hold back
                    keep = max(_marker_prefix_len(data),
                               _prefix_len(data, SHUTDOWN_INTERRUPT_LINE))
                    self._to_terminal(data[:len(data) - keep])
                    held = data[len(data) - keep:]
                    continue
                self._to_terminal(data[:cut])
                data, diverted = data[cut + len(MARKER):], True
            held = b""
            self._to_log(data.replace(MARKER, b""))
        self._to_terminal(held)
        if self._log is not None:
            self._log.close()

    def _to_terminal(self, data: bytes) -> None:
        data = data.replace(SHUTDOWN_INTERRUPT_LINE, b"")  # the kernel's normal shutdown
        try:
            while data:
                data = data[os.write(self._terminal, data):]
        except OSError:
            pass

    def _to_log(self, data: bytes) -> None:
        """Append ``data`` to :attr:`log_path`, created on the first byte."""
        if not data:
            return
        try:
            if self._log is None:
                self._log = self.log_path.open("ab")
            self._log.write(data)
            self._log.flush()
        except OSError:
            pass


def _prefix_len(data: bytes, token: bytes) -> int:
    """Length of the longest tail of ``data`` that is a proper prefix of ``token``
    (:data:`MARKER` or :data:`SHUTDOWN_INTERRUPT_LINE`)."""
    for k in range(min(len(token) - 1, len(data)), 0, -1):
        if data.endswith(token[:k]):
            return k
    return 0


def _marker_prefix_len(data: bytes) -> int:
    """:func:`_prefix_len` of :data:`MARKER`."""
    return _prefix_len(data, MARKER)
