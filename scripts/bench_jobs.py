#!/usr/bin/env python
"""The job layer's cost as a job grows: the same generated rows through

  run       `batchgen run` with the real engine on a tiny random model,
  generate  `LLM.generate` on the same model and prompts (no job layer),
  instant   `batchgen run` on an engine that costs nothing (scripts/instant_engine.py): the job layer alone,
  vllm      (only with --vllm-python, and only asked for by name) vLLM's offline `LLM.generate` on the same model
            and prompts, in vLLM's own environment (scripts/bench_vllm.py's docstring has its set-up)

at each size (default 100k and 1M rows for all three, 10M for `instant` only). Every case is a fresh
process, so its peak RSS is its own (the kernel's ru_maxrss of that child). For the two `batchgen run`
cases it then times the rerun with nothing to do, `batchgen status`, `batchgen merge`, a rerun with
`--retry-errors` (every 1000th input row has no prompt, so there are error rows to redo) and an
increment (a new input file of 1,000 rows).

    python scripts/bench_jobs.py                          # 100k and 1M (run, generate, instant), 10M (instant)
    python scripts/bench_jobs.py --sizes 100k --cases instant
    python scripts/bench_jobs.py --quick                  # 2,000 rows of each case: the suite's smoke test
    python scripts/bench_jobs.py --sizes 20k --cases generate,vllm --steps "" --vllm-python /tmp/vllm/bin/python

Rows/s count every input row (error rows included) over the process's wall time, start-up included;
`first part` is the time from the process's start until its first part file exists. The output is
JSONL parts (merge joins those), 10,000 rows a part (500 with --quick); greedy, 4 tokens, ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from machine import processor

REPO = Path(__file__).resolve().parent.parent
INSTANT = f"{REPO / 'scripts' / 'instant_engine.py'}:InstantLLM"
ERROR_EVERY = 1000  # every this many rows, one without a prompt: an error row
INCREMENT_ROWS = 1000
MAX_TOKENS = 4
ENGINE_OPTIONS = {"dtype": "float32", "kv_cache_memory": "256MiB", "swap_space": "64MiB", "max_num_seqs": 256}
CASES = ("run", "generate", "instant")  # the default; "vllm" only by name
STEPS = ("rerun", "status", "merge", "retry_errors", "increment")
# Linux carries a process's RSS high-water mark across fork and exec, so a child of this (large)
# process would report at least this one's peak: each command runs under a small launcher instead,
# whose own fresh child reports the command's peak alone.
LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(f"\\npeak-rss-kb {usage.ru_maxrss}", flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""
RSS_TAG = "peak-rss-kb"


@dataclass
class Process:
    """One child process: its wall time, peak RSS and exit code."""

    seconds: float
    peak_rss_mb: float
    returncode: int
    first_part_s: float | None = None
    stdout: str = ""


@dataclass
class CaseResult:
    case: str
    size: int  # input rows
    rows: int  # rows generated or written (generate: the rows with a prompt)
    seconds: float
    rows_s: float
    peak_rss_mb: float
    first_part_s: float | None = None
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # rerun, status, ...: seconds and RSS
    generate_rows_s: float | None = None  # generate, vllm: rows/s of the generate call alone (no start-up)


def parse_size(text: str) -> int:
    text = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def prompt(i: int) -> str:
    return f"Write one word about the number {i}."


def write_input(path: Path, rows: int, start: int = 0) -> None:
    """Rows ``r<start>``.. with short prompts; every ERROR_EVERY-th has none (an error row)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    chunk = 200_000
    with pq.ParquetWriter(path, schema) as w:
        for lo in range(start, start + rows, chunk):
            idx = range(lo, min(start + rows, lo + chunk))
            w.write_table(pa.table({"id": [f"r{i:09d}" for i in idx],
                                    "prompt": [None if i % ERROR_EVERY == ERROR_EVERY - 1 else prompt(i) for i in idx]},
                                   schema=schema), row_group_size=65_536)


