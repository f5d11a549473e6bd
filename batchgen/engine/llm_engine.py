"""LLMEngine: requests in, finished RequestOutputs out, one scheduler step at a time.

It owns the tokenizer, the scheduler (what to run) and the model runner (running it), and does
what lies between them: sampling, forking the n samples after a prompt's prefill, beam search's
steps (engine/beam_search.py), stop checks, detokenisation and the outputs.

Requests that read hidden states rather than (or before) sampling ride the same steps: prompt
logprobs and scoring turn prefill rows into logprobs (engine/prompt_logprobs.py), embeddings and
classifiers pool them (engine/pooling.py). Scoring and pooling requests are prefill-only: their
request ends with its prompt's last chunk.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from batchgen.config import ConfigError, EngineConfig
from batchgen.engine.beam_search import BeamSearch
from batchgen.engine.config import SchedulerConfig
from batchgen.engine.cuda_graphs import DecodeGraphs
from batchgen.engine.kept_rows import KeptRows
from batchgen.engine.model_runner import CacheShape, ModelRunner, StepOutput
from batchgen.engine.pooling import Pooler, class_probs, embedding, read_pooling_config
from batchgen.engine.preflight import plan_model, too_few_blocks
from batchgen.engine.prompt_logprobs import LogprobBatch, PromptLogprobs, name_tokens
from batchgen.engine.prompts import EncodedPrompt, Prompt, PromptEncoder
from batchgen.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.engine.stopping import StopChecker, StopDecision, StopWatch
from batchgen.layers.sampler import SampledTokens, SamplingRow, mix_seed, sample
from batchgen.lora.manager import LoRAManager
from batchgen.lora.request import LoRARequest
from batchgen.models.loader import load_model, load_tokenizer
from batchgen.models.vision.processing import load_preprocessor
from batchgen.ops.host_memory import release_freed_memory, retain_freed_memory
from batchgen.outputs import (
    ClassificationOutput,
    CompletionOutput,
    CompletionScore,
    EmbeddingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from batchgen.pooling_params import PoolingParams, ScoringParams
from batchgen.sampling_params import BeamSearchParams, SamplingParams
from batchgen.structured.backend import GrammarBackend, RequestGrammar

AnyParams = SamplingParams | BeamSearchParams | PoolingParams | ScoringParams
AnyOutput = RequestOutput | PoolingRequestOutput | CompletionScore
logger = logging.getLogger(__name__)  # start-up steps at INFO; `batchgen run` shows them


@dataclass(frozen=True)
class ModelConfig:
    """The model as the engine runs it, under vLLM's names."""

    model: str
    max_model_len: int
    dtype: torch.dtype


@dataclass(slots=True)  # slots: read for each of its sequences at every step
class _Request:
    group: SequenceGroup
    prompt: str | None
    params: SamplingParams | PoolingParams | ScoringParams
    seed: int
    metrics: RequestMetrics
    stop_reasons: dict[int, int | str | None] = field(default_factory=dict)  # seq_id -> why it stopped
    grammar: RequestGrammar | None = None  # structured outputs: one matcher per sample
    beams: BeamSearch | None = None  # beam search (params are then its greedy stop rules)
    # What it reads from its prompt's hidden states: logprobs of given tokens, or a pooled vector.
    reader: PromptLogprobs | Pooler | None = None
    pooling: tuple[bool, int | None] | None = None  # embed: (normalize, dimensions) as resolved
    lora_request: LoRARequest | None = None
    rows: dict[int, SamplingRow] = field(default_factory=dict)  # seq id -> its sampling row, where kept
    watch: StopWatch | None = None  # generation: when its samples' tokens need a stop check
    sampling: bool = False  # its samples have had a token (metrics.first_token_time is set)


_FINISHED = SequenceStatus.FINISHED

# A step's forward that fails is traced to a request (LLMEngine._step_failed). A failure after this
# many requests were blamed in a row, with no step succeeding in between, is the engine's own and
# is raised: a broken engine must end the run, not turn every row into an error row.
MAX_BLAMED_IN_A_ROW = 3


