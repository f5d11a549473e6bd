#!/usr/bin/env bash
# The README's test command: set up (or reuse) the environment, then run the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k ops`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${BATCHGEN_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
