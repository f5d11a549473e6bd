#!/usr/bin/env python
"""LoRA throughput: the same workload on the base model and split over adapters, in one run.

Workload (bench.py's chat prompts, deterministic from --seed): --count prompts of 20-200 tokens, max_tokens
from {16, 32, 64}, greedy, ignore_eos. Runs, each on a fresh LLM with the same options:
  base        enable_lora=False: the plain engine (fused gate/up, the decoder stack where it applies)
  lora-off    enable_lora=True, no request names an adapter: what enabling LoRA costs base rows
  lora-4      enable_lora=True, max_loras=4: the prompts round-robin over 4 random rank-16 PEFT adapters on
              all seven projections (issue 34's workload); ratio against base is the target (>= 0.8x)
  lora-4of2   the same with max_loras=2: adapters swapped in and out of the slots
Tokens/s count prompt + output tokens over the wall time of generate().
--alternate N: one base LLM and one lora-4 LLM in this process, their generate() calls alternated N times
(each pair seeing the same machine), the ratio printed per pair with the load average.
--kernel: `ops.lora_shrink_expand` alone, one call of 4 rank-16 slots (rows split evenly) at SmolLM2's shapes,
the float32 form (float32 A and B, float32 FMAs) against the bf16 form (`ops.pack_lora_bf16`, the bf16 dot
product) in alternation, the fastest call of each. With --device cuda: the CUDA kernel (float32 A and B, bf16 x)
with the segment table on the host (read and copied each call) against the table already on the device, each
timed to completion; the engine runs then run on the GPU as well.

    .venv/bin/python scripts/bench_lora.py --dtype bf16
    .venv/bin/python scripts/bench_lora.py --quick        # smoke test
    .venv/bin/python scripts/bench_lora.py --alternate 6 --count 16
    .venv/bin/python scripts/bench_lora.py --kernel --threads 2
    python scripts/bench_lora.py --kernel --device cuda                           # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - the chat prompt generator, from the script next to this one

DEFAULT_MODEL = "~/.cache/batchgen/models/SmolLM2-135M-Instruct"


def run(model: str, prompts, params, options: dict, loras) -> dict:
    from batchgen import LLM

    llm = LLM(model, **options)
    llm.generate(prompts[:4], params[:4], use_tqdm=False, lora_request=None if loras is None else loras[:4])  # warm
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "tok_s": tokens / seconds, "lora_loads": llm.stats()["lora_loads"]}


def time_fastest(fns, calls: int) -> list[float]:
    """Seconds of the fastest of `calls` calls of each function, called in turn (after one warm-up call each)."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(calls):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _lora_call_synced(y, x, table, a, b_t) -> None:
    import torch

    from batchgen import ops

    ops.lora_shrink_expand(y, x, table, a, b_t, store=True)
    torch.cuda.synchronize()


def bench_cuda_kernel(calls: int) -> None:
    import torch

    slots, rank = 4, bench.LORA_RANK
    print(f"{'rows':>5} {'in->out':>10} {'host table us':>13} {'device table us':>15} {'speed-up':>8}  "
          f"(4 slots of rank {rank}, {torch.cuda.get_device_name()})")
    for rows in (16, 64, 256, 2048):
        for n_in, n_out in ((576, 576), (576, 1536)):
            gen = torch.Generator().manual_seed(rows + n_out)
            a = (torch.randn(slots, rank, n_in, generator=gen) * 0.05).cuda()
            b_t = (torch.randn(slots, rank, n_out, generator=gen) * 0.05).cuda()
            x = torch.randn(rows, n_in, generator=gen).bfloat16().cuda()
            y = torch.empty(rows, n_out, device="cuda")
            step = rows // slots
            host = torch.tensor([(s * step, (s + 1) * step, s) for s in range(slots)], dtype=torch.int32)
            times = time_fastest([partial(_lora_call_synced, y, x, table, a, b_t) for table in (host, host.cuda())],
                                 calls)
            print(f"{rows:>5} {f'{n_in}->{n_out}':>10} {times[0] * 1e6:13.1f} {times[1] * 1e6:15.1f} "
                  f"{times[0] / times[1]:7.2f}x", flush=True)


