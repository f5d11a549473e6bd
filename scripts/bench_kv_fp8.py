#!/usr/bin/env python
"""The fp8 KV cache against the model's own dtype on one model (issue 53): quality, and what it saves.

  perplexity  of tests/data/pride_and_prejudice_ch1.txt (the prompt's logprobs: every position's attention reads
              its K/V back from the cache, so the fp8 rounding counts from the first token on), per KV cache dtype
  agreement   greedy continuations of the first --agree-prompts mixed prompts, 64 tokens each (ignore_eos): the
              share of tokens the fp8 cache gives where the model's dtype gives the same token after the same
              prefix (tokens after a first difference counted as different), and the share of prompts whose 64
              tokens are all the same
  blocks      KV blocks that --kv-cache-memory holds per dtype (the sequences that fit side by side)
  --decode    instead, decode attention alone (ops.paged_attention_decode): SmolLM2's 9/3 heads x 64, 64 sequences
              x 1,024 cached tokens in scattered blocks of a cache allocated as the engine allocates it (2 MiB
              pages where the kernel gives them), one layer, float32, float16 and bf16 queries over their own and
              the fp8 caches, the fastest of 30 calls or more. Beside each, called in turn with it: a plain read of
              the same bytes in decode's order on decode's threads (ops.read_decode_blocks), the yardstick issue 53
              sets (decode's K/V read rate at 90% of it); the same blocks read a whole block (all kv heads) at a
              time; and a sequential read of memory (the fastest sum over a 256 MiB tensor, bench.py's read_gb_s).
              Then the same as the engine meets it on "mixed": 30 layers' caches called in turn (so that each call's
              K/V come from memory, not from the cache a call before left them in), 75 sequences of 20-650 tokens
              (`engine_like` in the JSON); on a 2-core Zen 4 one layer's K/V of such a batch lie partly in L3.

Each configuration runs in a fresh process. On a processor without AVX-512, bf16 models multiply float32 copies of
their weights (compute_dtype in batchgen/layers/linear.py), a little slower than float32 itself: float32 is the
quicker choice for the quality runs there.

    .venv/bin/python scripts/bench_kv_fp8.py --quick                          # smoke test
    .venv/bin/python scripts/bench_kv_fp8.py --dtype float32 --json /tmp/kv_fp8.json
    .venv/bin/python scripts/bench_kv_fp8.py --decode
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import SETTINGS, TEXT, agreement, isolated, make_workload, quality, read_gb_s  # noqa: E402

CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", help="the activations' (and auto cache's) dtype")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--agree-prompts", type=int, default=50)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode", action="store_true", help="decode attention's speed per cache dtype instead")
    parser.add_argument("--json", help="write every result here")
    return parser.parse_args(argv)


def cache_blocks(model: str, dtype: str, kv_cache_dtype: str, memory: str) -> int:
    from batchgen import LLM

    return LLM(model=model, dtype=dtype, kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype,
               swap_space=0).llm_engine.scheduler.config.num_device_blocks


# --decode's cases, full and --quick: one layer of `seqs` x `context` tokens, then `engine_like`.
DECODE_SIZES = {False: dict(seqs=64, context=1024, read_time=2.0, engine_like=dict(seqs=75, context=650, layers=30)),
                True: dict(seqs=8, context=256, read_time=0.2, engine_like=dict(seqs=8, context=160, layers=3))}


def decode_and_reads(query, caches, tables, lens) -> dict[str, float]:
    """Seconds of decode attention and of the plain reads of its bytes (decode's order, whole blocks), each over
    every layer's (k, v) in `caches` in turn: the fastest pass of each, the three called in turn
    (bench_kernels.time_interleaved) so that a slow spell of the machine touches all."""
    from bench_kernels import time_interleaved

    from batchgen import ops

    scale = query.shape[-1] ** -0.5
    runs = {"decode": lambda: [ops.paged_attention_decode(query, k, v, tables, lens, scale) for k, v in caches],
            "read": lambda: [ops.read_decode_blocks(k, v, tables, lens) for k, v in caches],
            "whole_blocks": lambda: [ops.read_decode_blocks(k, v, tables, lens, whole_blocks=True) for k, v in caches]}
    return dict(zip(runs, time_interleaved(list(runs.values()), torch.device("cpu"), min_time=0.3, min_reps=30),
                    strict=True))


def decode_batch(seqs: int, context: int, ragged: bool, gen: torch.Generator,
                 block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A decode batch in scattered blocks: (lens, block tables, blocks in all). `ragged`: sequences of 20 to
    `context` tokens (seeded) instead of `context` each."""
    lens = (torch.randint(20, context + 1, (seqs,), generator=gen) if ragged else torch.full((seqs,), context)).int()
    per_seq = (lens + block_size - 1) // block_size
    blocks = int(per_seq.sum())
    tables = torch.zeros(seqs, int(per_seq.max()), dtype=torch.int32)  # scattered over the cache
    for s, ids in enumerate(torch.randperm(blocks, generator=gen).int().split(per_seq.tolist())):
        tables[s, : len(ids)] = ids
    return lens, tables, blocks


def layer_caches(kv: torch.Tensor, layers: int, cache_dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`layers` (K, V) caches shaped as `kv` ([blocks, kv heads, block size, head dim]), allocated as the engine
    allocates its own, each layer's values a little different."""
    from batchgen import ops

    blocks, kv_heads, block_size, head_dim = kv.shape
    caches = []
    for layer in range(layers):
        k, v = ops.allocate_kv_cache(blocks, kv_heads, block_size, head_dim, cache_dtype, "cpu")
        k.copy_((kv + layer).to(cache_dtype))
        v.copy_(((kv - layer) / 2).to(cache_dtype))
        caches.append((k, v))
    return caches


def decode_speed(threads: int, seqs: int = 64, context: int = 1024, read_time: float = 2.0, layers: int = 1,
                 ragged: bool = False) -> list[dict]:
    """Decode attention against the plain reads of its bytes, per (query, cache) dtype. `ragged`: sequences of
    20 to `context` tokens (seeded) instead of `context` each; `layers`: caches called in turn, each one
    layer's, so that every call reads K/V from memory (one layer's may stay in the processor's cache)."""
    torch.set_num_threads(threads)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    lens, tables, blocks = decode_batch(seqs, context, ragged, gen, block_size)
    kv = torch.randn(blocks, kv_heads, block_size, head_dim, generator=gen)
    keys_read = int(lens.sum()) * kv_heads * head_dim * 2 * layers  # elements of K and V, over every layer
    rows = []
    plain = read_gb_s(threads, min_time=read_time)
    print(f"sequential read of memory: {plain:.1f} GB/s", flush=True)
    for activation in (torch.float32, torch.float16, torch.bfloat16):
        query = torch.randn(seqs, heads, head_dim, generator=gen).to(activation)
        for cache_dtype in (activation, torch.float8_e4m3fn, torch.float8_e5m2):
            caches = layer_caches(kv, layers, cache_dtype)
            seconds = decode_and_reads(query, caches, tables, lens)
            rate = {name: keys_read * caches[0][0].element_size() / s / 1e9 for name, s in seconds.items()}
            rows.append(dict(query=str(activation), cache=str(cache_dtype), layers=layers, ragged=ragged,
                             ms=seconds["decode"] * 1e3 / layers, cache_gb_s=rate["decode"], read_gb_s=rate["read"],
                             whole_block_read_gb_s=rate["whole_blocks"], share_of_read=rate["decode"] / rate["read"],
                             sequential_read_gb_s=plain, share_of_sequential_read=rate["decode"] / plain))
            print(f"query {rows[-1]['query']:14s} cache {rows[-1]['cache']:20s} {rows[-1]['ms']:6.2f} ms "
                  f"{rate['decode']:5.1f} GB/s = {rows[-1]['share_of_read']:4.0%} of a plain read of the same bytes "
                  f"({rate['read']:.1f} GB/s; whole blocks {rate['whole_blocks']:.1f})", flush=True)
            del caches  # before the next dtype's: 30 float32 layers hold ~1.2 GB
    return rows


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    if args.decode:
        size = DECODE_SIZES[args.quick]
        print(f"one layer, {size['seqs']} sequences of {size['context']:,} tokens:", flush=True)
        report = {"decode": decode_speed(args.threads, size["seqs"], size["context"], size["read_time"])}
        like = size["engine_like"]
        print(f"\nas in the engine: {like['layers']} layers in turn, {like['seqs']} sequences of 20-{like['context']} "
              "tokens:", flush=True)
        report["engine_like"] = decode_speed(args.threads, read_time=size["read_time"], ragged=True, **like)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return report
    if args.model is None:
        from batchgen.models.smollm2 import ensure_smollm2

        args.model = str(ensure_smollm2())
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    mixed = make_workload("mixed", tokenizer, args.seed, **SETTINGS[args.quick]["mixed"])
    prompts = mixed.prompts[: 2 if args.quick else args.agree_prompts]
    results = {name: isolated(True, quality, args.model, None, args.threads, prompts, args.dtype, name)
               for name in CACHE_DTYPES}
    blocks = {name: isolated(True, cache_blocks, args.model, args.dtype, name, args.kv_cache_memory)
              for name in CACHE_DTYPES}
    base = results["auto"]
    report = dict(model=args.model, dtype=args.dtype, agreement_prompts=len(prompts), text=TEXT.name,
                  text_tokens=base["text_tokens"], blocks=blocks,
                  perplexity={name: r["perplexity"] for name, r in results.items()},
                  agreement={name: agreement(base["continuations"], r["continuations"])
                             for name, r in results.items() if name != "auto"})
    print(f"{args.model} ({args.dtype}); perplexity of {TEXT.name} ({report['text_tokens']} tokens), greedy "
          f"agreement with auto over 64 tokens of {len(prompts)} mixed prompts, blocks in {args.kv_cache_memory}:")
    for name in CACHE_DTYPES:
        ppl = report["perplexity"][name]
        line = f"  {name:9s} perplexity {ppl:.4f} ({ppl / report['perplexity']['auto'] - 1:+.2%})"
        if name in report["agreement"]:
            a = report["agreement"][name]
            line += f", agreement {a['token_share']:.1%} of tokens, {a['identical_share']:.0%} of prompts identical"
        print(f"{line}, {blocks[name]} blocks")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
