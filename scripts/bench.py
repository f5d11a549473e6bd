#!/usr/bin/env python
"""Throughput benchmark: batchgen against transformers on the same workloads, and against the machine's limit.

Engines: batchgen (`LLM`), transformers `generate` on static batches (left padding, rows grouped by max_tokens then
prompt length, the best of several batch sizes), and transformers continuous batching (the manager behind
`generate_batch`, fed per-request max_tokens). Workloads are chat prompts built deterministically from a seed:
  mixed     prompts of 20-400 tokens, max_tokens from {16..256}, greedy, ignore_eos
  parallel  prompts of ~400 tokens, n=8 samples of 64 tokens (temperature 0.8, top_p 0.95)
  pressure  mixed with a KV cache of a quarter of mixed's peak need (must preempt; peers: mixed's numbers)
  beam      prompts of ~400 tokens, beam search of width 4 for 64 tokens (ignore_eos; transformers:
            generate(num_beams=4) with min_new_tokens, so both run every step)
  json      mixed's prompts, each output constrained to one shared JSON schema (structured outputs), then
            json-free: the same prompts unconstrained, each with max_tokens = its constrained output's length,
            so both generate the same tokens; the ratio of their output tokens/s is the constraint's cost
  lora      mixed's requests round-robin over 4 random rank-16 PEFT adapters on all seven projections
            (enable_lora, max_loras=4), against lora-base: the same requests on the base model; the two run
            alternately twice and the ratio of their tokens/s is LoRA's cost (issue 34's target: >= 0.8x)
  int8      mixed's requests with int8 projections (quantization="int8"), run right after mixed: the ratio of
            their tokens/s, and int8's quality against the same dtype: greedy agreement over the first 64 tokens
            of mixed's first 32 prompts, the perplexity of tests/data/pride_and_prejudice_ch1.txt (budget: within
            2%); scripts/bench_int8.py measures more (rounds, W8A8 checkpoints, a 1B shape)
  caption   N images x 1 prompt on a vision-language model (--vision-model; default a random LLaVA of SmolLM2's
            decoder under a CLIP tower): images/s and tokens/s against transformers' batched generate on the same
            preprocessed inputs, and the vision encoder's share of each run (scripts/bench_caption.py)
  vocab     not chat: random Llama models of hidden 256 at Llama 3's 128,256 and Gemma 3's 262,144 tokens, so that
            the lm_head and the sampler are most of a step (64 rows of greedy, top-p, penalties and logprobs, 64
            tokens each): the sampler's rate of reading logits as a share of the measured read bandwidth
            (scripts/bench_vocab.py --engine; bench_vocab.py alone times each sampler op)
The limit: GEMM GFLOP/s (the faster of F.linear and the packed GEMM) on the model's own layer shapes, turned
into a tokens/s ceiling, set against batchgen's total tokens/s on mixed and its decode-only steps at batch 64-256.
Also a bound that adds what the matmul ceiling leaves out: the K/V bytes mixed's decode steps must read, at the
machine's read bandwidth measured in the same run; and the rate at which batchgen's decode attention read them (its
own seconds, from the layers' op calls or the decoder stack's clocks) as a share of that bandwidth. And a bound that
counts the weights too: every step reads them at least once, so where that read takes longer than the step's
GEMMs (at the ceiling's rates, over the tokens the engine fed it) the difference is added. Each batchgen
run faults its (lazily mapped) KV cache in before its clock starts, as vLLM's engine zero-fills its cache at
start-up.

    .venv/bin/python scripts/bench.py --quick --dtype bf16            # smoke test
    .venv/bin/python scripts/bench.py --dtype bf16 --json /tmp/bench.json
    .venv/bin/python scripts/bench.py --dtype bf16 --skip-peers --workloads mixed,int8,vocab   # issue 36's report
    .venv/bin/python scripts/bench.py --dtype fp32 --workloads caption --vision-model ~/models/llava-1.5-7b-hf
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

# batchgen from this checkout, installed or not, but after PYTHONPATH's entries: a build copied elsewhere
# and named there is the one measured, as in A/B runs of two builds.
_NAMED = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
sys.path.insert(max((i + 1 for i, p in enumerate(sys.path) if p and os.path.abspath(p) in _NAMED), default=0),
                str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other scripts: machine.py, bench_vocab.py
from machine import processor  # noqa: E402

BLOCK = 16
LORA_RANK = 16
TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "pride_and_prejudice_ch1.txt"
AGREE_TOKENS = 64
PERPLEXITY_BUDGET = 0.02  # int8's perplexity within 2% of its dtype's (issue 36)
VOCAB_SIZES = (128256, 262144)  # the vocab workload's: Llama 3's and Gemma 3's
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
SETTINGS = {  # full and --quick sizes
    False: dict(mixed=dict(count=200, lengths=(20, 400), max_tokens=(16, 32, 64, 128, 256)),
                parallel=dict(count=32, lengths=(390, 410), max_tokens=(64,), n=8),
                beam=dict(count=32, lengths=(390, 410), max_tokens=(64,), beam_width=4),
                decode=dict(count=256, lengths=(32, 32), max_tokens=(16, 32, 48, 64)),
                batch_sizes=(8, 16, 32, 64), gemm_ms=(64, 128, 256), gemm_time=0.3, agree_prompts=32,
                vocab=dict(sizes=VOCAB_SIZES, requests=64, max_tokens=64),
                caption=dict(count=64, max_tokens=32, batch_size=8)),
    True: dict(mixed=dict(count=16, lengths=(20, 80), max_tokens=(4, 8, 16)),
               parallel=dict(count=4, lengths=(60, 70), max_tokens=(8,), n=8),
               beam=dict(count=4, lengths=(60, 70), max_tokens=(8,), beam_width=4),
               decode=dict(count=64, lengths=(16, 16), max_tokens=(4, 8)),
               batch_sizes=(8,), gemm_ms=(64,), gemm_time=0.02, agree_prompts=2,
               vocab=dict(sizes=(4096,), requests=8, max_tokens=8),
               caption=dict(count=4, max_tokens=4, batch_size=4)),
}

# --- workloads ---------------------------------------------------------------------------------------------------
TOPICS = ["sourdough bread", "a binary search tree", "the French revolution", "compound interest", "tidal energy",
          "learning the violin", "container shipping", "photosynthesis", "a job interview", "the rules of chess",
          "training for a marathon", "database indexes", "composting at home", "black holes", "writing a cover letter",
          "the Roman aqueducts", "a monthly budget", "machine translation", "growing tomatoes", "jet lag"]
OPENERS = ["Can you explain {t} to me?", "I need help with {t}.", "Write a short note about {t}.",
           "What are the common mistakes with {t}?", "Summarise what matters about {t}.",
           "How should I start with {t}?"]
SUBJECTS = ["I", "My team", "Our teacher", "A friend of mine", "My manager", "The book I read", "Last week we"]
VERBS = ["tried to understand", "wrote about", "kept asking about", "read a long article on", "got confused by",
         "spent an afternoon on", "wanted a clear example of", "argued about"]
ENDINGS = ["and it did not work.", "so please keep it simple.", "but the steps were unclear.",
           "and I would like a checklist.", "so give me concrete examples.", "and we need it by Friday."]


# The json workload's schema: a record a dataset job might ask for (objects, strings, enums, bounds, arrays).
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "difficulty": {"enum": ["easy", "medium", "hard"]},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
        "steps": {"type": "array", "items": {"type": "object", "properties": {
            "action": {"type": "string", "maxLength": 120}, "optional": {"type": "boolean"}},
            "required": ["action", "optional"]}, "minItems": 1, "maxItems": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    },
    "required": ["title", "difficulty", "minutes", "steps", "tags"],
}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    structured_outputs: dict | None = None  # every request's constraint (SamplingParams.structured_outputs)
    beam_width: int = 0  # > 0: a beam search (greedy, n unused)
    adapters: int = 0  # > 0: the requests round-robin over this many random rank-LORA_RANK LoRA adapters

    @property
    def width(self) -> int:
        """Sequences per request: its samples or its beams."""
        return self.beam_width or self.n

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return self.width * sum(self.max_tokens)

    def kv_blocks(self) -> list[int]:
        """Blocks each request holds when it finishes: the prompt's full blocks shared, the rest per sample
        (a bound for beams, which share part of their outputs too)."""
        return [len(p) // BLOCK + self.width * math.ceil((len(p) % BLOCK + m) / BLOCK)
                for p, m in zip(self.prompts, self.max_tokens, strict=True)]

    def decode_context_sum(self) -> int:
        """Keys all decode steps attend to: a request's m - 1 decode steps see p + 1 .. p + m - 1 keys per sample."""
        return sum(self.n * ((m - 1) * len(p) + m * (m - 1) // 2)
                   for p, m in zip(self.prompts, self.max_tokens, strict=True))

    def context_sum(self) -> int:
        """Sum over all fed tokens of the positions each attends to (causal)."""
        totals = [len(p) + m for p, m in zip(self.prompts, self.max_tokens, strict=True)]
        return sum(self.n * t * (t + 1) // 2 for t in totals)


def user_text(rng: random.Random, min_words: int) -> str:
    parts = [rng.choice(OPENERS).format(t=rng.choice(TOPICS))]
    while sum(len(p.split()) for p in parts) < min_words:
        parts.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(TOPICS)} {rng.choice(ENDINGS)}")
    return " ".join(parts)


def chat_frames(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(head, tail) ids around a user message: with the template's default system prompt, then an empty one."""
    frames = []
    for system in ([], [{"role": "system", "content": ""}]):
        messages = system + [{"role": "user", "content": "@@USER@@"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = text.split("@@USER@@")
        frames.append(tuple(tokenizer.encode(part, add_special_tokens=False) for part in (head, tail)))
    return frames


def chat_prompt(tokenizer, frames, rng: random.Random, length: int) -> list[int]:
    """A chat prompt of exactly `length` token ids, in the first frame that leaves >= 4 tokens of content."""
    head, tail = next((f for f in frames if len(f[0]) + len(f[1]) + 4 <= length), min(frames, key=lambda f: len(f[0])))
    room = length - len(head) - len(tail)
    content = tokenizer.encode(user_text(rng, room), add_special_tokens=False)[:room]
    return (head + content + tail)[-length:]


def make_workload(name: str, tokenizer, seed: int, count: int, lengths: tuple[int, int], max_tokens: tuple[int, ...],
                  n: int = 1, beam_width: int = 0) -> Workload:
    rng = random.Random(f"{name}-{seed}")
    frames = chat_frames(tokenizer)
    prompts = [chat_prompt(tokenizer, frames, rng, rng.randint(*lengths)) for _ in range(count)]
    budget = [rng.choice(max_tokens) for _ in range(count)]
    sampled = dict(temperature=0.8, top_p=0.95) if n > 1 else {}
    return Workload(name, prompts, budget, n, beam_width=beam_width, **sampled)


# --- measuring ---------------------------------------------------------------------------------------------------
class PeakRSS:
    """Samples this process's resident memory in a thread; `peak_mb` and `start_mb` once the block ends."""

    def __init__(self, interval: float = 0.05):
        self.proc, self.interval, self._stop = psutil.Process(), interval, threading.Event()

    def _rss(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_mb = max(self.peak_mb, self._rss())

    def __enter__(self) -> PeakRSS:
        self.start_mb = self.peak_mb = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self._rss())


@dataclass
class Run:
    workload: str
    engine: str
    dtype: str
    seconds: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    peak_rss_mb: float
    start_rss_mb: float
    extra: dict = field(default_factory=dict)

    def rates(self) -> dict:
        s = self.seconds
        return dict(req_s=self.requests / s, out_tok_s=self.output_tokens / s,
                    total_tok_s=(self.prompt_tokens + self.output_tokens) / s)

    def record(self) -> dict:
        return {**asdict(self), **self.rates()}


class StepProfile:
    """Wraps the engine's stages with timers and remembers each step's schedule (to find decode-only steps)."""

    def __init__(self, llm):
        self.totals: dict[str, float] = defaultdict(float)
        self.last = None
        self._wrapped: list[tuple] = []  # (object, name, what it held), for finish to put back
        self.engine = engine = llm.engine
        self._wrap(engine.scheduler, "schedule", "schedule", keep=True)
        self._wrap(engine.runner, "execute", "execute")
        self._wrap(engine.runner.model, "forward", "forward")
        self._wrap(engine.runner.model, "compute_logits", "logits")
        for layer in engine.runner.model.attention_layers():
            self._wrap(layer, "forward", "attention")
        # The layers in one C++ call (ops.DecoderStack) time their own ops.
        self.stack = getattr(engine.runner.model, "decoder_stack", None)
        self.stack_start = self.stack.op_seconds() if self.stack is not None else {}
        self.decode_attention = 0.0  # seconds, set by finish
        self.stack_seconds: dict[str, float] = {}  # the stack's own clocks per op over the run, set by finish

    def _wrap(self, obj, name: str, key: str, keep: bool = False) -> None:
        fn = getattr(obj, name)
        self._wrapped.append((obj, name, vars(obj).get(name)))  # None: the attribute was its class's

        def timed(*args, **kwargs):
            t = time.perf_counter()
            result = fn(*args, **kwargs)
            self.totals[key] += time.perf_counter() - t
            if keep:
                self.last = result
            return result

        setattr(obj, name, timed)

    def time_grammar(self) -> None:
        """Times the structured-output work: the bitmask fill of a step's constrained rows, the sampler (which
        applies the masks) and the matchers' token accepts."""
        from batchgen.engine import llm_engine
        from batchgen.structured import backend

        self._wrap(self.engine, "_fill_grammar_masks", "grammar_fill")
        self._wrap(llm_engine, "sample", "sample")
        self._wrap(backend.RequestGrammar, "accept", "grammar_accept")

    def time_decode_attention(self) -> None:
        """Times decode attention on its own where the Python layers call it (the stack's has its own clock)."""
        from batchgen import ops

        self._wrap(ops, "paged_attention_decode", "decode_attention")

    def finish(self) -> None:
        """At the run's end: puts back everything it wrapped (a module's function or a class's method would
        otherwise stay timed into this profile in the next run of the process), adds the stack's attention (with
        its cache writes, as PagedAttention.forward has them) since __init__ and sums decode attention's seconds
        (the layers' and the stack's)."""
        for obj, name, held in reversed(self._wrapped):
            if held is None:
                delattr(obj, name)  # it was the class's: the instance's own attribute goes
            else:
                setattr(obj, name, held)
        self._wrapped.clear()
        self.decode_attention = self.totals.pop("decode_attention", 0.0)
        if self.stack is not None:
            now = self.stack.op_seconds()
            self.totals["attention"] += sum(now[k] - self.stack_start[k]
                                            for k in ("cache_write", "decode_attention", "prefill_attention"))
            self.decode_attention += now["decode_attention"] - self.stack_start["decode_attention"]
            self.stack_seconds = {k: now[k] - self.stack_start[k] for k in now if now[k] > self.stack_start[k]}

    def is_decode_only(self) -> bool:
        out = self.last
        moves = out.blocks_to_swap_in or out.blocks_to_swap_out or out.blocks_to_copy
        return bool(out.scheduled) and not moves and all(s.num_new_tokens == 1 for s in out.scheduled)


def step_work(scheduled: list) -> tuple[int, int, int]:
    """A step's tokens fed, rows sampled and (query, key) pairs its attention scores (causal)."""
    pairs = sum(s.num_new_tokens * s.start + s.num_new_tokens * (s.num_new_tokens + 1) // 2 for s in scheduled)
    return sum(s.num_new_tokens for s in scheduled), sum(s.samples for s in scheduled), pairs


def isolated(isolate: bool, fn, *args):
    """fn(*args) in a fresh (spawned) process, so that a run's peak RSS is its own and no run inherits another's
    memory or warm caches; in this process when `isolate` is false."""
    if not isolate:
        return fn(*args)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def quality(model: str, quantization: str | None, threads: int, prompts: list[list[int]],
            dtype: str = "bfloat16", kv_cache_dtype: str = "auto", model_impl: str = "native") -> dict:
    """Greedy continuations of `prompts` and the perplexity of TEXT (as much as the model's context holds) under
    one configuration."""
    from batchgen import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, quantization=quantization, num_threads=threads, model_impl=model_impl,
              kv_cache_memory="2GiB", max_num_seqs=64, kv_cache_dtype=kv_cache_dtype)
    greedy = SamplingParams(temperature=0, max_tokens=AGREE_TOKENS, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    text_ids = llm.tokenizer(TEXT.read_text())["input_ids"][: llm.max_model_len - 1]  # all of it for real models
    scored = llm.generate([text_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [entry[token] for entry, token in zip(scored.prompt_logprobs[1:], text_ids[1:], strict=True)]
    return dict(continuations=continuations, perplexity=math.exp(-sum(logprobs) / len(logprobs)),
                text_tokens=len(text_ids))


def agreement(want: list[list[int]], got: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
                for w, g in zip(want, got, strict=True)]
    return dict(token_share=sum(prefixes) / sum(map(len, want)),
                identical_share=sum(p == len(w) for p, w in zip(prefixes, want, strict=True)) / len(want),
                mean_common_prefix=statistics.mean(prefixes))


# --- engines -----------------------------------------------------------------------------------------------------
def sampling_params(wl: Workload):
    from batchgen import BeamSearchParams, SamplingParams

    if wl.beam_width:
        return [BeamSearchParams(beam_width=wl.beam_width, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    return [SamplingParams(n=wl.n, temperature=wl.temperature, top_p=wl.top_p, max_tokens=m, ignore_eos=True, seed=i,
                           structured_outputs=wl.structured_outputs) for i, m in enumerate(wl.max_tokens)]


def make_lora_adapters(model: str, root: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT LoRA adapters of rank `rank` with random weights on every linear of `model`, saved under root."""
    import peft
    import transformers as tf

    paths = []
    for i in range(count):
        base = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        torch.manual_seed(i)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        peft.get_peft_model(base, config).save_pretrained(root / f"a{i}")
        paths.append(root / f"a{i}")
    return paths


def run_batchgen(model: str, wl: Workload, dtype: str, threads: int, kv_blocks: int, swap_blocks: int,
                 bytes_per_block: int, model_impl: str = "native", quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> Run:
    """The workload through add_request/step (what LLM.generate does), timing stages and decode-only steps."""
    import tempfile

    from batchgen import LLM, LoRARequest, SamplingParams

    lora = dict(enable_lora=True, max_loras=wl.adapters, max_lora_rank=LORA_RANK) if wl.adapters else {}
    llm = LLM(model=model, dtype=dtype, kv_cache_memory=kv_blocks * bytes_per_block, block_size=BLOCK,
              swap_space=swap_blocks * bytes_per_block, max_num_seqs=256, max_num_batched_tokens=2048,
              enable_prefix_caching=True, preemption_mode="swap", seed=0, num_threads=threads, model_impl=model_impl,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype, **lora)
    adapters: list[LoRARequest | None] = [None]
    with tempfile.TemporaryDirectory() as tmp:
        if wl.adapters:
            paths = make_lora_adapters(model, Path(tmp), wl.adapters, LORA_RANK)
            adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        # Warm-up, which also reads every adapter (before the clock starts, as the base model's weights are).
        llm.generate([list(range(10, 26))] * len(adapters), SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=adapters)
    # The KV cache faulted in before the clock too, as vLLM's is (zero-filled when its engine starts): batchgen's
    # is lazy so that it starts in seconds, and its first touch (~1.8 s of mixed's 23 s on a 2-core VM,
    # scripts/PERF.md) is start-up, paid once per process, not throughput. The RSS column includes the cache.
    for key_cache, value_cache in llm.engine.runner.device_caches:
        key_cache.zero_()
        value_cache.zero_()
    profile, utilisation, decode_steps, finished, schedules = StepProfile(llm), [], [], [], []
    profile.time_decode_attention()
    if wl.structured_outputs is not None:
        profile.time_grammar()
    with PeakRSS() as rss:
        start = time.perf_counter()
        for i, (prompt, params) in enumerate(zip(wl.prompts, sampling_params(wl), strict=True)):
            llm.add_request(f"{wl.name}-{i}", prompt, params, lora_request=adapters[i % len(adapters)])
        while llm.has_unfinished_requests():
            t = time.perf_counter()
            finished += llm.step()
            schedules.append(profile.last.scheduled)
            if profile.is_decode_only():
                decode_steps.append((len(profile.last.scheduled), time.perf_counter() - t))
            s = llm.engine.scheduler.stats()
            if s.used_device_blocks:
                utilisation.append(s.slot_utilization)
        seconds = time.perf_counter() - start
    profile.finish()
    if failed := [r for r in finished if r.error]:  # the engine fails a request alone rather than the run
        raise SystemExit(f"{wl.name}: {len(failed)} of {len(finished)} requests failed, the first: {failed[0].error}")
    stats = llm.stats()
    outputs = sum(len(c.token_ids) for r in finished for c in r.outputs)
    extra = dict(slot_utilization=sum(utilisation) / max(1, len(utilisation)), peak_blocks=stats["peak_device_blocks"],
                 kv_blocks=kv_blocks, preemptions=stats["num_preemptions"], swap_preemptions=stats["swap_preemptions"],
                 prefix_cache_hits=stats["prefix_cache_hits"], prefix_cache_queries=stats["prefix_cache_queries"],
                 stage_seconds=stage_breakdown({"step": seconds, **profile.totals}), decode_steps=decode_steps,
                 kv_cache=str(llm.engine.runner.device_caches[0][0].dtype), decode_attention_s=profile.decode_attention,
                 stack_seconds=profile.stack_seconds, steps=[step_work(scheduled) for scheduled in schedules])
    if wl.structured_outputs is not None:
        order = {f"{wl.name}-{i}": i for i in range(len(wl.prompts))}
        in_order = sorted(finished, key=lambda r: order[r.request_id])
        extra.update(grammar_compiles=stats["grammar_compiles"],
                     output_lengths=[len(r.outputs[0].token_ids) for r in in_order],
                     valid=sum(bool(c.valid) for r in finished for c in r.outputs),
                     finished_by_grammar=sum(c.finish_reason == "stop" for r in finished for c in r.outputs))
    del llm, profile
    gc.collect()
    engine = "batchgen" if model_impl == "native" else f"batchgen-{model_impl}"
    engine += f"+{quantization}" if quantization else ""
    return Run(wl.name, engine, dtype, seconds, len(wl.prompts), wl.prompt_tokens, outputs,
               rss.peak_mb, rss.start_mb, extra)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def sampling_kwargs(wl: Workload) -> dict:
    if wl.beam_width:
        return dict(do_sample=False, num_beams=wl.beam_width)
    if wl.temperature == 0:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=wl.temperature, top_p=wl.top_p, top_k=0)


@torch.inference_mode()
def load_hf(model_path: str, dtype: str, threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0
    model.generate(input_ids=torch.arange(10, 26)[None], max_new_tokens=2, do_sample=False, pad_token_id=pad_id)
    return model, pad_id


@torch.inference_mode()
def run_hf_static(model_path: str, wl: Workload, dtype: str, threads: int, batch_size: int, count: int) -> Run:
    """transformers generate on static batches of `batch_size` rows (batch_size // n prompts), left padded, grouped
    by (max_tokens, prompt length); each batch runs to its largest max_tokens, only asked-for tokens count."""
    model, pad_id = load_hf(model_path, dtype, threads)
    order = sorted(range(count), key=lambda i: (wl.max_tokens[i], len(wl.prompts[i])))
    per_batch, computed = max(1, batch_size // wl.width), 0
    with PeakRSS() as rss:
        start = time.perf_counter()
        for b in range(0, count, per_batch):
            chunk = order[b : b + per_batch]
            ids, mask = left_pad([wl.prompts[i] for i in chunk], pad_id)
            steps = max(wl.max_tokens[i] for i in chunk)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                 num_return_sequences=wl.width, pad_token_id=pad_id, **sampling_kwargs(wl))
            computed += out.numel()
        seconds = time.perf_counter() - start
    useful = sum(wl.width * (len(p) + m) for p, m in zip(wl.prompts[:count], wl.max_tokens[:count], strict=True))
    return Run(wl.name, f"hf-static-{batch_size}", dtype, seconds, count, sum(map(len, wl.prompts[:count])),
               wl.width * sum(wl.max_tokens[:count]), rss.peak_mb, rss.start_mb,
               dict(batch_size=batch_size, padded_token_fraction=1 - useful / computed))


def best_static(args, wl: Workload, dtype: str, sizes: tuple[int, ...]) -> Run:
    """Each batch size on the first max(sizes) // n requests; the fastest then on the whole workload."""
    subset = min(len(wl.prompts), max(1, max(sizes) // wl.width))
    probes = [isolated(args.isolate, run_hf_static, args.model, wl, dtype, args.threads, size, subset)
              for size in sizes]
    best = max(probes, key=lambda r: r.rates()["total_tok_s"])
    if subset < len(wl.prompts):
        best = isolated(args.isolate, run_hf_static, args.model, wl, dtype, args.threads, best.extra["batch_size"],
                        len(wl.prompts))
    best.extra["probes"] = {p.extra["batch_size"]: round(p.rates()["total_tok_s"], 1) for p in probes}
    best.extra["probe_requests"] = subset
    return best


@torch.inference_mode()
def run_hf_continuous(model_path: str, wl: Workload, dtype: str, threads: int, kv_blocks: int) -> Run:
    """transformers continuous batching (generate_batch's manager, so each request keeps its max_tokens), with
    batchgen's KV budget, block size, token budget and sequence limit."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model, pad_id = load_hf(model_path, dtype, threads)
    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers has no generate_batch")
    config = GenerationConfig(num_return_sequences=wl.n, eos_token_id=-1, pad_token_id=pad_id, **sampling_kwargs(wl))
    cb = ContinuousBatchingConfig(page_size=BLOCK, num_blocks=kv_blocks, max_batch_tokens=2048,
                                  max_requests_per_batch=256, seed=0)
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb,
                                                   block=True, timeout=10, warmup=False) as manager, PeakRSS() as rss:
        start = time.perf_counter()
        for i, prompt in enumerate(wl.prompts):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=wl.max_tokens[i], eos_token_id=-1)
        while len(results) < wl.n * len(wl.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped")
        seconds = time.perf_counter() - start
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(errors[0])
    outputs = sum(len(r.generated_tokens) for r in results.values())
    return Run(wl.name, "hf-continuous", dtype, seconds, len(wl.prompts), wl.prompt_tokens, outputs,
               rss.peak_mb, rss.start_mb, dict(kv_blocks=kv_blocks))


# --- the limit ---------------------------------------------------------------------------------------------------
def layer_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) features of each of the model's GEMMs, q/k/v and gate/up fused as batchgen runs them."""
    q, kv = cfg.num_attention_heads * head_dim(cfg), cfg.num_key_value_heads * head_dim(cfg)
    return {"qkv": (cfg.hidden_size, q + 2 * kv), "o": (q, cfg.hidden_size),
            "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size), "down": (cfg.intermediate_size, cfg.hidden_size),
            "lm_head": (cfg.hidden_size, cfg.vocab_size)}


@torch.inference_mode()
def linear_gflops(m: int, k: int, n: int, dtype: torch.dtype, min_time: float) -> float:
    """The faster of `F.linear` and the packed GEMM batchgen runs (layers/linear.py)."""
    from batchgen.layers.linear import PackedLinear, can_pack

    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    gemms = [lambda rows: F.linear(rows, w)]
    if can_pack(w):
        gemms.append(PackedLinear(w))
    best = 0.0
    for gemm in gemms:
        for _ in range(10):
            gemm(x)
        for _ in range(5):  # the fastest of five windows: other work on the machine only slows a window down
            reps, start = 0, time.perf_counter()
            while reps < 2 or time.perf_counter() - start < min_time / 5:
                gemm(x)
                reps += 1
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    return best


def gemm_rates(shapes: dict, dtype: str, ms: tuple[int, ...], min_time: float, threads: int) -> dict:
    """GFLOP/s per shape name and M."""
    torch.set_num_threads(threads)
    return {name: {m: linear_gflops(m, k, n, getattr(torch, dtype), min_time) for m in ms}
            for name, (k, n) in shapes.items()}


@torch.inference_mode()
def read_gb_s(threads: int, min_time: float, megabytes: int = 256) -> float:
    """Memory read bandwidth: the fastest of several sums over a float32 tensor far larger than the caches."""
    torch.set_num_threads(threads)
    x = torch.ones(megabytes * 2**18)
    best, deadline = math.inf, time.perf_counter() + min_time
    for i in range(100):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
        if i >= 5 and time.perf_counter() > deadline:
            break
    return x.nbytes / best / 1e9


def matmul_seconds(rates: dict, shapes: dict, cfg, fed: float, sampled: float, context_sum: float) -> float:
    """Seconds if every GEMM ran at its best measured rate: 2*K*N FLOPs per fed token for each layer projection,
    the lm_head per sampled token, and 4*heads*head_dim FLOPs per layer per (query, key) pair at the best rate."""
    best = {name: max(r.values()) * 1e9 for name, r in rates.items()}
    per_layer = sum(2 * k * n / best[name] for name, (k, n) in shapes.items() if name != "lm_head")
    k, n = shapes["lm_head"]
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim(cfg) / max(best.values())
    return fed * cfg.num_hidden_layers * per_layer + sampled * 2 * k * n / best["lm_head"] + context_sum * attention


def ceiling_tok_s(rates: dict, shapes: dict, cfg, fed: float, sampled: float, context_sum: float) -> float:
    """Tokens/s at matmul_seconds."""
    return fed / matmul_seconds(rates, shapes, cfg, fed, sampled, context_sum)


def element_size(dtype: str) -> int:
    """Bytes of one element of a torch dtype named as in DTYPES' values ("bfloat16", "float32")."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def weight_bytes(shapes: dict, cfg, dtype: str) -> int:
    """Bytes of the projections of every layer and of the lm_head: what each step reads at least once."""
    layers = sum(k * n for name, (k, n) in shapes.items() if name != "lm_head") * cfg.num_hidden_layers
    return (layers + math.prod(shapes["lm_head"])) * element_size(dtype)


def stage_breakdown(totals: dict[str, float]) -> dict[str, float]:
    """Exclusive seconds per stage of batchgen's step, from StepProfile's nested timers."""
    t = defaultdict(float, totals)
    stages = {"schedule": t["schedule"], "prepare+moves": t["execute"] - t["forward"] - t["logits"],
              "attention": t["attention"], "gemm+other fwd": t["forward"] - t["attention"], "lm_head": t["logits"],
              "sample+engine": t["step"] - t["schedule"] - t["execute"]}
    if "grammar_fill" in t:  # structured outputs: the grammar's share of sample+engine, and the sampler's
        stages.update({"grammar fill": t["grammar_fill"], "grammar accept": t["grammar_accept"],
                       "sampler": t["sample"]})
        stages["sample+engine"] -= t["grammar_fill"] + t["grammar_accept"] + t["sample"]
    return stages


def decode_summary(steps: list[tuple[int, float]]) -> dict[str, float]:
    """Decode-only tokens/s by running batch size: 64-127, 128-255, 256, and all of 64-256."""
    buckets = {"64-127": (64, 127), "128-255": (128, 255), "256": (256, 256), "64-256": (64, 256)}
    out = {}
    for label, (lo, hi) in buckets.items():
        picked = [(b, t) for b, t in steps if lo <= b <= hi]
        if picked:
            out[label] = sum(b for b, _ in picked) / sum(t for _, t in picked)
    return out


# --- the run -----------------------------------------------------------------------------------------------------
def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def kv_bytes_per_token(cfg, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in every layer, in the activations' dtype or, with an fp8 kv_cache_dtype, one byte."""
    itemsize = 1 if kv_cache_dtype != "auto" else element_size(dtype)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim(cfg) * itemsize


def bench_batchgen(args, dtype: str, cfg, workloads: dict[str, Workload]) -> list[Run]:
    """mixed (when mixed, pressure or int8 is asked for), int8, pressure, parallel, beam, json, lora, then the
    decode run, in that order."""
    bytes_per_block = BLOCK * kv_bytes_per_token(cfg, dtype, args.kv_cache_dtype)

    def run(wl: Workload, kv_blocks: int | None = None, swap_blocks: int = 64, model_impl: str = "native",
            quantization: str | None = None) -> Run:
        kv_blocks = kv_blocks or int(sum(wl.kv_blocks()) * 1.1) + 16  # all of it at once: no preemption
        print(f"[{dtype}] batchgen ({model_impl}) {wl.name}: {len(wl.prompts)} requests, {kv_blocks} KV blocks "
              f"(kv_cache_dtype {args.kv_cache_dtype})", flush=True)
        return isolated(args.isolate, run_batchgen, args.model, wl, dtype, args.threads, kv_blocks, swap_blocks,
                        bytes_per_block, model_impl, quantization, args.kv_cache_dtype)

    runs, mixed = [], workloads["mixed"]
    if {"mixed", "pressure", "int8"} & set(args.workloads):
        runs.append(run(mixed))
    if "int8" in args.workloads:  # mixed's requests with int8 projections, next to mixed's run in time
        runs.append(run(Workload(**{**asdict(mixed), "name": "int8"}), quantization="int8"))
    if "pressure" in args.workloads:
        peak = runs[0].extra["peak_blocks"]
        pressure = run(Workload(**{**asdict(mixed), "name": "pressure"}),
                       kv_blocks=max(peak // 4, max(mixed.kv_blocks()) + 4), swap_blocks=peak)
        if pressure.extra["preemptions"] == 0:
            raise SystemExit(f"pressure: no preemption with {pressure.extra['kv_blocks']} KV blocks of {peak} peak")
        runs.append(pressure)
    for name in ("parallel", "beam"):
        if name in args.workloads:
            runs.append(run(workloads[name]))
    if "json" in args.workloads:
        constrained = Workload(**{**asdict(mixed), "name": "json", "structured_outputs": {"json": JSON_SCHEMA}})
        runs.append(run(constrained))
        lengths = runs[-1].extra["output_lengths"]
        runs.append(run(Workload(**{**asdict(mixed), "name": "json-free", "max_tokens": lengths})))
    if "lora" in args.workloads:  # alternately, twice: a slow spell on a shared machine hits both sides
        for _ in range(2):
            runs.append(run(Workload(**{**asdict(mixed), "name": "lora-base"})))
            runs.append(run(Workload(**{**asdict(mixed), "name": "lora", "adapters": 4})))
    runs.append(run(workloads["decode"]))
    # --model-impl transformers: the transformers backend on the same workloads, in the same process's run, as a
    # peer of the native path (engine "batchgen-transformers"; bench_dtype keeps it apart from the native runs).
    if args.model_impl == "transformers":
        runs += [run(workloads[name], model_impl="transformers") for name in ("mixed", "parallel")
                 if name in args.workloads or (name == "mixed" and "pressure" in args.workloads)]
    return runs


def bench_peers(args, dtype: str, workloads: dict[str, Workload], ours: list[Run], settings: dict,
                notes: list[str]) -> list[Run]:
    """transformers static and continuous batching on mixed (also standing for pressure) and parallel; static
    only on beam (its continuous batching has no beam search)."""
    kv_of, runs = {r.workload: r.extra["kv_blocks"] for r in ours}, []
    for name in [w for w in ("mixed", "parallel", "beam") if w in kv_of]:
        print(f"[{dtype}] transformers static {name}: batch sizes {settings['batch_sizes']}", flush=True)
        runs.append(best_static(args, workloads[name], dtype, settings["batch_sizes"]))
        if "continuous" not in args.peers or name == "beam":
            continue
        print(f"[{dtype}] transformers continuous {name}", flush=True)
        try:
            runs.append(isolated(args.isolate, run_hf_continuous, args.model, workloads[name], dtype, args.threads,
                                 kv_of[name]))
        except Exception as error:  # a peer failing must not lose batchgen's numbers
            notes.append(f"{dtype} {name}: transformers continuous batching skipped: {error!r}")
    for r in [r for r in runs if r.engine.startswith("hf-static")]:
        notes.append(f"{dtype} {r.workload}: static batch sizes (rows) -> total tok/s on the first "
                     f"{r.extra['probe_requests']} requests: {r.extra['probes']}; the best ran the whole workload")
    return runs


def the_limit(rates: dict, read_gbs: float, cfg, dtype: str, workloads: dict[str, Workload], ours: list[Run],
              kv_cache_dtype: str = "auto") -> dict:
    """Ceilings from the GEMM rates, and batchgen's mixed total and decode-only tokens/s as fractions of them; and
    for mixed, the matmul ceiling's time plus that of reading the decode steps' K/V at `read_gbs`."""
    shapes, mixed, decode = layer_shapes(cfg), workloads["mixed"], workloads["decode"]
    fed = mixed.prompt_tokens + mixed.output_tokens
    pairs = zip(decode.prompts, decode.max_tokens, strict=True)
    decode_context = sum(m * len(p) + m * (m + 1) / 2 for p, m in pairs) / sum(decode.max_tokens)
    limit = dict(gemm_gflops=rates, shapes=shapes, mixed_mean_context=mixed.context_sum() / fed,
                 mixed_ceiling_tok_s=ceiling_tok_s(rates, shapes, cfg, fed, mixed.output_tokens, mixed.context_sum()),
                 decode_mean_context=decode_context,
                 decode_ceiling_tok_s=ceiling_tok_s(rates, shapes, cfg, 1, 1, decode_context))
    kv_bytes = mixed.decode_context_sum() * kv_bytes_per_token(cfg, dtype, kv_cache_dtype)
    limit.update(read_gb_s=read_gbs, mixed_decode_kv_gb=kv_bytes / 1e9,
                 mixed_with_kv_tok_s=fed / (fed / limit["mixed_ceiling_tok_s"] + kv_bytes / (read_gbs * 1e9)))
    by_name = {r.workload: r for r in ours}
    if "mixed" in by_name:
        limit["batchgen_mixed_total_tok_s"] = by_name["mixed"].rates()["total_tok_s"]
        limit["mixed_fraction"] = limit["batchgen_mixed_total_tok_s"] / limit["mixed_ceiling_tok_s"]
        limit["mixed_with_kv_fraction"] = limit["batchgen_mixed_total_tok_s"] / limit["mixed_with_kv_tok_s"]
        # Each step reads every weight at least once, and its GEMMs, whatever their rate, wait for them: the K/V
        # bound plus, for each step the engine ran, the time reading its weights takes beyond its GEMMs.
        weights = weight_bytes(shapes, cfg, dtype)
        weights_s = weights / (read_gbs * 1e9)
        matmul = [matmul_seconds(rates, shapes, cfg, *work) for work in by_name["mixed"].extra["steps"]]
        waits = sum(max(0.0, weights_s - t) for t in matmul)
        limit.update(weight_gb=weights / 1e9, mixed_steps=len(matmul),
                     mixed_weight_bound_steps=sum(t < weights_s for t in matmul), mixed_weight_wait_s=waits,
                     mixed_with_weights_tok_s=fed / (fed / limit["mixed_with_kv_tok_s"] + waits))
        limit["mixed_with_weights_fraction"] = limit["batchgen_mixed_total_tok_s"] / limit["mixed_with_weights_tok_s"]
        if seconds := by_name["mixed"].extra.get("decode_attention_s"):
            limit["mixed_decode_attention_gb_s"] = kv_bytes / seconds / 1e9
            limit["mixed_decode_attention_share_of_read"] = limit["mixed_decode_attention_gb_s"] / read_gbs
    limit["batchgen_decode_tok_s"] = decode_summary(by_name["decode"].extra["decode_steps"])
    limit["decode_fraction"] = {k: v / limit["decode_ceiling_tok_s"] for k, v in limit["batchgen_decode_tok_s"].items()}
    return limit


def bench_dtype(args, dtype: str, cfg, tokenizer, settings: dict) -> tuple[list[Run], dict, list[str]]:
    workloads = {name: make_workload(name, tokenizer, args.seed, **settings[name])
                 for name in ("mixed", "parallel", "beam", "decode")}
    print(f"[{dtype}] GEMM rates", flush=True)
    rates = isolated(args.isolate, gemm_rates, layer_shapes(cfg), dtype, settings["gemm_ms"], settings["gemm_time"],
                     args.threads)
    read_gbs = isolated(args.isolate, read_gb_s, args.threads, settings["gemm_time"] * 10)
    ours = bench_batchgen(args, dtype, cfg, workloads)
    notes = lora_notes(ours, dtype)
    backend = [r for r in ours if r.engine != "batchgen"]  # the transformers backend (a peer) and int8
    ours = [r for r in ours if r.engine == "batchgen"]
    limit = the_limit(rates, read_gbs, cfg, dtype, workloads, ours, args.kv_cache_dtype)
    for run in ours + backend:
        run.extra["decode_steps"] = len(run.extra["decode_steps"])
        run.extra["steps"] = len(run.extra["steps"])
    measures = {}
    if "int8" in args.workloads:
        measures["int8"] = int8_against(args, dtype, workloads["mixed"], ours + backend, settings["agree_prompts"])
    if "vocab" in args.workloads:
        v = settings["vocab"]
        measures["vocab"] = [isolated(args.isolate, vocab_engine_run, size, dtype, args.threads, v["requests"],
                                      v["max_tokens"]) for size in v["sizes"]]
    peers = [] if args.skip_peers else bench_peers(args, dtype, workloads, ours, settings, notes)
    return ours + backend + peers, limit, notes, measures


def int8_against(args, dtype: str, mixed: Workload, ours: list[Run], agree_prompts: int) -> dict:
    """int8 compute against `dtype` (issue 36): the int8 workload's tokens/s over mixed's in this run, and the
    quality: greedy agreement over mixed's first prompts and the perplexity of TEXT, each side in its own process."""
    print(f"[{dtype}] int8 quality: {agree_prompts} greedy continuations and {TEXT.name}'s perplexity", flush=True)
    prompts = mixed.prompts[:agree_prompts]
    base, int8 = (isolated(args.isolate, quality, args.model, q, args.threads, prompts, dtype) for q in (None, "int8"))
    rate = {r.workload: r.rates()["total_tok_s"] for r in ours}
    change = int8["perplexity"] / base["perplexity"] - 1
    return dict(int8_over_dtype=rate["int8"] / rate["mixed"], int8_tok_s=rate["int8"], dtype_tok_s=rate["mixed"],
                agreement=agreement(base["continuations"], int8["continuations"]), agreement_prompts=len(prompts),
                perplexity=dict(dtype=base["perplexity"], int8=int8["perplexity"]), perplexity_change=change,
                perplexity_budget_met=abs(change) <= PERPLEXITY_BUDGET, text_tokens=base["text_tokens"])


def vocab_engine_run(vocab: int, dtype: str, threads: int, requests: int, max_tokens: int) -> dict:
    """`bench_vocab.py --engine` at one vocabulary: a random Llama of hidden 256 whose vocabulary side (lm_head and
    sampler) is most of a step, rows mixing greedy, top-p, penalties and logprobs; the sampler's rate of reading
    logits against the machine's read bandwidth measured after the run."""
    from bench_vocab import READ_PROBE_BYTES, engine_run

    probe = torch.ones(READ_PROBE_BYTES // 4)
    result = engine_run(vocab, {"bfloat16": "bf16", "float32": "fp32"}[dtype], threads, requests, max_tokens, probe)
    return {**asdict(result), "sample_share_of_read": result.sample_share_of_read}


def lora_notes(runs: list[Run], dtype: str) -> list[str]:
    """The lora workload's tokens/s over lora-base's, pair by pair (they ran alternately) and over all pairs."""
    rates = {name: [r.rates()["total_tok_s"] for r in runs if r.workload == name] for name in ("lora", "lora-base")}
    if not rates["lora"]:
        return []
    pairs = ", ".join(f"{a / b:.2f}x" for a, b in zip(rates["lora"], rates["lora-base"], strict=True))
    ratio = sum(rates["lora"]) / sum(rates["lora-base"])
    return [f"[{dtype}] lora: 4 rank-{LORA_RANK} adapters at {ratio:.2f}x the base model's tokens/s "
            f"(alternate pairs: {pairs}; issue 34's target >= 0.8x)"]


def ratio_rows(runs: list[Run]) -> list[dict]:
    """batchgen / peer per workload: throughput (requests and tokens are the same on both sides, so req/s, output
    and total tok/s give one ratio) and peak RSS; pressure is compared with the peers' mixed runs."""
    peers = defaultdict(dict)
    for r in runs:
        if r.engine != "batchgen" and "+" not in r.engine:  # a quantized run (int8) is no peer: int8_against
            peers[(r.workload, r.dtype)][r.engine.split("-")[1]] = r
    rows = []
    for r in runs:
        if r.engine == "batchgen":
            against = peers.get((r.workload if r.workload != "pressure" else "mixed", r.dtype), {})
            rows.append(dict(workload=r.workload, dtype=r.dtype, **{
                f"vs_{kind}": dict(throughput=r.rates()["total_tok_s"] / p.rates()["total_tok_s"],
                                   peak_rss=r.peak_rss_mb / p.peak_rss_mb) for kind, p in against.items()}))
    return rows


def backend_rows(runs: list[Run]) -> list[dict]:
    """The transformers backend per workload: the native path's throughput over it, and it over transformers'
    own generate on static batches (when that peer ran)."""
    by_key = {(r.workload, r.dtype, r.engine.split("-")[1] if "-" in r.engine else r.engine): r for r in runs}
    rows = []
    for (workload, dtype, kind), backend in by_key.items():
        if kind != "transformers":
            continue
        rate = backend.rates()["total_tok_s"]
        row = dict(workload=workload, dtype=dtype, backend_tok_s=rate)
        if native := by_key.get((workload, dtype, "batchgen")):
            row["native_over_backend"] = native.rates()["total_tok_s"] / rate
        if static := by_key.get((workload, dtype, "static")):
            row["backend_over_hf_static"] = rate / static.rates()["total_tok_s"]
        rows.append(row)
    return rows


def print_report(runs: list[Run], ceilings: dict, notes: list[str], measures: dict, machine: str) -> None:
    print(f"\n== {machine}")
    for dtype, c in ceilings.items():
        print(f"\n== limit, {dtype}: GEMM GFLOP/s by M (tokens), the faster of F.linear and packed")
        for name, by_m in c["gemm_gflops"].items():
            print(f"  {name:8s} {c['shapes'][name]!s:14s} " + "  ".join(f"M={m}: {g:7.1f}" for m, g in by_m.items()))
        print(f"  ceiling mixed {c['mixed_ceiling_tok_s']:.0f} tok/s (mean context {c['mixed_mean_context']:.0f}), "
              f"decode {c['decode_ceiling_tok_s']:.0f} tok/s (mean context {c['decode_mean_context']:.0f})")
        print(f"  with mixed's decode K/V reads ({c['mixed_decode_kv_gb']:.0f} GB) at the read bandwidth "
              f"({c['read_gb_s']:.1f} GB/s): mixed {c['mixed_with_kv_tok_s']:.0f} tok/s")
        if "mixed_fraction" in c:
            print(f"  batchgen mixed {c['batchgen_mixed_total_tok_s']:.0f} tok/s = {c['mixed_fraction']:.1%} of the "
                  f"matmul ceiling, {c['mixed_with_kv_fraction']:.1%} with the K/V reads")
        if "mixed_with_weights_fraction" in c:
            print(f"  and each step's weights ({c['weight_gb']:.2f} GB) read at that bandwidth, where it takes longer "
                  f"than the step's GEMMs ({c['mixed_weight_bound_steps']} of {c['mixed_steps']} steps, "
                  f"+{c['mixed_weight_wait_s']:.2f} s): mixed {c['mixed_with_weights_tok_s']:.0f} tok/s; batchgen "
                  f"{c['mixed_with_weights_fraction']:.1%} of it")
        if "mixed_decode_attention_gb_s" in c:
            print(f"  batchgen's decode attention read those K/V at {c['mixed_decode_attention_gb_s']:.1f} GB/s = "
                  f"{c['mixed_decode_attention_share_of_read']:.0%} of the read bandwidth (a sequential read; "
                  f"bench_kv_fp8.py --decode measures it against a plain read of the same bytes)")
        for label, rate in c["batchgen_decode_tok_s"].items():
            print(f"  batchgen decode-only, batch {label}: {rate:.0f} tok/s = {c['decode_fraction'][label]:.1%}")
    for dtype, m in measures.items():
        if q := m.get("int8"):
            a = q["agreement"]
            print(f"\n== int8 against {dtype}, mixed's requests in this run: x{q['int8_over_dtype']:.2f} the total "
                  f"tok/s ({q['int8_tok_s']:.0f} vs {q['dtype_tok_s']:.0f})")
            print(f"  perplexity of {TEXT.name} ({q['text_tokens']} tokens): {q['perplexity']['dtype']:.3f} -> "
                  f"{q['perplexity']['int8']:.3f} ({q['perplexity_change']:+.2%}; budget {PERPLEXITY_BUDGET:.0%} "
                  f"{'met' if q['perplexity_budget_met'] else 'missed'})")
            print(f"  greedy agreement over {AGREE_TOKENS} tokens of {q['agreement_prompts']} prompts: "
                  f"{a['token_share']:.1%} of tokens before the first difference, {a['identical_share']:.1%} of "
                  f"prompts identical")
        if results := m.get("vocab"):
            print(f"\n== large vocabularies, {dtype}: random Llama models of hidden 256 (bench_vocab.py --engine)")
            for v in results:
                print(f"  {v['vocab']:>7,}: {v['output_tokens'] / v['seconds']:.0f} out tok/s; lm_head "
                      f"{v['logits_s'] / v['seconds']:.0%} and sampler {v['sample_s'] / v['seconds']:.0%} of the run; "
                      f"the sampler reads logits at {v['logits_bytes'] / v['sample_s'] / 1e9:.1f} GB/s = "
                      f"{v['sample_share_of_read']:.0%} of the {v['read_gb_s']:.1f} GB/s read bandwidth")
    print("\n== where batchgen's time goes (seconds, share of the run)")
    for r in [r for r in runs if r.engine.startswith("batchgen")]:
        stages = r.extra["stage_seconds"]
        shares = ", ".join(f"{k} {v:.1f} ({v / r.seconds:.0%})" for k, v in stages.items())
        print(f"  {r.workload:9s} {r.engine:21s} {r.dtype:9s} {shares}")
        if ops := r.extra.get("stack_seconds"):  # the layers in one C++ call: its own clock per op
            print(f"  {'':9s} {'  its decoder stack':31s} " + ", ".join(f"{k} {v:.1f}" for k, v in ops.items()))
    if any(r.workload == "pressure" for r in runs):
        print("note: pressure is compared with the peers' mixed runs (the same requests; they have no KV budget)")
    for r in [r for r in runs if r.workload == "json"]:
        free = next(f for f in runs if f.workload == "json-free" and f.dtype == r.dtype)
        ratio = r.rates()["out_tok_s"] / free.rates()["out_tok_s"]
        print(f"structured outputs, {r.dtype}: json {r.rates()['out_tok_s']:.1f} out tok/s vs json-free "
              f"{free.rates()['out_tok_s']:.1f} on the same prompts and output lengths = x{ratio:.3f}; "
              f"{r.extra['grammar_compiles']} grammar compile(s), {r.extra['finished_by_grammar']} of {r.requests} "
              f"outputs ended by the grammar, {r.extra['valid']} valid")
    for note in notes:
        print(f"note: {note}")
    header = f"{'workload':9s} {'engine':16s} {'dtype':9s} {'req/s':>7s} {'out tok/s':>9s} {'tot tok/s':>9s} " \
             f"{'RSS MB':>7s} {'slot util':>9s} {'peak blk':>8s} {'preempt':>7s} {'pfx hits':>8s}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in runs:
        rate, e = r.rates(), r.extra
        util = f"{e['slot_utilization']:.1%}" if "slot_utilization" in e else "-"
        print(f"{r.workload:9s} {r.engine:16s} {r.dtype:9s} {rate['req_s']:7.2f} {rate['out_tok_s']:9.1f} "
              f"{rate['total_tok_s']:9.1f} {r.peak_rss_mb:7.0f} {util:>9s} {e.get('peak_blocks', '-')!s:>8s} "
              f"{e.get('preemptions', '-')!s:>7s} {e.get('prefix_cache_hits', '-')!s:>8s}")
    for row in [r for r in ratio_rows(runs) if len(r) > 2]:
        cells = ", ".join(f"{k[3:]} x{v['throughput']:.2f} (RSS x{v['peak_rss']:.2f})"
                          for k, v in row.items() if k.startswith("vs_"))
        print(f"batchgen/peer throughput  {row['workload']:9s} {row['dtype']:9s} {cells}")
    for row in backend_rows(runs):
        cells = ", ".join(f"{k} x{row[k]:.2f}" for k in ("native_over_backend", "backend_over_hf_static") if k in row)
        print(f"transformers backend      {row['workload']:9s} {row['dtype']:9s} {row['backend_tok_s']:.1f} tok/s; "
              f"{cells}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bf16,fp32", help="comma list of bf16/bfloat16, fp32/float32")
    parser.add_argument("--workloads", default="mixed,parallel,pressure")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-peers", action="store_true", help="batchgen and the limit only")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                        help="batchgen's KV cache (docs/kv-cache.md); bench_vllm.py takes the same option")
    parser.add_argument("--peers", default="static,continuous",
                        help="transformers engines to run: static (generate on static batches), continuous "
                             "(its continuous batching, the slowest to measure)")
    parser.add_argument("--batch-sizes", help="comma list of transformers' static batch sizes (rows) to probe, "
                                              "instead of the defaults (8,16,32,64)")
    parser.add_argument("--model-impl", choices=("native", "transformers"), default="native",
                        help="transformers: also run mixed and parallel on the transformers backend (model_impl), "
                             "reported as a peer of the native path")
    parser.add_argument("--vision-model", help="the caption workload's model: a LLaVA or Qwen2-VL directory "
                                               "(default: a random LLaVA of SmolLM2-135M's decoder, built here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed-count", type=int,
                        help="requests of mixed (and of the workloads built on it: pressure, json, lora) instead of "
                             "200 (16 with --quick)")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="run every engine in this process (faster start; RSS then mixes the runs)")
    parser.add_argument("--omp-passive", action="store_true",
                        help="OMP_WAIT_POLICY=PASSIVE in the engines' processes: on cores shared with other work, "
                             "spinning OpenMP barriers can stall a step for ~100 ms (not with --no-isolate)")
    args = parser.parse_args(argv)
    args.dtypes = [DTYPES[d.strip().lower()] for d in args.dtype.split(",")]
    args.workloads = [w.strip() for w in args.workloads.split(",")]
    args.peers = [p.strip() for p in args.peers.split(",")]
    args.batch_sizes = tuple(int(b) for b in args.batch_sizes.split(",")) if args.batch_sizes else None
    if set(args.peers) - {"static", "continuous"} or "static" not in args.peers:
        parser.error(f"--peers: static, optionally with continuous (got {args.peers})")
    unknown = set(args.workloads) - {"mixed", "parallel", "pressure", "json", "beam", "lora", "int8", "vocab",
                                     "caption"}
    if unknown:
        parser.error(f"unknown workloads: {sorted(unknown)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    if args.model is None:
        from batchgen.models.smollm2 import ensure_smollm2

        args.model = str(ensure_smollm2())
    if args.omp_passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read by the spawned processes' OpenMP when it loads
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    cfg, tokenizer = AutoConfig.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    settings = SETTINGS[args.quick]
    if args.batch_sizes:
        settings = {**settings, "batch_sizes": args.batch_sizes}
    if args.mixed_count:
        settings = {**settings, "mixed": {**settings["mixed"], "count": args.mixed_count}}
    runs, ceilings, notes, measures, captions = [], {}, [], {}, {}
    for dtype in args.dtypes:
        if set(args.workloads) - {"caption"}:
            dtype_runs, ceilings[dtype], dtype_notes, measures[dtype] = bench_dtype(args, dtype, cfg, tokenizer,
                                                                                    settings)
            runs += dtype_runs
            notes += dtype_notes
        if "caption" in args.workloads:
            from bench_caption import caption_bench

            captions[dtype] = caption_bench(args.vision_model, dtype=dtype, threads=args.threads, seed=args.seed,
                                            **settings["caption"])
    loads = [", ".join(f"{x:.1f}" for x in load) for load in (load_before, os.getloadavg())]
    notes.append(f"load average (1, 5, 15 min) {loads[0]} at the start, {loads[1]} at the end, "
                 f"{psutil.cpu_count()} CPUs: other work on the machine slows every engine down")
    from batchgen import _C

    report = dict(args=vars(args), processor=processor(), kernels=_C.cpu_isa(), int8_kernel=_C.int8_kernel(),
                  torch=torch.__version__, threads=torch.get_num_threads(), cpus=psutil.cpu_count(),
                  runs=[r.record() for r in runs], ratios=ratio_rows(runs), backend=backend_rows(runs),
                  ceilings=ceilings, int8={d: m["int8"] for d, m in measures.items() if "int8" in m},
                  vocab={d: m["vocab"] for d, m in measures.items() if "vocab" in m}, caption=captions, notes=notes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print_report(runs, ceilings, notes, measures, f"{report['processor']}, kernel table {report['kernels']}, "
                 f"int8 loop {report['int8_kernel']}, {args.threads} threads")
    if captions:
        from bench_caption import print_caption

        for caption in captions.values():
            print_caption(caption)
    return report


if __name__ == "__main__":
    main()
