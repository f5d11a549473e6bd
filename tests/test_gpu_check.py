"""scripts/gpu_check.py, the one command a GPU node (or a lent card with minutes of device time) runs: without a
GPU here, what must hold is its bookkeeping. A step stopped at its time is interrupted before it is killed and
counts as failed, a step with too little of the budget left is not started, the report reaches $OUT after every
step, and a machine without a GPU gets a report saying so and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_bench_smoke import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_no_gpu_gives_a_report_and_a_failure(tmp_path):
    """nvidia-smi failing (as on this machine, where it is absent or has no device): exit 1, and the report in $OUT
    says which step failed and why."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "OUT": str(out),
           "BATCHGEN_GPU_LOG": str(tmp_path / "log")}
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "RESULT: FAILED" in run.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["steps"]["python"]["status"] == "FAILED"
    assert "no NVIDIA GPU visible" in report["steps"]["python"]["detail"]
    assert all(report["steps"][s]["status"] == "skipped" for s in ("build", "tests", "bench", "e2e"))
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "nvidia-smi.txt" in tar.getnames()


INTERRUPTIBLE = """
import signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("interrupted")
    sys.exit(3)
signal.signal(signal.SIGINT, stop)
print("started", flush=True)
time.sleep(60)
"""


def test_a_step_past_its_time_is_interrupted_then_counted_failed(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.CAPS_S, "tests", 1)
    check = gpu_check.GpuCheck(tmp_path)
    marker = tmp_path / "marker"
    start = time.monotonic()
    rc = check.run("tests", [sys.executable, "-c", INTERRUPTIBLE, str(marker)], "tests.txt")
    assert rc is None
    assert time.monotonic() - start < 30
    assert marker.read_text() == "interrupted"  # SIGINT first: pytest writes its junit report then
    assert "started" in (tmp_path / "tests.txt").read_text()
    step = check.steps["tests"]
    assert step.status == "timeout" and "its limit" in step.detail
    assert check.failed


def test_a_step_deaf_to_sigint_is_killed(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.CAPS_S, "bench", 1)
    monkeypatch.setattr(gpu_check, "INTERRUPT_GRACE_S", 1)
    check = gpu_check.GpuCheck(tmp_path)
    deaf = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    start = time.monotonic()
    assert check.run("bench", [sys.executable, "-c", deaf], "bench.txt") is None
    assert time.monotonic() - start < 30
    assert check.steps["bench"].status == "timeout"


def test_the_budget_bounds_each_step_and_stops_starting_them(gpu_check, tmp_path):
    check = gpu_check.GpuCheck(tmp_path, budget_s=100)
    assert check.time_for("build") == pytest.approx(100 - gpu_check.REPORT_RESERVE_S, abs=2)
    assert gpu_check.GpuCheck(tmp_path).time_for("build") == gpu_check.CAPS_S["build"]  # no budget: the cap
    check.started -= 100 - gpu_check.REPORT_RESERVE_S - gpu_check.MIN_STEP_S + 1  # too little left now
    assert check.time_for("e2e") is None
    ran = tmp_path / "ran"
    assert check.run("e2e", [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], "e2e.txt") is None
    assert not ran.exists()
    assert check.steps["e2e"].status == "timeout" and "not started" in check.steps["e2e"].detail
    assert check.failed


def test_the_report_holds_the_benchmarks_as_they_stand(gpu_check, tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "log"
    log.mkdir()
    check = gpu_check.GpuCheck(log, out, budget_s=500)
    check.mark("python", "ok", "python3: a card")
    (log / "bench.json").write_text(json.dumps({"results": [{"kind": "decode"}]}))
    (log / "bench.txt").write_text("decode row\n")
    check.publish()
    report = json.loads((out / "report.json").read_text())
    assert report["steps"]["python"] == {"status": "ok", "detail": "python3: a card", "seconds": 0.0}
    assert report["kernels"] == {"results": [{"kind": "decode"}]} and report["e2e"] is None
    assert report["budget_s"] == 500
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["bench.json", "bench.txt"]
    assert not check.failed  # skipped steps are not failures
    assert "decode row" in check.summary() and "RESULT: ok" in check.summary()


def test_junit_counts_read_pytests_own_report(gpu_check, tmp_path):
    tests = tmp_path / "test_three.py"
    tests.write_text(textwrap.dedent("""
        import pytest
        def test_passes(): pass
        def test_fails(): assert False
        @pytest.mark.skip(reason="no card")
        def test_skipped(): pass
    """))
    xml = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(tests)],
                   cwd=tmp_path, capture_output=True, timeout=120)
    assert gpu_check.junit_counts(xml) == "1 passed, 1 failed, 0 errors, 1 skipped"
    assert gpu_check.junit_counts(tmp_path / "missing.xml") == "no result"


def test_gpu_test_modules_are_the_ones_with_gpu_tests(gpu_check):
    modules = gpu_check.gpu_test_modules()
    for module in ("tests/test_gpu.py", "tests/test_ops.py", "tests/test_kv_fp8.py", "tests/test_cuda_graphs.py"):
        assert module in modules
    assert "tests/test_gpu_check.py" not in modules


