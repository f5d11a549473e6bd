#!/usr/bin/env python
"""The engine end to end on random-weight models of Llama 3.2 1B's and Llama 3.1 8B's shapes (issue 52), with
the run's roofline beside it: made for a GPU node (`--device cuda`), runnable small on a CPU (`--shapes tiny`).

Each shape's weights are drawn on the device and written as safetensors with its config (no download, no
tokenizer: token ids in, token ids out), then `LLM` runs two workloads, prompts as random token ids:
  mixed     prompts of 20-1,000 tokens and outputs of 16-1,000 (both log-uniform, so short ones dominate as in
            chat logs: mean ~230 in, ~220 out), greedy, ignore_eos
  parallel  prompts of ~400 tokens, n=8 samples of 64 tokens each (temperature 0.8, top_p 0.95)
and the batch-1 latency: one 128-token prompt, 128 output tokens, ms per output token.

The roofline is the time the run could not beat on this device: every GEMM's flops at the rate a bf16 matmul of
the model's shapes measures here, plus every byte each step must read at the device's copy rate (the weights once
a step, the K/V of every decode token's context). Reported: output and total tok/s, the share of the roofline
(roofline seconds / wall seconds) and, on CUDA, the share of the wall time the GPU was busy (kernel time over a
profiled window of steps). On a CPU with the tiny shape the weights sit in the caches, so its roofline means
little there: that run is the smoke test's.

    python scripts/bench_e2e.py --device cuda --json /tmp/e2e.json            # 1b and 8b, 2,000 prompts each
    python scripts/bench_e2e.py --device cpu --shapes tiny --prompts 8 --max-output 16   # the smoke test's
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import CopyProbe, sync, time_interleaved  # noqa: E402

# Llama-family shapes: (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied embeddings).
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=2048, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
}
VLLM_H100_8B_OUTPUT_TOK_S = 9700  # vLLM's published Llama-3.1-8B figure on an H100 (ShareGPT-like), not this run's


@dataclass
class Result:
    shape: str
    workload: str
    device: str
    seconds: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    steps: int
    output_tok_s: float
    total_tok_s: float
    roofline_s: float
    roofline_share: float  # roofline_s / seconds
    gpu_busy_share: float | None  # kernel time / wall time over the profiled steps (CUDA)


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The Hugging Face Llama checkpoint's tensors and their shapes."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def write_model(root: Path, name: str, device: torch.device, seed: int = 0) -> Path:
    """A random bf16 checkpoint of SHAPES[name] (drawn on `device`), one safetensors file per ~2 GB."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = SHAPES[name]
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**cfg, architectures=["LlamaForCausalLM"], max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2).save_pretrained(path)
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    files = 0

    def flush() -> None:
        nonlocal files
        if shard:
            save_file(shard, str(path / f"model-{files:05d}.safetensors"), metadata={"format": "pt"})
            shard.clear()
            files += 1

    for key, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:  # std 1/sqrt(fan_in): activations keep their scale through the layers
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(shape[1] ** -0.5)
            t = t.to(torch.bfloat16).cpu()
        shard[key] = t
        if sum(v.numel() * 2 for v in shard.values()) > 2 << 30:
            flush()
    flush()
    return path


