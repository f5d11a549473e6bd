#!/usr/bin/env bash
# The README's test command: set up (or reuse) the environment, then run the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k ops`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Test files run in parallel worker processes (pytest-xdist), one file to a worker at a time so that a
# file's module fixtures are built once: one worker a core, at most 4 (each loads models). Much of the
# suite waits on subprocesses (`batchgen run` jobs, the S3 server), so two workers on two cores finish
# it well before one. The long files go first (tests/conftest.py's LONG_FILES). BATCHGEN_TEST_WORKERS=0
# runs it in this process.
workers="${BATCHGEN_TEST_WORKERS:-$(n=$(nproc); echo $(( n < 4 ? n : 4 )))}"
parallel=()
if [ "$workers" -gt 0 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
  # The cores shared out: each worker (and the batchgen processes its tests start) gets nproc/workers
  # OpenMP threads, and threads that wait sleep rather than spin (the tests that ask for more threads).
  # Two workers of two spinning threads each on two cores made a tiny model's job take 24x longer: every
  # small kernel waited at its barrier for a thread the other worker had pushed off a core (PERF.md).
  threads=$(( $(nproc) / workers ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
fi
exec "${BATCHGEN_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