def make_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, `tinypkg`, as pip installs it."""
    import zipfile

    wheel = folder / "tinypkg-0.1-py3-none-any.whl"
    files = {"tinypkg/__init__.py": "ANSWER = 42\n",
             "tinypkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n",
             "tinypkg-0.1.dist-info/WHEEL":
                 "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "tinypkg-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in {**files, "tinypkg-0.1.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    return wheel


def test_carried_wheels_reach_every_later_step(gpu_check, tmp_path, monkeypatch):
    """The wheels in $BATCHGEN_GPU_WHEELS (a machine with no package index) are installed into $LOG/site, which the
    processes of the steps after the python step import from."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels)
    monkeypatch.setenv("BATCHGEN_GPU_WHEELS", str(wheels))
    monkeypatch.setenv("PYTHONPATH", "")
    log = tmp_path / "log"
    log.mkdir()
    check = gpu_check.GpuCheck(log)
    assert gpu_check.install_wheels(check, sys.executable) == 1
    assert (log / "site" / "tinypkg" / "__init__.py").is_file()
    answer = tmp_path / "answer.txt"
    probe = f"import tinypkg; open({str(answer)!r}, 'w').write(str(tinypkg.ANSWER))"
    assert check.run("tests", [sys.executable, "-c", probe], "tests.txt") == 0
    assert answer.read_text() == "42"
    monkeypatch.setenv("BATCHGEN_GPU_WHEELS", str(tmp_path / "none"))
    assert gpu_check.install_wheels(check, sys.executable) == 0  # nothing carried: nothing done


def test_the_profile_step_runs_the_kernels_under_ncu(gpu_check, tmp_path, monkeypatch):
    """Nsight Compute where there is one (a stand-in here that records its arguments), asked for the attention
    kernels only, over bench_kernels.py's untimed calls; no ncu: the step is skipped, not failed."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    check = gpu_check.GpuCheck(tmp_path)
    with monkeypatch.context() as no_ncu:
        no_ncu.setattr(gpu_check, "shutil", SimpleNamespace(which=lambda name: None))
        gpu_check.step_profile(check, sys.executable)
    assert check.steps["profile"].status == "skipped" and not check.failed
    ncu = fake_bin / "ncu"
    ncu.write_text('#!/bin/sh\necho "ncu $@"\n')
    ncu.chmod(0o755)
    gpu_check.step_profile(check, sys.executable)
    assert check.steps["profile"].status == "ok"
    args = (tmp_path / "profile.txt").read_text()
    assert "-k regex:paged_attention_(decode|prefill_tc)_kernel" in args
    assert "--section WarpStateStats" in args and args.rstrip().endswith("kernel_calls.py profile --device cuda")


def record_kernel_calls(monkeypatch) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """(op, activations' dtype, cache dtype) of every attention or cache-write call from here on."""
    from batchgen import ops

    calls = []
    for name in ("paged_attention_decode", "paged_attention_prefill", "reshape_and_cache"):
        real = getattr(ops, name)

        def recorded(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, args[0].dtype, args[2 if _name == "reshape_and_cache" else 1].dtype))
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, recorded)
    return calls


def test_kernel_calls_profile_calls_each_kernel_twice(monkeypatch):
    """scripts/kernel_calls.py profile, small, on the CPU: decode then prefill, over the 16-bit caches and over fp8
    (e4m3), each twice: what the profile step's ncu sees."""
    calls = record_kernel_calls(monkeypatch)
    load_script("kernel_calls").profile(torch.device("cpu"), batch=2, context=40, prompt=24, prompts=2)
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert calls == [("paged_attention_decode", bf16, bf16)] * 2 + [("paged_attention_decode", bf16, fp8)] * 2 + \
        [("paged_attention_prefill", bf16, bf16)] * 2 + [("paged_attention_prefill", bf16, fp8)] * 2


def test_kernel_calls_sweep_covers_every_dtype_cache_and_head_dim(monkeypatch):
    """scripts/kernel_calls.py sweep on the CPU (the sanitize step runs it on a card): each of the 45 cases writes
    its cache, decodes and prefills, and the cases span every activation dtype, cache format and head_dim."""
    from batchgen import ops

    calls = record_kernel_calls(monkeypatch)
    head_dims = []
    real_allocate = ops.allocate_kv_cache
    monkeypatch.setattr(ops, "allocate_kv_cache", lambda n, h, b, d, *a, **k: (head_dims.append(d),
                                                                                 real_allocate(n, h, b, d, *a, **k))[1])
    assert load_script("kernel_calls").sweep(torch.device("cpu")) == 45
    assert [name for name, _, _ in calls] == ["reshape_and_cache", "paged_attention_decode",
                                              "paged_attention_prefill"] * 45
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    pairs = {(act, cache) for _, act, cache in calls}
    assert pairs == {(d, c) for d in dtypes for c in (d, *fp8)}
    assert sorted(set(head_dims)) == list(ops.SUPPORTED_HEAD_DIMS) and len(head_dims) == 45


