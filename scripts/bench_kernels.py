"""Benchmark the paged attention kernels of batchgen._C against the pure-torch reference and
against torch's scaled_dot_product_attention on the same K/V laid out contiguously [B, H, L, D].

For each config it prints the time of each implementation and, for decode, the K/V bandwidth of
the kernel (bytes of K and V read, divided by time) over the 16-bit caches and over fp8 (e4m3) copies of them
(half the bytes, docs/kv-cache.md), next to the machine's copy bandwidth: a
large tensor copy_, counted as bytes read + bytes written (STREAM "copy" convention), timed in
alternation with the kernel so that both see the same machine (on shared or virtual machines
the memory bandwidth drifts). The ratio of the two is the kernel's share of the memory system.
Every time is the fastest of several calls, the least disturbed one.

On CUDA it also measures prefill on tensor cores (issue 51's grid, `--prefill-flops`): causal prompts of
512, 2,048 and 4,096 tokens (16,384 tokens a call), head dim 64 (9/3 heads) and 128 (32/8 heads), fp16 or
bf16, in TFLOP/s of the paged kernel next to torch SDPA's flash backend on the same K/V laid out
contiguously (each kv head repeated for its query heads), and of the paged kernel over an fp8 (e4m3) copy of
the caches (tiles widened for the tensor cores, docs/kv-cache.md), timed in turn.

    python scripts/bench_kernels.py --quick
    python scripts/bench_kernels.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batchgen import _C, ops
from batchgen.ops import reference

HEAD_CONFIGS = {"llama-gqa": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL_GRID = {
    "decode": [(b, c) for b in (1, 8, 64, 256) for c in (128, 1024, 4096)],
    "prefill": [(b, c) for b in (1, 4) for c in (128, 512, 2048)],
}
QUICK_GRID = {"decode": [(1, 1024), (64, 1024)], "prefill": [(1, 512)]}
# Issue 51's decode grid for a card: batch 1/16/64/256 at contexts 512/2k/8k (its prefill TFLOP/s grid is
# PREFILL_FLOPS_GRID, run on CUDA either way).
ISSUE51_GRID = {"decode": [(b, c) for b in (1, 16, 64, 256) for c in (512, 2048, 8192)]}
GRIDS = {"full": FULL_GRID, "quick": QUICK_GRID, "issue51": ISSUE51_GRID}
PREFILL_FLOPS_GRID = [(heads, tokens) for heads in ("smollm2-135m", "llama-gqa") for tokens in (512, 2048, 4096)]
PREFILL_FLOPS_TOKENS = 16384  # query tokens a call: the batch is this over the prompt length
REFERENCE_MAX_SEQS = 8  # the reference loops over sequences in Python: skip it beyond this many


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, min_time: float = 0.3, min_reps: int = 5) -> float:
    """Seconds of the fastest call, after a warm-up call."""
    return time_interleaved([fn], device, min_time, min_reps)[0]


def time_interleaved(fns, device: torch.device, min_time: float = 0.3, min_reps: int = 5) -> list[float]:
    """Seconds of the fastest call of each function, calling them in turn (after a warm-up call)."""
    for fn in fns:
        fn()
    sync(device)
    times: list[list[float]] = [[] for _ in fns]
    while len(times[0]) < 100 and (len(times[0]) < min_reps or sum(times[0]) < min_time):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            sync(device)
            spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


class CopyProbe:
    """A large tensor copy: one call moves `nbytes` (read + written, 2 * nbytes counted)."""

    def __init__(self, device: torch.device, nbytes: int = 512 << 20):
        self.src = torch.ones(nbytes // 4, device=device)
        self.dst = torch.empty_like(self.src)
        self.bytes_moved = 2 * nbytes

    def __call__(self) -> None:
        self.dst.copy_(self.src)


def paged_inputs(batch, context, heads, dtype, device, block_size, q_len):
    """Caches holding `batch` sequences of `context` tokens in shuffled blocks, queries for their
    last q_len tokens, and the same K/V as contiguous [B, KVH, L, D] tensors for SDPA."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, device)
    key_cache.normal_()
    value_cache.normal_()
    order = torch.randperm(num_blocks, device=device).int()
    block_tables = order.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch * q_len, num_heads, head_dim, dtype=dtype, device=device)

    def contiguous(cache):  # [B, KVH, L, D], the layout SDPA wants
        per_seq = cache[block_tables.long()]  # [B, blocks, KVH, BS, D]
        return per_seq.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)[:, :, :context]

    dense = (contiguous(key_cache).contiguous(), contiguous(value_cache).contiguous())
    return query, key_cache, value_cache, block_tables, seq_lens, dense


