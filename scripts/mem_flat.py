#!/usr/bin/env python
"""Shows that a job's memory stays flat as its input grows: 200k rows, max_tokens=1.

    python scripts/mem_flat.py --fake                      # the deterministic fake engine
    python scripts/mem_flat.py --model path/to/tiny-model  # the real batchgen.LLM

Writes an input file (JSONL or Parquet) of --rows prompts to a temp dir, runs the job in this
process and samples the RSS whenever the runner reports progress. Prints the RSS at 10%, 50%
and 100% of the rows and the ratio 100%/10%: streaming input, bounded in-flight requests and
part-sized output buffers keep it close to 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchgen.job.engine import default_factory, load_factory  # noqa: E402
from batchgen.job.run.progress import Plan, Snapshot  # noqa: E402
from batchgen.job.run.runner import Runner  # noqa: E402
from batchgen.job.shard import Shard  # noqa: E402
from batchgen.job.validate import validate_job_file  # noqa: E402


class RssSampler:
    """A progress reporter that records (rows done, RSS) instead of printing."""

    def __init__(self, total: int) -> None:
        self.proc = psutil.Process()
        self.total = total
        self.samples: list[tuple[int, int]] = []
        self.peak = 0
        self._next_tenth = 1
        self._t0 = time.time()

    def _sample(self, rows: int) -> None:
        rss = self.proc.memory_info().rss
        self.peak = max(self.peak, rss)
        self.samples.append((rows, rss))
        while rows >= self._next_tenth * self.total // 10 and self._next_tenth <= 10:
            print(f"  {10 * self._next_tenth:3d}% rows {rows:>9,}  RSS {rss / (1 << 20):7.1f} MiB  "
                  f"{time.time() - self._t0:6.1f}s", flush=True)
            self._next_tenth += 1

    def start(self, plan: Plan) -> None:
        self._sample(0)

    def idle(self) -> None:
        pass

    def update(self, snap: Snapshot, force: bool = False) -> None:
        self._sample(snap.rows)

    def message(self, text: str) -> None:
        print(text)

    def finish(self, snap: Snapshot, status: str) -> None:
        self._sample(snap.rows)

    def at(self, rows: int) -> int:
        """RSS of the first sample with at least ``rows`` rows done."""
        return next(rss for done, rss in self.samples if done >= rows)


def prompt(i: int) -> str:
    return f"Write one word about the number {i}."


def write_input(path: Path, rows: int, fmt: str) -> None:
    chunk = 10_000
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for i in range(rows):
                f.write(json.dumps({"id": f"row{i:07d}", "prompt": prompt(i)}) + "\n")
        return
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, rows, chunk):
            idx = range(start, min(rows, start + chunk))
            ids = [f"row{i:07d}" for i in idx]
            w.write_table(pa.table({"id": ids, "prompt": [prompt(i) for i in idx]}, schema=schema))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--model", help="a (tiny) Hugging Face model dir for the real engine")
    ap.add_argument("--fake", action="store_true", help="use the fake engine of tests/fake_llm.py (default)")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    ap.add_argument("--rows-per-part", type=int, default=5000)
    ap.add_argument("--kv-cache-memory", default="1GiB", help="engine KV cache budget (CPU)")
    args = ap.parse_args()
    use_fake = args.fake or not args.model

    with tempfile.TemporaryDirectory(prefix="batchgen-memflat-") as tmp:
        root = Path(tmp)
        model = root / "model"
        if use_fake:
            model.mkdir()
            (model / "config.json").write_text("{}")
            factory = load_factory(f"{REPO / 'tests' / 'fake_llm.py'}:FakeLLM")
        else:
            model = Path(args.model).resolve()
            factory = default_factory
        t0 = time.time()
        write_input(root / f"in.{args.format}", args.rows, args.format)
        print(f"wrote {args.rows:,} rows of {args.format} in {time.time() - t0:.1f}s")
        job = {
            "model": {"path": str(model), "max_num_seqs": 256, "kv_cache_memory": args.kv_cache_memory,
                      "swap_space": args.kv_cache_memory},
            "input": {"paths": [f"in.{args.format}"], "id_column": "id", "prompt_column": "prompt"},
            "sampling": {"temperature": 0, "max_tokens": 1},
            "output": {"dir": "out", "rows_per_part": args.rows_per_part},
            "max_in_flight": 512,
        }
        (root / "job.yaml").write_text(yaml.safe_dump(job))
        sampler = RssSampler(args.rows)
        t0 = time.time()
        result = Runner(validate_job_file(root / "job.yaml"), Shard(), factory, reporter=sampler).run()
        wall = time.time() - t0
        assert result.status == "complete", result.status
        n = result.snapshot.rows
        print(f"engine: {'fake' if use_fake else model}; {n:,} rows in {wall:.1f}s ({n / wall:,.0f} rows/s), "
              f"{result.snapshot.parts} parts, {len(sampler.samples)} RSS samples")
        mib = 1 << 20
        r10, r50, r100 = sampler.at(n // 10), sampler.at(n // 2), sampler.samples[-1][1]
        print(f"RSS at  10%: {r10 / mib:8.1f} MiB")
        print(f"RSS at  50%: {r50 / mib:8.1f} MiB")
        print(f"RSS at 100%: {r100 / mib:8.1f} MiB   (peak {sampler.peak / mib:.1f} MiB)")
        print(f"ratio 100%/10%: {r100 / r10:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
