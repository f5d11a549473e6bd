#!/usr/bin/env python
"""The paged-attention kernels called without timing, for tools that watch them run on a card.

    python scripts/kernel_calls.py profile --device cuda   # issue 51's shapes: what Nsight Compute profiles
    python scripts/kernel_calls.py sweep --device cuda     # small shapes of every kind: what compute-sanitizer checks

`profile`: decode of 64 sequences of 2,048 keys and causal prefill of 8 prompts of 2,048 tokens, Llama's heads
(32/8 x 128), bf16, over the 16-bit caches and over fp8 (e4m3) copies, each kernel called twice.
`sweep`: for every activation dtype (fp32, fp16, bf16), cache (the activations' dtype, e4m3, e5m2) and head_dim,
the cache write, decode of three sequences (1, 300 and 520 keys: one split and several, merged) and prefill of
a fresh prompt beside one behind cached context (a prefix hit), once each. gpu_check.py runs both (its profile
and sanitize steps); on a CPU they run the CPU kernels, as the tests do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import DTYPES, HEAD_CONFIGS, fp8_copies, paged_inputs, sync  # noqa: E402

from batchgen import ops  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def profile(device: torch.device, dtype_name: str = "bf16", block_size: int = 16, batch: int = 64,
            context: int = 2048, prompt: int = 2048, prompts: int = 8) -> None:
    """Decode of `batch` sequences of `context` keys and prefill of `prompts` prompts of `prompt` tokens, over the
    16-bit caches and over fp8 copies, each call twice."""
    heads = HEAD_CONFIGS["llama-gqa"]
    dtype = DTYPES[dtype_name]
    scale = heads[2] ** -0.5
    query, key_cache, value_cache, tables, lens, _ = paged_inputs(batch, context, heads, dtype, device, block_size, 1)
    for caches in ((key_cache, value_cache), fp8_copies(key_cache, value_cache)):
        for _ in range(2):
            ops.paged_attention_decode(query, *caches, tables, lens, scale)
    query, key_cache, value_cache, tables, lens, _ = paged_inputs(prompts, prompt, heads, dtype, device, block_size,
                                                                  prompt)
    starts = torch.arange(0, prompts * prompt + 1, prompt, dtype=torch.int32, device=device)
    for caches in ((key_cache, value_cache), fp8_copies(key_cache, value_cache)):
        for _ in range(2):
            ops.paged_attention_prefill(query, *caches, tables, lens, starts, scale)
    sync(device)


def sweep_case(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, device: torch.device,
               block_size: int = 16, num_heads: int = 4, num_kv_heads: int = 2) -> None:
    """One (activations, cache, head_dim) case: the cache written through a slot mapping, then decode and prefill
    read it through shuffled block tables."""
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, 300, 520]  # decode: one split, two, three (merged)
    blocks = [-(-n // block_size) for n in lens]
    key_cache, value_cache = ops.allocate_kv_cache(sum(blocks), num_kv_heads, block_size, head_dim, cache_dtype,
                                                   device)
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    slots = []
    for i, n in enumerate(blocks):
        row, order = order[:n], order[n:]
        tables[i, :n] = torch.tensor(row, dtype=torch.int32)
        slots += [row[t // block_size] * block_size + t % block_size for t in range(lens[i])]
    tables = tables.to(device)
    kv = [torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(device, dtype) for _ in range(2)]
    ops.reshape_and_cache(*kv, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64, device=device))
    scale = head_dim**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(device, dtype)
    ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, scale)
    # Prefill: sequence 1 whole (300 tokens, a fresh prompt), sequence 2's last 33 behind 487 cached (a prefix hit).
    new = [300, 33]
    query = torch.randn(sum(new), num_heads, head_dim, generator=gen).to(device, dtype)
    starts = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device=device)
    ops.paged_attention_prefill(query, key_cache, value_cache, tables[1:], seq_lens[1:], starts, scale)


def sweep(device: torch.device) -> int:
    """Every case of sweep_case; how many ran."""
    cases = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for cache_dtype in (dtype, *FP8):
            for head_dim in ops.SUPPORTED_HEAD_DIMS:
                sweep_case(dtype, cache_dtype, head_dim, device)
                cases += 1
    sync(device)
    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("calls", choices=["profile", "sweep"])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.calls == "profile":
        profile(device)
        print("profile: decode and prefill over bf16 and e4m3 caches, each twice")
    else:
        print(f"sweep: {sweep(device)} cases (activations x caches x head dims), each writes, decodes and prefills")


if __name__ == "__main__":
    main()