def fp8_copies(key_cache: torch.Tensor, value_cache: torch.Tensor) -> list[torch.Tensor]:
    """The caches' e4m3 copies (scales of 1): the kernels over an fp8 cache beside the same values at 16 bits."""
    return [cache.to(torch.float8_e4m3fn) for cache in (key_cache, value_cache)]


def bench_config(kind, batch, context, heads_name, dtype_name, device, block_size, with_reference, copy):
    num_heads, num_kv_heads, head_dim = HEAD_CONFIGS[heads_name]
    dtype = DTYPES[dtype_name]
    q_len = 1 if kind == "decode" else context
    query, key_cache, value_cache, tables, lens, (k, v) = paged_inputs(
        batch, context, HEAD_CONFIGS[heads_name], dtype, device, block_size, q_len
    )
    scale = head_dim**-0.5
    out = torch.empty_like(query)
    timed = []  # timed in turn with the kernel and the copy
    if kind == "decode":
        args = (query, key_cache, value_cache, tables, lens, scale)
        kernel = lambda: ops.paged_attention_decode(*args, out=out)
        ref = lambda: reference.paged_attention_decode(*args)
        if dtype != torch.float32:
            fp8_caches = fp8_copies(key_cache, value_cache)
            fp8_out = torch.empty_like(query)
            timed.append(lambda: ops.paged_attention_decode(query, *fp8_caches, tables, lens, scale, out=fp8_out))
    else:
        starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
        args = (query, key_cache, value_cache, tables, lens, starts, scale)
        kernel = lambda: ops.paged_attention_prefill(*args, out=out)
        ref = lambda: reference.paged_attention_prefill(*args)
    q_dense = query.view(batch, q_len, num_heads, head_dim).transpose(1, 2)
    sdpa = lambda: F.scaled_dot_product_attention(q_dense, k, v, is_causal=q_len > 1, scale=scale, enable_gqa=True)

    kv_bytes = 2 * k.numel() * k.element_size()
    keys_seen = batch * (context if kind == "decode" else context * (context + 1) // 2)  # summed over queries
    row = {"kind": kind, "batch": batch, "context": context, "heads": heads_name, "dtype": dtype_name,
           "kv_mb": kv_bytes / 1e6}
    kernel_s, copy_s, *fp8_s = time_interleaved([kernel, copy, *timed], device)
    row["kernel_ms"] = kernel_s * 1e3
    row["fp8_kernel_ms"] = fp8_s[0] * 1e3 if fp8_s else None
    row["fp8_kv_gbps"] = kv_bytes / k.element_size() / fp8_s[0] / 1e9 if fp8_s else None  # one byte an element
    row["copy_gbps"] = copy.bytes_moved / copy_s / 1e9
    row["sdpa_ms"] = time_call(sdpa, device) * 1e3
    row["reference_ms"] = time_call(ref, device, min_reps=1, min_time=0) * 1e3 if with_reference else None
    row["gflops"] = 4 * num_heads * head_dim * keys_seen / row["kernel_ms"] / 1e6  # q.k and p.v, 2 flops a FMA
    row["kv_gbps"] = kv_bytes / row["kernel_ms"] / 1e6 if kind == "decode" else None
    return row


def sdpa_flash(query, key, value, scale):
    """Causal SDPA on the flash backend only (an error where that backend cannot run the inputs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)


def bench_prefill_flops(heads_name, tokens, dtype_name, device, block_size):
    """TFLOP/s of causal prefill over paged K/V (whole prompts, no cached context), of SDPA's flash backend over
    the same K/V contiguous, and of the paged kernel over the caches' fp8 (e4m3) copies; the largest difference
    between the first two's outputs."""
    num_heads, num_kv_heads, head_dim = HEAD_CONFIGS[heads_name]
    batch = max(1, PREFILL_FLOPS_TOKENS // tokens)
    query, key_cache, value_cache, tables, lens, (k, v) = paged_inputs(
        batch, tokens, HEAD_CONFIGS[heads_name], DTYPES[dtype_name], device, block_size, tokens
    )
    group = num_heads // num_kv_heads
    k_full, v_full = (t.repeat_interleave(group, dim=1).contiguous() for t in (k, v))  # [B, H, L, D]
    q_dense = query.view(batch, tokens, num_heads, head_dim).transpose(1, 2).contiguous()
    scale = head_dim**-0.5
    starts = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    kernel = lambda: ops.paged_attention_prefill(query, key_cache, value_cache, tables, lens, starts, scale, out=out)
    flash = lambda: sdpa_flash(q_dense, k_full, v_full, scale)
    fp8_caches = fp8_copies(key_cache, value_cache)
    fp8_out = torch.empty_like(query)
    fp8 = lambda: ops.paged_attention_prefill(query, *fp8_caches, tables, lens, starts, scale, out=fp8_out)
    kernel_s, flash_s, fp8_s = time_interleaved([kernel, flash, fp8], device)
    kernel()
    want = flash().transpose(1, 2).reshape_as(out)
    flops = 4 * num_heads * head_dim * batch * tokens * (tokens + 1) / 2  # causal: q.k and p.v per visible pair
    return {"kind": "prefill-flops", "heads": heads_name, "head_dim": head_dim, "dtype": dtype_name, "batch": batch,
            "tokens": tokens, "kernel_ms": kernel_s * 1e3, "sdpa_flash_ms": flash_s * 1e3,
            "kernel_tflops": flops / kernel_s / 1e12, "sdpa_flash_tflops": flops / flash_s / 1e12,
            "vs_flash": flash_s / kernel_s, "max_abs_diff": (out.float() - want.float()).abs().max().item(),
            "fp8_kernel_ms": fp8_s * 1e3, "fp8_kernel_tflops": flops / fp8_s / 1e12}


def print_prefill_flops(row):
    print(f"{row['heads']:13} {row['head_dim']:4} {row['dtype']:5} {row['batch']:5} {row['tokens']:6} "
          f"{row['kernel_ms']:10.3f} {row['sdpa_flash_ms']:10.3f} {row['kernel_tflops']:9.1f} "
          f"{row['sdpa_flash_tflops']:9.1f} {row['vs_flash']:8.2f}x {row['max_abs_diff']:9.2e} "
          f"{row['fp8_kernel_tflops']:9.1f}", flush=True)


def print_row(row):
    ref = f"{row['reference_ms']:10.2f}" if row["reference_ms"] is not None else f"{'-':>10}"
    if row["kv_gbps"] is None:
        bandwidth = f"{'-':>8} {'-':>7}"
    else:
        bandwidth = f"{row['kv_gbps']:8.1f} {100 * row['kv_gbps'] / row['copy_gbps']:6.0f}%"
    if row.get("fp8_kv_gbps") is None:
        fp8 = f"{'-':>8} {'-':>7}"
    else:
        fp8 = f"{row['fp8_kv_gbps']:8.1f} {100 * row['fp8_kv_gbps'] / row['copy_gbps']:6.0f}%"
    print(
        f"{row['kind']:8} {row['heads']:13} {row['dtype']:5} {row['batch']:5} {row['context']:6} "
        f"{row['kv_mb']:9.1f} {row['kernel_ms']:10.3f} {row['sdpa_ms']:10.3f} {ref} "
        f"{row['sdpa_ms'] / row['kernel_ms']:8.1f}x {row['gflops']:8.1f} {row['copy_gbps']:8.1f} {bandwidth} {fp8}",
        flush=True,
    )


def print_header():
    print(
        f"{'kind':8} {'heads':13} {'dtype':5} {'batch':>5} {'ctx':>6} {'kv MB':>9} {'_C ms':>10} "
        f"{'sdpa ms':>10} {'ref ms':>10} {'vs sdpa':>9} {'GFLOP/s':>8} {'copy':>8} {'KV GB/s':>8} {'%copy':>7} "
        f"{'fp8 GB/s':>8} {'%copy':>7}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small grid (--grid quick)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="full",
                        help="issue51: decode at batch 1/16/64/256 x context 512/2k/8k (K/V up to --max-kv-gb)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--heads", nargs="*", default=sorted(HEAD_CONFIGS), choices=sorted(HEAD_CONFIGS))
    parser.add_argument("--block-size", type=int, default=16, choices=ops.SUPPORTED_BLOCK_SIZES)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--isa", help="CPU instruction set of the kernels (scalar, avx2, avx512, avx512_bf16)")
    parser.add_argument("--max-kv-gb", type=float, help="skip configs whose K/V is larger (default: 1.5 on a CPU, "
                                                           "16 on CUDA)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--prefill-flops", choices=["auto", "on", "off"], default="auto",
                        help="prefill TFLOP/s against SDPA's flash backend (auto: on CUDA with fp16/bf16)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.isa:
        _C.set_cpu_isa(args.isa)
    grid = QUICK_GRID if args.quick else GRIDS[args.grid]
    max_kv_gb = args.max_kv_gb or (16.0 if device.type == "cuda" else 1.5)
    copy = CopyProbe(device)
    where = f"{torch.get_num_threads()} threads, kernels {_C.cpu_isa()}" if device.type == "cpu" else str(device)
    print(f"device {device} ({where})")
    print("copy: GB/s of a 512 MiB tensor copy (read + written), timed in turn with the kernel; KV GB/s")
    print("(decode): bytes of K and V read by the kernel per second; %copy: KV GB/s / copy; fp8 GB/s: the same")
    print("over fp8 (e4m3) copies of the caches (one byte an element); GFLOP/s: 4 * heads * head_dim flops per")
    print("(query, key) pair; vs sdpa: SDPA time / _C time\n")
    print_header()

    rows, flops_rows = [], []
    report = {"device": str(device), "where": where, "results": rows, "prefill_flops": flops_rows}

    def save() -> None:  # after every row: a run stopped at its time keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))

    for kind, configs in grid.items():
        for heads in args.heads:
            _, num_kv_heads, head_dim = HEAD_CONFIGS[heads]
            for batch, context in configs:
                kv_gb = 2 * batch * context * num_kv_heads * head_dim * DTYPES[args.dtype].itemsize / 1e9
                if kv_gb > max_kv_gb:
                    continue
                with_reference = batch <= REFERENCE_MAX_SEQS and (kind == "decode" or context <= 512)
                row = bench_config(
                    kind, batch, context, heads, args.dtype, device, args.block_size, with_reference, copy
                )
                print_row(row)
                rows.append(row)
                save()

    print("\nsummary")
    print_header()
    for row in rows:
        print_row(row)

    want_flops = args.prefill_flops == "on" or (args.prefill_flops == "auto" and device.type == "cuda")
    if want_flops and (device.type != "cuda" or args.dtype == "fp32"):
        print("\nprefill TFLOP/s: needs CUDA and fp16/bf16 (SDPA's flash backend); skipped")
    elif want_flops:
        print("\nprefill, causal, whole prompts: TFLOP/s of the paged kernel and of SDPA's flash backend")
        print(f"{'heads':13} {'hd':>4} {'dtype':5} {'batch':>5} {'tokens':>6} {'_C ms':>10} {'flash ms':>10} "
              f"{'_C TF/s':>9} {'flash TF/s':>9} {'vs flash':>9} {'max diff':>9} {'fp8 TF/s':>9}")
        for heads, tokens in PREFILL_FLOPS_GRID:
            row = bench_prefill_flops(heads, tokens, args.dtype, device, args.block_size)
            print_prefill_flops(row)
            flops_rows.append(row)
            save()
    save()
    return report


if __name__ == "__main__":
    main()
