#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: builds batchgen._C for it, runs the GPU tests, the kernel and
# end-to-end benchmarks, and writes one JSON report. All of it is scripts/gpu_check.py (its docstring says
# what each step does, its budget and where the report goes); this runs it with the system's python3, which
# needs only its standard library.
exec python3 "$(dirname "$0")/gpu_check.py" "$@"
