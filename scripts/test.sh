#!/usr/bin/env bash
# The test suite on a CPU host: the same (idempotent) setup as the main job, then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not notebooks"`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" -m pytest -q "$@"
