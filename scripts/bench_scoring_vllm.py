"""The scoring and embedding peer bench_scoring.py cannot host: vLLM's CPU engine on the same texts.

vLLM lives in an environment of its own (see bench_vllm.py for how it is made); this script takes
bench_scoring.py's rows (the same token ids, from the same seed and tokenizer) and prints tokens/s as
bench_scoring.py does, so the two scripts' lines compare directly. Run them back to back on the same
quiet machine:

    .venv/bin/python scripts/bench_scoring.py --dtype bf16
    LD_PRELOAD=/tmp/vllm/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /tmp/vllm/bin/python scripts/bench_scoring_vllm.py --model ~/.cache/batchgen/models/SmolLM2-135M-Instruct

score: each row's prompt + completion as one prompt with `prompt_logprobs=0` and `max_tokens=1`, the
completion positions' logprobs summed (what `LLM.score_completions` returns). embed: vLLM's pooling
runner with mean pooling and normalisation. The sum of all scores is printed on both sides as a check
that the two engines scored the same thing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scoring  # noqa: E402 - the rows, from the script next to this one


def score(llm, prompts: list[list[int]], completions: list[list[int]]) -> tuple[list[float], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p + c) for p, c in zip(prompts, completions, strict=True)]
    start = time.perf_counter()
    outputs = llm.generate(requests, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    seconds = time.perf_counter() - start
    sums = []
    for out, p in zip(outputs, prompts, strict=True):
        ids = out.prompt_token_ids
        sums.append(sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(p), len(ids))))
    return sums, seconds


def embed(llm, texts: list[list[int]]) -> float:
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm.embed([TokensPrompt(prompt_token_ids=t) for t in texts], use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as bench_scoring.py gives batchgen
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.config import PoolerConfig

    model = str(Path(args.model).expanduser())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts, completions = bench_scoring.make_rows(tokenizer, args.seed, 2 if args.quick else 32, 4)
    texts = bench_scoring.make_texts(tokenizer, args.seed, 8 if args.quick else 128)
    score_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    embed_tokens = sum(map(len, texts))

    llm = LLM(model=model, dtype=args.dtype, max_num_batched_tokens=2048, enable_prefix_caching=True,
              seed=args.seed)
    score(llm, prompts[:2], completions[:2])  # warm-up
    sums, score_s = score(llm, prompts, completions)
    del llm
    pooler = PoolerConfig(pooling_type="MEAN", use_activation=True)
    # vLLM prefills a pooling request in one piece, so its length is capped by the batch's tokens
    llm = LLM(model=model, dtype=args.dtype, runner="pooling", convert="embed", pooler_config=pooler,
              max_num_batched_tokens=2048, max_model_len=2048, seed=args.seed)
    embed(llm, texts[:2])  # warm-up
    embed_s = embed(llm, texts)
    print(f"vllm score {len(prompts):5d} rows {score_tokens:8d} tokens {score_tokens / score_s:10.1f} tok/s "
          f"(sum of scores {sum(sums):.2f})")
    print(f"vllm embed {len(texts):5d} rows {embed_tokens:8d} tokens {embed_tokens / embed_s:10.1f} tok/s")


if __name__ == "__main__":
    main()