def bench_kernel(threads: int | None, calls: int, isa: str | None) -> None:
    import torch

    from batchgen import _C, ops

    if threads:
        torch.set_num_threads(threads)
    if isa:
        _C.set_cpu_isa(isa)
    slots, rank = 4, bench.LORA_RANK
    print(f"{'rows':>5} {'in->out':>10} {'float32 us':>11} {'bf16 us':>9} {'GMAC/s':>13} {'speed-up':>8}  "
          f"(4 slots of rank {rank}, {torch.get_num_threads()} threads, {_C.cpu_isa()} kernels)")
    for rows in (16, 64, 256):
        for n_in, n_out in ((576, 576), (576, 1536)):
            gen = torch.Generator().manual_seed(rows + n_out)
            a = (torch.randn(slots, rank, n_in, generator=gen) * 0.05).bfloat16().float()
            b_t = (torch.randn(slots, rank, n_out, generator=gen) * 0.05).bfloat16().float()
            a_pairs, b_pairs = ops.pack_lora_bf16(a, b_t)
            x = torch.randn(rows, n_in, generator=gen).bfloat16()
            y = torch.empty(rows, n_out)
            step = rows // slots
            segments = torch.tensor([(s * step, (s + 1) * step, s) for s in range(slots)], dtype=torch.int32)
            times = time_fastest([partial(ops.lora_shrink_expand, y, x, segments, a, b_t, store=True),
                                  partial(ops.lora_shrink_expand, y, x, segments, a_pairs, b_pairs, store=True)],
                                 calls)
            macs = rows * rank * (n_in + n_out) / 1e9
            rates = "/".join(f"{macs / t:.1f}" for t in times)
            print(f"{rows:>5} {f'{n_in}->{n_out}':>10} {times[0] * 1e6:11.1f} {times[1] * 1e6:9.1f} {rates:>13} "
                  f"{times[0] / times[1]:7.2f}x", flush=True)


def alternate(model: str, prompts, params, options: dict, lora: dict, loras, rounds: int) -> None:
    from batchgen import LLM

    engines = {"base": (LLM(model, **options), None), "lora-4": (LLM(model, **lora), loras)}
    for llm, requests in engines.values():
        llm.generate(prompts[:4], params[:4], use_tqdm=False, lora_request=None if requests is None else requests[:4])
    print(f"{'round':<6} {'base tok/s':>10} {'lora tok/s':>10} {'ratio':>6}  load average", flush=True)
    for i in range(rounds):
        rates = []
        for llm, requests in engines.values():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
            tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
            rates.append(tokens / (time.perf_counter() - start))
        load = " ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"{i + 1:<6} {rates[0]:10.1f} {rates[1]:10.1f} {rates[1] / rates[0]:5.2f}x  {load}", flush=True)
    for name, (llm, _) in engines.items():
        stack = getattr(llm.engine.runner.model, "decoder_stack", None)
        if stack is not None:
            seconds = stack.op_seconds()
            gemms = sum(seconds[op] for op in ("qkv", "o", "gate_up", "down"))
            print(f"{name}'s decoder stack: LoRA terms {seconds['lora']:.2f} s, the four GEMMs {gemms:.2f} s, "
                  f"all {sum(seconds.values()):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bf16", choices=sorted(bench.DTYPES))
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="8 prompts")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--alternate", type=int, default=0, metavar="N",
                        help="base and lora-4 in this process, alternated N times")
    parser.add_argument("--kernel", action="store_true", help="the LoRA kernel alone: float32 form against bf16")
    parser.add_argument("--calls", type=int, default=2000, help="--kernel: calls of each form per shape")
    parser.add_argument("--isa", help="--kernel: this kernel table (_C.supported_cpu_isas()) instead of the best")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if args.kernel:
        if args.device == "cuda":
            bench_cuda_kernel(args.calls)
        else:
            bench_kernel(args.threads, args.calls, args.isa)
        return
    from batchgen import LoRARequest, SamplingParams
    from batchgen.models.loader import load_tokenizer

    model = str(Path(args.model).expanduser())
    tokenizer = load_tokenizer(Path(model))
    rng = random.Random(f"lora-{args.seed}")
    frames = bench.chat_frames(tokenizer)
    count = 8 if args.quick else args.count
    prompts = [bench.chat_prompt(tokenizer, frames, rng, rng.randint(20, 200)) for _ in range(count)]
    params = [SamplingParams(temperature=0, max_tokens=rng.choice((16, 32, 64)), ignore_eos=True) for _ in prompts]
    options = dict(dtype=bench.DTYPES[args.dtype], kv_cache_memory="1GiB", num_threads=args.threads)
    if args.device == "cuda":
        options = dict(dtype=bench.DTYPES[args.dtype], device="cuda", gpu_memory_utilization=0.3)
    with tempfile.TemporaryDirectory() as tmp:
        paths = bench.make_lora_adapters(model, Path(tmp), 4, bench.LORA_RANK)
        adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        loras = [adapters[i % 4] for i in range(count)]
        lora = dict(options, enable_lora=True, max_lora_rank=bench.LORA_RANK)
        if args.alternate:
            alternate(model, prompts, params, options, dict(lora, max_loras=4), loras, args.alternate)
            return
        runs = {"base": (options, None), "lora-off": (dict(lora, max_loras=4), None),
                "lora-4": (dict(lora, max_loras=4), loras), "lora-4of2": (dict(lora, max_loras=2), loras)}
        results = {}
        print(f"{'run':<10} {'tok/s':>8} {'vs base':>8} {'loads':>6}", flush=True)
        for name, (engine_options, requests) in runs.items():
            r = results[name] = run(model, prompts, params, engine_options, requests)
            ratio = r["tok_s"] / results["base"]["tok_s"]
            print(f"{name:<10} {r['tok_s']:8.1f} {ratio:7.2f}x {r['lora_loads']:6d}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "count": count, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
