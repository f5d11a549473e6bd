#!/usr/bin/env python
"""Issue 53's figures in one command, made for a session on an Intel Xeon with AMX (it runs on any processor):
each step in a fresh process, its output shown live and kept in a log, then one table of each figure, its target
and whether it is met, and the whole in a JSON report.

  tests   tests/test_amx_emulated.py with BATCHGEN_EMULATE_AMX=1. On an AMX processor this compares the emulated
          tile unit, on which CI tests the AMX code, with the hardware's, bit for bit; elsewhere it runs the
          emulated tables' own tests and the comparison is skipped.
  bench   bench.py --skip-peers --dtype bf16 --workloads mixed,int8: mixed against the bound counting its K/V
          reads, decode attention's read rate within the run, int8 against bf16 with its perplexity and greedy
          agreement, and the decoder stack's seconds per op in both.
  decode  bench_kv_fp8.py --decode: decode attention's K/V read rate against a plain read of the same blocks, bf16
          queries over bf16 and fp8 caches, on one layer and as in the engine (layers in turn, ragged lengths).
  vllm    bench_vs_vllm.py --kv-cache-dtypes auto,fp8: the sandwich against vLLM's CPU engine, where --vllm-python
          names vLLM's CPU environment (bench_vllm.py's docstring makes one); without it the step is skipped.

The targets are the issue's, set for AMX Xeons; on other processors the table shows them for comparison. A step
that fails is reported and the rest still run; the exit status is 1 when a step failed (a missed target is a
measurement, not a failure).

    .venv/bin/python scripts/cpu_check.py --vllm-python /tmp/vllm/bin/python    # ~25 minutes on 2 cores
    .venv/bin/python scripts/cpu_check.py --quick                                 # smoke test: no measurement
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

from machine import processor  # noqa: E402

STEPS = ("tests", "bench", "decode", "tables", "vllm")
BITS_TEST = "test_the_emulated_unit_gives_the_tile_units_bits"


@dataclass
class Figure:
    step: str
    name: str
    value: float | str | None  # None: the step did not give it
    target: str = ""  # e.g. ">= 1.5"; empty where the issue sets none
    met: bool | None = None

    def shown(self) -> str:
        if self.value is None:
            return "-"
        if isinstance(self.value, str):
            return self.value
        return f"{self.value:.1%}" if self.name.endswith("(share)") else f"{self.value:,.2f}"


def at_least(step: str, name: str, value: float | None, target: float) -> Figure:
    met = None if value is None else value >= target
    shown = f"{target:.0%}" if name.endswith("(share)") else f"{target:g}"
    return Figure(step, name, value, f">= {shown}", met)


def run_step(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> tuple[bool, Path]:
    """Runs argv in a fresh process, its output shown as it comes and kept in log_dir/<name>.txt."""
    log = log_dir / f"{name}.txt"
    start = time.monotonic()
    print(f"\n[cpu_check] {name}: {' '.join(argv)}", flush=True)
    with log.open("w") as out, subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})}, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
    print(f"[cpu_check] {name}: exit status {proc.returncode} after {time.monotonic() - start:.0f} s", flush=True)
    return proc.returncode == 0, log


def tests_figures(junit: Path) -> list[Figure]:
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[case.get("name")] = outcome
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "skipped", "failed")}
    bits = [v for k, v in outcomes.items() if k.split("[")[0] == BITS_TEST]
    return [Figure("tests", "tests/test_amx_emulated.py", ", ".join(f"{n} {k}" for k, n in counts.items()),
                   "0 failed", counts["failed"] == 0),
            Figure("tests", "the tile unit's bits = the emulation's", bits[0] if bits else None,
                   "passed (needs AMX)", None if not bits or bits[0] == "skipped" else bits[0] == "passed")]


def bench_figures(path: Path) -> list[Figure]:
    report = json.loads(path.read_text())
    limit = report["ceilings"]["bfloat16"]
    int8 = report.get("int8", {}).get("bfloat16", {})
    runs = {r["workload"]: r for r in report["runs"] if r["dtype"] == "bfloat16"}
    figures = [Figure("bench", "mixed, bf16: total tok/s", runs["mixed"]["total_tok_s"]),
               at_least("bench", "mixed: of the bound counting K/V reads (share)", limit["mixed_with_kv_fraction"],
                        0.85),
               Figure("bench", "mixed: of the bound counting K/V and weight reads (share)",
                      limit.get("mixed_with_weights_fraction")),
               Figure("bench", "mixed: of the matmul ceiling (share)", limit["mixed_fraction"]),
               Figure("bench", "mixed: decode attention's K/V read, of a sequential read (share)",
                      limit.get("mixed_decode_attention_share_of_read")),
               at_least("bench", "int8 / bf16 total tok/s on mixed", int8.get("int8_over_dtype"), 1.5)]
    change = int8.get("perplexity_change")
    figures.append(Figure("bench", "int8: perplexity above bf16's (share)", change, "<= 2%",
                          None if change is None else change <= 0.02))
    figures.append(Figure("bench", "int8: greedy agreement, tokens before a first difference (share)",
                          int8.get("agreement", {}).get("token_share")))
    for workload in ("mixed", "int8"):
        stack = runs.get(workload, {}).get("extra", {}).get("stack_seconds")
        if stack:
            ops = ", ".join(f"{op} {s:.2f}" for op, s in sorted(stack.items(), key=lambda kv: -kv[1]))
            figures.append(Figure("bench", f"{workload}: decoder stack seconds per op", ops))
    return figures


def decode_figures(path: Path) -> list[Figure]:
    report = json.loads(path.read_text())
    figures = []
    for case, where in (("decode", "one layer"), ("engine_like", "as in the engine")):
        shares = {row["cache"]: row["share_of_read"] for row in report[case] if row["query"] == "torch.bfloat16"}
        figures += [at_least("decode", f"decode {where}, bf16 over {cache.removeprefix('torch.')}: of a plain read "
                             "(share)", shares.get(cache), 0.9)
                    for cache in ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2")]
    return figures


def tables_figures(path: Path) -> list[Figure]:
    report = json.loads(path.read_text())
    first, second = report["isas"]
    return [Figure("tables", f"attention, {case}: ms, {first} / {second}",
                   f"{ms[first]:.3f} / {ms[second]:.3f} ({ms[second] / ms[first]:.2f}x)")
            for case, ms in report["ms"].items()]


def table_below(default: str, supported: list[str]) -> str | None:
    """The kernel table just below `default` among those this processor runs natively (supported_cpu_isas lists
    them in rising order, the emulated tile unit first), or None where there is none."""
    native = [isa for isa in supported if isa != "amx_emulated"]
    if default not in native:  # the emulated tile unit, asked for: against the best native table
        return native[-1] if native else None
    at = native.index(default)
    return native[at - 1] if at > 0 else None


def vllm_figures(path: Path) -> list[Figure]:
    report = json.loads(path.read_text())
    return [at_least("vllm", f"batchgen / vLLM on mixed, kv_cache_dtype {s['kv_cache_dtype']}", s["ratio"], 1.5)
            for s in report["sandwiches"]]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="the python of vLLM's CPU environment (the vllm step)")
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores for each engine")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/batchgen_cpu_check"))
    parser.add_argument("--json", type=Path, help="the report (default: LOG_DIR/report.json)")
    parser.add_argument("--quick", action="store_true", help="each step at its tiny sizes (smoke tests)")
    args = parser.parse_args(argv)
    args.steps = args.steps.split(",")
    if unknown := set(args.steps) - set(STEPS):
        parser.error(f"--steps: no step {', '.join(sorted(unknown))}; the steps are {', '.join(STEPS)}")
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        parser.error(f"--vllm-python {args.vllm_python}: no such interpreter (bench_vllm.py's docstring makes one)")
    return args


def step_argv(step: str, args: argparse.Namespace, out: Path) -> list[str]:
    python, quick = sys.executable, ["--quick"] if args.quick else []
    threads = ["--threads", str(args.threads)]
    model = ["--model", args.model] if args.model else []
    if step == "tests":
        select = ["-k", "offered"] if args.quick else []  # one quick test: the step's own plumbing
        return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_amx_emulated.py", *select,
                f"--junitxml={out}"]
    if step == "bench":
        no_isolate = ["--no-isolate"] if args.quick else []  # engines in one process: quicker to start
        return [python, str(SCRIPTS / "bench.py"), "--skip-peers", "--dtype", "bf16", "--workloads", "mixed,int8",
                *model, *threads, *quick, *no_isolate, "--json", str(out)]
    if step == "decode":
        return [python, str(SCRIPTS / "bench_kv_fp8.py"), "--decode", *threads, *quick, "--json", str(out)]
    if step == "tables":
        return [python, str(SCRIPTS / "bench_attn_ab.py"), "--isas", ",".join(args.tables), *threads, *quick,
                "--json", str(out)]
    return [python, str(SCRIPTS / "bench_vs_vllm.py"), "--vllm-python", args.vllm_python, "--kv-cache-dtypes",
            "auto,fp8", *model, *threads, *quick, "--json", str(out)]


FIGURES = {"tests": tests_figures, "bench": bench_figures, "decode": decode_figures, "tables": tables_figures,
           "vllm": vllm_figures}


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    import torch  # noqa: F401  (batchgen._C links against torch's libraries)

    from batchgen import _C

    report = {"processor": processor(), "kernels": _C.cpu_isa(), "int8_kernel": _C.int8_kernel(),
              "amx": "amx_bf16" in _C.supported_cpu_isas(), "threads": args.threads, "quick": args.quick,
              "steps": {}, "figures": []}
    below = table_below(_C.cpu_isa(), _C.supported_cpu_isas())
    args.tables = (_C.cpu_isa(), below)
    for step in STEPS:
        if step not in args.steps:
            report["steps"][step] = {"status": "not asked for", "detail": ""}
            continue
        if step == "vllm" and not args.vllm_python:
            report["steps"][step] = {"status": "skipped", "detail": "no --vllm-python"}
            continue
        if step == "tables" and below is None:
            report["steps"][step] = {"status": "skipped", "detail": f"no kernel table below {_C.cpu_isa()} here"}
            continue
        out = args.log_dir / f"{step}.{'xml' if step == 'tests' else 'json'}"
        out.unlink(missing_ok=True)
        env = {"BATCHGEN_EMULATE_AMX": "1"} if step == "tests" else {}
        ok, log = run_step(step, step_argv(step, args, out), args.log_dir, env)
        detail = f"log {log}"
        try:
            report["figures"] += [asdict(f) for f in FIGURES[step](out)] if out.exists() else []
        except (KeyError, TypeError, ValueError, ElementTree.ParseError) as e:  # a report of another shape
            ok, detail = False, f"{out}: not the report expected ({type(e).__name__}: {e}); log {log}"
        report["steps"][step] = {"status": "ok" if ok and out.exists() else "FAILED", "detail": detail}
    print_summary(report)
    (args.json or args.log_dir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def print_summary(report: dict) -> None:
    print(f"\n================ issue 53's figures: {report['processor']}, kernel table {report['kernels']}, "
          f"int8 loop {report['int8_kernel']}, {report['threads']} threads ================")
    if not report["amx"]:
        print("no AMX here: the targets are set for AMX Xeons and shown for comparison")
    if report["quick"]:
        print("--quick: tiny sizes, no measurement")
    for step, s in report["steps"].items():
        print(f"step {step:7s} {s['status']:13s} {s['detail']}")
    figures = [Figure(**f) for f in report["figures"]]
    width = max([len(f.name) for f in figures if not f.name.endswith("seconds per op")], default=6)
    print(f"{'figure':{width}s} {'measured':>12s}  {'target':12s} met")
    for f in figures:
        met = "-" if f.met is None else "yes" if f.met else "NO"
        if f.name.endswith("seconds per op"):
            print(f"{f.name}: {f.value}")
        else:
            print(f"{f.name:{width}s} {f.shown():>12s}  {f.target:12s} {met}")
    failed = [step for step, s in report["steps"].items() if s["status"] == "FAILED"]
    print("RESULT: " + (f"FAILED ({', '.join(failed)})" if failed else "ok"))


if __name__ == "__main__":
    sys.exit(1 if any(s["status"] == "FAILED" for s in main()["steps"].values()) else 0)