def write_job(root: Path, model: Path, rows_per_part: int) -> Path:
    import yaml

    job = {
        "model": {"path": str(model), **ENGINE_OPTIONS},
        "input": {"paths": ["in/*.parquet"], "id_column": "id", "prompt_column": "prompt"},
        "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        "output": {"dir": "out", "format": "jsonl", "rows_per_part": rows_per_part,
                   "fields": ["text", "finish_reason"]},
        "progress_interval": 3600,
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_child(args: list[str], watch: Path | None = None, env: dict[str, str] | None = None) -> Process:
    """Run ``args``: its wall time, its peak RSS, and when ``watch`` is given, when its first part appeared."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    while proc.poll() is None:
        if watch is not None and first is None and watch.is_dir() and any(watch.glob("part-*")):
            first = time.perf_counter() - start
        time.sleep(0.01 if first is None and watch is not None else 0.05)
    seconds = time.perf_counter() - start
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} exited {proc.returncode}:\n{out[-3000:]}")
    tag, kb = out.rstrip().rsplit("\n", 1)[-1].split()
    assert tag == RSS_TAG, out[-500:]
    return Process(seconds, int(kb) / 1024, proc.returncode, first, out)


def batchgen(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "batchgen", *map(str, args)]


def bench_job(case: str, root: Path, model: Path, rows: int, rows_per_part: int,
              steps: tuple[str, ...] = STEPS) -> CaseResult:
    """`batchgen run` on fresh output, then ``steps``: the rerun, status, merge, --retry-errors and
    increment, in that order."""
    job = write_job(root, model, rows_per_part)
    engine = ["--engine", INSTANT] if case == "instant" else []
    out = root / "out"
    first = run_child(batchgen("run", job, *engine), watch=out)
    result = CaseResult(case, rows, rows, first.seconds, rows / first.seconds, first.peak_rss_mb, first.first_part_s)
    commands = {
        "rerun": batchgen("run", job, *engine),
        "status": batchgen("status", out),
        "merge": batchgen("merge", out, "-o", root / "merged.jsonl"),
        "retry_errors": batchgen("run", job, "--retry-errors", *engine),
    }
    print(f"  {case} {rows:,}: run {first.seconds:.1f}s, peak {first.peak_rss_mb:.0f} MB", flush=True)
    for step, args in commands.items():
        if step in steps:
            step_done(result, step, run_child(args))
    if "increment" in steps:
        write_input(root / "in" / "more.parquet", INCREMENT_ROWS, start=rows)
        step_done(result, "increment", run_child(batchgen("run", job, *engine)))
    return result


def step_done(result: CaseResult, step: str, p: Process) -> None:
    result.steps[step] = {"seconds": p.seconds, "peak_rss_mb": p.peak_rss_mb}
    print(f"  {result.case} {result.rows:,}: {step} {p.seconds:.1f}s, peak {p.peak_rss_mb:.0f} MB", flush=True)


def engine_case(case: str, size: int, p: Process) -> CaseResult:
    """A generate child's (generate, vllm) result: the rows with a prompt, over its process and its call alone."""
    rows = size - size // ERROR_EVERY
    return CaseResult(case, size, rows, p.seconds, rows / p.seconds, p.peak_rss_mb,
                      generate_rows_s=rows / generate_seconds(p))


def bench_generate(root: Path, model: Path, size: int) -> CaseResult:
    p = run_child([sys.executable, __file__, "--child-generate", str(model), str(root / "in" / "data.parquet")])
    return engine_case("generate", size, p)


def input_prompts(data: str) -> list[str]:
    """The input's prompts (the rows with one)."""
    import pyarrow.parquet as pq

    return [p for p in pq.read_table(data, columns=["prompt"]).column("prompt").to_pylist() if p is not None]


def bench_vllm(root: Path, model: Path, size: int, python: str) -> CaseResult:
    """vLLM's `LLM.generate` on the rows with a prompt (handed over as JSON: vLLM's environment has no
    pyarrow), in a child on vLLM's own Python; start-up counts, as in `generate`."""
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(input_prompts(str(root / "in" / "data.parquet"))))
    p = run_child([python, __file__, "--child-vllm", str(model), str(prompts)], env=vllm_env(python))
    return engine_case("vllm", size, p)


GENERATE_TAG = "generate-seconds"


def generate_seconds(p: Process) -> float:
    """The seconds a generate child reported for its generate call alone."""
    return next(float(line.split()[1]) for line in p.stdout.splitlines() if line.startswith(GENERATE_TAG))


def timed_generate(llm, prompts: list[str], params) -> list:
    """`llm.generate(prompts, params)`, its seconds printed for the parent (GENERATE_TAG)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(f"\n{GENERATE_TAG} {time.perf_counter() - start:.3f}", flush=True)
    return outs


def vllm_env(python: str) -> dict[str, str]:
    """What vLLM's CPU documentation advises: its environment's libiomp preloaded, and every core computing (by
    default it keeps one for its front end)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    return {**env, "LD_PRELOAD": str(iomp)} if iomp.exists() else env


def child_vllm(model: str, prompts_json: str) -> None:
    """vLLM's offline generate with ENGINE_OPTIONS' dtype and batch size, greedy, MAX_TOKENS each."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny model needs little
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(prompts_json).read_text())
    llm = LLM(model=model, dtype=ENGINE_OPTIONS["dtype"], max_num_seqs=ENGINE_OPTIONS["max_num_seqs"])
    outs = timed_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert len(outs) == len(prompts) and all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


def child_generate(model: str, data: str) -> None:
    """LLM.generate on the input's prompts (the rows with one), greedy, MAX_TOKENS each."""
    from batchgen import LLM
    from batchgen.sampling_params import SamplingParams

    prompts = input_prompts(data)
    llm = LLM(model, **ENGINE_OPTIONS)
    outs = timed_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert len(outs) == len(prompts) and all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


