"""A job's ``task``: what the engine does with each row and which columns a part gets.

``generate`` (the default) samples completions. ``score`` computes the log-likelihood of the row's
``input.completion_column`` after its prompt, ``embed`` pools the prompt's final hidden states into a
vector, ``classify`` runs the model's classification head; none of them samples anything, so the
``sampling`` section and ``output.fields`` belong to ``generate`` alone. The options of a task are in
the section named after it (``score:``, ``embed:``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PositiveInt

from .errors import Problem

TASKS = ("generate", "score", "embed", "classify")
Task = Literal["generate", "score", "embed", "classify"]
# The columns each task writes besides id, sample_index, num_samples, the carried ones and error.
SCORE_COLUMNS = ("num_prompt_tokens", "completion_tokens", "completion_logprob", "mean_logprob", "perplexity")
TASK_COLUMNS = {
    "score": (*SCORE_COLUMNS, "token_logprobs"),
    "embed": ("embedding", "num_prompt_tokens"),
    "classify": ("label", "probs", "score", "num_prompt_tokens"),
}


class ScoreSpec(BaseModel):
    """``score:`` options."""

    model_config = ConfigDict(extra="forbid")
    token_logprobs: bool = False  # a token_logprobs column: each completion token's logprob, in order


class EmbedSpec(BaseModel):
    """``embed:`` options; None follows the model's sentence-transformers config (else last, normalised)."""

    model_config = ConfigDict(extra="forbid")
    pooling: Literal["last", "mean", "cls"] | None = None
    normalize: bool | None = None
    dimensions: PositiveInt | None = None  # keep the first N dimensions (Matryoshka models), before normalising


TASK_SECTIONS: dict[str, type[BaseModel]] = {"score": ScoreSpec, "embed": EmbedSpec}


def dimensions_problem(dimensions: int | None, hidden: int | None) -> str | None:
    """Why ``embed.dimensions`` cannot be served by a model of ``hidden`` dimensions (None: it can, or unknown)."""
    if dimensions is None or hidden is None or dimensions <= hidden:
        return None
    return f"{dimensions} is more than the model's hidden size ({hidden})"


def task_options(task: str, section: BaseModel | None) -> dict[str, Any]:
    """The task's options with their defaults filled in (what the config hash covers)."""
    cls = TASK_SECTIONS.get(task)
    if cls is None:
        return {}
    return (section or cls()).model_dump()


def task_problems(raw: dict[str, Any]) -> list[Problem]:
    """Combinations of ``task`` and the other sections that cannot be served, each in one line."""
    task = raw.get("task", "generate")
    if task not in TASKS:
        return []  # the schema reports it
    problems = [Problem(name, f"applies to task {name}; set task: {name}")
                for name in TASK_SECTIONS if name in raw and task != name]
    inp = raw.get("input") if isinstance(raw.get("input"), dict) else {}
    out = raw.get("output") if isinstance(raw.get("output"), dict) else {}
    if inp.get("format") == "openai_batch":
        if "task" in raw:
            problems.append(Problem("task", "input.format openai_batch: each request's url says what to do "
                                            "(/v1/embeddings embeds); remove task"))
        return problems
    completion = inp.get("completion_column")
    if task == "score" and not completion:
        problems.append(Problem("input.completion_column", "task score needs the column holding the completion "
                                                           "to score after each prompt"))
    elif task != "score" and completion:
        problems.append(Problem("input.completion_column", "applies to task score only"))
    if task == "generate":
        return problems
    if raw.get("sampling"):
        problems.append(Problem("sampling", f"task {task} samples nothing; remove the sampling section"))
    if "fields" in out:
        problems.append(Problem("output.fields", f"task {task} writes its own columns "
                                                 f"({', '.join(task_columns(task))}); remove fields"))
    if out.get("format") == "openai_batch" and task != "embed":
        problems.append(Problem("output.format", f"task {task} has no OpenAI batch response shape; "
                                                 "use parquet or jsonl"))
    return problems


def task_columns(task: str) -> tuple[str, ...]:
    return TASK_COLUMNS.get(task, ())
