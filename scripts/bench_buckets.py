"""The mixed workload through `batchgen run` twice in one process: input and output on the local
disk, then on an S3 server on 127.0.0.1 (moto, as the tests use), and the bucket run's throughput
as a ratio of the local one. The target is >= 0.95x: the bucket must cost nothing the engine feels.

    .venv/bin/python scripts/bench_buckets.py [--quick] [--rounds 2] [--model DIR] [--dtype bf16]

Each round runs local then bucket (alternating which goes first from the second round on) on the
same prompts (token ids, per-row max_tokens, greedy, ignore_eos); throughput counts the run loop
(reading rows, generating, writing parts), not loading the model; the two outputs must be equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from machine import processor  # noqa: E402
from s3_server import S3Server, apply_env  # noqa: E402

from batchgen.job.engine import default_factory  # noqa: E402
from batchgen.job.outputs.writer import list_parts  # noqa: E402
from batchgen.job.run.progress import make_reporter  # noqa: E402
from batchgen.job.run.runner import Runner  # noqa: E402
from batchgen.job.shard import Shard  # noqa: E402
from batchgen.job.spec import parse_job  # noqa: E402
from batchgen.storage import location  # noqa: E402


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module
    spec.loader.exec_module(module)
    return module


def job_text(model: str, dtype: str, kv: str, inp: str, out: str, rows_per_part: int) -> str:
    return yaml.safe_dump({
        "model": {"path": model, "dtype": dtype, "kv_cache_memory": kv, "max_num_seqs": 256,
                  "max_num_batched_tokens": 2048},
        "input": {"paths": [inp], "id_column": "id", "prompt_column": "prompt"},
        "sampling": {"temperature": 0.0, "ignore_eos": True, "max_tokens": 16,
                     "overrides": {"max_tokens": "max_tokens"}},
        "output": {"dir": out, "rows_per_part": rows_per_part,
                   "fields": ["token_ids", "finish_reason", "token_counts"]},
        "progress_interval": 3600,
    })


def run_once(text: str, base: Path) -> dict:
    job = parse_job(text, base)
    result = Runner(job, Shard(), default_factory, reporter=make_reporter(3600)).run()
    snap = result.snapshot
    assert result.status == "complete", result.status
    return {"rows": snap.rows, "output_tokens": snap.output_tokens, "seconds": snap.elapsed,
            "rows_s": snap.rows / snap.elapsed, "tok_s": snap.output_tokens / snap.elapsed}


def output_tokens(out: str) -> dict[str, list[int]]:
    rows = {}
    for part in list_parts(location(out)):
        for r in pq.read_table(io.BytesIO(part.path.read_bytes())).to_pylist():
            rows[r["id"]] = r["token_ids"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/batchgen/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--quick", action="store_true", help="the small mixed workload (a smoke test)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rows-per-part", type=int, default=25)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    bench = load_bench()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    wl = bench.make_workload("mixed", tokenizer, 0, **bench.SETTINGS[args.quick]["mixed"])
    dtype = bench.DTYPES[args.dtype]
    server = S3Server().start()
    apply_env(server.env())
    server.make_bucket("bench")
    results: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            table = pa.table({"id": [f"m{i:04d}" for i in range(len(wl.prompts))], "prompt": wl.prompts,
                              "max_tokens": wl.max_tokens})
            pq.write_table(table, root / "prompts.parquet", row_group_size=64)
            location("s3://bench/prompts.parquet").publish_bytes((root / "prompts.parquet").read_bytes())
            for r in range(args.rounds):
                order = ["local", "bucket"] if r % 2 == 0 else ["bucket", "local"]
                for where in order:
                    inp, out = ((str(root / "prompts.parquet"), str(root / f"out-{r}")) if where == "local"
                                else ("s3://bench/prompts.parquet", f"s3://bench/out-{r}"))
                    text = job_text(args.model, dtype, args.kv_cache_memory, inp, out, args.rows_per_part)
                    res = run_once(text, root)
                    res.update(where=where, round=r, out=out)
                    results.append(res)
                    print(f"round {r} {where:6s}: {res['rows']} rows, {res['output_tokens']} output tokens in "
                          f"{res['seconds']:.1f}s = {res['tok_s']:.1f} tok/s", flush=True)
                local_out, bucket_out = (x["out"] for x in sorted(results[-2:], key=lambda x: x["where"] != "local"))
                assert output_tokens(local_out) == output_tokens(bucket_out), "bucket and local outputs differ"
    finally:
        server.stop()
    local = sum(x["output_tokens"] for x in results if x["where"] == "local") / \
        sum(x["seconds"] for x in results if x["where"] == "local")
    bucket = sum(x["output_tokens"] for x in results if x["where"] == "bucket") / \
        sum(x["seconds"] for x in results if x["where"] == "bucket")
    summary = {"processor": processor(), "dtype": args.dtype, "quick": args.quick,
               "local_tok_s": local, "bucket_tok_s": bucket, "bucket_over_local": bucket / local, "runs": results}
    print(f"bucket / local: {bucket / local:.3f}x ({bucket:.1f} vs {local:.1f} output tok/s; target >= 0.95x)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
