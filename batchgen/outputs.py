"""What the engine returns: RequestOutput holding one CompletionOutput per sample (generation),
PoolingRequestOutput (embeddings, classifiers) and CompletionScore (scoring a given completion)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.lora.request import LoRARequest


class Logprob(float):
    """One token's log-probability at one position, as vLLM's `Logprob`: `.logprob`, `.rank` (1-based, among
    the whole vocabulary at that position: 1 + how many tokens score higher, ties counted as vLLM does) and
    `.decoded_token` (the token's text alone; None when the request does not detokenize).

    It is a float too, so code that reads these dicts as token id -> float (sums, `max(d, key=d.get)`, the
    Parquet and JSON writers, lm-eval's `getattr(lp, "logprob", lp)`) reads it unchanged."""

    __slots__ = ("rank", "decoded_token")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


# Per position: token id -> its Logprob (the chosen or actual token, and the top k).
LogprobDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while unfinished
    cumulative_logprob: float | None = None
    logprobs: list[LogprobDict] | None = None  # per generated token: the sampled token and the top k
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    valid: bool | None = None  # structured outputs: a whole string of the grammar; None if unconstrained
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to first being scheduled (vLLM's field)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None  # set when the request could not be served (e.g. prompt too long)
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per token a dict of token id ->
    # Logprob with the token itself and the top k (vLLM's shape)
    prompt_logprobs: list[LogprobDict | None] | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's field); None: the base model


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax of the logits (a sigmoid for one label); the logits when activation is off
    logits: list[float]
    labels: list[str]  # the config's id2label, in class order

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @property
    def label(self) -> str:
        """The most likely class's name."""
        return self.labels[max(range(len(self.logits)), key=self.logits.__getitem__)]


@dataclass
class PoolingRequestOutput:
    """vLLM's `EmbeddingRequestOutput` / `ClassificationRequestOutput`: `outputs.embedding` or `outputs.probs`
    (`outputs` is None when `error` is set)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | None
    finished: bool = True
    error: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class CompletionScore:
    """The log-likelihood of a given completion after its prompt (`LLM.score_completions`): natural logs.
    Statistics are None when `error` is set."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprob: float | None = None  # the sum over the completion's tokens
    num_tokens: int = 0
    mean_logprob: float | None = None
    perplexity: float | None = None  # exp(-mean_logprob)
    token_logprobs: list[float] | None = None  # ScoringParams.token_logprobs
    top_logprobs: list[dict[int, float]] | None = None  # ScoringParams.logprobs: per token, top k and itself
    error: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class BeamSearchSequence:
    """One finished hypothesis of `LLM.beam_search`, as vLLM's: `tokens` holds the prompt and the
    output; `text` is the output's text alone (vLLM's holds the prompt's text too)."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float  # what the hypotheses are ranked by: cum_logprob / num_output_tokens ** length_penalty
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)  # vLLM has it; not filled here

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best hypotheses of one prompt, best first (at most beam_width; none when `error` is set)."""

    sequences: list[BeamSearchSequence]
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> BeamSearchOutput:
        prompt = list(out.prompt_token_ids)
        sequences = [BeamSearchSequence(prompt + c.token_ids, c.text, c.cumulative_logprob, c.score, c.finish_reason,
                                        c.stop_reason, len(prompt)) for c in out.outputs]
        return cls(sequences, out.prompt, prompt, out.error)
