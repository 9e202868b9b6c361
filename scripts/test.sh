#!/usr/bin/env bash
# The test suite on a CPU host: the same (idempotent) setup as the main job, triton for the
# interpreted kernel tests, the import-linter contracts of pyproject.toml (a broken contract
# fails the run with its message), then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not notebooks"`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
workers=${NBH_TEST_WORKERS:-2}
if ! [[ $workers =~ ^([1-9][0-9]*|0|auto|logical)$ ]]; then  # before minutes of setup
  echo "scripts/test.sh: NBH_TEST_WORKERS=$workers: give a worker count (e.g. 2), auto, or 0" \
       "for one process" >&2
  exit 2
fi
bash scripts/setup.sh
# triton for the interpreted CPU tests of the engine's Triton kernels (pyproject extra "interp"),
# Playwright for tests/browser/ (extra "browser"; it drives Debian's /usr/bin/chromium)
"${VENV:-.venv}/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[interp,browser]"
# layering (pyproject.toml [tool.importlinter]; import-linter comes with the dev extra of setup.sh):
# the engine stands alone, nothing imports upward, no cycles
"${VENV:-.venv}/bin/lint-imports"
# pytest in NBH_TEST_WORKERS xdist workers (default 2, one per core of the CI host; 0: one
# process), whole test files per worker (--dist loadfile: module fixtures built once), one BLAS
# thread each (two workers of two threads on two cores oversubscribe): on a 2-core host the
# suite took 14 min 20 s this way against 29 min 50 s in one process (2026-12-02, 1708 passed).
# --durations=25 prints the slowest tests, so a slow CI run names them.
xdist=()
if [ "$workers" != "0" ]; then
  xdist=(-n "$workers" --dist loadfile)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
exec "${VENV:-.venv}/bin/python" -m pytest -q "${xdist[@]}" --durations=25 "$@"
