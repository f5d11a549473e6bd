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

    .venv/bin/python scripts/bench_lora.py --dtype bf16
    .venv/bin/python scripts/bench_lora.py --quick        # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bf16", choices=sorted(bench.DTYPES))
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="8 prompts")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
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
    with tempfile.TemporaryDirectory() as tmp:
        paths = bench.make_lora_adapters(model, Path(tmp), 4, bench.LORA_RANK)
        adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        loras = [adapters[i % 4] for i in range(count)]
        lora = dict(options, enable_lora=True, max_lora_rank=bench.LORA_RANK)
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
