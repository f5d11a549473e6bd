#!/usr/bin/env python
"""The vocabulary side of a step at large vocabularies: the sampler's ops on the logits of a random-weight
lm_head with a tiny hidden size, so that reading [rows, vocab] logits is the work, at Llama 3's 128,256 and
Gemma 3's 262,144 tokens.

Each op's rate is the bytes of logits it must read (rows x vocab x element size) over its time, set against
the machine's read bandwidth: a sum over a float32 tensor far larger than the caches, timed in alternation
with the op so that both see the same machine (shared VMs drift). Every time is the fastest of several calls.
Logits of a few rows sit in the caches after the lm_head, as they do in the engine, so small batches can read
faster than memory allows; the share at 64 rows is the one to read as "at bandwidth".

    python scripts/bench_vocab.py                        # both vocabularies, bf16 and fp32 logits
    python scripts/bench_vocab.py --quick --json /tmp/vocab.json
    python scripts/bench_vocab.py --engine               # the whole engine on 128k- and 262k-vocab models
    python scripts/bench_vocab.py --device cuda --vocabs 128256 --dtype bf16 --rows 64,256   # the ops on a GPU

On a GPU the ops are the sampler's torch paths (no CUDA kernels of their own), the read probe a sum over GPU
memory, and the stable sort that ops.top_k replaced is timed beside it.

`--engine` runs LLM.generate on a random-weight model of Llama 3's shape family with a tiny hidden size (2 layers,
hidden 256, GQA), at each vocabulary, over rows that mix greedy, top-p, penalties and logprobs: how much of the
step the vocabulary side takes (lm_head, sampler) and the sampler's rate as a share of the read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import time_interleaved  # noqa: E402
from machine import processor  # noqa: E402

from batchgen import _C, ops  # noqa: E402
from batchgen.layers.sampler import SamplingRow, sample  # noqa: E402
from batchgen.ops import reference  # noqa: E402
from batchgen.ops.host_memory import retain_freed_memory  # noqa: E402
from batchgen.sampling_params import SamplingParams  # noqa: E402

VOCABS = {"llama3": 128256, "gemma3": 262144}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
READ_PROBE_BYTES = 512 << 20


@dataclass
class Result:
    vocab: int
    dtype: str
    rows: int
    op: str
    ms: float
    gb_s: float  # logits bytes read / time
    read_gb_s: float  # the read probe, timed with the op
    share: float  # gb_s / read_gb_s


def random_logits(rows: int, vocab: int, hidden: int, dtype: torch.dtype, seed: int,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """A random-weight lm_head's logits of random hidden states (std ~1), with 24 tokens a row raised 14-20
    above them as a language model's likely next tokens: a top-p 0.95 nucleus of a few tokens, as real
    models mostly give (a random model alone gives nuclei of thousands, which only measures the sort)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype)
    hidden_states = torch.randn(rows, hidden, generator=gen).to(dtype)
    logits = torch.nn.functional.linear(hidden_states, weight)
    for r in range(rows):
        likely = torch.randperm(vocab, generator=gen)[:24]
        logits[r, likely] += (14 + 0.25 * torch.arange(24)).to(dtype)
    return logits.to(device)


