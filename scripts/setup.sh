#!/usr/bin/env bash
# Makes (or reuses) the virtual environment and installs batchgen into it, building batchgen._C.
# torch goes in first and alone: torch==2.13.0 is a CPU build on local disk here, while a bare
# `torch` requirement could pull a multi-GB CUDA build. Then the package, without build isolation
# so the extension compiles against that torch. The install is skipped when nothing it depends on
# changed since the last one (a stamp of pyproject.toml, setup.py and engine_src/ in the venv).
# Set BATCHGEN_VENV to use another folder.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BATCHGEN_VENV:-.venv}"
PY="${PYTHON:-python3}"
LOG="$VENV/setup.log"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() {
  if ! "$VENV/bin/python" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG"; echo "[setup] pip $* failed; the whole log is in $LOG" >&2; exit 1
  fi
}
: >"$LOG"
# The pip a fresh venv brings (23.x on Python 3.11) backtracks for some 15 minutes over boto3 and
# botocore releases to fit s3fs, moto and ray together; pip 25+ resolves the same set in under a minute.
if ! "$VENV/bin/python" -c "import pip, sys; sys.exit(int(pip.__version__.split('.')[0]) < 25)" 2>/dev/null; then
  echo "[setup] upgrading pip (the venv's own resolves the test extras slowly)"
  pip install --upgrade "pip>=25"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==${BATCHGEN_TORCH_VERSION:-2.13.0}"
  pip install "torch==${BATCHGEN_TORCH_VERSION:-2.13.0}"
fi
stamp=$(cat pyproject.toml setup.py $(find engine_src -type f | sort) | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.batchgen-stamp" 2>/dev/null)" = "$stamp" ] && "$VENV/bin/python" -c "import torch, batchgen._C" 2>/dev/null; then
  echo "[setup] up to date: $VENV"
  exit 0
fi
echo "[setup] installing batchgen and building batchgen._C (the first build takes a few minutes)"
pip install setuptools wheel pybind11 ninja
MAX_JOBS="${MAX_JOBS:-2}" pip install --no-build-isolation -e ".[test]"
"$VENV/bin/python" -c "import torch, batchgen._C"
echo "$stamp" >"$VENV/.batchgen-stamp"
echo "[setup] ok: $VENV"
