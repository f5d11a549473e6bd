"""What generation returns: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while unfinished
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: top-k token id -> logprob
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    valid: bool | None = None  # structured outputs: a whole string of the grammar; None if unconstrained


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None  # set when the request could not be served (e.g. prompt too long)
    metrics: RequestMetrics | None = field(default=None, repr=False)
