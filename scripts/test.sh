#!/usr/bin/env bash
# The test suite on a CPU host: the same (idempotent) setup as the main job, triton for the
# interpreted kernel tests, the import-linter contracts of pyproject.toml (a broken contract
# fails the run with its message), then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not notebooks"`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# triton for the interpreted CPU tests of the engine's Triton kernels (pyproject extra "interp"),
# Playwright for tests/browser/ (extra "browser"; it drives Debian's /usr/bin/chromium)
"${VENV:-.venv}/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[interp,browser]"
# layering (pyproject.toml [tool.importlinter]; import-linter comes with the dev extra of setup.sh):
# the engine stands alone, nothing imports upward, no cycles
"${VENV:-.venv}/bin/lint-imports"
exec "${VENV:-.venv}/bin/python" -m pytest -q "$@"
