"""A/B of two builds of the CPU attention kernels on the shapes that matter for SmolLM2-135M.

Each round runs one process per build, alternating (A, B, A, B, ...), so that both see the same
minutes of a shared or virtual machine; a build is a directory holding a `batchgen` package with
its `_C` extension, put first on that process's PYTHONPATH. The cases (9/3 heads x 64, block 16):
decode of 64 x 256 and 16 x 1,000 keys, prefill of 6 x 341 tokens, prefill of 2 x 128-token chunks
on 1,000 cached, and the decode of 32 prompts x 8 samples sharing 400 keys (20 own each, seq_groups).
Each time is the fastest call of the process; the table shows each build's fastest and slowest
process and B / A of the fastest.

    python scripts/bench_attn_ab.py --a /tmp/old_attn --b . --rounds 3
    python scripts/bench_attn_ab.py --run            # one process: this PYTHONPATH's build, JSON out
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def best_seconds(fn, min_time: float = 0.5, min_reps: int = 10) -> float:
    fn()
    times: list[float] = []
    while len(times) < min_reps or sum(times) < min_time:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cases(dtype_name: str) -> dict:
    import torch

    from batchgen import ops

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator().manual_seed(0)

    def cache(blocks: int):
        shape = (blocks, KV_HEADS, BLOCK, HEAD_DIM)
        return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)

    def table(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int32)

    def query(rows: int) -> torch.Tensor:
        return torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)

    def decode(seqs: int, keys: int):
        per = -(-keys // BLOCK)
        k, v = cache(seqs * per)
        blocks = torch.randperm(seqs * per, generator=gen).view(seqs, per).int()
        q, lens = query(seqs), torch.full((seqs,), keys, dtype=torch.int32)
        return lambda: ops.paged_attention_decode(q, k, v, blocks, lens, SCALE)

    def prefill(seqs: int, cached: int, new: int):
        per = -(-(cached + new) // BLOCK)
        k, v = cache(seqs * per)
        blocks = torch.randperm(seqs * per, generator=gen).view(seqs, per).int()
        q = query(seqs * new)
        lens = torch.full((seqs,), cached + new, dtype=torch.int32)
        starts = torch.arange(0, seqs * new + 1, new, dtype=torch.int32)
        return lambda: ops.paged_attention_prefill(q, k, v, blocks, lens, starts, SCALE)

    def shared(prompts: int, samples: int, shared_keys: int, own: int):
        shared_blocks, own_blocks = shared_keys // BLOCK, -(-own // BLOCK)
        k, v = cache(prompts * (shared_blocks + samples * own_blocks))
        free = iter(torch.randperm(len(k), generator=gen).tolist())
        rows, groups = [], []
        for p in range(prompts):
            prompt = [next(free) for _ in range(shared_blocks)]
            for _ in range(samples):
                rows.append(prompt + [next(free) for _ in range(own_blocks)])
                groups.append(p)
        q = query(len(rows))
        lens = torch.full((len(rows),), shared_keys + own, dtype=torch.int32)
        group_ids = torch.tensor(groups, dtype=torch.int32)
        return lambda: ops.paged_attention_decode(q, k, v, table(rows), lens, SCALE, seq_groups=group_ids)

    return {
        "decode 64 x 256": decode(64, 256),
        "decode 16 x 1000": decode(16, 1000),
        "prefill 6 x 341": prefill(6, 0, 341),
        "prefill 2 x 128 on 1000": prefill(2, 1000, 128),
        "shared decode 32 x 8 x 420": shared(32, 8, 400, 20),
    }


def run_once(dtype_name: str, threads: int) -> dict:
    import torch

    from batchgen import _C

    torch.set_num_threads(threads)
    times = {name: best_seconds(fn) * 1e3 for name, fn in cases(dtype_name).items()}
    return {"isa": _C.cpu_isa(), "ms": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="time this PYTHONPATH's build once, print JSON")
    parser.add_argument("--a", default="/tmp/old_attn", help="directory holding build A's batchgen package")
    parser.add_argument("--b", default=".", help="directory holding build B's batchgen package")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_once(args.dtype, args.threads)))
        return
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for label, path in (("A", args.a), ("B", args.b)):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            out = subprocess.run([sys.executable, __file__, "--run", "--dtype", args.dtype,
                                  "--threads", str(args.threads)], env=env, check=True, capture_output=True, text=True)
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"A = {args.a} ({results['A'][0]['isa']}), B = {args.b} ({results['B'][0]['isa']}), "
          f"{args.dtype}, {args.threads} threads, {args.rounds} alternating rounds, ms (best .. worst process)")
    for name in results["A"][0]["ms"]:
        a = [r["ms"][name] for r in results["A"]]
        b = [r["ms"][name] for r in results["B"]]
        print(f"{name:28s} A {min(a):8.3f} .. {max(a):8.3f}   B {min(b):8.3f} .. {max(b):8.3f}   "
              f"B/A {min(b) / min(a):.3f}")


if __name__ == "__main__":
    main()
