"""Many shards on one bucket, simulated: N shard runs of one job (the fake engine) against one moto S3 server
on 127.0.0.1, behind the fault proxy (tests/s3_faults.py), in waves as wide as the machine allows, with
random SIGKILLs (a killed shard runs again in a later wave) and a fault rate; then `status` and `merge`.

    .venv/bin/python scripts/bench_shards.py [--shards 1000] [--rows-per-shard 20] [--rows-per-part 10]
        [--wave 8] [--kill-rate 0.1] [--fault-rate 0.05] [--seed 57] [--json FILE]

It checks that the merged output holds every (id, sample) exactly once, and reports the requests the
shard runs made, by kind (LIST, GET, HEAD, PUT, POST, DELETE), per part and per 1M rows, the lease's
share of them, and what 1M rows cost in requests at S3 Standard's list prices (us-east-1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.forkserver
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from jobkit import batchgen_cmd, cli_child, make_model, prompts, subprocess_env, write_jsonl  # noqa: E402
from s3_faults import FaultProxy  # noqa: E402
from s3_server import S3Server, apply_env, restore_env  # noqa: E402

# S3 Standard, us-east-1, per 1,000 requests (DELETE is free).
PRICE_PER_1000 = {"PUT": 0.005, "POST": 0.005, "LIST": 0.005, "GET": 0.0004, "HEAD": 0.0004, "DELETE": 0.0}
MAX_TRIES = 8  # runs of one shard, kills included, before the benchmark gives up on it
SAMPLES = 2  # the job's sampling.n
PRELOAD_PROBE = "import sys; sys.exit(0 if {'jobkit', 's3fs'} <= set(sys.modules) else 3)"


@dataclass
class Tally:
    runs: int = 0
    kills: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def job_file(root: Path, bucket: str, rows_per_part: int) -> Path:
    spec = {"model": {"path": str(root / "model")},
            "input": {"paths": [f"{bucket}/in.jsonl"], "id_column": "id", "prompt_column": "prompt"},
            "sampling": {"n": SAMPLES, "temperature": 0.8, "seed": 7, "max_tokens": 4},
            "output": {"dir": f"{bucket}/out", "rows_per_part": rows_per_part, "format": "jsonl"},
            "storage": {"lease_seconds": 30, "retries": 10, "retry_wait": 0.05, "retry_max_wait": 1.0},
            "progress_interval": 3600}
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_waves(job: Path, shards: int, wave: int, kill_rate: float, env: dict[str, str],
              rng: random.Random, stderr_dir: Path) -> Tally:
    """Every shard run to completion, ``wave`` at a time; a run drawn for a kill is SIGKILLed at a random
    moment and its shard queued again. Each run is a process forked from one that has imported batchgen
    (multiprocessing's forkserver): the same ``batchgen run`` as the command line's, without each run's
    two seconds of start-up, which would otherwise be most of the benchmark's time."""
    tally, started = Tally(), time.monotonic()
    context = _preloaded_forkserver()
    queue = [(i, 0) for i in range(shards)]
    while queue:
        batch, queue = queue[:wave], queue[wave:]
        procs = []
        for i, tries in batch:
            argv = ["run", str(job), "--shard", f"{i}/{shards}"]
            err = stderr_dir / f"shard-{i}-{tries}.err"
            proc = context.Process(target=cli_child, args=(argv, env, str(err)), daemon=True)
            proc.start()
            procs.append((i, tries, proc, err))
        tally.runs += len(procs)
        kills = {i: rng.uniform(0.3, 2.0) for i, _, _, _ in procs if rng.random() < kill_rate}
        queue += _finish(procs, kills, tally)
    tally.seconds = time.monotonic() - started
    return tally


def _preloaded_forkserver() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver, started with batchgen, the tests' job kit and s3fs imported. Python
    3.11's forkserver ignores the parent's sys.path (it imports its preloads with its own), so it starts
    with PYTHONPATH naming the repository and tests/; a preload that fails to import is silently skipped
    there, hence the check on a child."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["jobkit", "s3fs"])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")] + ([saved] if saved else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    probe = context.Process(target=exec, args=(PRELOAD_PROBE,))  # a builtin target: unpickling imports nothing
    probe.start()
    probe.join()
    if probe.exitcode != 0:
        raise SystemExit("bench_shards: multiprocessing's forkserver did not preload batchgen and s3fs")
    return context


def _finish(procs: list, kills: dict[int, float], tally: Tally) -> list[tuple[int, int]]:
    """Wait for a wave (killing the drawn runs at their moment); the shards to run again."""
    again, t0 = [], time.monotonic()
    for i, tries, proc, err in procs:
        if i in kills:
            proc.join(timeout=max(0.0, kills[i] - (time.monotonic() - t0)))
            if proc.exitcode is None:
                proc.kill()
        proc.join(timeout=600)
        if proc.exitcode == 0:  # done (a kill sent as it was exiting came too late: not counted)
            continue
        tally.kills += proc.exitcode == -signal.SIGKILL
        if proc.exitcode == -signal.SIGKILL and tries + 1 < MAX_TRIES:  # killed: run again later
            again.append((i, tries + 1))
        else:
            tally.failures.append(f"shard {i}: exit {proc.exitcode}: {err.read_text().strip()[-300:]}")
    return again


def check_merged(merged: bytes, rows: int) -> int:
    """(id, sample) pairs in the merged file; raises unless each expected one is there exactly once."""
    keys = Counter((r["id"], r["sample_index"]) for r in map(json.loads, merged.splitlines()))
    twice = [k for k, n in keys.items() if n > 1]
    expected = {(f"q{i:04d}", s) for i in range(rows) for s in range(SAMPLES)}
    if twice or set(keys) != expected:
        raise SystemExit(f"merged output wrong: {len(twice)} pairs twice, {len(expected - set(keys))} missing")
    return len(keys)


def report(kinds: Counter[str], lease: int, parts: int, rows: int) -> dict:
    per_million = 1e6 / max(rows, 1)
    cost = sum(PRICE_PER_1000.get(k, 0.0004) * n / 1000 for k, n in kinds.items()) * per_million
    return {"requests": dict(kinds), "total": sum(kinds.values()), "lease_requests": lease, "parts": parts,
            "rows": rows, "per_part": {k: round(n / max(parts, 1), 2) for k, n in kinds.items()},
            "per_1M_rows": {k: round(n * per_million) for k, n in kinds.items()},
            "usd_per_1M_rows": round(cost, 4)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--rows-per-shard", type=int, default=20)
    ap.add_argument("--rows-per-part", type=int, default=10)
    ap.add_argument("--wave", type=int, default=max(2, (os.cpu_count() or 2) * 2))
    ap.add_argument("--kill-rate", type=float, default=0.1)
    ap.add_argument("--fault-rate", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=57)
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    rows = args.shards * args.rows_per_shard
    server = S3Server().start()
    old_env = apply_env(server.env())
    try:
        bucket = "s3://" + server.make_bucket("shards")
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            make_model(root / "model")
            write_jsonl(root / "in.jsonl", prompts(rows))
            server.client().upload_file(str(root / "in.jsonl"), "shards", "in.jsonl")
            job = job_file(root, bucket, args.rows_per_part)
            with FaultProxy(server.endpoint, rate=args.fault_rate, seed=args.seed, delay=0.1,
                            lifetime=24 * 3600) as proxy:
                env = subprocess_env(AWS_ENDPOINT_URL=proxy.endpoint)
                tally = run_waves(job, args.shards, args.wave, args.kill_rate, env, random.Random(args.seed), root)
                kinds, lease, faults = Counter(proxy.kinds_seen), proxy.lease_requests, dict(proxy.faults)
            if tally.failures:
                raise SystemExit("shard runs failed:\n" + "\n".join(tally.failures[:10]))
            env = subprocess_env()
            status = subprocess.run(batchgen_cmd("status", f"{bucket}/out", "--json"), env=env, capture_output=True,
                                    text=True, check=True)
            parts = json.loads(status.stdout)["total"]["parts"]
            subprocess.run(batchgen_cmd("merge", f"{bucket}/out", "-o", f"{bucket}/all.jsonl"), env=env,
                           capture_output=True, check=True)
            merged = server.client().get_object(Bucket="shards", Key="all.jsonl")["Body"].read()
            pairs = check_merged(merged, rows)
    finally:
        restore_env(old_env)
        server.stop()
    out = {"shards": args.shards, "rows": rows, "pairs_once": pairs, "runs": tally.runs, "kills": tally.kills,
           "faults": faults, "seconds": round(tally.seconds, 1), **report(kinds, lease, parts, rows)}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
