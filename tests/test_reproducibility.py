"""Seeded requests give bit-identical tokens and logprobs however the engine runs them, in bf16 too.

What must not matter: the prefix cache, how many sequences a step holds, how prompts are chunked,
swap or recompute preemption, the order requests arrive in, the thread count; and, through
`batchgen run`, a SIGKILL and a resume, or 3 shards instead of 1. In float32 these used to differ by
~1e-6 and the texts matched by luck; in bf16 they differed after a few tokens.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch
from jobkit import batchgen_cmd, read_rows, write_job, write_jsonl
from test_job_real_engine import _env

from batchgen import LLM, SamplingParams

MAX_TOKENS = 24
# Options that change how the work is split into steps; none may change a seeded request's output.
# The tiny models' KV block is 2 layers x 2 kv heads x 16 tokens x 64; 24 blocks hold the longest
# request alone but not the batch, so those runs preempt.
TINY_BLOCK = 2 * 2 * 2 * 16 * 64
VARIANTS = {
    "no-prefix-cache": {"enable_prefix_caching": False},
    "max-num-seqs-2": {"max_num_seqs": 2},
    "max-num-seqs-4": {"max_num_seqs": 4},
    "max-num-seqs-64": {"max_num_seqs": 64},
    "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 8},
    "swap": {"kv_cache_memory": "block:24", "swap_space": "8MiB", "preemption_mode": "swap"},
    "recompute": {"kv_cache_memory": "block:24", "preemption_mode": "recompute"},
    "one-thread": {"num_threads": 1},
}


def tiny_prompts(vocab: int) -> list[list[int]]:
    """Ragged prompts, some sharing a 70-token prefix (prefix-cache hits when it is on)."""
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, vocab, (70,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 40, 17, 130, 33, 2, 64, 90)]
    prompts += [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    return prompts


def seeded(count: int, first_seed: int = 100, n: int = 2) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, seed=first_seed + i,
                           logprobs=0, ignore_eos=True) for i in range(count)]


def results(outputs) -> list:
    """Per request and sample: token ids, each token's logprobs, the cumulative logprob (exact floats)."""
    return [[(c.token_ids, c.logprobs, c.cumulative_logprob) for c in o.outputs] for o in outputs]


def first_difference(got: list, want: list) -> str:
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        for s, (gs, ws) in enumerate(zip(g, w, strict=True)):
            if gs != ws:
                at = next((i for i, (a, b) in enumerate(zip(gs[0], ws[0], strict=False)) if a != b), None)
                lp = next((i for i, (a, b) in enumerate(zip(gs[1], ws[1], strict=False)) if a != b), None)
                return (f"request {r} sample {s}: first token differing at {at}, first logprob at {lp}, "
                        f"cumulative logprob {gs[2]!r} vs {ws[2]!r}")
    return "equal"


def engine_options(variant: dict, block_bytes: int) -> dict:
    options = dict(variant)
    if str(options.get("kv_cache_memory", "")).startswith("block:"):
        options["kv_cache_memory"] = int(options["kv_cache_memory"].removeprefix("block:")) * block_bytes
    return options


def check_variants(model, dtype: str, prompts, params, block_bytes: int, base: dict, variants: dict) -> None:
    want = results(LLM(model, dtype=dtype, **base).generate(prompts, params, use_tqdm=False))
    assert len({tuple(s[0]) for r in want for s in r}) == sum(p.n for p in params), "each sample its own tokens"
    for name, variant in variants.items():
        llm = LLM(model, dtype=dtype, **{**base, **engine_options(variant, block_bytes)})
        got = results(llm.generate(prompts, params, use_tqdm=False))
        assert got == want, f"{dtype}, {name}: {first_difference(got, want)}"
        stats = llm.stats()
        if "preemption_mode" in variant:
            assert stats[f"{variant['preemption_mode']}_preemptions"] > 0, name
    # Another order, with other requests in front.
    llm = LLM(model, dtype=dtype, **base)
    noise = [p[::-1] for p in prompts[:3]]
    got = results(llm.generate(noise + prompts[::-1], seeded(3, 900) + params[::-1], use_tqdm=False))[3:][::-1]
    assert got == want, f"{dtype}, reversed order: {first_difference(got, want)}"


def check_all_variants(model, dtype: str) -> None:
    prompts = tiny_prompts(400)
    block_bytes = TINY_BLOCK * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    base = {"kv_cache_memory": "32MiB", "swap_space": "8MiB"}
    check_variants(model, dtype, prompts, seeded(len(prompts)), block_bytes, base, VARIANTS)
    # One sequence a step (n = 1: a request's samples must fit in one step together).
    check_variants(model, dtype, prompts, seeded(len(prompts), n=1), block_bytes, base,
                   {"max-num-seqs-1": {"max_num_seqs": 1}})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_seeded_outputs_do_not_depend_on_how_the_engine_runs_them(tiny_model_dirs, arch, dtype):
    check_all_variants(tiny_model_dirs[arch], dtype)


