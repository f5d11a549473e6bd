#!/usr/bin/env python
"""Start-up: seconds from process start to the engine's first step, with the default KV cache
(kv_cache_memory and swap_space 4 GiB), on a tiny random Llama; and RSS after a small run.

    python scripts/bench_startup.py                       # this checkout, 3 fresh processes
    python scripts/bench_startup.py --tree ../old-commit  # another checkout (its _C built), for a before/after

Each run is a fresh Python process, so imports count. It prints the median of each stage: imports
(batchgen and torch), config (`plan_model`: the model's config through transformers, whose import
it pays), tokenizer, weights (`load_model`), KV (every `ops.allocate_kv_cache` call), the rest of
`LLM(...)` (scheduler, block tables), and the first step (one request added, one
`step()`); then a small run (40 requests x 16 tokens) and the RSS after `LLM(...)` and after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ["imports", "config", "tokenizer", "weights", "kv", "other_setup", "first_step", "to_first_step", "small_run"]


def child(model: str, t0: float) -> None:
    """One start-up, timed from t0 (the parent's clock just before it started this process)."""
    import psutil

    from batchgen import LLM, SamplingParams, ops
    from batchgen.engine import llm_engine

    t_imports = time.time()
    spent = dict.fromkeys(["config", "tokenizer", "weights", "kv"], 0.0)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    llm_engine.plan_model = timed("config", llm_engine.plan_model)  # transformers' config (and its imports)
    llm_engine.load_tokenizer = timed("tokenizer", llm_engine.load_tokenizer)
    llm_engine.load_model = timed("weights", llm_engine.load_model)
    ops.allocate_kv_cache = timed("kv", ops.allocate_kv_cache)
    llm = LLM(model)  # every engine option at its default: 4 GiB of KV cache, 4 GiB of swap space
    t_llm = time.time()
    rss_llm = psutil.Process().memory_info().rss
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.add_request("r0", list(range(10, 42)), params)
    llm.step()
    t_step = time.time()
    for i in range(1, 40):
        llm.add_request(f"r{i}", list(range(10 + i, 42 + 3 * i)), params)
    while llm.has_unfinished_requests():
        llm.step()
    t_run = time.time()
    print(json.dumps({
        "imports": t_imports - t0, **spent, "other_setup": t_llm - t_imports - sum(spent.values()),
        "first_step": t_step - t_llm, "to_first_step": t_step - t0, "small_run": t_run - t_step,
        "rss_after_init_mib": rss_llm / 2**20, "rss_after_run_mib": psutil.Process().memory_info().rss / 2**20,
    }))


def tiny_model(root: Path) -> str:
    """The test suite's tiny random Llama (2 layers, 2 KV heads of 64, float32), saved under root."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_model

    return str(build_tiny_model(root / "llama", "llama"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama in a temp dir)")
    parser.add_argument("--tree", default=str(REPO), help="the checkout whose batchgen is measured")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "T0"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], float(args.child[1]))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp))
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.tree))
        results = []
        for _ in range(args.runs):
            t0 = time.time()
            out = subprocess.run([sys.executable, __file__, "--child", model, repr(t0)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            results.append(json.loads(out.splitlines()[-1]))
    print(f"batchgen from {args.tree}, {args.runs} fresh processes, median (min-max):")
    for key in [*STAGES, "rss_after_init_mib", "rss_after_run_mib"]:
        values = [r[key] for r in results]
        unit = " MiB" if key.endswith("mib") else " s"
        print(f"  {key:20} {statistics.median(values):8.2f}{unit}  ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
