#!/usr/bin/env python3
"""GPU check, for a machine with an NVIDIA GPU, nvcc and a CUDA build of torch (`bash scripts/gpu_check.sh` runs
this with python3; only the standard library here, torch is looked for in another Python).

Steps, in order:
  python  a Python whose torch sees the GPU: $PYTHON, else the first of $BATCHGEN_GPU_VENV (default
          ~/.cache/batchgen/venv-gpu), .venv and python3 that does; failing that that venv is made (system
          packages visible) and torch installed into it
  build   batchgen._C with the CUDA kernels for this GPU's architecture (pip install -e . without dependencies:
          the machine may be offline)
  tests   pytest -m gpu over the test modules that hold GPU tests
  bench   scripts/bench_kernels.py --grid issue51: decode K/V GB/s against the card's copy rate (16-bit and fp8
          caches), prefill TFLOP/s against SDPA's flash backend
  e2e     scripts/bench_e2e.py: the engine on random-weight 1B and 8B shapes ($BATCHGEN_GPU_E2E_SHAPES, default
          1b,8b, "none" skips it; $BATCHGEN_GPU_E2E_PROMPTS, default 1000)
  profile Nsight Compute (ncu, where installed) over `kernel_calls.py profile`: decode and tensor-core prefill
          over 16-bit and fp8 caches, their throughput, occupancy and warp stalls ($LOG/profile.txt, CSV)
  sanitize compute-sanitizer (where installed), memcheck then racecheck, over `kernel_calls.py sweep`: every
          dtype, cache and head_dim on small shapes, writes, decode with merged splits, prefill with a prefix hit
The steps after build can be chosen: --steps (or $BATCHGEN_GPU_STEPS), a comma-separated list in that order.

A machine with no package index (a lent device machine, an air-gapped node) may lack packages batchgen imports:
`python scripts/gpu_check.py --fetch-wheels` (on a machine with an index, in batchgen's venv) downloads their
wheels into .whl/ ($BATCHGEN_GPU_WHEELS), and the python step installs the wheels it finds there into $LOG/site,
put on PYTHONPATH for the steps after it.

Each step has a time cap, and the whole run a budget when one is given (--budget-s or $BATCHGEN_GPU_BUDGET_S,
seconds; 0, the default, is none): a step gets the smaller of its cap and what is left of the budget, a step
stopped at its time is sent SIGINT first (pytest then still writes what ran) and counts as failed, and one with
too little left is not started. After every step the report, $LOG/report.json (the steps, the benchmarks' JSON),
is written again, and copied with a tarball of the logs to $OUT when $OUT is set (as on a lent device machine,
where a command stopped at its limit returns what $OUT holds). Logs go to $BATCHGEN_GPU_LOG (default
/tmp/batchgen_gpu_check). Prints a summary table last; exits 1 when a step failed or ran out of time.

The compilers are $CC / $CXX as torch's extension builder takes them. On an image whose CC/CXX are a wrapper that
links its own libstdc++ into _C (seen on a lent H200 machine: /opt/gcc/bin/g++), every error message that formats
a number crashes inside std::ostream: run with CC=/usr/bin/gcc CXX=/usr/bin/g++.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("python", "build", "tests", "bench", "e2e", "profile", "sanitize")
# Each step's own limit, in seconds (sanitize's for each of its tools).
CAPS_S = {"python": 460, "build": 480, "tests": 300, "bench": 240, "e2e": 300, "profile": 180, "sanitize": 180}
SANITIZER_TOOLS = ("memcheck", "racecheck")  # out-of-bounds and misaligned accesses; shared-memory hazards
# The kernels' counters under Nsight Compute: throughput against the card's peaks, occupancy, where warps stall.
NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")
NCU_KERNELS = "regex:paged_attention_(decode|prefill_tc)_kernel"
INTERRUPT_GRACE_S = 20  # from SIGINT to SIGKILL
REPORT_RESERVE_S = INTERRUPT_GRACE_S + 10  # kept back from the budget: a step's interruption, the last report
MIN_STEP_S = 30  # a step with less than this left is not started
BUILD_TOOLS = ("setuptools", "wheel", "pybind11", "ninja", "pytest", "hypothesis")
# batchgen's imports that a CUDA image (the lent machines' 'cuda' image, 2026-11) lacks: pydantic and its own;
# xgrammar and its own, and pillow, for the structured outputs and images of tests/test_engine_devices.py.
OFFLINE_WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "xgrammar", "apache-tvm-ffi",
                  "pillow")
LINUX_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def signal_group(pid: int, sig: int) -> None:
    """Sends sig to a step's whole process group (its compilers, its workers), if it is still there."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Step:
    status: str = "skipped"  # ok, FAILED, timeout (stopped at its time, or not started for lack of it), skipped
    detail: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in ("FAILED", "timeout")


