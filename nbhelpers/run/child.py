"""The papermill child of :func:`nbhelpers.run.execute.execute`:
``python -m nbhelpers.run.child SPEC`` (SPEC: JSON with ``input``, ``output``, ``parameters``,
``cwd``, ``error_file``, ``log_file``).

Contract: runs papermill with the ``nbhelpers`` kernel
(:data:`~nbhelpers.run.execute.KERNEL_NAME`), retrying a kernel that dies before its first
reply; exit 0 (ok), 1 (a cell failed: the cause in
``error_file``), 130 (stopped by :func:`~nbhelpers.run.execute.stop_jobs`' SIGINT: the partial
notebook's papermill record says so, :mod:`nbhelpers.run.interrupted`, and the stderr after the
signal is in ``log_file``, :mod:`nbhelpers.run.capture`); any other error propagates with its
traceback (its cause also in ``error_file``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from nbhelpers.run.capture import StderrCapture
from nbhelpers.run.execute import KERNEL_NAME, repo_path
from nbhelpers.run.interrupted import CellTracker, mark_file

START_RETRIES = 2
"""Extra attempts when the kernel dies before its first reply (no cell has run yet)."""
_START_DEATH = "Kernel died before replying to kernel_info"


def echo_free_kernel_manager() -> type:
    """nbclient's kernel manager with the kernel's stdout sent to ``/dev/null``.

    Why: ipykernel captures what its subprocesses write to fd 1 (phase 2 trains each backend in a
    spawned process) and forwards it to the notebook, and also echoes it to the kernel's own
    stdout, which is this terminal; papermill then prints the notebook's stream output here as
    well (``stdout_file``), so every line of a child's log showed twice (found by a new user's
    run, 2026-12-04). The notebook keeps the output either way; the kernel's stderr is left as it
    is (:class:`~nbhelpers.run.capture.StderrCapture` reads it)."""
    import subprocess

    from jupyter_client.manager import AsyncKernelManager

    class EchoFreeKernelManager(AsyncKernelManager):
        async def start_kernel(self, **kw: Any) -> None:
            kw.setdefault("stdout", subprocess.DEVNULL)
            return await super().start_kernel(**kw)

    return EchoFreeKernelManager


def _execute_with_start_retry(pm: Any, spec: dict[str, Any],
                              hooks: dict[str, Any] | None = None) -> None:
    """``pm.execute_notebook`` for ``spec``; a kernel that dies before replying to
    ``kernel_info`` (nbclient's startup check: no cell ran, nothing to lose) is started again up
    to :data:`START_RETRIES` times. Seen once on a shared host when two notebook kernels started
    in the same moment: jupyter_client picks free TCP ports by binding and releasing them, so a
    concurrent start can take the port first ("ZMQError: Address already in use", 2026-12-01).
    Any other failure propagates at once."""
    import time
    for attempt in range(START_RETRIES + 1):
        try:
            pm.execute_notebook(spec["input"], spec["output"], parameters=spec["parameters"],
                                kernel_name=KERNEL_NAME, cwd=spec["cwd"], progress_bar=True,
                                stdout_file=sys.stdout, stderr_file=sys.stderr,
                                kernel_manager_class=echo_free_kernel_manager(), **(hooks or {}))
            return
        except RuntimeError as exc:
            if _START_DEATH not in str(exc) or attempt == START_RETRIES:
                raise
            print(f"kernel died at startup ({exc}); starting it again "
                  f"({attempt + 1} of {START_RETRIES})", file=sys.stderr)
            time.sleep(1.0 + attempt)


def _execute_in_child(spec: dict[str, Any]) -> int:
    """Child-process side of :func:`~nbhelpers.run.execute.execute`: papermill with the
    ``nbhelpers`` kernel; the cells' text output is also streamed to this terminal as it comes
    (``stdout_file``/``stderr_file``), so a long run shows its training logs, not only
    papermill's cell bar. A failure is written to ``spec["error_file"]`` as ``<ename>: <evalue>
    (cell <index>, execution count <n>)`` for the parent's sidecar. Stopped by
    :func:`~nbhelpers.run.execute.stop_jobs` (SIGINT, taken as ``KeyboardInterrupt``), it marks
    the partial notebook's papermill record (:func:`~nbhelpers.run.interrupted.mark_file`: the
    cell in flight failed, never-run cells pending), prints one line instead of a traceback and
    returns 130; the parent records the failure. With ``spec["log_file"]``, fd 2 (and so the
    kernel's stderr) goes through :class:`~nbhelpers.run.capture.StderrCapture`: what comes
    after the signal lands in that file, which the line names."""
    import signal
    capture = StderrCapture(Path(spec["log_file"])) if spec.get("log_file") else None

    def on_stop(signum: int, frame: Any) -> None:
        if capture is not None:
            capture.divert()
        raise KeyboardInterrupt

    # stop_jobs stops this child with SIGINT: take it as KeyboardInterrupt even when the chain
    # that started the runner ignored SIGINT (a shell's background job), which Python inherits
    signal.signal(signal.SIGINT, on_stop)
    tracker = CellTracker()
    try:
        return _run_papermill(spec, tracker)
    except KeyboardInterrupt:  # stop_jobs' SIGINT: the runner records the run (no traceback)
        if capture is not None:
            capture.close()
        if spec.get("output"):
            _mark(Path(spec["output"]), tracker.in_flight)
        _asyncio_log_to(capture.log_path if capture is not None else None)
        print(_stopped_line(spec, capture), file=sys.stderr)
        return 130
    finally:  # before a traceback is printed: it belongs on the terminal
        if capture is not None:
            capture.close()


def _asyncio_log_to(log_path: Path | None) -> None:
    """After the stop: asyncio's log (its "Task exception was never retrieved" report of
    nbclient's cell task, which the kernel's error reply can end after this process took the
    signal: three tracebacks, ~150 lines, on a new user's terminal at exit, 2026-12-04) goes to
    the shutdown log beside the kernel's own shutdown output, or nowhere without one."""
    import logging
    logger = logging.getLogger("asyncio")
    handler: logging.Handler = (logging.FileHandler(log_path, encoding="utf-8")
                                if log_path is not None else logging.NullHandler())
    logger.handlers = [handler]
    logger.propagate = False


def _mark(output: Path, in_flight: int | None) -> None:
    """:func:`~nbhelpers.run.interrupted.mark_file`; a partial notebook it cannot read or write
    is one line, not a traceback (the runner still records the run and adds the banner)."""
    try:
        mark_file(output, in_flight)
    except Exception as exc:  # noqa: BLE001 -- one line; the runner still adds the banner
        print(f"could not mark {output} as interrupted: {exc!r}", file=sys.stderr)


def _stopped_line(spec: dict[str, Any], capture: StderrCapture | None) -> str:
    line = "notebook stopped by the runner (interrupted); the partial notebook is kept"
    if capture is None or not capture.log_path.is_file():
        return line
    # a new line: papermill's cell bar, whose close went to the log, left the terminal mid-line
    return f"\n{line}; kernel shutdown output: {repo_path(capture.log_path, Path(spec['cwd']))}"


def _run_papermill(spec: dict[str, Any], tracker: CellTracker) -> int:
    """papermill for ``spec``; 0, or 1 after a cell's failure (written to the error file); the
    stop signal, however it surfaces (:func:`_interrupted`), as ``KeyboardInterrupt``."""
    import papermill as pm
    error_file = Path(spec["error_file"]) if spec.get("error_file") else None
    try:
        try:
            _execute_with_start_retry(pm, spec, tracker.hooks())
        except Exception as exc:
            if _interrupted(exc):
                raise KeyboardInterrupt from None
            raise
    except pm.PapermillExecutionError as exc:
        msg = (f"{exc.ename}: {exc.evalue} (cell {exc.cell_index}, execution count "
               f"{exc.exec_count})")
        print(f"notebook failed: {msg}", file=sys.stderr)
        if error_file:
            error_file.write_text(msg)
        return 1
    except Exception as exc:  # kernel death, papermill bug: record it, keep the traceback
        if error_file:
            error_file.write_text(f"{type(exc).__name__}: {exc}")
        raise
    return 0


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the stop signal: nbclient answers a ``KeyboardInterrupt`` by
    interrupting the kernel, and when the kernel's reply (its cell's ``KeyboardInterrupt``) wins
    the race, a ``CellExecutionError`` / ``PapermillExecutionError`` escapes instead, with the
    ``KeyboardInterrupt`` as its context (seen under a 12-worker suite on the H200, 2026-12-01)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, KeyboardInterrupt) or getattr(cur, "ename", None) == "KeyboardInterrupt":
            return True
        cur = cur.__cause__ or cur.__context__
    return False


if __name__ == "__main__":
    import json
    sys.exit(_execute_in_child(json.loads(sys.argv[1])))
