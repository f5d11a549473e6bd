"""`LLM`: the vLLM-shaped public API over LLMEngine."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from batchgen.config import ConfigError, ConfigProblem, engine_config
from batchgen.engine.gc_pacing import fewer_collections
from batchgen.engine.llm_engine import AnyOutput, AnyParams, LLMEngine
from batchgen.engine.pooling import PoolingConfig
from batchgen.engine.preflight import plan_model
from batchgen.engine.prompts import EncodedPrompt, Prompt
from batchgen.lora.request import LoRARequest
from batchgen.models.resolve import ModelNotFound, fetch_note, locate_model, model_source, resolve_model
from batchgen.outputs import BeamSearchOutput, CompletionScore, PoolingRequestOutput, RequestOutput
from batchgen.pooling_params import PoolingParams, ScoringParams
from batchgen.sampling_params import BeamSearchParams, SamplingParams
from batchgen.storage import StorageOptions

AnyLoRA = LoRARequest | Sequence[LoRARequest | None] | None
ENCODE_CHUNK = 1024  # prompts encoded in one tokenizer call by the batch API
logger = logging.getLogger(__name__)


class LLM:
    """An offline generator: `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

    `model` is a local model directory (or .gguf file), a Hugging Face Hub id such as
    "HuggingFaceTB/SmolLM2-135M-Instruct" (found in the Hub cache, downloaded unless HF_HUB_OFFLINE is
    set; `revision` picks a branch, tag or commit), or a bucket URL such as "s3://bucket/models/NAME"
    (copied once per node into $BATCHGEN_CACHE/models; `storage` takes the job file's storage options
    as a `batchgen.storage.StorageOptions` or a dict). A local path that exists wins over an id.

    Engine options (vLLM's names): dtype, device, block_size, kv_cache_memory (CPU), gpu_memory_utilization
    (CUDA), swap_space, max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching,
    preemption_mode, seed, num_threads, skip_tokenizer_init, model_impl ("auto", "native" or "transformers":
    batchgen's own implementation of the architecture, or the model's transformers code on batchgen's attention),
    enable_lora, max_loras, max_lora_rank, max_cpu_loras (LoRA adapters: every batch call takes `lora_request=`,
    one `LoRARequest` for all prompts or a list with one per prompt, None for the base model; docs/lora.md).
    quantization ("int8": the layers' projections and MoE experts on int8 compute, CPU only; docs/int8.md),
    enforce_eager (CUDA: decode steps run op by op instead of as CUDA graphs captured per batch size; docs/gpu.md),
    kv_cache_dtype ("auto", or "fp8" / "fp8_e4m3" / "fp8_e5m2": the KV cache in 8 bits, half the bytes per cached
    token; docs/kv-cache.md), num_gpu_blocks_override (the KV cache's blocks on any device, in place of what
    kv_cache_memory or gpu_memory_utilization would give: a small cache that makes preemption happen in tests).
    """

    def __init__(self, model: str | os.PathLike[str], *, revision: str | None = None,
                 storage: StorageOptions | dict[str, Any] | None = None, **options):
        source = model_source(model, revision=revision)
        local = resolve_model(source, storage)
        if source.kind != "local":
            options.setdefault("served_model_name", source.ref)
        config, ignored = engine_config(str(local), options)
        if ignored:
            logger.warning("batchgen ignores %s: vLLM options that change nothing it computes", ", ".join(ignored))
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @staticmethod
    def check_config(model: str | os.PathLike[str], *, revision: str | None = None,
                     storage: StorageOptions | dict[str, Any] | None = None, **options) -> list[ConfigProblem]:
        """The problems `LLM(model, **options)` would refuse to start with, found without loading
        the weights (an empty list: none) and without fetching the model: a model that is not
        here (a missing path, a Hub id not in the cache, a bucket not copied yet) raises
        FileNotFoundError."""
        source = model_source(model, revision=revision)
        local = locate_model(source, storage)
        if local is None:
            raise ModelNotFound(fetch_note(source))
        try:
            plan_model(engine_config(str(local), options)[0])
        except ConfigError as e:
            return e.problems
        return []

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name): `llm.llm_engine.model_config.max_model_len` as vLLM's clients read it."""
        return self.engine

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's name for `tokenizer`); None with skip_tokenizer_init."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def hidden_size(self) -> int:
        """The length of an embedding before `dimensions` truncates it."""
        return self.engine.runner.model.hidden_size

    @property
    def supports_images(self) -> bool:
        """Whether the model reads images: a vision-language model batchgen runs (docs/vision.md)."""
        return self.engine.prompts.images is not None

    @property
    def class_labels(self) -> list[str] | None:
        """A classifier's class names (its config's id2label, in class order); None without a classification head."""
        return self.engine.class_labels

    @property
    def spare_core(self) -> bool:
        """Whether a CPU core is left free of the engine's compute (its model runs on a GPU, or on fewer CPU
        threads than this process may use): where host work on another thread runs beside the steps instead
        of taking turns with the engine's threads."""
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        return self.engine.device.type != "cpu" or torch.get_num_threads() < len(usable)

    @property
    def pooling_config(self) -> PoolingConfig:
        """How the model's sentence-transformers config says to pool (what `embed` follows by default)."""
        return self.engine.pooling_config

    # --- incremental API (what the job runner streams through) ---
    def add_request(self, request_id: str, prompt: Prompt | EncodedPrompt, params: AnyParams, *,
                    completion: str | list[int] | None = None, lora_request: LoRARequest | None = None) -> None:
        """Generation (SamplingParams, BeamSearchParams), embedding or classification (PoolingParams) or
        the scoring of `completion` after `prompt` (ScoringParams); all of them share the engine's steps."""
        self.engine.add_request(request_id, prompt, params, completion=completion, lora_request=lora_request)

    def encode_batch(self, prompts: Sequence[Prompt]) -> list[Prompt | EncodedPrompt | Exception]:
        """Text and chat prompts encoded together, ready for `add_request` (which then does not encode
        them again); token ids as they are; a prompt that cannot be encoded as the error `add_request`
        would raise. One call for many prompts costs far less than one per prompt."""
        return self.engine.prompts.encode_batch(prompts)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads and checks `lora_request`'s adapter now rather than when a request first names it (a
        `ValueError` in one line when it cannot be applied)."""
        self.engine.add_lora(lora_request)

    def step(self) -> list[AnyOutput]:
        return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests()

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    # --- batch API ---
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: AnyLoRA = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in input order. A prompt is a text, token ids, vLLM's
        `{"prompt": text}` or `{"prompt_token_ids": ids}`, or, for a vision-language model, `{"prompt": text,
        "multi_modal_data": {"image": image or [images]}}` (PIL images; a text without the model's image
        placeholder gets one per image in front of it; docs/vision.md)."""
        return self._run(_prompt_list(prompts), sampling_params, use_tqdm, lora_request=lora_request)

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: AnyLoRA = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates. A message's content may be
        a list of OpenAI content parts: `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url":
        {"url": ...}}` (a path, bucket or data: URL, loaded with `batchgen.images.load_image`) or `{"type":
        "image", "image": <PIL image>}` (vision-language models; docs/vision.md)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run(list(conversations), sampling_params, use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        lora_request: AnyLoRA = None,
    ) -> list[PoolingRequestOutput]:
        """One embedding per prompt (text, token ids or a chat conversation), `outputs.embedding`: its final
        hidden states pooled ("last", "mean" or "cls"; by default as the model's sentence-transformers config
        says, else "last"), truncated to `dimensions` and L2-normalised (by default as the model's config says,
        else normalised). Prefill only: nothing is sampled, and they mix with other requests in one engine."""
        if pooling_params is None:
            pooling_params = PoolingParams("embed", pooling=pooling, normalize=normalize, dimensions=dimensions)
        elif (pooling, normalize, dimensions) != (None, None, None):
            raise ValueError("embed: give pooling, normalize and dimensions in pooling_params or as keywords, not both")
        return self._run(_prompt_list(prompts), _task(pooling_params, "embed"), use_tqdm, "embedding",
                         lora_request=lora_request)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: AnyLoRA = None,
    ) -> list[PoolingRequestOutput]:
        """A classifier's (or reward model's) output per prompt: `outputs.probs` (softmax of the logits; a
        sigmoid for one label), `outputs.logits` and `outputs.labels` (the config's names). The head reads the
        last token's final hidden state, as transformers' `...ForSequenceClassification` does."""
        return self._run(_prompt_list(prompts), _task(pooling_params or PoolingParams("classify"), "classify"),
                         use_tqdm, "classifying", lora_request=lora_request)

    def score_completions(
        self,
        prompts: Prompt | Sequence[Prompt],
        completions: str | list[int] | Sequence[str | list[int]],
        params: ScoringParams | None = None,
        use_tqdm: bool = True,
        lora_request: AnyLoRA = None,
    ) -> list[CompletionScore]:
        """The log-likelihood of each completion after its prompt, under the model: `logprob` (the sum of its
        tokens' logprobs), `num_tokens`, `mean_logprob`, `perplexity`, and with `ScoringParams(token_logprobs=True)`
        each token's. Prompt and completion are tokenized apart (the completion without special tokens) and
        joined; a chat conversation as prompt is rendered with the generation prompt, the completion being the
        assistant's reply. One prompt with many completions, or rows sharing a prompt, compute it once where
        the prefix cache holds it. Nothing is sampled. (vLLM's `LLM.score` is another thing: a cross-encoder's
        relevance of two texts.)"""
        prompts = _prompt_list(prompts)
        completions = [completions] if isinstance(completions, str) or (
            completions and isinstance(completions[0], int)) else list(completions)
        if len(prompts) == 1 and len(completions) > 1:
            prompts = prompts * len(completions)
        if len(prompts) != len(completions):
            raise ValueError(f"completions: {len(completions)} given for {len(prompts)} prompts")
        return self._run(prompts, params or ScoringParams(), use_tqdm, "scoring", completions, lora_request)

    def beam_search(
        self,
        prompts: Prompt | dict | Sequence[Prompt | dict],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: AnyLoRA = None,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best hypotheses of each prompt, best first. A prompt is a text,
        token ids, vLLM's `{"prompt": text}` or `{"prompt_token_ids": ids}`, or a chat conversation
        (a list of `{"role", "content"}` messages, rendered with the chat template). The beams of a
        prompt share its KV blocks and run with every other request in continuous batches; a
        prompt the engine cannot serve gets `error` set instead of raising."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        single = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)) or (
            prompts and isinstance(prompts[0], dict) and "role" in prompts[0])
        prompts = [prompts] if single else list(prompts)
        outputs = self._run(prompts, params, use_tqdm, lora_request=lora_request)
        return [BeamSearchOutput.of(out) for out in outputs]

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm: bool, desc: str = "generating",
             completions: list | None = None, lora_request: AnyLoRA = None) -> list:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams, PoolingParams, ScoringParams)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        done: dict[str, AnyOutput] = {}
        with fewer_collections():
            for lo in range(0, len(prompts), ENCODE_CHUNK):
                for i, prompt in enumerate(self.encode_batch(prompts[lo:lo + ENCODE_CHUNK]), lo):
                    if isinstance(prompt, Exception):
                        raise prompt
                    self.add_request(ids[i], prompt, sampling_params[i],
                                     completion=None if completions is None else completions[i],
                                     lora_request=loras[i])
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(prompts), desc=desc, unit="req", dynamic_ncols=True)
            while self.has_unfinished_requests():
                for output in self.step():
                    done[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(out_tok=self.engine.num_output_tokens, refresh=False)
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _per_prompt(lora_request: AnyLoRA, num_prompts: int) -> list[LoRARequest | None]:
    """`lora_request` as one entry per prompt: one request (or None) for all, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request: {len(loras)} given for {num_prompts} prompts")
    return loras


def _prompt_list(prompts: Prompt | dict | Sequence[Prompt | dict]) -> list[Prompt]:
    """One prompt (a text, token ids, a conversation or one of vLLM's prompt dicts) as a list of one, a list of
    prompts as it is (PromptEncoder.normalize reads each one's shape)."""
    single = isinstance(prompts, (str, dict)) or bool(prompts) and (
        isinstance(prompts[0], int) or isinstance(prompts[0], dict) and "role" in prompts[0])
    return [prompts] if single else list(prompts)


def _task(params: PoolingParams | Sequence[PoolingParams], task: str) -> PoolingParams | list[PoolingParams]:
    """params, checked to be for `task` (PoolingParams' default task is embed)."""
    for p in [params] if isinstance(params, PoolingParams) else params:
        if not isinstance(p, PoolingParams) or p.task != task:
            raise ValueError(f"pooling_params: {task} takes PoolingParams(task={task!r}), got {p!r}")
    return params
