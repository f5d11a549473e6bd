#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU, nvcc and a CUDA build of torch: builds batchgen._C
# with the CUDA kernels for this GPU's architecture, runs the GPU tests (pytest -m gpu), the kernel
# benchmark (issue 51's grid: decode GB/s against the card's copy rate, prefill TFLOP/s against SDPA's
# flash backend) and the end-to-end benchmark (scripts/bench_e2e.py: random-weight 1B and 8B shapes),
# prints a summary table last and writes everything to one JSON report, $LOG/report.json (copied to
# $OUT/report.json when $OUT is set, as on a lent device machine). Exits non-zero when any step fails.
# Made to fit 8 minutes on an H100/H200: BATCHGEN_GPU_E2E_SHAPES (default 1b,8b; "none" skips the step)
# and BATCHGEN_GPU_E2E_PROMPTS (default 1000) size the end-to-end step.
#
# Python: $PYTHON if set, else the first of $BATCHGEN_GPU_VENV (default
# ~/.cache/batchgen/venv-gpu), .venv, python3 whose torch sees the GPU; failing that that venv is
# made (system packages visible) and torch installed into it. The package is installed editable
# without its dependencies (the machine may be offline).
# Logs go to $BATCHGEN_GPU_LOG (default /tmp/batchgen_gpu_check).
#
# The compilers are $CC / $CXX as torch's extension builder takes them. On an image whose CC/CXX are a wrapper
# that links its own libstdc++ into _C (seen on a lent H200 machine: /opt/gcc/bin/g++), every error message
# that formats a number crashes inside std::ostream: run with CC=/usr/bin/gcc CXX=/usr/bin/g++.
set -uo pipefail
cd "$(dirname "$0")/.."

LOG="${BATCHGEN_GPU_LOG:-/tmp/batchgen_gpu_check}"
GPU_VENV="${BATCHGEN_GPU_VENV:-$HOME/.cache/batchgen/venv-gpu}"
mkdir -p "$LOG"
declare -A STATUS DETAIL
STEPS=(python build tests bench e2e)
for s in "${STEPS[@]}"; do STATUS[$s]="skipped"; DETAIL[$s]=""; done
FAILED=0

log() { echo "[gpu_check] $*"; }
elapsed() { echo "$(($(date +%s) - $1))s"; }
fail() { STATUS[$1]="FAILED"; DETAIL[$1]="$2"; FAILED=1; }

summary() {
  echo
  echo "================ batchgen GPU check ================"
  printf '%-8s %-8s %s\n' step status detail
  for s in "${STEPS[@]}"; do printf '%-8s %-8s %s\n' "$s" "${STATUS[$s]}" "${DETAIL[$s]}"; done
  if [ -s "$LOG/bench.txt" ]; then
    echo "---- benchmark (last lines of $LOG/bench.txt) ----"
    tail -n 12 "$LOG/bench.txt"
  fi
  echo "logs: $LOG"
  [ "$FAILED" = 0 ] && echo "RESULT: ok" || echo "RESULT: FAILED"
}

has_cuda_torch() {
  "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1
}

# --- python with a CUDA torch --------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$LOG/nvidia-smi.txt" 2>&1; then
  fail python "no NVIDIA GPU visible (nvidia-smi missing or failing)"
  summary
  exit 1
fi
PY=""
for candidate in "${PYTHON:-}" "$GPU_VENV/bin/python" .venv/bin/python python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && has_cuda_torch "$candidate"; then
    PY="$candidate"
    break
  fi
done
if [ -z "$PY" ]; then
  log "no python with a CUDA torch found; making $GPU_VENV and installing torch (large download)"
  python3 -m venv --system-site-packages "$GPU_VENV" >"$LOG/venv.txt" 2>&1 &&
    timeout 400 "$GPU_VENV/bin/python" -m pip install -q torch >>"$LOG/venv.txt" 2>&1
  has_cuda_torch "$GPU_VENV/bin/python" && PY="$GPU_VENV/bin/python"
fi
if [ -z "$PY" ]; then
  fail python "no torch that sees the GPU (see $LOG/venv.txt)"
  summary
  exit 1
fi
DEVICE_INFO=$("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'{p.name}, sm_{p.major}{p.minor}, torch {torch.__version__}, CUDA {torch.version.cuda}')")
ARCH=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))")
STATUS[python]="ok"
DETAIL[python]="$PY: $DEVICE_INFO"
log "python: ${DETAIL[python]}"

# --- build ---------------------------------------------------------------------------------
start=$(date +%s)
log "building batchgen._C for sm_$ARCH (log: $LOG/build.txt)"
# Build and test tools, fetched only when missing (short timeouts: the machine may be offline).
for module in setuptools wheel pybind11 ninja pytest hypothesis; do
  if ! "$PY" -c "import $module" >/dev/null 2>&1; then
    timeout 120 "$PY" -m pip install -q --retries 1 --timeout 15 "$module" >>"$LOG/pip_tools.txt" 2>&1 ||
      log "could not install $module (see $LOG/pip_tools.txt)"
  fi