FAKE_PYTHON = r'''#!/usr/bin/env python3
"""A Python whose torch sees a GPU, as far as gpu_check can tell: it answers the probes, records every call."""
import json, os, sys
args = sys.argv[1:]
with open(CALLS, "a") as log:
    log.write(" ".join(args) + "\n")
if args[0] == "-c":
    code = args[1]
    if "get_device_properties" in code:
        print("Fake GPU, sm_90, torch 0.0+cu, CUDA 13.0")
    elif "get_device_capability" in code:
        print("90")
    sys.exit(0)
if args[:2] == ["-m", "pytest"]:
    xml = next(a for a in args if a.startswith("--junitxml=")).split("=", 1)[1]
    open(xml, "w").write('<testsuites><testsuite tests="5" failures="0" errors="0" skipped="1"/></testsuites>')
    sys.exit(0)
if args[0].startswith("scripts/bench"):
    out = args[args.index("--json") + 1]
    open(out, "w").write(json.dumps({"results": [{"script": args[0], "path": os.environ.get("PYTHONPATH")}]}))
    print("a benchmark row")
sys.exit(0)
'''


def test_a_whole_run_on_a_stand_in_gpu_machine(tmp_path):
    """Every step in order through a stand-in Python (probes answered, pip, pytest and the benchmarks recorded) and a
    stand-in nvidia-smi and ncu: the report holds each step ok, the tests' counts and both benchmarks' JSON, the
    carried wheels go first on every later step's PYTHONPATH, and the run exits 0."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "calls.txt"
    for name, text in {"python": FAKE_PYTHON.replace("CALLS", repr(str(calls))),
                       "nvidia-smi": "#!/bin/sh\necho 'GPU 0: Fake GPU'\n",
                       "ncu": f"#!/bin/sh\necho \"ncu $@\" >> {calls}\n",
                       "compute-sanitizer": f"#!/bin/sh\necho \"compute-sanitizer $@\" >> {calls}\n"}.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels)
    out, log = tmp_path / "out", tmp_path / "log"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "OUT": str(out), "BATCHGEN_GPU_LOG": str(log),
           "PYTHON": str(fake_bin / "python"), "BATCHGEN_GPU_WHEELS": str(wheels), "PYTHONPATH": "",
           "BATCHGEN_GPU_BUDGET_S": "400"}
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "report.json").read_text())
    assert {name: step["status"] for name, step in report["steps"].items()} == dict.fromkeys(
        ("python", "build", "tests", "bench", "e2e", "profile", "sanitize"), "ok")
    assert report["device"] == "Fake GPU, sm_90, torch 0.0+cu, CUDA 13.0"
    assert "1 wheels from" in report["steps"]["python"]["detail"]
    assert report["steps"]["build"]["detail"].startswith("sm_90")
    assert report["steps"]["tests"]["detail"].startswith("4 passed, 0 failed, 0 errors, 1 skipped")
    site = str(log / "site")  # the carried wheels, first on the path of every step after the python step
    assert report["kernels"] == {"results": [{"script": "scripts/bench_kernels.py", "path": site}]}
    assert report["sampler"] == {"results": [{"script": "scripts/bench_vocab.py", "path": site}]}
    assert report["e2e"] == {"results": [{"script": "scripts/bench_e2e.py", "path": site}]}
    assert report["budget_s"] == 400
    kinds = {"wheels": "-m pip install -q --no-index", "build": "-m pip install --no-build-isolation",
             "tests": "-m pytest -m gpu", "bench": "scripts/bench_kernels.py --device cuda --grid issue51",
             "vocab": "scripts/bench_vocab.py --device cuda",
             "e2e": "scripts/bench_e2e.py --device cuda", "profile": "ncu ",
             "memcheck": "compute-sanitizer --tool memcheck", "racecheck": "compute-sanitizer --tool racecheck"}
    order = [next((kind for kind, start in kinds.items() if line.startswith(start)), None)
             for line in calls.read_text().splitlines()]
    assert [kind for kind in order if kind] == list(kinds)
    assert "kernel_calls.py sweep --device cuda" in calls.read_text()
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"build.txt", "tests.txt", "bench.txt", "vocab.txt", "e2e.txt", "profile.txt", "sanitize.txt",
                "wheels.txt"} <= set(tar.getnames())

    # The steps after build chosen: only those run, in the order given; an unknown one is a usage error.
    calls.unlink()
    chosen = subprocess.run(["bash", "scripts/gpu_check.sh", "--steps", "sanitize,bench"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert chosen.returncode == 0, chosen.stdout + chosen.stderr
    steps = json.loads((out / "report.json").read_text())["steps"]
    assert [name for name, step in steps.items() if step["status"] == "ok"] == ["python", "build", "bench", "sanitize"]
    lines = calls.read_text().splitlines()
    assert lines.index(next(x for x in lines if x.startswith("compute-sanitizer"))) < \
        lines.index(next(x for x in lines if x.startswith("scripts/bench_kernels.py")))
    wrong = subprocess.run(["bash", "scripts/gpu_check.sh", "--steps", "tests,fly"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "unknown steps fly" in wrong.stderr