@dataclass
class GpuCheck:
    log: Path
    out: Path | None = None
    budget_s: float = 0.0  # 0: no budget
    started: float = field(default_factory=time.monotonic)
    steps: dict[str, Step] = field(default_factory=lambda: {s: Step() for s in STEPS})
    device: str = ""

    def time_for(self, name: str) -> float | None:
        """Seconds the step may run: its cap, or what is left of the budget if less; None when too little is left."""
        cap = float(CAPS_S[name])
        if not self.budget_s:
            return cap
        left = self.budget_s - (time.monotonic() - self.started) - REPORT_RESERVE_S
        return min(cap, left) if left >= MIN_STEP_S else None

    def run(self, name: str, argv: list[str], log_name: str, env: dict | None = None) -> int | None:
        """Runs argv for step `name` (output appended to $LOG/log_name); its exit code, or None if stopped at its
        time or not started for lack of it (the step is then marked timeout)."""
        limit = self.time_for(name)
        if limit is None:
            self.mark(name, "timeout", "not started: too little left of the budget")
            return None
        start = time.monotonic()
        with open(self.log / log_name, "a") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                    env={**os.environ, **(env or {})})
            try:
                return proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGINT)  # pytest writes its junit report on an interrupt
                try:
                    proc.wait(timeout=INTERRUPT_GRACE_S)
                except subprocess.TimeoutExpired:
                    signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                self.mark(name, "timeout", f"stopped after {time.monotonic() - start:.0f}s (its limit)")
                return None
            finally:
                self.steps[name].seconds += time.monotonic() - start

    def mark(self, name: str, status: str, detail: str) -> None:
        self.steps[name].status = status
        self.steps[name].detail = detail
        print(f"[gpu_check] {name}: {status} {detail}", flush=True)

    def report(self) -> dict:
        def read(file: str):
            try:
                return json.loads((self.log / file).read_text())
            except (OSError, ValueError):
                return None

        return {"device": self.device, "budget_s": self.budget_s,
                "elapsed_s": round(time.monotonic() - self.started, 1),
                "steps": {name: asdict(step) for name, step in self.steps.items()},
                "kernels": read("bench.json"), "sampler": read("vocab.json"), "e2e": read("e2e.json")}

    def publish(self) -> None:
        """Writes the report as it stands, and copies it and the logs to $OUT when set."""
        text = json.dumps(self.report(), indent=2)
        (self.log / "report.json").write_text(text)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "report.json").write_text(text)
            with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
                for path in sorted(self.log.iterdir()):
                    if path.is_file() and path.name != "report.json":
                        tar.add(path, arcname=path.name)

    @property
    def failed(self) -> bool:
        return any(step.failed for step in self.steps.values())

    def summary(self) -> str:
        lines = ["", "================ batchgen GPU check ================", f"{'step':8} {'status':8} detail"]
        lines += [f"{name:8} {step.status:8} {step.detail}" for name, step in self.steps.items()]
        bench = self.log / "bench.txt"
        if bench.is_file() and bench.stat().st_size:
            lines += [f"---- benchmark (last lines of {bench}) ----", *bench.read_text().splitlines()[-12:]]
        lines += [f"logs: {self.log}", "RESULT: FAILED" if self.failed else "RESULT: ok"]
        return "\n".join(lines)


