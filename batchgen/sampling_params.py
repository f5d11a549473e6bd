"""SamplingParams: how to sample one request, with the fields vLLM users know."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from batchgen.structured.params import StructuredOutputsParams

LogitsProcessor = Callable[..., Any]  # returns the row's logits (a torch.Tensor)


# SamplingParams fields that only Python code can give, and what a job file is told instead.
PYTHON_ONLY = {"logits_processors": "Python callables cannot be given in a job file; pass "
                                    "SamplingParams(logits_processors=[...]) to LLM.generate in Python instead"}


def processor_arity(fn: object) -> int | None:
    """How many arguments a logits processor takes (2: generated ids and logits; 3: the prompt's ids first),
    as vLLM tells them apart; None for something that is not a callable of two or three arguments."""
    if not callable(fn):
        return None
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) if not any(p.kind == p.VAR_POSITIONAL for p in params) else 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top k (vLLM's meaning)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True  # False: outputs carry token ids and an empty text (vLLM's meaning)
    spaces_between_special_tokens: bool = True  # kept special tokens spaced from the text (slow tokenizers; vLLM's)
    # Python callables (generated_ids, logits) -> logits or (prompt_ids, generated_ids, logits) -> logits, applied
    # in order to each sample's own row of logits (a float32 vector) before it is sampled: the slow path, per row.
    # Not in job files (a callable has no YAML form).
    logits_processors: list[LogitsProcessor] | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logits_processors = list(self.logits_processors or []) or None
        try:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"SamplingParams.{e}") from None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why} (got {getattr(self, name)!r})")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0 or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.stop and not self.detokenize:
            raise bad("detokenize", f"stop strings ({self.stop!r}) are found in the text: leave detokenize on")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        for fn in self.logits_processors or ():
            if processor_arity(fn) not in (2, 3):
                raise bad("logits_processors", "each must be a callable (generated_ids, logits) -> logits or "
                                               "(prompt_ids, generated_ids, logits) -> logits")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def field_names(cls) -> list[str]:
        """The fields a job file or a request body can set (not PYTHON_ONLY's)."""
        return [f.name for f in fields(cls) if f.init and f.name not in PYTHON_ONLY]


@dataclass
class BeamSearchParams:
    """Beam search for one prompt, vLLM's `BeamSearchParams` plus the fields transformers' beam search
    has (`early_stopping`, `min_tokens`, stop tokens and strings). The `beam_width` best finished
    hypotheses come back, ranked by `cumulative_logprob / num_output_tokens ** length_penalty`
    (transformers' score: the output's length counts its final EOS)."""

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    temperature: float = 0.0  # vLLM has it; beam search here ranks by the model's own logprobs
    _as_sampling: SamplingParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"BeamSearchParams.{name}: {why} (got {getattr(self, name)!r})")

        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise bad("beam_width", "must be an integer >= 1")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise bad("length_penalty", "must be a number")
        if not isinstance(self.early_stopping, bool):
            raise bad("early_stopping", "must be true or false")
        if self.temperature != 0:
            raise bad("temperature", "beam search ranks by the model's logprobs; only 0 is supported")
        try:
            self._as_sampling = SamplingParams(
                n=1, temperature=0.0, max_tokens=self.max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens)
        except ValueError as e:
            raise ValueError(str(e).replace("SamplingParams.", "BeamSearchParams.", 1)) from None
        self.stop, self.stop_token_ids = self._as_sampling.stop, self._as_sampling.stop_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        """The same stopping rules as greedy SamplingParams: what the engine's stop checks read."""
        return self._as_sampling
