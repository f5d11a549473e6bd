#!/usr/bin/env python
"""int8 compute against bf16 on one model in one run (issue 36): throughput and quality.

  throughput  bench.py's mixed workload through batchgen in bf16 and with quantization="int8" (bf16 activations),
              the two alternating for --rounds rounds, each run in a fresh process; the ratio of the medians
  agreement   greedy continuations of the first --agree-prompts mixed prompts, 64 tokens each (ignore_eos): the
              share of tokens int8 gives where bf16 gives the same token at the same position after the same
              prefix (the common prefix, tokens after a first difference counted as different), and the share of
              prompts whose 64 tokens are all the same; float32 against bf16 alike, for scale
  perplexity  of tests/data/pride_and_prejudice_ch1.txt (the prompt's logprobs), bf16 and int8; the budget is
              int8 within 2% of bf16
  --w8a8      all of the above also for the model written as a compressed-tensors int8 W8A8 checkpoint
              (scripts/w8a8.py: the library's round to nearest) and run as a checkpoint quantized ahead
  --model-impl transformers
              every run through the transformers backend (transformers' layers, batchgen's int8 projections)
  --shape 1b  instead of the model itself, random weights in Llama-3.2-1B's layers (hidden 2,048, ffn 8,192, 16
              layers, 32/8 heads of 64) with the model's tokenizer and vocabulary, head tied: throughput where
              the projections are a larger share of a step (the quality figures mean nothing for random weights)

    .venv/bin/python scripts/bench_int8.py --quick          # smoke test
    .venv/bin/python scripts/bench_int8.py --json /tmp/int8.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402
    AGREE_TOKENS,
    BLOCK,
    PERPLEXITY_BUDGET,
    SETTINGS,
    TEXT,
    agreement,
    isolated,
    kv_bytes_per_token,
    make_workload,
    quality,
    run_batchgen,
)
from w8a8 import copy_tokenizer, write_w8a8  # noqa: E402


def random_1b(src: Path, dst: Path) -> Path:
    """--shape 1b's model: `src`'s config and tokenizer files with Llama-3.2-1B's layer shape, random bf16 weights."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(src)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 2048, 8192, 16
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 32, 8, 64
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0, 0.02)
    model.save_pretrained(dst)
    copy_tokenizer(src, dst)
    return dst


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="bf16/int8 throughput pairs, alternating")
    parser.add_argument("--agree-prompts", type=int, default=64)
    parser.add_argument("--prompts", type=int, help="the first this many of mixed's requests only (a loaded machine)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--w8a8", action="store_true", help="also a W8A8 checkpoint of the model (see above)")
    parser.add_argument("--shape", choices=["1b"], help="random weights of a larger shape (see above)")
    parser.add_argument("--model-impl", choices=["native", "transformers"], default="native",
                        help="transformers: every run through the transformers backend (docs/int8.md)")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args(argv)
    if args.w8a8 and args.model_impl != "native":
        parser.error("--w8a8 needs --model-impl native: a checkpoint quantized ahead runs in the native models only")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="bench_int8-"))  # --shape's and --w8a8's models
    try:
        return measure(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args: argparse.Namespace, scratch: Path) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    if args.model is None:
        from batchgen.models.smollm2 import ensure_smollm2

        args.model = str(ensure_smollm2())
    if args.shape:
        args.model = str(random_1b(Path(args.model), scratch / "random-1b"))
    torch.set_num_threads(args.threads)
    cfg, tokenizer = AutoConfig.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    mixed = make_workload("mixed", tokenizer, args.seed, **SETTINGS[args.quick]["mixed"])
    if args.prompts:
        mixed = replace(mixed, prompts=mixed.prompts[: args.prompts], max_tokens=mixed.max_tokens[: args.prompts])
    bytes_per_block = BLOCK * kv_bytes_per_token(cfg, "bfloat16")
    kv_blocks = int(sum(mixed.kv_blocks()) * 1.1) + 16
    configs = {"bf16": (args.model, None), "int8": (args.model, "int8")}  # label: (model, quantization)
    if args.w8a8:
        configs["w8a8"] = (str(write_w8a8(Path(args.model), scratch / "w8a8")), None)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, (model, q) in configs.items():
            print(f"round {round_ + 1}/{args.rounds}: mixed, {name}", flush=True)
            run = isolated(True, run_batchgen, model, mixed, "bfloat16", args.threads, kv_blocks, 64,
                           bytes_per_block, args.model_impl, q)
            rates[name].append(run.rates()["total_tok_s"])
    prompts = mixed.prompts[: args.agree_prompts]
    results = {name: isolated(True, quality, model, q, args.threads, prompts, "bfloat16", "auto", args.model_impl)
               for name, (model, q) in configs.items()}
    results["fp32"] = isolated(True, quality, args.model, None, args.threads, prompts, "float32", "auto",
                               args.model_impl)
    ppl = {name: r["perplexity"] for name, r in results.items()}
    report = dict(
        model=args.model, model_impl=args.model_impl, threads=args.threads, load_average=os.getloadavg(),
        mixed_total_tok_s=rates, int8_over_bf16=statistics.median(rates["int8"]) / statistics.median(rates["bf16"]),
        agreement=agreement(results["bf16"]["continuations"], results["int8"]["continuations"]),
        fp32_agreement=agreement(results["bf16"]["continuations"], results["fp32"]["continuations"]),
        agreement_prompts=len(prompts), perplexity=ppl, perplexity_change=ppl["int8"] / ppl["bf16"] - 1,
        text_tokens=results["bf16"]["text_tokens"], workload=dict(asdict(mixed), prompts=len(mixed.prompts)))
    report["perplexity_budget_met"] = abs(report["perplexity_change"]) <= PERPLEXITY_BUDGET
    if args.w8a8:
        report |= dict(w8a8_over_bf16=statistics.median(rates["w8a8"]) / statistics.median(rates["bf16"]),
                       w8a8_agreement=agreement(results["bf16"]["continuations"], results["w8a8"]["continuations"]),
                       w8a8_perplexity_change=ppl["w8a8"] / ppl["bf16"] - 1)
    print("mixed total tok/s: " + "; ".join(f"{k} {', '.join(f'{v:.0f}' for v in vs)}" for k, vs in rates.items()))
    print(f"int8 / bf16 throughput (medians): x{report['int8_over_bf16']:.2f}")
    a = report["agreement"]
    print(f"greedy agreement over {AGREE_TOKENS} tokens of {len(prompts)} mixed prompts: {a['token_share']:.1%} of "
          f"tokens before the first difference, {a['identical_share']:.1%} of prompts identical")
    f = report["fp32_agreement"]
    print(f"  for scale, float32 against bf16 on the same prompts: {f['token_share']:.1%} of tokens, "
          f"{f['identical_share']:.1%} of prompts identical")
    print(f"perplexity of {TEXT.name} ({report['text_tokens']} tokens): bf16 {ppl['bf16']:.3f}, int8 "
          f"{ppl['int8']:.3f} ({report['perplexity_change']:+.2%}; budget {PERPLEXITY_BUDGET:.0%} "
          f"{'met' if report['perplexity_budget_met'] else 'missed'}); float32 {ppl['fp32']:.3f}")
    if args.w8a8:
        w = report["w8a8_agreement"]
        print(f"W8A8 checkpoint: x{report['w8a8_over_bf16']:.2f} bf16's throughput, perplexity {ppl['w8a8']:.3f} "
              f"({report['w8a8_perplexity_change']:+.2%}), greedy agreement {w['token_share']:.1%} of tokens")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
