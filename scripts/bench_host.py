#!/usr/bin/env python
"""Host cost of the engine's loop, measured with a null model (issue 52): what the GPU would wait on.

The real `LLMEngine` runs its real loop (scheduler and block manager, the runner's input preparation,
sampling rows, appends and stop checks, outputs) on a tiny random Llama whose forward is replaced by a
null model: the hidden states and logits are preallocated tensors of the right shapes, returned at once.
Sampling is timed apart, as on a GPU it runs on the device. Each batch size runs steady-state decode:
`batch` requests, every one prefilled before the timing starts, `ignore_eos` and max_tokens far beyond
the steps timed, prompt lengths spread over several blocks so that block allocations fall on every step.

One JSON line per batch size, e.g.

    {"batch": 256, "us_per_step": 900.0, "us_per_seq": 3.5, "sample_us": 400.0, "breakdown_us":
     {"schedule": ..., "prepare": ..., "model": ..., "update": ...}, ...}

us_per_step is the step's wall time less sampling; breakdown_us splits it (schedule: Scheduler.schedule;
prepare: ModelRunner.prepare; model: the rest of ModelRunner.execute, the null forward and logits and the
gather of the sampled rows;
update: the rest of LLMEngine.step, i.e. on_step_done, sampling rows, appends, stop checks, outputs).

    python scripts/bench_host.py                    # batches 64, 256, 512
    python scripts/bench_host.py --quick            # a smoke run: small batches, few steps
    python scripts/bench_host.py --profile 256      # and cProfile's top functions of the timed steps
    python scripts/bench_host.py --cpu-time         # the thread's CPU time in place of wall time
    python scripts/bench_host.py --stub-sampler     # sampling a fixed token, without reading the logits

--cpu-time: on a shared machine the wall time of a run moves by 2-3x with the load, its thread CPU time
(`time.thread_time`) by ~15%. --stub-sampler: the CPU sampler's pass over the step's logits (256 x 32,768
float32 = 32 MiB) evicts the caches at every step, which the rest of the loop then pays in misses; on a GPU
the logits never reach the host, so the stubbed figure is the nearer to what a card would wait on.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import processor  # noqa: E402

from batchgen.engine import llm_engine  # noqa: E402
from batchgen.engine.gc_pacing import fewer_collections  # noqa: E402
from batchgen.layers.sampler import SampledTokens  # noqa: E402
from batchgen.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Settings:
    batches: list[int]
    steps: int  # decode steps timed per batch size
    warmup: int  # decode steps run before the timing
    prompt_lens: tuple[int, int]  # prompt lengths drawn uniformly from this range
    vocab: int


FULL = Settings([64, 256, 512], steps=64, warmup=16, prompt_lens=(64, 192), vocab=32768)
QUICK = Settings([8, 32], steps=8, warmup=2, prompt_lens=(8, 40), vocab=1024)


@dataclass
class Result:
    batch: int
    us_per_step: float  # host time per decode step, sampling excluded (thread CPU time with --cpu-time)
    us_per_seq: float
    sample_us: float  # the sampler's time per step, on the CPU here (on a GPU it runs on the device)
    breakdown_us: dict[str, float]  # us_per_step split: schedule, prepare, model, update
    steps: int
    clock: str = "wall"  # "wall" or "thread_cpu" (--cpu-time)
    sampler: str = "cpu"  # "cpu" or "stub" (--stub-sampler)
    processor: str = field(default_factory=processor)


class NullModel:
    """Stands in for the runner's model: the forward and compute_logits return preallocated tensors of the
    right shapes without computing anything; all else (attention_layers, hidden_size, ...) is the model's."""

    def __init__(self, model, max_tokens: int, max_rows: int, seed: int = 0):
        self._model = model
        gen = torch.Generator().manual_seed(seed)
        self._hidden = torch.zeros(max_tokens, model.hidden_size)
        self._logits = torch.randn(max_rows, model.vocab_size, generator=gen)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits[: hidden.shape[0]]


class Timers:
    """Seconds spent in a few functions called once per step, wrapped in place; `clock` reads the time."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        self.spent.setdefault(name, 0.0)

        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += self.clock() - start

        return timed

    def reset(self) -> None:
        self.spent = dict.fromkeys(self.spent, 0.0)


def tiny_model(root: Path, vocab: int, max_len: int) -> Path:
    """A random 1-layer Llama of hidden 128 (its weights are loaded, never run), no tokenizer."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=max_len,
                            tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    path = root / "null-llama"
    tf.LlamaForCausalLM(config).float().save_pretrained(path)
    return path