def sampler_rows(rows: int, vocab: int, params: SamplingParams, outputs: int, allowed: bool) -> list[SamplingRow]:
    """Rows of `params`, each with `outputs` generated tokens (for the penalties) and a grammar allowing a
    random half of the vocabulary when `allowed`."""
    gen = torch.Generator().manual_seed(1)
    result = []
    for r in range(rows):
        tokens = torch.randint(vocab, (64 + outputs,), generator=gen).tolist()
        mask = torch.randint(-(2**31), 2**31 - 1, ((vocab + 31) // 32,), generator=gen, dtype=torch.int32)
        result.append(SamplingRow.of(params, seed=r, sample_index=0, prompt_token_ids=tokens[:64],
                                     output_token_ids=tokens[64:], banned_token_ids=[],
                                     allowed=mask if allowed else None))
    return result


def op_table(logits: torch.Tensor) -> dict[str, Callable[[], object]]:
    rows, vocab = logits.shape
    per_row = lambda value, dtype=torch.float32: torch.full((rows,), value, dtype=dtype, device=logits.device)  # noqa: E731
    u = torch.rand(rows, generator=torch.Generator().manual_seed(2)).to(logits.device)
    plain = (per_row(1.0), per_row(0, torch.int64), per_row(1.0), per_row(0.0), u)
    filtered = (per_row(0.8), per_row(50, torch.int64), per_row(0.95), per_row(0.05), u)
    greedy = SamplingParams(temperature=0)
    random_p = SamplingParams(temperature=0.8, top_p=0.95)
    penalized = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5,
                               frequency_penalty=0.5)
    cases = {
        "argmax_logsumexp": lambda: ops.argmax_logsumexp(logits),
        "top_k 20": lambda: ops.top_k(logits, 20),
        "top_k 20 by keys (GPU)": lambda: ops.top_k_by_keys(logits, 20),
        "top_k 20 sorted (old GPU)": lambda: reference.top_k(logits, 20),
        "torch.topk 20 (peer)": lambda: logits.topk(20, dim=-1),
        "sample_tokens plain": lambda: ops.sample_tokens(logits, *plain),
        "sample_tokens top-k/p/min-p": lambda: ops.sample_tokens(logits, *filtered),
        "sample() greedy": (logits, sampler_rows(rows, vocab, greedy, 0, False)),
        "sample() top-p": (logits, sampler_rows(rows, vocab, random_p, 0, False)),
        "sample() penalties": (logits, sampler_rows(rows, vocab, penalized, 256, False)),
        "sample() logprobs=5": (logits, sampler_rows(rows, vocab, SamplingParams(temperature=0, logprobs=5), 0,
                                                     False)),
        "sample() grammar": (logits, sampler_rows(rows, vocab, random_p, 0, True)),
    }
    return {name: case if callable(case) else (lambda case=case: sample(*case)) for name, case in cases.items()}


def bench(vocab: int, dtype_name: str, rows: int, hidden: int, min_time: float, probe: torch.Tensor) -> list[Result]:
    logits = random_logits(rows, vocab, hidden, DTYPES[dtype_name], seed=rows, device=probe.device)
    nbytes = logits.numel() * logits.element_size()
    read = lambda: probe.sum()  # noqa: E731
    results = []
    for name, fn in op_table(logits).items():
        op_s, read_s = time_interleaved([fn, read], probe.device, min_time)
        read_gb_s = probe.numel() * 4 / read_s / 1e9
        gb_s = nbytes / op_s / 1e9
        results.append(Result(vocab, dtype_name, rows, name, op_s * 1e3, gb_s, read_gb_s, gb_s / read_gb_s))
        print(f"{vocab:>7} {dtype_name} {rows:>3} rows  {name:<28} {op_s * 1e3:8.3f} ms  {gb_s:7.2f} GB/s  "
              f"{100 * gb_s / read_gb_s:5.1f}% of {read_gb_s:.1f} GB/s", flush=True)
    return results


@dataclass
class EngineResult:
    vocab: int
    dtype: str
    requests: int
    output_tokens: int
    seconds: float
    logits_s: float  # lm_head (compute_logits)
    sample_s: float  # the sampler over the step's logits
    sampled_rows: int
    logits_bytes: int  # bytes of the logits the sampler read
    read_gb_s: float

    @property
    def sample_share_of_read(self) -> float:
        return self.logits_bytes / self.sample_s / 1e9 / self.read_gb_s


def vocab_model(root: Path, vocab: int) -> Path:
    """A random bf16 Llama with `vocab` tokens and a tied head, 2 layers of hidden 256: the vocabulary dominates.
    The embedding is drawn wide enough (std 0.25) that the logits of the last hidden state spread over several
    units, like a trained model's, rather than the near-uniform ones of the default init."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                            tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    torch.manual_seed(vocab)
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.25)
    path = root / f"llama-{vocab}"
    model.save_pretrained(path)
    return path


def engine_params(count: int, max_tokens: int) -> list[SamplingParams]:
    """A quarter each of greedy, top-p, top-p with the three penalties, and greedy with 5 top logprobs."""
    kinds = [dict(temperature=0), dict(temperature=0.8, top_p=0.95),
             dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
             dict(temperature=0, logprobs=5)]
    return [SamplingParams(**kinds[i % 4], max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(count)]


def engine_run(vocab: int, dtype: str, threads: int, count: int, max_tokens: int, probe: torch.Tensor) -> EngineResult:
    from batchgen import LLM
    from batchgen.engine import llm_engine

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=str(vocab_model(Path(tmp), vocab)), dtype=str(DTYPES[dtype]).removeprefix("torch."),
                  skip_tokenizer_init=True, seed=0, num_threads=threads, kv_cache_memory=256 << 20,
                  max_num_seqs=count)
    gen = torch.Generator().manual_seed(vocab)
    prompts = [torch.randint(2, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(32, 129, (count,), generator=gen)]
    spent, read = {"logits": 0.0, "sample": 0.0}, {"rows": 0, "bytes": 0}
    model, sample_fn = llm.engine.runner.model, llm_engine.sample

    def timed_logits(hidden, _inner=model.compute_logits):
        start = time.perf_counter()
        out = _inner(hidden)
        spent["logits"] += time.perf_counter() - start
        return out

    def timed_sample(logits, rows):
        start = time.perf_counter()
        out = sample_fn(logits, rows)
        spent["sample"] += time.perf_counter() - start
        read["rows"] += logits.shape[0]
        read["bytes"] += logits.numel() * logits.element_size()
        return out

    model.compute_logits, llm_engine.sample = timed_logits, timed_sample
    try:
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        spent.update(logits=0.0, sample=0.0)
        read.update(rows=0, bytes=0)
        start = time.perf_counter()
        outs = llm.generate(prompts, engine_params(count, max_tokens), use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm_engine.sample = sample_fn
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == count * max_tokens, "every row runs to max_tokens (ignore_eos)"
    (read_s,) = time_interleaved([lambda: probe.sum()], torch.device("cpu"), 0.3)
    result = EngineResult(vocab, dtype, count, tokens, seconds, spent["logits"], spent["sample"], read["rows"],
                          read["bytes"], probe.numel() * 4 / read_s / 1e9)
    print(f"engine {vocab:>7} {dtype}: {count} rows x {max_tokens} tokens in {seconds:.2f} s "
          f"({tokens / seconds:.0f} out tok/s); lm_head {spent['logits'] / seconds:.0%} of the run, sampler "
          f"{spent['sample'] / seconds:.0%} ({read['rows']} rows, {read['bytes'] / spent['sample'] / 1e9:.1f} GB/s of "
          f"logits = {100 * result.sample_share_of_read:.0f}% of {result.read_gb_s:.1f} GB/s read)", flush=True)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", default=",".join(VOCABS), help=f"comma list of {sorted(VOCABS)} or sizes")
    parser.add_argument("--dtype", default="bf16,fp32", help="logits dtypes: bf16, fp32")
    parser.add_argument("--rows", default="1,16,64", help="comma list of batch rows")
    parser.add_argument("--hidden", type=int, default=256, help="the random lm_head's hidden size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the ops only, not --engine)")
    parser.add_argument("--quick", action="store_true", help="short timings, one batch size")
    parser.add_argument("--engine", action="store_true", help="run the whole engine on random models instead")
    parser.add_argument("--requests", type=int, default=64, help="--engine: rows (a quarter per sampling kind)")
    parser.add_argument("--max-tokens", type=int, default=64, help="--engine: tokens each row generates")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args(argv)
    args.vocabs = [VOCABS.get(v.strip(), None) or int(v) for v in args.vocabs.split(",")]
    args.dtypes = [d.strip() for d in args.dtype.split(",")]
    args.rows = [16] if args.quick else [int(r) for r in args.rows.split(",")]
    return args


def main(argv=None) -> list[Result] | list[EngineResult]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # the engine's allocator settings (ops/host_memory.py): temporaries reused, not remapped
    min_time = 0.05 if args.quick else 0.3
    device = torch.device(args.device)
    probe = torch.ones(READ_PROBE_BYTES // 4, device=device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{processor()}, {args.threads} threads"
    print(f"{where}, kernels {_C.cpu_isa()}, torch {torch.__version__}")
    if args.engine:
        if device.type != "cpu":
            sys.exit("bench_vocab.py: --engine runs on a CPU only")
        count, max_tokens = (8, 8) if args.quick else (args.requests, args.max_tokens)
        results = [engine_run(vocab, dtype, args.threads, count, max_tokens, probe)
                   for vocab in args.vocabs for dtype in args.dtypes]
    else:
        results = [r for vocab in args.vocabs for dtype in args.dtypes for rows in args.rows
                   for r in bench(vocab, dtype, rows, args.hidden, min_time, probe)]
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return results


if __name__ == "__main__":
    with torch.inference_mode():
        main()