def sees_gpu(python: str) -> bool:
    try:
        probe = subprocess.run([python, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"],
                               capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def find_python(check: GpuCheck) -> str | None:
    venv = Path(os.environ.get("BATCHGEN_GPU_VENV", Path.home() / ".cache/batchgen/venv-gpu"))
    for candidate in (os.environ.get("PYTHON"), str(venv / "bin/python"), str(ROOT / ".venv/bin/python"), "python3"):
        if candidate and sees_gpu(candidate):
            return candidate
    print(f"[gpu_check] no python with a CUDA torch found; making {venv} and installing torch (a large download)")
    if check.run("python", [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], "venv.txt") == 0:
        check.run("python", [str(venv / "bin/python"), "-m", "pip", "install", "-q", "torch"], "venv.txt")
    return str(venv / "bin/python") if sees_gpu(str(venv / "bin/python")) else None


def step_python(check: GpuCheck) -> str | None:
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        (check.log / "nvidia-smi.txt").write_text(smi.stdout + smi.stderr)
        visible = smi.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        visible = False
    if not visible:
        check.mark("python", "FAILED", "no NVIDIA GPU visible (nvidia-smi missing or failing)")
        return None
    python = find_python(check)
    if python is None:
        if not check.steps["python"].failed:
            check.mark("python", "FAILED", f"no torch that sees the GPU (see {check.log}/venv.txt)")
        return None
    describe = ("import torch; p = torch.cuda.get_device_properties(0); "
                "print(f'{p.name}, sm_{p.major}{p.minor}, torch {torch.__version__}, CUDA {torch.version.cuda}')")
    info = subprocess.run([python, "-c", describe], capture_output=True, text=True, timeout=120)
    check.device = info.stdout.strip()
    wheels = install_wheels(check, python)
    if check.steps["python"].failed:
        return None
    carried = f"; {wheels} wheels from {wheels_dir()}" if wheels else ""
    check.mark("python", "ok", f"{python}: {check.device}{carried}")
    return python


def wheels_dir() -> Path:
    return Path(os.environ.get("BATCHGEN_GPU_WHEELS", ROOT / ".whl"))


def install_wheels(check: GpuCheck, python: str) -> int:
    """Installs the wheels in wheels_dir() into $LOG/site and puts it first on PYTHONPATH (for every later step's
    processes); how many there were."""
    wheels = sorted(wheels_dir().glob("*.whl"))
    if not wheels:
        return 0
    site = check.log / "site"
    rc = check.run("python", [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                              "--upgrade", "--target", str(site), *map(str, wheels)], "wheels.txt")
    if rc != 0:
        if rc is not None:
            check.mark("python", "FAILED", f"installing {len(wheels)} wheels failed, see {check.log}/wheels.txt")
        return 0
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return len(wheels)


def fetch_wheels(dest: Path, python_version: str) -> int:
    """Downloads OFFLINE_WHEELS, at the versions installed here where they are, as wheels for CPython
    `python_version` on Linux x86-64, into dest; pip's exit code."""
    from importlib.metadata import PackageNotFoundError, version

    def pinned(name: str) -> str:
        try:
            return f"{name}=={version(name)}"
        except PackageNotFoundError:
            return name

    platforms = [arg for platform in LINUX_PLATFORMS for arg in ("--platform", platform)]
    return subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--implementation", "cp", "--python-version", python_version, *platforms, "-d", str(dest),
                           *map(pinned, OFFLINE_WHEELS)]).returncode


