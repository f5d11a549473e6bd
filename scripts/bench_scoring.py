#!/usr/bin/env python
"""Scoring and embedding throughput: batchgen against transformers on the same texts, in one run.

Workloads (chat prompts from bench.py's generator, deterministic from --seed):
  score   prompts of 100-400 tokens, each with 4 completions of 20-120 tokens: the completions'
          summed logprobs. batchgen: LLM.score_completions (the prompt shared through the prefix
          cache). transformers: one forward over prompt + completion per row, log_softmax, gather,
          rows sorted by length in batches of --batch (right padding).
  embed   texts of 20-400 tokens, mean pooling, normalised. batchgen: LLM.embed. transformers:
          AutoModel's last hidden states, masked mean, normalised, batches as above.
Throughput is tokens/s over the rows' full lengths (prompt + completion), what a engine without a
prefix cache would compute; the numbers are checked to agree (within 1e-3 / cosine > 0.9999).
With --vllm-python, score also runs through vLLM's CPU engine in its own environment (installed as
scripts/bench_vllm.py says; `generate` with prompt_logprobs=0, max_tokens=1), in the same run.

    .venv/bin/python scripts/bench_scoring.py --dtype bf16
    .venv/bin/python scripts/bench_scoring.py --dtype bf16 --vllm-python /tmp/vllm/bin/python
    .venv/bin/python scripts/bench_scoring.py --quick --model DIR   # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - the chat prompt generator, from the script next to this one

DEFAULT_MODEL = "~/.cache/batchgen/models/SmolLM2-135M-Instruct"


def make_rows(tokenizer, seed: int, prompts: int, completions: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(f"score-{seed}")
    frames = bench.chat_frames(tokenizer)
    heads = [bench.chat_prompt(tokenizer, frames, rng, rng.randint(100, 400)) for _ in range(prompts)]
    rows_p, rows_c = [], []
    for head in heads:
        for _ in range(completions):
            text = bench.user_text(rng, rng.randint(20, 120))
            rows_p.append(head)
            rows_c.append(tokenizer.encode(text, add_special_tokens=False)[: rng.randint(20, 120)])
    return rows_p, rows_c


def make_texts(tokenizer, seed: int, count: int) -> list[list[int]]:
    rng = random.Random(f"embed-{seed}")
    frames = bench.chat_frames(tokenizer)
    return [bench.chat_prompt(tokenizer, frames, rng, rng.randint(20, 400)) for _ in range(count)]


def batches(rows: list[list[int]], size: int) -> list[list[int]]:
    """Row indices, sorted by length (least padding), in batches of `size`."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    return [order[i:i + size] for i in range(0, len(order), size)]


def padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


@torch.inference_mode()
def hf_score(model, prompts, completions, batch: int, pad_id: int) -> list[float]:
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    out = [0.0] * len(rows)
    for index in batches(rows, batch):
        ids, mask = padded([rows[i] for i in index], pad_id)
        logprobs = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        for j, i in enumerate(index):
            start, end = len(prompts[i]), len(rows[i])
            targets = ids[j, start:end]
            out[i] = logprobs[j, start - 1:end - 1].gather(1, targets[:, None]).sum().item()
    return out