def build_engine(model_dir: Path, batch: int):
    from batchgen import LLM

    # One thread: the loop is one Python thread, and torch's small ops on it gain nothing from more (on a shared
    # machine OpenMP's spinning would only add noise). The defaults else: prefix caching on.
    llm = LLM(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, seed=0, kv_cache_memory=256 << 20,
              num_threads=1, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch))
    return llm.engine


def decoding(engine, batch: int) -> bool:
    """Every request is past its prefill: the next step decodes all of them."""
    running = engine.scheduler.running
    return (not engine.scheduler.waiting and len(running) == batch
            and all(s.num_uncomputed_tokens == 1 for g in running for s in g.seqs))


def stub_sample(logits: torch.Tensor, rows: list) -> SampledTokens:
    """The sampler's result without reading the logits: token 2 for every row (no stop: ignore_eos, max_tokens
    far off), log-probability 0."""
    return SampledTokens([2] * len(rows), [0.0] * len(rows), [None] * len(rows))


def run_batch(model_dir: Path, batch: int, settings: Settings, profile: bool, cpu_time: bool = False,
              stub_sampler: bool = False) -> Result:
    engine = build_engine(model_dir, batch)
    runner, scheduler = engine.runner, engine.scheduler
    runner.model = NullModel(runner.model, max(2048, batch), batch)
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(2, settings.vocab) for _ in range(rng.randint(*settings.prompt_lens))]
        engine.add_request(f"r{i}", prompt, params)
    clock = time.thread_time if cpu_time else time.perf_counter
    timers = Timers(clock)
    scheduler.schedule = timers.wrap("schedule", scheduler.schedule)
    runner.prepare = timers.wrap("prepare", runner.prepare)  # runner.execute calls it: counted in both
    runner.execute = timers.wrap("execute", runner.execute)
    sample_fn = llm_engine.sample
    llm_engine.sample = timers.wrap("sample", stub_sample if stub_sampler else sample_fn)
    try:
        with fewer_collections():
            while not decoding(engine, batch):
                engine.step()
            for _ in range(settings.warmup):
                engine.step()
            timers.reset()
            profiler = cProfile.Profile() if profile else None
            start = clock()
            if profiler is not None:
                profiler.enable()
            for _ in range(settings.steps):
                assert not engine.step(), "a request finished during the timed steps"
            if profiler is not None:
                profiler.disable()
            wall = clock() - start
    finally:
        llm_engine.sample = sample_fn
    assert decoding(engine, batch)
    spent = {k: v * 1e6 / settings.steps for k, v in timers.spent.items()}
    per_step = wall * 1e6 / settings.steps - spent["sample"]
    breakdown = {"schedule": spent["schedule"], "prepare": spent["prepare"],
                 "model": spent["execute"] - spent["prepare"]}
    breakdown["update"] = per_step - sum(breakdown.values())
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return Result(batch, round(per_step, 1), round(per_step / batch, 3), round(spent["sample"], 1),
                  {k: round(v, 1) for k, v in breakdown.items()}, settings.steps,
                  "thread_cpu" if cpu_time else "wall", "stub" if stub_sampler else "cpu")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: batches 8 and 32, 8 steps")
    parser.add_argument("--batches", help="comma list of batch sizes (default 64,256,512)")
    parser.add_argument("--steps", type=int, help="decode steps timed per batch size")
    parser.add_argument("--profile", type=int, default=0, metavar="BATCH",
                        help="cProfile the timed steps of this batch size (top functions on stderr)")
    parser.add_argument("--cpu-time", action="store_true", help="time the thread's CPU time, not wall time")
    parser.add_argument("--stub-sampler", action="store_true",
                        help="sample a fixed token without reading the logits (as on a GPU, where they stay there)")
    parser.add_argument("--json", help="also write the results here, one JSON line each")
    return parser.parse_args(argv)


def main(argv=None) -> list[Result]:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.batches:
        settings = replace(settings, batches=[int(b) for b in args.batches.split(",")])
    if args.steps:
        settings = replace(settings, steps=args.steps)
    max_len = settings.prompt_lens[1] + settings.warmup + settings.steps + 64
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp), settings.vocab, max_len)
        for batch in settings.batches:
            result = run_batch(model_dir, batch, settings, profile=args.profile == batch, cpu_time=args.cpu_time,
                               stub_sampler=args.stub_sampler)
            print(json.dumps(asdict(result)), flush=True)
            results.append(result)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
    return results


if __name__ == "__main__":
    main()
