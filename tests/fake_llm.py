"""A deterministic stand-in for ``batchgen.LLM`` with the same incremental API, for job tests.

Tokens are bytes of the UTF-8 prompt. A request's output is a function of its prompt, its
params and (for seeded sampling) its seed and sample index only, never of the batch it runs
in, like the real engine; unseeded sampling (temperature > 0, no seed) draws from the engine's
RNG, so it differs between runs. Each step advances every running request by one token, so
a request of k tokens takes k steps.

Knobs (environment, so subprocess tests can set them):
  FAKE_LLM_STEP_SLEEP  seconds to sleep per step (makes runs killable mid-way)
  FAKE_LLM_FAIL_AFTER  raise RuntimeError in the step after this many steps
The model dir must exist and hold a config.json; ``{"chat_template": false}`` in it gives a
tokenizer without chat template, ``{"max_model_len": N}`` sets the default context length.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
VOCAB = 256 + len(WORDS)


class FakeTokenizer:
    def __init__(self, chat_template: str | None):
        self.chat_template = chat_template

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> Any:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        text += "<|assistant|>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(WORDS[(i - 256) % len(WORDS)] if i >= 256 else chr(i) for i in ids)


@dataclass
class _Sample:
    tokens: list[int]
    finish_reason: str
    done: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: Any
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    error: str | None = None
    arrival: float = 0.0


class FakeLLM:
    # As an engine on a GPU says: the job tests read and prepare rows on the runner's feeder thread, the
    # path a GPU node takes (the real-engine tests, on every core of the CPU, take the other).
    spare_core = True

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 kv_cache_memory: Any = "4GiB", swap_space: Any = "4GiB", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, preemption_mode: str = "swap", seed: int = 0,
                 **extra: Any):
        path = Path(model)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {model}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{model} has no config.json: not a Hugging Face model directory")
        config = json.loads(config_file.read_text())
        self.model_name = config.get("name", path.name)
        self.max_model_len = max_model_len or config.get("max_model_len", 512)
        template = None if config.get("chat_template") is False else "{fake template}"
        self.tokenizer = FakeTokenizer(template)
        self.max_num_seqs = max_num_seqs
        self.options = {"dtype": dtype, "device": device, "block_size": block_size, **extra}
        self._rng = random.Random(seed)
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._ids: set[str] = set()
        self._steps = 0
        self._sleep = float(os.environ.get("FAKE_LLM_STEP_SLEEP", "0"))
        self._fail_after = int(os.environ.get("FAKE_LLM_FAIL_AFTER", "0"))
        self._stats = {"kv_cache_usage": 0.0, "num_preemptions": 0, "prefix_cache_hits": 0,
                       "prefix_cache_queries": 0, "prompt_tokens": 0, "output_tokens": 0}

    # ------------------------------------------------------------------------------------ API

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.apply_chat_template(prompt, tokenize=True)
        else:
            ids = list(prompt)
        self._ids.add(request_id)
        req = _Request(request_id, prompt, ids, params, arrival=time.time())
        if len(ids) > self.max_model_len:
            req.error = f"prompt is {len(ids)} tokens, more than max_model_len {self.max_model_len}"
        else:
            req.samples = [self._sample(ids, params, i) for i in range(params.n)]
        self._waiting.append(req)

    def step(self) -> list[RequestOutput]:
        if self._sleep:
            time.sleep(self._sleep)
        self._steps += 1
        if self._fail_after and self._steps > self._fail_after:
            raise RuntimeError("fake engine failure (FAKE_LLM_FAIL_AFTER)")
        finished: list[RequestOutput] = []
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting.pop(0)
            if req.error:
                finished.append(self._output(req))
                continue
            self._stats["prompt_tokens"] += len(req.prompt_ids)
            self._stats["prefix_cache_queries"] += len(req.prompt_ids)
            self._stats["prefix_cache_hits"] += len(req.prompt_ids) // 2
            self._running.append(req)
        still = []
        for req in self._running:
            for s in req.samples:
                if s.done < len(s.tokens):
                    s.done += 1
                    self._stats["output_tokens"] += 1
            if all(s.done == len(s.tokens) for s in req.samples):
                finished.append(self._output(req))
            else:
                still.append(req)
        self._running = still
        self._stats["kv_cache_usage"] = len(self._running) / self.max_num_seqs
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    # ------------------------------------------------------------------------------- helpers

    def _sample(self, prompt_ids: list[int], p: SamplingParams, index: int) -> _Sample:
        if p.temperature == 0:
            key = ("greedy", prompt_ids, p.repetition_penalty)
        elif p.seed is not None:
            key = ("seeded", prompt_ids, p.seed, index, p.temperature, p.top_p, p.top_k)
        else:
            key = ("random", self._rng.getrandbits(64))
        digest = hashlib.sha256(repr(key).encode()).digest()
        rng = random.Random(digest)
        natural = 1 + rng.randrange(8)
        limit = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(prompt_ids)
        length = max(min(natural, limit), min(p.min_tokens, limit))
        tokens = [256 + rng.randrange(len(WORDS)) for _ in range(length)]
        return _Sample(tokens, "length" if natural >= limit and length == limit else "stop")

    def _output(self, req: _Request) -> RequestOutput:
        self._ids.discard(req.request_id)
        comps = []
        for i, s in enumerate(req.samples):
            logprobs = ([{t: -0.5, 256: -1.5} for t in s.tokens] if req.params.logprobs is not None else None)
            text = self.tokenizer.decode(s.tokens) if getattr(req.params, "detokenize", True) else ""
            comps.append(CompletionOutput(
                index=i, text=text, token_ids=list(s.tokens),
                finish_reason=s.finish_reason, cumulative_logprob=-0.5 * len(s.tokens), logprobs=logprobs))
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt if isinstance(req.prompt, str) else None,
            prompt_token_ids=req.prompt_ids, outputs=comps, finished=True, error=req.error,
            metrics=RequestMetrics(arrival_time=req.arrival, finished_time=time.time()))
