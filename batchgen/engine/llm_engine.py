"""LLMEngine: requests in, finished RequestOutputs out, one scheduler step at a time.

It owns the tokenizer, the scheduler (what to run) and the model runner (running it), and does
what lies between them: sampling, forking the n samples after a prompt's prefill, stop checks,
detokenisation and the outputs.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from batchgen.config import EngineConfig
from batchgen.engine.config import SchedulerConfig
from batchgen.engine.host_memory import release_freed_memory, retain_freed_memory
from batchgen.engine.model_runner import CacheShape, ModelRunner
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.engine.stopping import StopChecker
from batchgen.layers.sampler import SamplingRow, mix_seed, sample
from batchgen.models.loader import load_model, native_config, resolve_model_dir
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]


@dataclass
class _Request:
    group: SequenceGroup
    prompt: str | None
    params: SamplingParams
    seed: int
    metrics: RequestMetrics
    stop_reasons: dict[int, int | str | None] = field(default_factory=dict)  # seq_id -> why it stopped


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def _pick_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16  # CPU float16 GEMMs are slow; bf16 keeps the range and is fast
    return dtype


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = resolve_model_dir(config.model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        native_config(hf_config)  # an unsupported architecture fails here, before anything heavy
        self.model_name = str(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.device = _pick_device(config.device)
        if self.device.type == "cpu":
            retain_freed_memory()
        self.dtype = _pick_dtype(config.dtype, hf_config, self.device)
        self.max_model_len = self._max_model_len(hf_config)
        model = load_model(model_dir, hf_config, self.dtype, self.device, self.max_model_len)
        if self.device.type == "cpu":
            release_freed_memory()
        cfg = model.cfg
        shape = CacheShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, self.dtype)
        num_device_blocks = self._num_device_blocks(shape)
        num_cpu_blocks = config.swap_bytes // shape.bytes_per_block
        self.runner = ModelRunner(model, shape, num_device_blocks, num_cpu_blocks, self.device)
        self.scheduler = Scheduler(SchedulerConfig(
            block_size=config.block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            preemption_mode=config.preemption_mode,
        ))
        self.stopper = StopChecker(self.tokenizer, self._eos_ids(model_dir), self.max_model_len)
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0

    # --- set-up helpers -------------------------------------------------------------------
    def _max_model_len(self, hf_config) -> int:
        limit = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            limit = min(limit, window)  # we attend to everything, so stay where that is exact
        asked = self.config.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len: {asked} is more than the model supports ({limit})")
        return asked or limit

    def _num_device_blocks(self, shape: CacheShape) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
            budget -= 2**30  # activations and the sampler's logits
        else:
            budget = self.config.kv_cache_bytes
        blocks = int(budget // shape.bytes_per_block)
        if blocks < 2:
            raise ValueError(
                f"the KV cache budget leaves {max(blocks, 0)} blocks of {shape.bytes_per_block} bytes; "
                "raise kv_cache_memory (CPU) or gpu_memory_utilization (CUDA)"
            )
        return blocks

    def _eos_ids(self, model_dir) -> set[int]:
        from transformers import GenerationConfig

        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- requests -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, token_ids = self.encode(prompt)
        arrival = next(self._arrivals)
        seed = params.seed if params.seed is not None else mix_seed(self.config.seed, arrival)
        seq = Sequence(next(self._seq_ids), token_ids)
        group = SequenceGroup(request_id, arrival, params, [seq])
        self._requests[request_id] = _Request(group, text, params, seed, RequestMetrics(time.time()))
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> None:
        """Drops a request between steps; it produces no output."""
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        finished = [self._finish_request(group.request_id) for group in out.ignored]
        logits = self.runner.execute(out)
        self.scheduler.on_step_done(out)
        now = time.time()
        sampled = [s for s in out.scheduled if s.samples]
        rows: list[SamplingRow] = []
        targets: list[tuple[_Request, Sequence]] = []
        row_of_logits: list[int] = []
        for i, s in enumerate(sampled):
            req = self._requests[s.group.request_id]
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            seqs = [s.seq]
            if req.params.n > 1 and len(s.group.seqs) == 1 and s.seq.num_prompt_tokens == len(s.seq.token_ids):
                seqs += self.scheduler.fork(s.group, s.seq, req.params.n - 1)
            for seq in seqs:
                rows.append(self._sampling_row(req, seq))
                targets.append((req, seq))
                row_of_logits.append(i)
        if rows:
            if len(row_of_logits) != len(sampled):
                logits = logits[torch.tensor(row_of_logits, device=logits.device)]
            result = sample(logits, rows)
            for r, (req, seq) in enumerate(targets):
                self._append(req, seq, result.token_ids[r], result.logprobs[r], result.top_logprobs[r], now)
        for request_id in dict.fromkeys(s.group.request_id for s in out.scheduled if s.group.is_finished()):
            finished.append(self._finish_request(request_id))
        return finished

    def _sampling_row(self, req: _Request, seq: Sequence) -> SamplingRow:
        outputs = seq.output_token_ids
        return SamplingRow(
            params=req.params, seed=req.seed, sample_index=seq.sample_index,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens], output_token_ids=outputs,
            banned_token_ids=self.stopper.banned_tokens(req.params, len(outputs)),
        )

    def _append(self, req: _Request, seq: Sequence, token: int, logprob: float,
                top: dict[int, float] | None, now: float) -> None:
        seq.append_token(token)
        seq.cumulative_logprob += logprob
        if top is not None:
            seq.logprobs.append(top)
        req.metrics.first_token_time = req.metrics.first_token_time or now
        self.num_output_tokens += 1
        decision = self.stopper.check(req.params, seq.token_ids, seq.num_prompt_tokens)
        if decision is not None:
            req.stop_reasons[seq.seq_id] = decision.stop_reason
            self.scheduler.finish_seq(seq, decision.reason)

    def _finish_request(self, request_id: str) -> RequestOutput:
        req = self._requests.pop(request_id)
        group, params = req.group, req.params
        req.metrics.finished_time = time.time()
        req.metrics.num_preemptions = group.num_preemptions
        prompt_ids = group.seqs[0].token_ids[: group.seqs[0].num_prompt_tokens]
        self.num_prompt_tokens += len(prompt_ids)
        completions = []
        for seq in sorted(group.seqs, key=lambda s: s.sample_index):
            output = seq.output_token_ids
            stop_reason = req.stop_reasons.get(seq.seq_id)
            completions.append(CompletionOutput(
                index=seq.sample_index,
                text=self.stopper.final_text(params, output, stop_reason) if output else "",
                token_ids=output,
                finish_reason=seq.finish_reason,
                cumulative_logprob=seq.cumulative_logprob if output else None,
                logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                stop_reason=stop_reason,
            ))
        return RequestOutput(group.request_id, req.prompt, prompt_ids, completions, True, group.error, req.metrics)

    def stats(self) -> dict:
        s = self.scheduler.stats()
        return {
            "kv_cache_usage": s.used_device_blocks / max(1, s.num_device_blocks),
            "num_preemptions": s.num_swap_preemptions + s.num_recompute_preemptions,
            "swap_preemptions": s.num_swap_preemptions,
            "recompute_preemptions": s.num_recompute_preemptions,
            "prefix_cache_hits": s.prefix_cache_hit_tokens,
            "prefix_cache_queries": s.prefix_cache_query_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "running": s.num_running,
            "waiting": s.num_waiting,
            "swapped": s.num_swapped,
            "slot_utilization": s.slot_utilization,
            "peak_device_blocks": s.peak_used_device_blocks,
        }
