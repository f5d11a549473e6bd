"""Columns and rows of the tasks that sample nothing (``task: score | embed | classify``).

Every row is sample 0 of 1 (so recovery and ``status`` treat them as generation rows). Numbers are the
engine's, unchanged: a logprob sum in float64, per-token logprobs, embeddings and probabilities in
float32 (the engine computes them in float32, so nothing is lost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ...outputs import CompletionScore, PoolingRequestOutput
from ..errors import JobError
from ..inputs import Row
from ..tasks import dimensions_problem


@dataclass(frozen=True)
class TaskShape:
    """What a task's columns depend on beyond the job file: the model's embedding size and labels."""

    task: str
    token_logprobs: bool = False  # score: a token_logprobs column
    dimensions: int | None = None  # embed: the vector's length
    labels: tuple[str, ...] = ()  # classify: the head's class names (one: a reward model's score)

    @property
    def reward(self) -> bool:
        return len(self.labels) == 1


def task_schema_columns(shape: TaskShape) -> list[pa.Field]:
    if shape.task == "score":
        cols = [pa.field("num_prompt_tokens", pa.int32()), pa.field("completion_tokens", pa.int32()),
                pa.field("completion_logprob", pa.float64()), pa.field("mean_logprob", pa.float64()),
                pa.field("perplexity", pa.float64())]
        if shape.token_logprobs:
            cols.append(pa.field("token_logprobs", pa.list_(pa.float32())))
        return cols
    if shape.task == "embed":
        return [pa.field("embedding", pa.list_(pa.float32(), shape.dimensions)),
                pa.field("num_prompt_tokens", pa.int32())]
    if shape.reward:
        return [pa.field("score", pa.float64()), pa.field("num_prompt_tokens", pa.int32())]
    probs = pa.struct([pa.field(name, pa.float32()) for name in shape.labels])
    return [pa.field("label", pa.string()), pa.field("probs", probs), pa.field("num_prompt_tokens", pa.int32())]


def task_rows(row: Row, out: CompletionScore | PoolingRequestOutput, shape: TaskShape) -> list[dict[str, Any]]:
    """The one output row of a scored, embedded or classified input row."""
    base = {"id": row.id, "sample_index": 0, "num_samples": 1, **row.carry,
            "num_prompt_tokens": len(out.prompt_token_ids)}
    if isinstance(out, CompletionScore):
        return [{**base, "completion_tokens": out.num_tokens, "completion_logprob": out.logprob,
                 "mean_logprob": out.mean_logprob, "perplexity": out.perplexity,
                 "token_logprobs": out.token_logprobs}]
    result = out.outputs
    if shape.task == "embed":
        return [{**base, "embedding": result.embedding}]
    if shape.reward:  # a reward model's output is its head's logit
        return [{**base, "score": result.logits[0]}]
    return [{**base, "label": result.label, "probs": dict(zip(result.labels, result.probs, strict=True))}]


def task_shape(task: str, llm: Any, token_logprobs: bool = False, pooling: str | None = None,
               dimensions: int | None = None) -> TaskShape:
    """The shape of a task's columns on this engine; a model that cannot serve the task is refused here,
    before any row (one line), instead of failing every row."""
    name = getattr(llm, "model_name", "?")
    if task == "classify":
        labels = getattr(llm, "class_labels", None)
        if not labels:
            raise JobError(f"task classify: model {name} has no classification head (a ...ForSequenceClassification "
                           "checkpoint with id2label); use task embed or generate")
        if len(set(labels)) != len(labels):
            raise JobError(f"task classify: model {name} repeats a label name in id2label ({', '.join(labels)}); "
                           "the probs columns are named by them")
        return TaskShape(task, labels=tuple(labels))
    if task == "embed":
        hidden = getattr(llm, "hidden_size", None)
        if why := dimensions_problem(dimensions, hidden):
            raise JobError(f"embed.dimensions: {why}")
        own = getattr(llm, "pooling_config", None)
        if pooling is None and own is not None and own.problem:
            raise JobError(f"embed.pooling: the model's own cannot be followed: {own.problem}; "
                           "name one (last, mean or cls)")
        return TaskShape(task, dimensions=dimensions or hidden)
    return TaskShape(task, token_logprobs=token_logprobs)