done
if BATCHGEN_CUDA_ARCHS="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" timeout 480 \
  "$PY" -m pip install --no-build-isolation --no-deps -v -e . >"$LOG/build.txt" 2>&1; then
  if "$PY" -c "import sys, torch, batchgen._C as C; sys.exit(0 if C.has_cuda() else 1)" >>"$LOG/build.txt" 2>&1; then
    STATUS[build]="ok"
    DETAIL[build]="sm_$ARCH, $(elapsed "$start"), CXX=${CXX:-c++}"
  else
    fail build "built without the CUDA kernels (nvcc or CUDA_HOME missing?), see $LOG/build.txt"
  fi
else
  fail build "pip install failed after $(elapsed "$start"), see $LOG/build.txt"
  tail -n 30 "$LOG/build.txt"
fi

# --- GPU tests -----------------------------------------------------------------------------
if [ "${STATUS[build]}" = ok ]; then
  start=$(date +%s)
  # Only the modules that hold GPU tests are collected: the others import packages (moto, ray, ...) that a
  # GPU image may lack, and a collection error would fail the run.
  # (kernel_cases.DEVICES carries the mark into the op tests.)
  gpu_modules=$(grep -lE "pytest.mark.gpu|DEVICES" tests/test_*.py)
  log "running pytest -m gpu on $(echo $gpu_modules | wc -w) modules (log: $LOG/tests.txt)"
  timeout 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$LOG/tests.xml" $gpu_modules \
    >"$LOG/tests.txt" 2>&1
  rc=$?
  counts=$("$PY" - "$LOG/tests.xml" <<'EOF' 2>/dev/null
import sys, xml.etree.ElementTree as ET
suites = ET.parse(sys.argv[1]).getroot()
suites = [suites] if suites.tag == "testsuite" else list(suites)
get = lambda k: sum(int(s.get(k, 0)) for s in suites)
total, failed, errors, skipped = get("tests"), get("failures"), get("errors"), get("skipped")
print(f"{total - failed - errors - skipped} passed, {failed} failed, {errors} errors, {skipped} skipped")
EOF
  )
  DETAIL[tests]="${counts:-no result} ($(elapsed "$start"))"
  if [ "$rc" = 0 ]; then
    STATUS[tests]="ok"
  else
    fail tests "${DETAIL[tests]}, pytest exit $rc (5: no gpu tests collected), see $LOG/tests.txt"
    tail -n 40 "$LOG/tests.txt"
  fi
fi

# --- benchmark -----------------------------------------------------------------------------
if [ "${STATUS[build]}" = ok ]; then
  if [ -f scripts/bench_kernels.py ]; then
    start=$(date +%s)
    log "running scripts/bench_kernels.py --device cuda --grid issue51 (log: $LOG/bench.txt)"
    if timeout 240 "$PY" scripts/bench_kernels.py --device cuda --grid issue51 --json "$LOG/bench.json" \
      >"$LOG/bench.txt" 2>&1; then
      STATUS[bench]="ok"
      DETAIL[bench]="$(elapsed "$start")"
    else
      fail bench "exit $? after $(elapsed "$start"), see $LOG/bench.txt"
    fi
  else
    fail bench "scripts/bench_kernels.py not found"
  fi
fi

# --- end to end ----------------------------------------------------------------------------
E2E_SHAPES="${BATCHGEN_GPU_E2E_SHAPES:-1b,8b}"
if [ "${STATUS[build]}" = ok ] && [ "$E2E_SHAPES" != none ]; then
  start=$(date +%s)
  log "running scripts/bench_e2e.py --shapes $E2E_SHAPES (log: $LOG/e2e.txt)"
  if timeout 300 "$PY" scripts/bench_e2e.py --device cuda --shapes "$E2E_SHAPES" \
    --prompts "${BATCHGEN_GPU_E2E_PROMPTS:-1000}" --json "$LOG/e2e.json" >"$LOG/e2e.txt" 2>&1; then
    STATUS[e2e]="ok"
    DETAIL[e2e]="$(elapsed "$start")"
  else
    fail e2e "exit $? after $(elapsed "$start"), see $LOG/e2e.txt"
    tail -n 20 "$LOG/e2e.txt"
  fi
fi

# --- one report ----------------------------------------------------------------------------
report_steps=""
for s in "${STEPS[@]}"; do report_steps+="$s=${STATUS[$s]}=${DETAIL[$s]}"$'\n'; done
"${PY:-python3}" - "$LOG" "${DEVICE_INFO:-}" "$report_steps" <<'EOF' || log "could not write $LOG/report.json"
import json, sys
from pathlib import Path

log, device, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def read(name):
    path = log / name
    return json.loads(path.read_text()) if path.is_file() else None
report = {"device": device,
          "steps": {s.split("=", 2)[0]: {"status": s.split("=", 2)[1], "detail": s.split("=", 2)[2]}
                    for s in steps.splitlines() if s},
          "kernels": read("bench.json"), "e2e": read("e2e.json")}
(log / "report.json").write_text(json.dumps(report, indent=2))
EOF
if [ -n "${OUT:-}" ] && [ -f "$LOG/report.json" ]; then
  cp "$LOG/report.json" "$OUT/report.json"
  tar -czf "$OUT/logs.tar.gz" -C "$LOG" . 2>/dev/null || true
fi

summary
exit "$FAILED"