def tiny_model(root: Path) -> Path:
    """The test suite's tiny random Llama (2 layers, float32), saved under root."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_model

    return Path(build_tiny_model(root / "llama", "llama"))


def render(results: list[CaseResult]) -> str:
    head = f"{'case':<9}{'rows':>11}{'rows/s':>10}{'peak MB':>9}{'1st part':>9}" + "".join(f"{s:>13}" for s in STEPS)
    lines = [head, f"{'':<48}" + "".join(f"{'s (MB)':>13}" for _ in STEPS)]
    for r in results:
        first = "-" if r.first_part_s is None else f"{r.first_part_s:.1f}"
        steps = "".join(f"{r.steps[s]['seconds']:>7.1f} ({r.steps[s]['peak_rss_mb']:>3.0f})" if s in r.steps
                        else f"{'-':>13}" for s in STEPS)
        lines.append(f"{r.case:<9}{r.rows:>11,}{r.rows_s:>10,.0f}{r.peak_rss_mb:>9.0f}{first:>9}{steps}")
    return "\n".join(lines)


def ratios(results: list[CaseResult]) -> dict[str, float]:
    """run / generate rows/s at each size (what the job layer costs over the bare engine), and generate / vllm
    (batchgen's engine against vLLM's: whole processes, and the generate calls alone)."""
    by = {(r.case, r.size): r for r in results}
    found = {f"{a}/{b}@{n}": by[(a, n)].rows_s / by[(b, n)].rows_s
             for a, b in (("run", "generate"), ("generate", "vllm")) for (case, n) in by
             if case == a and (b, n) in by}
    found.update({f"generate/vllm@{n} (generate calls)": by["generate", n].generate_rows_s / r.generate_rows_s
                  for (case, n), r in by.items() if case == "vllm" and ("generate", n) in by})
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100k,1M,10M")
    ap.add_argument("--real-max", default="1M", help="the largest size run with the real engine (run, generate)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", default=",".join(STEPS), help="what to time after each run")
    ap.add_argument("--quick", action="store_true", help="2,000 rows of each case (a smoke test)")
    ap.add_argument("--model", type=Path, help="a model dir (default: a tiny random Llama in the temp dir)")
    ap.add_argument("--rows-per-part", type=int, default=10_000)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--vllm-python", help="vLLM's environment's python, for the vllm case")
    ap.add_argument("--child-generate", nargs=2, metavar=("MODEL", "DATA"), help=argparse.SUPPRESS)
    ap.add_argument("--child-vllm", nargs=2, metavar=("MODEL", "PROMPTS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_generate:
        child_generate(*args.child_generate)
        return 0
    if args.child_vllm:
        child_vllm(*args.child_vllm)
        return 0
    sizes = [2000] if args.quick else [parse_size(s) for s in args.sizes.split(",")]
    rows_per_part = 500 if args.quick else args.rows_per_part
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = set(cases) - {*CASES, "vllm"}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}, vllm")
    if "vllm" in cases and not args.vllm_python:
        ap.error("the vllm case needs --vllm-python (vLLM's environment's python)")
    real_max = parse_size(args.real_max)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    if set(steps) - set(STEPS):
        ap.error(f"unknown steps {sorted(set(steps) - set(STEPS))}; choose from {', '.join(STEPS)}")
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-jobs-") as tmp:
        top = Path(tmp)
        model = args.model or tiny_model(top)
        for rows in sizes:
            for case in cases:
                if case != "instant" and rows > real_max:
                    continue
                root = top / f"{case}-{rows}"
                (root / "in").mkdir(parents=True)
                write_input(root / "in" / "data.parquet", rows)
                if case == "generate":
                    res = bench_generate(root, model, rows)
                elif case == "vllm":
                    res = bench_vllm(root, model, rows, args.vllm_python)
                else:
                    res = bench_job(case, root, model, rows, rows_per_part, steps)
                results.append(res)
                alone = "" if res.generate_rows_s is None else f" (the generate call {res.generate_rows_s:,.0f} rows/s)"
                print(f"{case} {rows:,}: {res.rows_s:,.0f} rows/s{alone}, peak {res.peak_rss_mb:.0f} MB "
                      + " ".join(f"{k} {v['seconds']:.1f}s" for k, v in res.steps.items()), flush=True)
                subprocess.run(["rm", "-rf", str(root)], check=True)
    report = {"processor": processor(), "results": [asdict(r) for r in results], "ratios": ratios(results)}
    print(f"\n{report['processor']}\n{render(results)}")
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
