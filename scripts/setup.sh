#!/usr/bin/env bash
# Makes (or reuses) the virtual environment and installs batchgen into it, building batchgen._C.
# torch goes in first and alone: torch==2.13.0 is a CPU build on local disk here, while a bare
# `torch` requirement could pull a multi-GB CUDA build. Then the package, without build isolation
# so the extension compiles against that torch. Set BATCHGEN_VENV to use another folder.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BATCHGEN_VENV:-.venv}"
PY="${PYTHON:-python3}"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  pip install "torch==${BATCHGEN_TORCH_VERSION:-2.13.0}"
fi
pip install setuptools wheel pybind11 ninja
echo "[setup] installing batchgen (building batchgen._C; the first build takes a few minutes)"
MAX_JOBS="${MAX_JOBS:-2}" pip install --no-build-isolation -e ".[test]"
"$VENV/bin/python" -c "import batchgen._C" && echo "[setup] ok: $VENV"