def step_build(check: GpuCheck, python: str) -> bool:
    arch = subprocess.run([python, "-c", "import torch; print('%d%d' % torch.cuda.get_device_capability(0))"],
                          capture_output=True, text=True, timeout=120).stdout.strip()
    for module in BUILD_TOOLS:  # fetched only when missing (short timeouts: the machine may be offline)
        if subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode != 0:
            check.run("build", [python, "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "15", module],
                      "pip_tools.txt")
    print(f"[gpu_check] building batchgen._C for sm_{arch} (log: {check.log}/build.txt)", flush=True)
    env = {"BATCHGEN_CUDA_ARCHS": arch, "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))}
    rc = check.run("build", [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-v", "-e", "."],
                   "build.txt", env)
    took = f"{check.steps['build'].seconds:.0f}s"
    if rc is None:
        return False
    if rc != 0:
        check.mark("build", "FAILED", f"pip install failed after {took}, see {check.log}/build.txt")
        return False
    has_cuda = check.run("build", [python, "-c", "import sys, batchgen._C as C; sys.exit(0 if C.has_cuda() else 1)"],
                         "build.txt")
    if has_cuda != 0:
        if has_cuda is not None:
            check.mark("build", "FAILED", f"built without CUDA kernels (nvcc, CUDA_HOME?), see {check.log}/build.txt")
        return False
    check.mark("build", "ok", f"sm_{arch}, {took}, CXX={os.environ.get('CXX', 'c++')}")
    return True


def gpu_test_modules() -> list[str]:
    """The test modules holding GPU tests: the others import packages (moto, ray, ...) a GPU image may lack, and a
    collection error would fail the run. kernel_cases.DEVICES carries the mark into the op tests."""
    marked = re.compile(r"pytest\.mark\.gpu|DEVICES")
    modules = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(p.relative_to(ROOT)) for p in modules if marked.search(p.read_text())]


def junit_counts(path: Path) -> str:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return "no result"
    suites = [root] if root.tag == "testsuite" else list(root)
    total, failed, errors, skipped = (sum(int(s.get(k, 0)) for s in suites)
                                      for k in ("tests", "failures", "errors", "skipped"))
    return f"{total - failed - errors - skipped} passed, {failed} failed, {errors} errors, {skipped} skipped"


def step_tests(check: GpuCheck, python: str) -> None:
    modules = gpu_test_modules()
    print(f"[gpu_check] pytest -m gpu on {len(modules)} modules (log: {check.log}/tests.txt)", flush=True)
    xml = check.log / "tests.xml"
    rc = check.run("tests", [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs",
                             f"--junitxml={xml}", *modules], "tests.txt")
    counts = f"{junit_counts(xml)} ({check.steps['tests'].seconds:.0f}s)"
    if rc is None:
        check.mark("tests", "timeout", f"{counts}; {check.steps['tests'].detail}")
    elif rc == 0:
        check.mark("tests", "ok", counts)
    else:
        check.mark("tests", "FAILED", f"{counts}, pytest exit {rc} (5: no gpu tests), see {check.log}/tests.txt")


def mark_exit(check: GpuCheck, name: str, rc: int | None) -> None:
    """Marks a step by its command's exit code; rc None (stopped at its time, or not started) is marked already."""
    if rc is None:
        return
    took = f"{check.steps[name].seconds:.0f}s"
    if rc == 0:
        check.mark(name, "ok", took)
    else:
        check.mark(name, "FAILED", f"exit {rc} after {took}, see {check.log}/{name}.txt")


def tool_or_skip(check: GpuCheck, name: str, tool: str) -> str | None:
    """The path of a step's tool, or None with the step marked skipped where it is not installed."""
    path = shutil.which(tool)
    if path is None:
        check.mark(name, "skipped", f"{tool} not found")
    return path


def step_bench(check: GpuCheck, python: str) -> None:
    print(f"[gpu_check] scripts/bench_kernels.py --device cuda --grid issue51 (log: {check.log}/bench.txt)", flush=True)
    rc = check.run("bench", [python, "scripts/bench_kernels.py", "--device", "cuda", "--grid", "issue51",
                             "--json", str(check.log / "bench.json")], "bench.txt", {"PYTHONUNBUFFERED": "1"})
    if rc == 0:  # the sampler's ops on the device: ops.top_k by keys against the sort it replaced, the draws
        print(f"[gpu_check] scripts/bench_vocab.py --device cuda (log: {check.log}/vocab.txt)", flush=True)
        rc = check.run("bench", [python, "scripts/bench_vocab.py", "--device", "cuda", "--vocabs", "128256",
                                 "--dtype", "bf16", "--rows", "64,256", "--json", str(check.log / "vocab.json")],
                       "vocab.txt", {"PYTHONUNBUFFERED": "1"})
    mark_exit(check, "bench", rc)


def step_e2e(check: GpuCheck, python: str) -> None:
    shapes = os.environ.get("BATCHGEN_GPU_E2E_SHAPES", "1b,8b")
    if shapes == "none":
        check.mark("e2e", "skipped", "BATCHGEN_GPU_E2E_SHAPES=none")
        return
    print(f"[gpu_check] scripts/bench_e2e.py --shapes {shapes} (log: {check.log}/e2e.txt)", flush=True)
    rc = check.run("e2e", [python, "scripts/bench_e2e.py", "--device", "cuda", "--shapes", shapes, "--prompts",
                           os.environ.get("BATCHGEN_GPU_E2E_PROMPTS", "1000"), "--json", str(check.log / "e2e.json")],
                   "e2e.txt", {"PYTHONUNBUFFERED": "1"})
    mark_exit(check, "e2e", rc)


def step_profile(check: GpuCheck, python: str) -> None:
    if (ncu := tool_or_skip(check, "profile", "ncu")) is None:
        return
    print(f"[gpu_check] ncu over kernel_calls.py profile (log: {check.log}/profile.txt)", flush=True)
    sections = [arg for name in NCU_SECTIONS for arg in ("--section", name)]
    rc = check.run("profile", [ncu, "--target-processes", "all", "-k", NCU_KERNELS, *sections, "--csv", "--page",
                               "details", python, "scripts/kernel_calls.py", "profile", "--device", "cuda"],
                   "profile.txt")
    mark_exit(check, "profile", rc)


def step_sanitize(check: GpuCheck, python: str) -> None:
    if (sanitizer := tool_or_skip(check, "sanitize", "compute-sanitizer")) is None:
        return
    for tool in SANITIZER_TOOLS:
        print(f"[gpu_check] compute-sanitizer --tool {tool} over kernel_calls.py sweep (log: {check.log}/sanitize.txt)",
              flush=True)
        rc = check.run("sanitize", [sanitizer, "--tool", tool, "--target-processes", "all", "--error-exitcode", "1",
                                    python, "scripts/kernel_calls.py", "sweep", "--device", "cuda"], "sanitize.txt")
        if rc is None:
            return
        if rc != 0:
            check.mark("sanitize", "FAILED", f"{tool}: exit {rc}, see {check.log}/sanitize.txt")
            return
    check.mark("sanitize", "ok", f"{', '.join(SANITIZER_TOOLS)} clean, {check.steps['sanitize'].seconds:.0f}s")


STEP_RUNS = {"tests": step_tests, "bench": step_bench, "e2e": step_e2e, "profile": step_profile,
             "sanitize": step_sanitize}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("BATCHGEN_GPU_BUDGET_S", 0)),
                        help="seconds for the whole run (0: none; default $BATCHGEN_GPU_BUDGET_S or 0)")
    parser.add_argument("--fetch-wheels", action="store_true",
                        help=f"download the wheels an offline CUDA image lacks ({', '.join(OFFLINE_WHEELS)}) into "
                             "$BATCHGEN_GPU_WHEELS (default .whl/) and exit")
    parser.add_argument("--python-version", default="3.12", help="of the GPU machine's Python, for --fetch-wheels")
    parser.add_argument("--steps", default=os.environ.get("BATCHGEN_GPU_STEPS", ",".join(STEP_RUNS)),
                        help=f"the steps after build, in order (default $BATCHGEN_GPU_STEPS or {','.join(STEP_RUNS)})")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    if unknown := [s for s in steps if s not in STEP_RUNS]:
        parser.error(f"unknown steps {', '.join(unknown)}; the steps after build are {', '.join(STEP_RUNS)}")
    if args.fetch_wheels:
        return fetch_wheels(wheels_dir(), args.python_version)
    log = Path(os.environ.get("BATCHGEN_GPU_LOG", "/tmp/batchgen_gpu_check"))
    log.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    check = GpuCheck(log, out, args.budget_s)
    python = step_python(check)
    check.publish()
    if python is not None and step_build(check, python):
        check.publish()
        for step in steps:
            STEP_RUNS[step](check, python)
            check.publish()
    check.publish()
    print(check.summary())
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
