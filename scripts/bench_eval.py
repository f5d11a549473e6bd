#!/usr/bin/env python
"""lm-evaluation-harness on batchgen against lm-eval's own `hf` backend (and `vllm` where it is installed), on
the same local tasks in one run: wall time and requests per second of each (issue 54).

Three tasks are written to a temporary directory, their data made deterministically from a seed:
  bench_mc    multiple_choice: --docs questions of 4 choices (a loglikelihood request per choice)
  bench_gen   generate_until: --docs prompts, greedy, up to 32 tokens, stopped at a newline
  bench_ppl   loglikelihood_rolling: --docs texts of ~300 words
Each backend runs all three in one `simple_evaluate` call, in float32 or bf16 (`--dtype`), on the same model
(SmolLM2-135M-Instruct by default: `python -m batchgen.models.smollm2` fetches it). The hf backend runs at its
own `--batch-size` (default 16); batchgen takes every request of a task at once whatever it is given.

    python scripts/bench_eval.py --json /tmp/eval.json
    python scripts/bench_eval.py --docs 20 --backends batchgen       # a quick look
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
from machine import processor  # noqa: E402

WORDS = ("the sea sky river city light night house garden road winter summer bird tree stone cloud voice hand "
         "book letter friend window morning evening story music paper table").split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize()


def write_tasks(root: Path, docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    data = {
        "bench_mc": [{"question": sentence(rng, 20) + " The next word is",
                      "choices": [" " + rng.choice(WORDS) for _ in range(4)], "answer": rng.randrange(4)}
                     for _ in range(docs)],
        "bench_gen": [{"question": sentence(rng, 40) + "\nContinue:", "answer": rng.choice(WORDS)}
                      for _ in range(docs)],
        "bench_ppl": [{"text": ". ".join(sentence(rng, 12) for _ in range(25))} for _ in range(docs)],
    }
    bodies = {
        "bench_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
        "bench_gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
                     "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 32\n  do_sample: false\n"
                     "metric_list:\n  - metric: exact_match\n",
        "bench_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                     "metric_list:\n  - metric: word_perplexity\n",
    }
    for task, rows in data.items():
        (root / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ntest_split: train\ndataset_kwargs:\n  data_files:\n"
            f"    train: {root / f'{task}.jsonl'}\n" + bodies[task])
    return list(data)


def run(backend: str, model: str, dtype: str, tasks: list[str], root: Path, batch_size: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if backend == "batchgen":
        import batchgen.integrations.lm_eval  # noqa: F401 (registers the model name)
    start = time.perf_counter()
    result = simple_evaluate(model=backend, model_args=f"pretrained={model},dtype={dtype}", tasks=tasks,
                             task_manager=TaskManager(include_path=str(root)), batch_size=batch_size, device="cpu",
                             log_samples=True)
    seconds = time.perf_counter() - start
    requests = sum(len(s["resps"]) for t in tasks for s in result["samples"][t])
    return {"backend": backend, "seconds": seconds, "requests": requests, "requests_per_s": requests / seconds,
            "results": {t: {k: v for k, v in result["results"][t].items() if "," in k} for t in tasks}}


def main(argv=None) -> list[dict]:
    from batchgen.models.smollm2 import ensure_smollm2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--docs", type=int, default=100, help="documents per task")
    parser.add_argument("--backends", default="hf,batchgen,vllm")
    parser.add_argument("--batch-size", type=int, default=16, help="the hf (and vllm) backends' batch size")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    model = args.model or str(ensure_smollm2())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp), args.docs)
        for backend in args.backends.split(","):
            if backend == "vllm":
                try:
                    import vllm  # noqa: F401
                except ImportError:
                    print("vllm: not installed, skipped", flush=True)
                    continue
            row = run(backend, model, args.dtype, tasks, Path(tmp), args.batch_size)
            row.update(processor=processor(), dtype=args.dtype, docs_per_task=args.docs)
            print(json.dumps(row), flush=True)
            rows.append(row)
    base = next((r for r in rows if r["backend"] == "hf"), None)
    for r in rows:
        if base is not None and r is not base:
            print(f"{r['backend']}: {r['seconds']:.1f} s, {base['seconds'] / r['seconds']:.2f}x hf's speed "
                  f"({base['seconds']:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