@pytest.mark.parametrize("arch", ["gemma2", "olmo2", "gpt_oss"])
def test_three_threads_split_no_token_differently(tmp_path, arch):
    """With a thread count that splits torch's elementwise loops unevenly, Gemma 2's gelu and final soft cap
    (native) and the transformers backend's activations (OLMo 2) rounded a token's last elements through torch's
    scalar path or not depending on the step (layers/elementwise.py); float32, where it showed. GPT-OSS: its
    experts' own gate (a sigmoid in transformers' code, not an activation module) and its attention sinks."""
    from model_zoo import build_zoo_model

    model = str(build_zoo_model(tmp_path / arch, arch))
    prompts = tiny_prompts(400)
    base = {"kv_cache_memory": "32MiB", "num_threads": 3}
    variants = {"max-num-seqs-1": {"max_num_seqs": 1}, "chunked": VARIANTS["chunked"]}
    check_variants(model, "float32", prompts, seeded(len(prompts), n=1), TINY_BLOCK * 4, base, variants)


def test_bf16_seeded_outputs_are_invariant_on_every_kernel_table(tiny_model_dirs, cpu_isas):
    """The lower tables too: the widened GEMMs (avx2, avx512), oneDNN on float32 copies (scalar), other vectors."""
    from batchgen import _C

    default = _C.cpu_isa()
    for isa in cpu_isas:
        if isa != default:
            _C.set_cpu_isa(isa)
            check_all_variants(tiny_model_dirs["llama"], "bfloat16")


@pytest.mark.slow
def test_smollm2_bf16_seeded_outputs_do_not_depend_on_how_the_engine_runs_them(smollm2_dir):
    from test_smollm2 import QUESTIONS

    llm = LLM(smollm2_dir, dtype="bfloat16")
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS[:8]]
    block_bytes = 30 * 2 * 3 * 16 * 64 * 2  # layers x (K, V) x kv heads x block x head_dim x bf16
    # 12 blocks a sequence at most here; 20 make the batch preempt.
    variants = {name: {**VARIANTS[name], **({"kv_cache_memory": "block:20"} if "preemption_mode" in VARIANTS[name]
                                           else {})}
                for name in ("no-prefix-cache", "max-num-seqs-2", "chunked", "swap", "recompute")}
    check_variants(smollm2_dir, "bfloat16", prompts, seeded(len(prompts)), block_bytes, {"swap_space": "64MiB"},
                   variants)


def _job(root, model, rows: int, out: str = "out", **engine):
    """The job file (rewritten in place when called again, e.g. with other engine capacities)."""
    root.mkdir(parents=True, exist_ok=True)
    records = [{"id": f"r{i:03d}", "prompt": f"tell me about number {i} " * (1 + i % 7)} for i in range(rows)]
    write_jsonl(root / "in.jsonl", records)
    return write_job(root / "job.yaml", {
        "model": {"path": str(model), "dtype": "bfloat16", "kv_cache_memory": "32MiB", "swap_space": "8MiB",
                  **engine},
        "input": {"paths": ["in.jsonl"], "id_column": "id", "prompt_column": "prompt"},
        "sampling": {"n": 2, "temperature": 0.8, "top_p": 0.95, "seed": 11, "max_tokens": MAX_TOKENS,
                     "ignore_eos": True, "logprobs": 0},
        "output": {"dir": out, "rows_per_part": 2, "fields": ["text", "token_ids", "logprobs"]},
        "max_in_flight": 8,
        "progress_interval": 3600,
    })


def _rows(out_dir) -> dict:
    rows = read_rows(out_dir)
    keyed = {(r["id"], r["sample_index"]): (r["token_ids"], r["logprobs"]) for r in rows}
    assert len(keyed) == len(rows), "an (id, sample) was written twice"
    return keyed


def _run(job, *args):
    proc = subprocess.run(batchgen_cmd("run", job, *args), env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_bf16_job_killed_resumed_and_sharded_equals_one_run(tmp_path, tiny_model_dirs, model, request):
    path, rows = (tiny_model_dirs["llama"], 60) if model == "tiny" else (request.getfixturevalue("smollm2_dir"), 24)
    _run(_job(tmp_path / "whole", path, rows))
    want = _rows(tmp_path / "whole" / "out")
    assert len(want) == 2 * rows

    killed = _job(tmp_path / "killed", path, rows)
    proc = subprocess.Popen(batchgen_cmd("run", killed), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    out_dir = tmp_path / "killed" / "out"
    deadline = time.time() + 300
    while time.time() < deadline and len(list(out_dir.glob("part-*.parquet"))) < 3 and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_rows(out_dir)) < len(want), "the kill came after the run had finished"
    # Resumed on a "smaller node": capacities may change between runs of a job.
    _run(_job(tmp_path / "killed", path, rows, max_num_seqs=4))
    assert _rows(out_dir) == want

    sharded = _job(tmp_path / "sharded", path, rows, max_num_seqs=16, max_num_batched_tokens=64)
    for i in range(3):
        _run(sharded, "--shard", f"{i}/3")
    assert _rows(tmp_path / "sharded" / "out") == want
