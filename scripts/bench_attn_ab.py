"""A/B of the CPU attention kernels on the shapes that matter for SmolLM2-135M: two builds, or two kernel tables
of one build.

Builds (--a, --b): each round runs one process per build, alternating (A, B, A, B, ...), so that both see the same
minutes of a shared or virtual machine; a build is a directory holding a `batchgen` package with its `_C`
extension, put first on that process's PYTHONPATH. Each time is the fastest call of the process; the table shows
each build's fastest and slowest process and B / A of the fastest.

Kernel tables (--isas A,B, e.g. amx_bf16,avx512_bf16): one process of this build, each case's calls made in turn
under table A and table B (`_C.set_cpu_isa`), the fastest call of each and B / A. On an AMX Xeon this says what
the tile unit's attention gains or loses against the AVX512-BF16 vector path on the same machine and minute
(scripts/cpu_check.py's `tables` step).

The cases (9/3 heads x 64, block 16): decode of 64 x 256 and 16 x 1,000 keys, prefill of 6 x 341 tokens, prefill
of 2 x 128-token chunks on 1,000 cached, the decode of 32 prompts x 8 samples sharing 400 keys (20 own each,
seq_groups), and decode as the engine meets it: 75 sequences of 20-650 tokens, 30 layers' caches called in turn
so that every call reads its K/V from memory (the time of the 30 calls).

    python scripts/bench_attn_ab.py --a /tmp/old_attn --b . --rounds 3
    python scripts/bench_attn_ab.py --isas amx_bf16,avx512_bf16
    python scripts/bench_attn_ab.py --run            # one process: this PYTHONPATH's build, JSON out
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_kv_fp8, bench_kernels

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


# Sizes of the cases, full and --quick (smoke tests).
SIZES = {False: dict(decode=((64, 256), (16, 1000)), prefill=((6, 0, 341), (2, 1000, 128)), shared=(32, 8, 400, 20),
                     engine_like=(75, 650, 30)),
         True: dict(decode=((4, 64),), prefill=((2, 0, 40),), shared=(2, 2, 32, 4), engine_like=(4, 80, 2))}


def cases(dtype_name: str, quick: bool = False) -> dict:
    import torch
    from bench_kv_fp8 import decode_batch, layer_caches

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

    def engine_like(seqs: int, context: int, layers: int):
        lens, tables, blocks = decode_batch(seqs, context, True, gen, BLOCK)
        caches = layer_caches(torch.randn(blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen), layers, dtype)
        q = query(seqs)
        return lambda: [ops.paged_attention_decode(q, k, v, tables, lens, SCALE) for k, v in caches]

    sizes = SIZES[quick]
    found = {f"decode {seqs} x {keys}": decode(seqs, keys) for seqs, keys in sizes["decode"]}
    for seqs, cached, new in sizes["prefill"]:
        found[f"prefill {seqs} x {new}" + (f" on {cached}" if cached else "")] = prefill(seqs, cached, new)
    prompts, samples, shared_keys, own = sizes["shared"]
    found[f"shared decode {prompts} x {samples} x {shared_keys + own}"] = shared(prompts, samples, shared_keys, own)
    seqs, context, layers = sizes["engine_like"]
    found[f"decode {seqs} x 20-{context}, {layers} layers in turn"] = engine_like(seqs, context, layers)
    return found


def run_once(dtype_name: str, threads: int, quick: bool = False) -> dict:
    import torch

    from batchgen import _C

    torch.set_num_threads(threads)
    times = {name: best_seconds(fn) * 1e3 for name, fn in cases(dtype_name, quick).items()}
    return {"isa": _C.cpu_isa(), "ms": times}


def compare_tables(isas: list[str], dtype_name: str, threads: int, quick: bool = False) -> dict:
    """Each case under each kernel table of this build, their calls made in turn: ms of the fastest call."""
    import torch
    from bench_kernels import time_interleaved

    from batchgen import _C

    torch.set_num_threads(threads)
    default = _C.cpu_isa()
    if missing := [isa for isa in isas if isa not in _C.supported_cpu_isas()]:
        raise SystemExit(f"--isas: {', '.join(missing)} not supported here; supported: "
                         f"{', '.join(_C.supported_cpu_isas())}")

    def under(isa: str, fn):
        return lambda: (_C.set_cpu_isa(isa), fn())

    ms = {}
    try:
        for name, fn in cases(dtype_name, quick).items():
            seconds = time_interleaved([under(isa, fn) for isa in isas], torch.device("cpu"),
                                       min_time=0.05 if quick else 0.5, min_reps=3 if quick else 10)
            ms[name] = dict(zip(isas, (s * 1e3 for s in seconds), strict=True))
    finally:
        _C.set_cpu_isa(default)
    return {"isas": isas, "dtype": dtype_name, "threads": threads, "ms": ms}


def compare_builds(args) -> dict:
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for label, path in (("A", args.a), ("B", args.b)):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            argv = [sys.executable, __file__, "--run", "--dtype", args.dtype, "--threads", str(args.threads)]
            out = subprocess.run(argv + (["--quick"] if args.quick else []), env=env, check=True,
                                 capture_output=True, text=True)
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="time this PYTHONPATH's build once, print JSON")
    parser.add_argument("--a", default="/tmp/old_attn", help="directory holding build A's batchgen package")
    parser.add_argument("--b", default=".", help="directory holding build B's batchgen package")
    parser.add_argument("--isas", help="instead of two builds, two kernel tables of this one: A,B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.run:
        report = run_once(args.dtype, args.threads, args.quick)
        print(json.dumps(report))
        return report
    if args.isas:
        isas = args.isas.split(",")
        if len(isas) != 2:
            parser.error(f"--isas {args.isas}: two kernel tables, A,B")
        report = compare_tables(isas, args.dtype, args.threads, args.quick)
        print(f"A = kernel table {isas[0]}, B = {isas[1]}, {args.dtype}, {args.threads} threads, calls in turn, "
              "ms of the fastest")
        for name, ms in report["ms"].items():
            a, b = ms[isas[0]], ms[isas[1]]
            print(f"{name:38s} A {a:8.3f}   B {b:8.3f}   B/A {b / a:.3f}")
    else:
        report = compare_builds(args)
        print(f"A = {args.a} ({report['A'][0]['isa']}), B = {args.b} ({report['B'][0]['isa']}), "
              f"{args.dtype}, {args.threads} threads, {args.rounds} alternating rounds, ms (best .. worst process)")
        for name in report["A"][0]["ms"]:
            a = [r["ms"][name] for r in report["A"]]
            b = [r["ms"][name] for r in report["B"]]
            print(f"{name:38s} A {min(a):8.3f} .. {max(a):8.3f}   B {min(b):8.3f} .. {max(b):8.3f}   "
                  f"B/A {min(b) / min(a):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