def workload(name: str, count: int, vocab: int, max_output: int = 1000, seed: int = 0):
    """(prompts as token ids, SamplingParams per prompt) of `name`; outputs of at most `max_output` tokens."""
    from batchgen import SamplingParams

    rng = random.Random(f"{name}-{seed}")
    log_uniform = lambda lo, hi: int(math.exp(rng.uniform(math.log(lo), math.log(hi))))  # noqa: E731
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    if name == "mixed":
        prompts = [ids(log_uniform(20, 1000)) for _ in range(count)]
        params = [SamplingParams(max_tokens=min(max_output, log_uniform(16, 1000)), temperature=0.0, ignore_eos=True)
                  for _ in range(count)]
    elif name == "parallel":
        count = max(1, count // 8)
        prompts = [ids(rng.randint(390, 410)) for _ in range(count)]
        params = [SamplingParams(n=8, max_tokens=min(max_output, 64), temperature=0.8, top_p=0.95, seed=i,
                                 ignore_eos=True) for i in range(count)]
    else:
        raise ValueError(f"unknown workload {name!r}")
    return prompts, params


@dataclass
class Work:
    """What a run asked of the device, summed over its steps."""

    tokens: int = 0  # tokens through the decoder (prompt tokens computed + one per decode)
    steps: int = 0
    kv_tokens_read: int = 0  # sum over decode tokens of their context length


def run_steps(llm, prompts, params, profile_steps: int, device: torch.device) -> tuple[float, Work, list, float | None]:
    """Adds every request, steps until done; returns (seconds, work, finished, GPU busy share)."""
    from bench import StepProfile

    schedule = StepProfile(llm)  # remembers each step's schedule (its timers cost ~1 us a call)
    work, finished, busy = Work(), [], None
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        llm.add_request(str(i), prompt, p)
    sync(device)
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        if device.type == "cuda" and busy is None and work.steps == 20:  # past the first prefill-heavy steps
            busy = gpu_busy_share(llm, schedule, profile_steps, device, finished, work)
            continue
        finished += llm.step()
        count_step(schedule.last, work)
    sync(device)
    return time.perf_counter() - start, work, finished, busy


def count_step(out, work: Work) -> None:
    """Adds a step's tokens and K/V reads (its scheduler output) to `work`."""
    work.steps += 1
    for s in out.scheduled:
        work.tokens += s.num_new_tokens
        if s.num_new_tokens == 1:
            work.kv_tokens_read += s.start + 1


def gpu_busy_share(llm, schedule, steps: int, device: torch.device, finished: list, work: Work) -> float:
    """Kernel time over wall time across `steps` engine steps, under torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            if not llm.has_unfinished_requests():
                break
            finished += llm.step()
            count_step(schedule.last, work)
        sync(device)
        wall = time.perf_counter() - start
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    return kernel_us / 1e6 / wall


def matmul_flops_per_token(cfg: dict) -> float:
    """2 x the decoder's GEMM weights (the lm_head is counted per sampled token apart)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return 2.0 * cfg["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * i)


def gemm_rate(cfg: dict, device: torch.device, rows: int = 256) -> float:
    """FLOP/s of a bf16 (fp32 on CPU) matmul of the MLP's up shape at `rows` tokens."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(rows, cfg["hidden_size"], device=device, dtype=dtype)
    w = torch.randn(cfg["intermediate_size"], cfg["hidden_size"], device=device, dtype=dtype)
    (seconds,) = time_interleaved([lambda: x @ w.t()], device)
    return 2.0 * rows * cfg["hidden_size"] * cfg["intermediate_size"] / seconds


def roofline_seconds(cfg: dict, work: Work, sampled: int, flops_s: float, copy_bytes_s: float) -> float:
    weight_bytes = 2 * sum(math.prod(s) for s in weight_shapes(cfg).values())
    kv_bytes_per_token = 2 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
    flops = matmul_flops_per_token(cfg) * work.tokens + 2.0 * cfg["hidden_size"] * cfg["vocab_size"] * sampled
    read = weight_bytes * work.steps + kv_bytes_per_token * work.kv_tokens_read
    return flops / flops_s + read / copy_bytes_s


def bench_shape(name: str, args, device: torch.device, root: Path, copy_bytes_s: float) -> list[Result]:
    from batchgen import LLM, SamplingParams

    cfg = SHAPES[name]
    path = write_model(root, name, device)
    options = dict(model=str(path), dtype="bfloat16" if device.type == "cuda" else "float32", device=device.type,
                   skip_tokenizer_init=True, seed=0, max_num_seqs=args.max_num_seqs, enable_prefix_caching=True)
    if device.type == "cpu":
        options["kv_cache_memory"] = "1GiB"
    llm = LLM(**options)
    llm.generate([[5] * 16], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    flops_s = gemm_rate(cfg, device)
    results = []
    for wl in args.workloads:
        prompts, params = workload(wl, args.prompts, cfg["vocab_size"], args.max_output)
        seconds, work, finished, busy = run_steps(llm, prompts, params, args.profile_steps, device)
        outputs = sum(len(c.token_ids) for r in finished for c in r.outputs)
        prompt_tokens = sum(len(p) for p in prompts)
        roof = roofline_seconds(cfg, work, outputs, flops_s, copy_bytes_s)
        results.append(Result(name, wl, str(device), seconds, len(prompts), prompt_tokens, outputs, work.steps,
                              outputs / seconds, (outputs + prompt_tokens) / seconds, roof, roof / seconds, busy))
    steps = min(128, args.max_output)
    sync(device)
    start = time.perf_counter()
    llm.generate([[7] * 128], SamplingParams(max_tokens=steps, ignore_eos=True), use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    results.append(Result(name, "batch1", str(device), seconds, 1, 128, steps, steps, steps / seconds,
                          (128 + steps) / seconds, 0.0, 0.0, None))
    del llm
    return results


def main(argv=None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="1b,8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--workloads", default="mixed,parallel")
    parser.add_argument("--prompts", type=int, default=2000, help="requests of mixed (parallel: this / 8 x n=8)")
    parser.add_argument("--max-output", type=int, default=1000, help="cap on every output's length")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=20, help="steps profiled for the GPU busy share")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.workloads = args.workloads.split(",")
    device = torch.device(args.device)
    copy = CopyProbe(device, 256 << 20)
    (copy_s,) = time_interleaved([copy], device)
    copy_bytes_s = copy.bytes_moved / copy_s
    del copy
    results = []

    def save() -> None:  # after every shape: a run stopped at its time keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({
                "copy_gb_s": copy_bytes_s / 1e9, "results": [asdict(r) for r in results],
                "vllm_h100_8b_output_tok_s_published": VLLM_H100_8B_OUTPUT_TOK_S}, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            for r in bench_shape(name, args, device, Path(tmp), copy_bytes_s):
                print(json.dumps(asdict(r)), flush=True)
                results.append(r)
            save()
    save()
    return results


if __name__ == "__main__":
    main()
