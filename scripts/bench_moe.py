#!/usr/bin/env python
"""Mixture-of-experts models on CPU: batchgen's packed experts against transformers' own experts code.

A random MoE of a real model's shape (default: Granite 3.0 1B-A400M's layers, 32 experts, 8 a token, fewer of
them) is saved once in bf16 and run by the engine three ways in one process, alternating: with the experts packed
per expert and run on batchgen's GEMMs in one C++ call a layer (the default, `batchgen/layers/experts.py`), the
same packed experts through the layer's Python loop (one step an expert: what ran before the one call), and
transformers' own experts implementation on the raw 3-D weights (`grouped_mm`; the model's dense projections
packed in all three). All take the same prompts, greedy, `ignore_eos`. One JSON line per run; the ratios of the
best runs in the last.
Their tokens are not compared: the random bf16 model's logits are nearly flat, so the two summation orders pick
different tokens early (tests/test_moe.py holds float32 parity with transformers' generate).

    python scripts/bench_moe.py                   # granite-moe shape, 12 layers, 32 prompts x 256 + 64 tokens
    python scripts/bench_moe.py --quick           # a smoke run (tests/test_bench_smoke.py)
    python scripts/bench_moe.py --arch qwen3_moe --layers 4
    python scripts/bench_moe.py --int8              # and quantization="int8" (the experts on int8 too)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import processor  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.models import transformers_backend  # noqa: E402

# Real models' MoE shapes (hidden, heads, kv heads, experts, experts a token, expert width, vocabulary).
SHAPES = {
    "granitemoe": dict(cls="GraniteMoe", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       num_local_experts=32, num_experts_per_tok=8, intermediate_size=512, vocab_size=49155),
    "qwen3_moe": dict(cls="Qwen3Moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936),
    "mixtral": dict(cls="Mixtral", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=3584, vocab_size=32000),
}


def save_model(arch: str, layers: int, path: Path) -> Path:
    import transformers as tf

    shape = dict(SHAPES[arch])
    cls = shape.pop("cls")
    config = getattr(tf, f"{cls}Config")(**shape, num_hidden_layers=layers, max_position_embeddings=4096,
                                         architectures=[f"{cls}ForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = getattr(tf, f"{cls}ForCausalLM")(config).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    return path


VARIANTS = ("batchgen", "batchgen-loop", "transformers")


def run(model_dir: Path, variant: str, prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    pack = transformers_backend.pack_experts
    if variant == "transformers":
        transformers_backend.pack_experts = lambda hf, **_: 0  # transformers' experts code, its default one
    try:
        llm = LLM(str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, num_threads=threads,
                  quantization="int8" if variant == "batchgen-int8" else None,
                  max_num_seqs=len(prompts))
    finally:
        transformers_backend.pack_experts = pack
    hf = llm.llm_engine.runner.model.hf
    experts = [m.batchgen_experts for m in transformers_backend.expert_layers(hf) if hasattr(m, "batchgen_experts")]
    if variant == "batchgen-loop":
        for layer in experts:
            layer.one_call = False
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = tokens + sum(len(p) for p in prompts)
    return {"experts": hf.config._experts_implementation, "one_call": any(layer.one_call for layer in experts),
            "seconds": round(seconds, 2),
            "output_tok_s": round(tokens / seconds, 1), "total_tok_s": round(total / seconds, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(SHAPES), default="granitemoe")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="each implementation this many times, alternating")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="2 layers, 4 prompts of 32 + 8 tokens, one round")
    parser.add_argument("--int8", action="store_true", help="also with quantization=int8 (experts and projections)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.prompts, args.prompt_len, args.max_tokens, args.rounds = 2, 4, 32, 8, 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(args.arch, args.layers, Path(tmp))
        vocab = SHAPES[args.arch]["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for variant in VARIANTS + (("batchgen-int8",) if args.int8 else ()):
                result = run(model_dir, variant, prompts, args.max_tokens, args.threads)
                print(json.dumps({"arch": args.arch, "layers": args.layers, "variant": variant, **result}), flush=True)
                if variant not in best or result["seconds"] < best[variant]["seconds"]:
                    best[variant] = result
        def speedup(over: str) -> float:
            return round(best[over]["seconds"] / best["batchgen"]["seconds"], 2)
        print(json.dumps({"processor": processor(), "threads": args.threads, "prompts": args.prompts,
                          "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                          "packed_over_transformers": speedup("transformers"),
                          "one_call_over_loop": speedup("batchgen-loop"),
                          **({"int8_over_bf16": round(best["batchgen"]["seconds"] / best["batchgen-int8"]["seconds"],
                                                      2)} if args.int8 else {})}),
              flush=True)


if __name__ == "__main__":
    main()