@torch.inference_mode()
def hf_embed(model, texts, batch: int, pad_id: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [None] * len(texts)
    for index in batches(texts, batch):
        ids, mask = padded([texts[i] for i in index], pad_id)
        states = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        means = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        for j, i in enumerate(index):
            out[i] = F.normalize(means[j], dim=0)
    return out


def vllm_score(python: str, model_dir: str, dtype: str, threads: int, prompts, completions) -> dict:
    """scripts/bench_vllm.py --score-rows in vLLM's environment (`python`): {"seconds", "scores"}."""
    from bench_vllm import run_child

    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.json"
        rows.write_text(json.dumps({"prompts": prompts, "completions": completions}))
        script = Path(__file__).resolve().parent / "bench_vllm.py"
        return run_child(python, [str(script), "--model", model_dir, "--dtype", dtype, "--score-rows", str(rows)],
                         "--out", "vLLM's scoring run", threads)


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "bf16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8, help="transformers' batch size")
    parser.add_argument("--quick", action="store_true", help="a few rows: a smoke test")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--vllm-python", help="the python of a vLLM CPU environment: score through vLLM too")
    args = parser.parse_args(argv)
    dtype = "bfloat16" if args.dtype == "bf16" else args.dtype
    torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoModelForCausalLM

    from batchgen import LLM
    from batchgen.pooling_params import ScoringParams

    model_dir = str(Path(args.model).expanduser())
    llm = LLM(model_dir, dtype=dtype, kv_cache_memory="1GiB", num_threads=args.threads)
    tokenizer = llm.tokenizer
    pad_id = tokenizer.pad_token_id or 0
    prompts, completions = make_rows(tokenizer, args.seed, 2 if args.quick else 32, 4)
    texts = make_texts(tokenizer, args.seed, 8 if args.quick else 128)
    score_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    embed_tokens = sum(map(len, texts))
    llm.embed(texts[:2], pooling="mean", use_tqdm=False)  # warm-up
    ours_scores, ours_score_s = timed(llm.score_completions, prompts, completions, ScoringParams(), False)
    ours_vectors, ours_embed_s = timed(partial(llm.embed, texts, pooling="mean", use_tqdm=False))
    cached = llm.stats()["prefix_cache_hits"]
    del llm

    causal = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    hf_score(causal, prompts[:2], completions[:2], args.batch, pad_id)  # warm-up
    theirs_scores, theirs_score_s = timed(hf_score, causal, prompts, completions, args.batch, pad_id)
    del causal
    base = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    theirs_vectors, theirs_embed_s = timed(hf_embed, base, texts, args.batch, pad_id)
    del base
    vllm = vllm_score(args.vllm_python, model_dir, dtype, args.threads, prompts, completions) \
        if args.vllm_python else None

    score_gap = max(abs(a.logprob - b) / max(1.0, abs(b)) for a, b in zip(ours_scores, theirs_scores, strict=True))
    cosine = min(float(torch.dot(torch.tensor(a.outputs.embedding), b))
                 for a, b in zip(ours_vectors, theirs_vectors, strict=True))
    report = {
        "model": model_dir, "dtype": dtype, "threads": args.threads, "transformers_batch": args.batch,
        "score": {"rows": len(prompts), "tokens": score_tokens, "prefix_cache_hit_tokens": cached,
                  "batchgen_tok_s": score_tokens / ours_score_s, "transformers_tok_s": score_tokens / theirs_score_s,
                  "ratio": theirs_score_s / ours_score_s, "max_relative_gap": score_gap},
        "embed": {"rows": len(texts), "tokens": embed_tokens, "batchgen_tok_s": embed_tokens / ours_embed_s,
                  "transformers_tok_s": embed_tokens / theirs_embed_s, "ratio": theirs_embed_s / ours_embed_s,
                  "min_cosine": cosine},
    }
    print(f"{'workload':<8} {'rows':>5} {'tokens':>8} {'batchgen tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for name in ("score", "embed"):
        r = report[name]
        print(f"{name:<8} {r['rows']:>5} {r['tokens']:>8} {r['batchgen_tok_s']:>15.1f} "
              f"{r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f}x")
    if vllm is not None:
        gap = max(abs(a.logprob - b) / max(1.0, abs(b)) for a, b in zip(ours_scores, vllm["scores"], strict=True))
        report["score"].update(vllm_tok_s=score_tokens / vllm["seconds"], vllm_ratio=vllm["seconds"] / ours_score_s,
                               vllm_max_relative_gap=gap)
        print(f"score vs vLLM: vLLM {score_tokens / vllm['seconds']:.1f} tok/s, batchgen "
              f"{vllm['seconds'] / ours_score_s:.2f}x; scores within {gap:.1e} (relative)")
    print(f"agreement: scores within {score_gap:.1e} (relative), embeddings cosine >= {cosine:.6f}")
    tolerance = (1e-3, 0.9999) if dtype == "float32" else (2e-2, 0.99)
    if score_gap > tolerance[0] or cosine < tolerance[1]:
        raise SystemExit(f"batchgen and transformers disagree beyond {tolerance}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