def _cache_line(lazy: bool) -> str:
    """The start-up line about the KV cache (MiB, blocks, block size, swap MiB to fill in): on CPU the cache
    and the swap space are ceilings, taking memory only as blocks are first written; on CUDA both are
    taken whole at start."""
    if lazy:
        return ("KV cache: reserving up to %d MiB (%d blocks of %d tokens; memory is taken as blocks are first "
                "written), swap space up to %d MiB")
    return "KV cache: allocating %d MiB (%d blocks of %d tokens), swap space %d MiB"


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        plan = plan_model(config)  # every option checked against the model before anything heavy
        self.model_name = config.served_model_name or str(config.model)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(plan.model_dir)
        self.device, self.dtype, self.max_model_len = plan.device, plan.dtype, plan.max_model_len
        if self.device.type == "cpu":
            retain_freed_memory()
        logger.info("loading weights from %s (%s, %s%s)", plan.model_dir, str(self.dtype).removeprefix("torch."),
                    self.device, f", {plan.quantization} compute" if plan.quantization else "")
        model = load_model(plan.model_dir, plan.hf_config, self.dtype, self.device, self.max_model_len,
                           plan.model_impl, for_lora=config.enable_lora, quantization=plan.quantization)
        self.lora = (LoRAManager(model, config.max_loras, config.max_lora_rank, self.dtype, self.device,
                                 config.max_cpu_loras) if config.enable_lora else None)
        if self.device.type == "cpu":
            release_freed_memory()
        self.vocab_size = model.vocab_size
        self.prompts = PromptEncoder(self.tokenizer, self.vocab_size,
                                     load_preprocessor(plan.model_dir, plan.hf_config, self.tokenizer))
        self.has_lm_head = getattr(model, "has_lm_head", True)
        self.class_labels: list[str] | None = getattr(model, "class_labels", None)  # a classifier's, else None
        self.pooling_config = read_pooling_config(plan.model_dir)
        shape = plan.cache_shape
        num_device_blocks = self._num_device_blocks(shape)
        num_cpu_blocks = config.swap_bytes // shape.bytes_per_block
        logger.info(_cache_line(self.device.type == "cpu"), num_device_blocks * shape.bytes_per_block >> 20,
                    num_device_blocks, config.block_size, num_cpu_blocks * shape.bytes_per_block >> 20)
        graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            max_blocks = -(-self.max_model_len // config.block_size)
            graphs = DecodeGraphs(model, self.device, config.max_num_seqs, max_blocks)
        self.runner = ModelRunner(model, shape, num_device_blocks, num_cpu_blocks, self.device, self.lora, graphs)
        self.scheduler = Scheduler(SchedulerConfig(
            block_size=config.block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            preemption_mode=config.preemption_mode,
            max_loras=config.max_loras if config.enable_lora else 0,
        ))
        self.stopper = StopChecker(self.tokenizer, self._eos_ids(plan.model_dir, plan.hf_config), self.max_model_len)
        self._grammars: GrammarBackend | None = None  # built on the first constrained request
        self._requests: dict[str, _Request] = {}
        self._kept: KeptRows | None = None  # the sampling rows of the scheduler's kept decode rows (kept_rows.py)
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        # After a failed step of several requests (see _step_failed): the requests waiting outside
        # the scheduler, those of the failed step still to be tried, and how many to try at once.
        self._isolating = False
        self._held: list[str] = []
        self._suspects: list[str] = []
        self._trial_size = 0
        self._blamed_in_a_row = 0

    # --- set-up helpers -------------------------------------------------------------------
    def _num_device_blocks(self, shape: CacheShape) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            gc.collect()  # an engine dropped but not yet collected (its cycles) still holds its cache: free it first
            free, total = torch.cuda.mem_get_info(self.device)
            # What torch's caching allocator holds unused (an engine before this one, freed) is free to us too.
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
            budget -= 2**30  # activations and the sampler's logits
        else:
            budget = self.config.kv_cache_bytes
        blocks = int(budget // shape.bytes_per_block)
        if few := too_few_blocks(blocks, shape):
            raise ConfigError([few])
        return blocks

    def _eos_ids(self, model_dir, hf_config) -> set[int]:
        from transformers import GenerationConfig

        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except OSError:
            eos = None if self.tokenizer is not None else getattr(hf_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt | EncodedPrompt, params: AnyParams, *,
                    completion: str | list[int] | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queues a request: generation (SamplingParams, BeamSearchParams), embedding or classification
        (PoolingParams), or the scoring of `completion` after `prompt` (ScoringParams); under the LoRA
        adapter `lora_request` (loaded and checked here, the first time its id comes) or the base model."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._check_lora(lora_request)
        if (completion is not None) != isinstance(params, ScoringParams):
            raise ValueError("completion: a scoring request (ScoringParams) takes a completion, and only it")
        if isinstance(params, PoolingParams):
            req = self._pooling_request(request_id, prompt, params)
        elif isinstance(params, ScoringParams):
            req = self._scoring_request(request_id, prompt, completion, params)
        else:
            req = self._generation_request(request_id, prompt, params)
        if req.reader is not None:
            req.group.seqs[0].keep_hidden_from = req.reader.hidden_from
        req.group.seqs[0].lora_id = lora_request.lora_int_id if lora_request is not None else 0
        req.lora_request = lora_request
        self._requests[request_id] = req
        if self._isolating:
            self._held.append(request_id)
        else:
            self.scheduler.add(req.group)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads and checks an adapter before any request names it (ValueError: one line why not)."""
        self._check_lora(lora_request)

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError("lora_request: this engine was built without LoRA support; pass enable_lora=True "
                             "(and max_loras, max_lora_rank as needed) to LLM(...)")
        self.lora.register(lora_request)

    def _generation_request(self, request_id: str, prompt: Prompt,
                            params: SamplingParams | BeamSearchParams) -> _Request:
        self._needs_lm_head("generation")
        beams = BeamSearch(params, self.stopper) if isinstance(params, BeamSearchParams) else None
        if beams is not None:
            params = beams.params.sampling_params
        encoded = self.prompts.encode_prompt(prompt)
        text, token_ids = encoded.text, encoded.token_ids
        self.prompts.checked_token_ids("stop_token_ids", params.stop_token_ids, allow_empty=True)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init=True); use stop_token_ids")
        grammar = self._grammar_for(params)
        arrival = next(self._arrivals)
        seed = params.seed if params.seed is not None else mix_seed(self.config.seed, arrival)
        seq = Sequence(next(self._seq_ids), token_ids, multi_modal=encoded.multi_modal)
        if grammar is not None:
            grammar.add(seq.seq_id)
        group = SequenceGroup(request_id, arrival, params, [seq], beam_width=beams.params.beam_width if beams else 0)
        reader = None if params.prompt_logprobs is None else PromptLogprobs(token_ids, 1, params.prompt_logprobs)
        return _Request(group, text, params, seed, RequestMetrics(time.time()), grammar=grammar, beams=beams,
                        reader=reader, watch=self.stopper.watch(params, len(token_ids)))

    def _prefill_only_request(self, request_id: str, text: str | None, token_ids: list[int],
                              params: PoolingParams | ScoringParams, reader: PromptLogprobs | Pooler) -> _Request:
        arrival = next(self._arrivals)
        group = SequenceGroup(request_id, arrival, params, [Sequence(next(self._seq_ids), token_ids)],
                              prefill_only=True)
        return _Request(group, text, params, 0, RequestMetrics(time.time()), reader=reader)

    def _scoring_request(self, request_id: str, prompt: Prompt, completion: str | list[int],
                         params: ScoringParams) -> _Request:
        self._needs_lm_head("scoring")
        text, prompt_ids = self.prompts.encode(prompt)
        if isinstance(completion, str):
            tokenizer = self.prompts.needs_tokenizer("a text completion")
            completion_ids = tokenizer.encode(completion, add_special_tokens=False)
            if not completion_ids:
                raise ValueError("completion: the text has no tokens")
        else:
            completion_ids = self.prompts.checked_token_ids("completion", completion)
        if not prompt_ids:
            raise ValueError("prompt: scoring needs at least one prompt token before the completion")
        token_ids = prompt_ids + completion_ids
        reader = PromptLogprobs(token_ids, len(prompt_ids), params.logprobs)
        return self._prefill_only_request(request_id, text, token_ids, params, reader)

    def _pooling_request(self, request_id: str, prompt: Prompt, params: PoolingParams) -> _Request:
        own = self.pooling_config
        if params.task == "classify":
            if self.class_labels is None:
                raise ValueError("task: classify needs a model with a classification head "
                                 "(a ...ForSequenceClassification checkpoint); this one has none")
            method = params.pooling or "last"  # the token transformers' classification heads read
        else:
            if params.pooling is None and own.problem:
                raise ValueError(f"pooling: the model's own cannot be followed: {own.problem}; "
                                 "name one (last, mean or cls)")
            method = params.pooling or own.method or "last"
            hidden = self.runner.model.hidden_size
            if params.dimensions is not None and params.dimensions > hidden:
                raise ValueError(f"dimensions: {params.dimensions} is more than the model's hidden size ({hidden})")
        text, token_ids = self.prompts.encode(prompt)
        if not token_ids:
            raise ValueError("prompt: the text has no tokens")
        req = self._prefill_only_request(request_id, text, token_ids, params, Pooler(method, len(token_ids)))
        if params.task == "embed":
            normalize = params.normalize if params.normalize is not None else own.normalize
            req.pooling = (True if normalize is None else normalize, params.dimensions)
        return req

    def _needs_lm_head(self, what: str) -> None:
        if not self.has_lm_head:
            kind = "a classification head" if self.class_labels is not None else "no language-model head"
            raise ValueError(f"model: {what} needs a language-model head, and this model has {kind}; "
                             "it can embed" + (" and classify" if self.class_labels is not None else ""))

    @property
    def model_config(self) -> ModelConfig:
        """What vLLM's clients read as `llm.llm_engine.model_config` (lm-eval: its max_model_len)."""
        return ModelConfig(self.config.model, self.max_model_len, self.dtype)

    @property
    def grammars(self) -> GrammarBackend:
        if self._grammars is None:
            self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.stopper.eos_token_ids)
        return self._grammars

    def _grammar_for(self, params: SamplingParams) -> RequestGrammar | None:
        if params.structured_outputs is None:
            return None
        self.prompts.needs_tokenizer("structured_outputs")
        return self.grammars.start(params.structured_outputs)

    def abort_request(self, request_id: str) -> None:
        """Drops a request between steps; it produces no output."""
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
            for parked in (self._held, self._suspects):
                if request_id in parked:
                    parked.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[AnyOutput]:
        if self._isolating and not self.scheduler.has_unfinished():
            self._next_trial()
        out = self.scheduler.schedule()
        finished = [self._finish_request(group.request_id) for group in out.ignored]
        try:
            step = self.runner.execute(out)
            self._read_hidden(out, step)
        except Exception as error:
            return finished + self._step_failed(out, error)
        logits = step.logits
        self._blamed_in_a_row = 0
        self.scheduler.on_step_done(out)
        now = time.time()
        kept = self._kept
        if kept is not None and not kept.batch.valid:
            kept = self._kept = None  # the scheduler dropped those rows: let go of their requests
        if out.decode is not None and kept is not None and kept.batch is out.decode.batch:
            return finished + self._kept_step(kept, logits, out.decode.positions + 2)
        sampled: list[ScheduledSeq] = [s for s in out.scheduled if s.samples]
        if len(sampled) < len(out.scheduled):
            for s in out.scheduled:
                if not s.samples and s.group.prefill_only and s.end == len(s.seq):
                    self._requests[s.group.request_id].metrics.first_scheduled_time = now
                    self.scheduler.finish_seq(s.seq, "stop")
        rows: list[SamplingRow] = []
        targets: list[tuple[_Request, Sequence]] = []
        row_of_logits: list[int] = []
        beam_rows: list[tuple[_Request, Sequence, int]] = []
        requests = self._requests
        kept_all = True  # every row is one kept in its request (no grammar, no bans): the step's rows can be kept
        for i, s in enumerate(sampled):
            req, seq = requests[s.group.request_id], s.seq
            if req.beams is not None:
                req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
                beam_rows.append((req, seq, i))
                continue
            if not req.sampling:  # its first token this step (the metrics, read once rather than every step)
                req.sampling = True
                req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
                req.metrics.first_token_time = req.metrics.first_token_time or now
            row = req.rows.get(seq.seq_id)
            if row is None:
                row = self._sampling_row(req, seq)
                kept_all = False
            rows.append(row)
            targets.append((req, seq))
            row_of_logits.append(i)
            if req.params.n > 1 and len(s.group.seqs) == 1 and seq.num_prompt_tokens == len(seq.token_ids):
                for child in self.scheduler.fork(s.group, seq, req.params.n - 1):
                    if req.grammar is not None:
                        req.grammar.fork(seq.seq_id, child.seq_id)
                    rows.append(self._sampling_row(req, child))
                    targets.append((req, child))
                    row_of_logits.append(i)
        if out.decode is not None and out.decode.batch.valid and kept_all and not beam_rows \
                and len(rows) == len(out.decode):  # no fork either (it drops the scheduler's rows)
            self._kept = KeptRows.of(out.decode.batch, rows, targets)
        beam_logprobs = self._beam_logprobs(logits, beam_rows)
        if rows:
            self._fill_grammar_masks(rows, targets)
            if len(row_of_logits) != len(sampled):
                logits = logits[torch.tensor(row_of_logits, device=logits.device)]
            self._append_tokens(targets, sample(logits, rows), now)
        for req in {req.group.request_id: req for req, _, _ in beam_rows}.values():
            self._beam_step(req, beam_logprobs, now)
        # A group is finished only when every sequence it scheduled is: the cheap test first.
        done = (s.group.request_id for s in out.scheduled if s.seq.status is _FINISHED and s.group.is_finished())
        for request_id in dict.fromkeys(done):
            finished.append(self._finish_request(request_id))
        return finished

    def _kept_step(self, kept: KeptRows, logits: torch.Tensor, lengths) -> list[AnyOutput]:
        """The rest of a steady decode step whose rows are kept (kept_rows.py): sample, append, the stop checks
        that are due, the finished requests. `lengths`: the rows' token counts after this step's token."""
        finished = kept.append(sample(logits, kept.rows), lengths, self.stopper.check, self.scheduler.finish_seq)
        self.num_output_tokens += len(kept.rows)
        done = (req.group.request_id for req, _ in finished if req.group.is_finished())
        return [self._finish_request(request_id) for request_id in dict.fromkeys(done)]

    def _read_hidden(self, out: SchedulerOutput, step: StepOutput) -> None:
        """What the step's requests read from its hidden states (see keep_hidden_from): logprobs of given
        tokens for all of them in one batch, pooled rows for each. Part of the step: a failure here is
        traced to a request as a failed forward is."""
        if out.decode is not None:
            return  # kept decode rows read none (decode_batch.keepable)
        batch, readers = LogprobBatch(), []
        for i, s in enumerate(out.scheduled):
            keep = s.seq.keep_hidden_from
            if keep is None or s.end <= keep:
                continue
            reader = self._requests[s.group.request_id].reader
            positions = reader.wanted(s.start, s.end)
            first = step.first_row[i] + positions.start - s.start
            if isinstance(reader, PromptLogprobs):
                batch.add(reader, first, positions)
            elif positions:
                reader.add(step.hidden[first:first + len(positions)], positions)
            readers.append((s.seq, reader))
        if batch:
            batch.compute(step.hidden, self.runner.model.compute_logits)
        for seq, reader in readers:
            seq.keep_hidden_from = reader.hidden_from

    # --- failed steps ---------------------------------------------------------------------------
    # A forward that raises has written nothing the engine keeps: its requests are aborted before
    # on_step_done, so none of their K/V is marked computed or shared through the prefix cache.
    def _step_failed(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """One request in the step: it fails alone with the error. Several: every request leaves
        the scheduler; the failed step's are tried again in halves, with nothing else, until a
        request fails alone (bisection), and the others start over afterwards (same seeds, so
        the same tokens)."""
        failed = list(dict.fromkeys(s.group.request_id for s in out.scheduled))
        if not failed or (len(failed) == 1 and self._blamed_in_a_row + 1 >= MAX_BLAMED_IN_A_ROW):
            raise error
        if len(failed) == 1:
            self._blamed_in_a_row += 1
            self.scheduler.abort(failed[0])
            self.scheduler.on_step_done(out)
            self._requests[failed[0]].group.error = (
                f"the engine failed on this request: {type(error).__name__}: {error}")
            self._trial_size = len(self._suspects)  # the rest of the failed step, all together
            return [self._finish_request(failed[0])]
        parked = set(self._held) | set(self._suspects)
        in_scheduler = [request_id for request_id in self._requests if request_id not in parked]
        for request_id in in_scheduler:
            self.scheduler.abort(request_id)
        self.scheduler.on_step_done(out)
        self._suspects = failed + self._suspects
        self._held += [request_id for request_id in in_scheduler if request_id not in self._suspects]
        self._trial_size = len(failed) // 2
        self._isolating = True
        return []

    def _next_trial(self) -> None:
        """The scheduler is empty: the next suspects go in, or, once none is left, all held ones."""
        if self._suspects:
            size = max(1, self._trial_size)
            batch, self._suspects = self._suspects[:size], self._suspects[size:]
        else:
            batch, self._held, self._isolating = self._held, [], False
        for request_id in batch:
            self._restart(request_id)

    def _restart(self, request_id: str) -> None:
        """Puts a request into the scheduler from its prompt again, as a new arrival."""
        req = self._requests[request_id]
        seq = Sequence(next(self._seq_ids), req.group.prompt_token_ids, lora_id=req.group.lora_id,
                       multi_modal=req.group.seqs[0].multi_modal)
        req.group = SequenceGroup(request_id, next(self._arrivals), req.params, [seq], beam_width=req.group.beam_width,
                                  prefill_only=req.group.prefill_only)
        req.stop_reasons.clear()
        req.rows.clear()
        if req.beams is not None:
            req.beams.reset()
        if req.reader is not None:
            req.reader.reset()
            seq.keep_hidden_from = req.reader.hidden_from
        if req.grammar is not None:
            req.grammar.reset()
            req.grammar.add(seq.seq_id)
        self.scheduler.add(req.group)

    def _sampling_row(self, req: _Request, seq: Sequence) -> SamplingRow:
        """The row that samples seq's next token. Kept in req.rows for the next steps where nothing in it can
        change: no grammar (its mask is set on the row every step) and no banned tokens (bans fall away once
        min_tokens is reached, and never come back); the row reads seq's token list in place."""
        params, outputs = req.params, len(seq.token_ids) - seq.num_prompt_tokens
        banned = self.stopper.banned_tokens(params, outputs) if outputs < params.min_tokens else []
        if req.grammar is not None:  # the grammar says when a constrained output may end
            banned = [t for t in banned if t not in self.stopper.eos_token_ids]
        row = SamplingRow(params, req.seed, seq.sample_index, seq.token_ids, seq.num_prompt_tokens, banned)
        if not banned and req.grammar is None:
            req.rows[seq.seq_id] = row
        return row

    @staticmethod
    def _beam_logprobs(logits: torch.Tensor | None,
                       beam_rows: list[tuple[_Request, Sequence, int]]) -> torch.Tensor | None:
        """The log-softmax of the step's beam rows, all in one call, each row's kept as pending for its beam."""
        if not beam_rows:
            return None
        index = [i for _, _, i in beam_rows]
        picked = logits if index == list(range(logits.shape[0])) else logits[torch.tensor(index, device=logits.device)]
        logprobs = torch.log_softmax(picked.float(), dim=-1)
        for j, (req, seq, _) in enumerate(beam_rows):
            req.beams.pending[seq.seq_id] = (logprobs, j)
        return logprobs

    def _beam_step(self, req: _Request, step_logprobs: torch.Tensor, now: float) -> None:
        """Once every live beam has its logprobs: the next beams, or the end of the search. A group's
        rows usually sit side by side in this step's logprobs and are read in place."""
        search, live = req.beams, req.group.unfinished_seqs()
        if any(seq.seq_id not in search.pending for seq in live):
            return
        pending = [search.pending.pop(seq.seq_id) for seq in live]
        first = pending[0][1]
        if all(t is step_logprobs and j == first + k for k, (t, j) in enumerate(pending)):
            logprobs = step_logprobs[first:first + len(live)]
        else:  # beams computed in different steps (after a recompute preemption)
            logprobs = torch.stack([t[j] for t, j in pending])
        continuations = search.step(live, logprobs)
        req.metrics.first_token_time = req.metrics.first_token_time or now
        if not continuations:
            for seq in live:
                self.scheduler.finish_seq(seq, "stop")
            return
        beams = self.scheduler.next_beams(req.group, [(c.parent, c.token_id) for c in continuations])
        for seq, c in zip(beams, continuations, strict=True):
            seq.cumulative_logprob = c.cumulative_logprob
        self.num_output_tokens += len(beams)

    def _fill_grammar_masks(self, rows: list[SamplingRow], targets: list[tuple[_Request, Sequence]]) -> None:
        """The allowed tokens of the step's constrained rows; unconstrained rows cost nothing."""
        constrained = [r for r, (req, _) in enumerate(targets) if req.grammar is not None]
        if not constrained:
            return
        matchers = [targets[r][0].grammar.matchers[targets[r][1].seq_id] for r in constrained]
        bitmask = self.grammars.fill(matchers)
        for i, r in enumerate(constrained):
            rows[r].allowed = bitmask[i]

    def _append_tokens(self, targets: list[tuple[_Request, Sequence]], result: SampledTokens, now: float) -> None:
        """Each sampled token onto its sequence, then its stop check: the sequence finishes where it says so."""
        check, finish = self.stopper.check, self.scheduler.finish_seq
        for (req, seq), token, logprob, top in zip(targets, result.token_ids, result.logprobs, result.top_logprobs,
                                                   strict=True):
            seq.token_ids.append(token)  # Sequence.append_token, without a call per sequence and step
            seq.cumulative_logprob += logprob
            if top is not None:
                seq.logprobs.append(top)
            watch = req.watch
            if watch.tokens is None or token in watch.tokens or len(seq.token_ids) >= watch.length:
                decision = check(req.params, seq.token_ids, seq.num_prompt_tokens)
            else:
                decision = None
            if req.grammar is not None and req.grammar.accept(seq.seq_id, token) and decision is None:
                decision = StopDecision("stop", token)  # the grammar has ended (e.g. EOS with ignore_eos)
            if decision is not None:
                req.stop_reasons[seq.seq_id] = decision.stop_reason
                finish(seq, decision.reason)
        self.num_output_tokens += len(targets)

    def _finish_request(self, request_id: str) -> AnyOutput:
        req = self._requests.pop(request_id)
        group = req.group
        req.metrics.finished_time = time.time()
        req.metrics.num_preemptions = group.num_preemptions
        prompt_ids = group.prompt_token_ids
        self.num_prompt_tokens += len(prompt_ids)
        if isinstance(req.params, PoolingParams):
            return self._pooling_output(req)
        if isinstance(req.params, ScoringParams):
            return self._score_output(req)
        completions = self._sample_completions(req) if req.beams is None else self._beam_completions(req)
        prompt_logprobs = req.reader.vllm_list() if req.reader is not None and group.error is None else None
        self._name_logprob_tokens(req.params, prompt_logprobs, *(c.logprobs for c in completions))
        return RequestOutput(group.request_id, req.prompt, prompt_ids, completions, True, group.error, req.metrics,
                             prompt_logprobs, req.lora_request)

    def _pooling_output(self, req: _Request) -> PoolingRequestOutput:
        group, params = req.group, req.params
        outputs = None
        if group.error is None:
            pooled = req.reader.result()
            if params.task == "embed":
                normalize, dimensions = req.pooling
                outputs = EmbeddingOutput(embedding(pooled, dimensions, normalize))
            else:
                logits = self.runner.model.compute_scores(pooled[None])[0]
                outputs = ClassificationOutput(class_probs(logits, params.activation).tolist(), logits.tolist(),
                                               list(self.class_labels))
        return PoolingRequestOutput(group.request_id, req.prompt, group.prompt_token_ids, outputs, True, group.error,
                                    req.metrics)

    def _score_output(self, req: _Request) -> CompletionScore:
        group, reader, params = req.group, req.reader, req.params
        tokens = group.prompt_token_ids
        out = CompletionScore(group.request_id, req.prompt, tokens[:reader.first], tokens[reader.first:],
                              error=group.error, metrics=req.metrics)
        if group.error is None:
            total = math.fsum(reader.chosen)
            out.logprob, out.num_tokens = total, len(reader.chosen)
            out.mean_logprob = total / out.num_tokens
            out.perplexity = math.exp(-out.mean_logprob)
            out.token_logprobs = list(reader.chosen) if params.token_logprobs else None
            out.top_logprobs = list(reader.top) if params.logprobs is not None else None
        return out

    def _name_logprob_tokens(self, params: SamplingParams, *positions: list | None) -> None:
        """The decoded_token of each Logprob, where the request detokenizes (vLLM leaves it None otherwise)."""
        if self.tokenizer is not None and getattr(params, "detokenize", True):
            for p in positions:
                name_tokens(p, self.tokenizer)

    def _text(self, params: SamplingParams, output: list[int], stop_reason: int | str | None) -> str:
        if not (output and self.tokenizer and getattr(params, "detokenize", True)):  # beams always detokenize
            return ""
        return self.stopper.final_text(params, output, stop_reason)

    def _sample_completions(self, req: _Request) -> list[CompletionOutput]:
        completions = []
        for seq in sorted(req.group.seqs, key=lambda s: s.sample_index):
            output = seq.output_token_ids
            stop_reason = req.stop_reasons.get(seq.seq_id)
            completions.append(CompletionOutput(
                index=seq.sample_index,
                text=self._text(req.params, output, stop_reason),
                token_ids=output,
                finish_reason=seq.finish_reason,
                cumulative_logprob=seq.cumulative_logprob if output else None,
                logprobs=list(seq.logprobs) if req.params.logprobs is not None else None,
                stop_reason=stop_reason,
                valid=None if req.grammar is None else self._valid(req.grammar, seq, stop_reason),
            ))
        return completions

    def _beam_completions(self, req: _Request) -> list[CompletionOutput]:
        """The finished hypotheses, best first (index = rank)."""
        return [CompletionOutput(
            index=rank, text=self._text(req.params, h.output_token_ids, h.stop_reason),
            token_ids=h.output_token_ids, finish_reason=h.finish_reason, cumulative_logprob=h.cumulative_logprob,
            stop_reason=h.stop_reason, score=h.score,
        ) for rank, h in enumerate(req.beams.hypotheses)]

    @staticmethod
    def _valid(grammar: RequestGrammar, seq: Sequence, stop_reason: int | str | None) -> bool:
        """A constrained output is valid when it ended with a whole string of its grammar; not when
        max_tokens cut it, nor when a stop string cut its text."""
        return seq.finish_reason == "stop" and not isinstance(stop_reason, str) and grammar.complete(seq.seq_id)

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
            "grammar_compiles": self._grammars.num_compiles if self._grammars is not None else 0,
            "lora_loads": self.scheduler.adapters.num_loads if self.scheduler.adapters is not None else 0,
            # a vision-language model's vision tower: images (or tiles) encoded, and the seconds it took
            **getattr(self.runner.model, "vision_stats", {}),
        }
