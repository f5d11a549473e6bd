"""``batchgen run``'s changes to a job for one run: ``--set FIELD=VALUE`` and ``--limit N``.

They are made to the parsed job file before it is validated, so an override is checked as if it
were written in the file, and the job saved next to the outputs (``_job.yaml``) is the job that
ran: a later run with other values is noticed as another configuration.
"""

from __future__ import annotations

import copy
import posixpath
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from ..sampling_params import PYTHON_ONLY
from .errors import JobInvalid, Problem
from .spec import field_named, field_names, section_at, suggest


@dataclass(frozen=True)
class Overrides:
    """``settings``: ``FIELD=VALUE`` as given (dotted path, YAML scalar); ``limit``: the first N rows
    only, into a trial output dir beside ``output.dir``."""

    settings: tuple[str, ...] = ()
    limit: int | None = None

    def __bool__(self) -> bool:
        return bool(self.settings) or self.limit is not None

    def apply(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A copy of the parsed job file with the overrides made; ``JobInvalid`` for a bad one."""
        out = copy.deepcopy(raw)
        problems: list[Problem] = []
        for text in self.settings:
            path, value, problem = parse_setting(text)
            problem = problem or path_problem(path) or assign(out, path, value)
            if problem:
                problems.append(Problem(f"--set {'.'.join(path)}", problem))
        if problems:
            raise JobInvalid(problems)
        if self.limit is not None:
            limit_outputs(out, self.limit)
        return out

    def job_text(self, raw: dict[str, Any], source: Path | None) -> str:
        """The job as it runs, as YAML, headed by where it came from and what was changed."""
        changes = [f"--set {s}" for s in self.settings]
        if self.limit is not None:
            changes.append(f"--limit {self.limit}")
        head = f"# {source.name if source else 'the job'} with {' '.join(changes)} (the job as run)\n"
        return head + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)


def parse_setting(text: str) -> tuple[list[str], Any, str | None]:
    """``sampling.max_tokens=16`` -> (["sampling", "max_tokens"], 16, None); the value is read as YAML
    (``null``, ``true``, ``0.5``, ``[a, b]``); the third item says what is wrong, if anything."""
    name, sep, value = text.partition("=")
    path = name.strip().split(".")
    if not sep or not all(path):
        return path, None, "expected FIELD=VALUE with a dotted field, e.g. sampling.max_tokens=16"
    try:
        return path, yaml.safe_load(value) if value.strip() else None, None
    except yaml.YAMLError as e:
        return path, None, f"the value is not YAML: {getattr(e, 'problem', None) or e}"


def path_problem(path: list[str]) -> str | None:
    """Why ``path`` names no field of a job file (with the closest field's name), or None. Below a
    field holding a mapping of free keys (``sampling.overrides``, ``model.lora_modules``) any key goes."""
    for depth, part in enumerate(path):
        model = section_at(path[:depth])
        if model is None:
            above = field_named(section_at(path[:depth - 1]) or BaseModel, path[depth - 1])
            if above is None or not _is_mapping(above.annotation):
                return f"{'.'.join(path[:depth])} is a value, not a section with fields"
            return None
        if field_named(model, part) is None:
            if path[:depth] == ["sampling"] and part in PYTHON_ONLY:
                return PYTHON_ONLY[part]
            which = "" if depth == len(path) - 1 else f" {part!r}"
            return f"unknown field{which}{suggest(part, field_names(model))}"
    return None


def _is_mapping(annotation: Any) -> bool:
    """Whether a field's annotation takes a mapping of free keys (``dict[str, str] | None``)."""
    return typing.get_origin(annotation) is dict or any(_is_mapping(a) for a in typing.get_args(annotation))


def assign(raw: dict[str, Any], path: list[str], value: Any) -> str | None:
    """Sets ``path`` in ``raw`` to ``value``, making missing sections; why it cannot, if so."""
    node = raw
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, str) and depth == 0 and part == "model":  # ``model: PATH`` is short for path
            child = node[part] = {"path": child}
        if not isinstance(child, dict):
            where = ".".join(path[:depth + 1])
            return f"{where} is {child!r} in the job file, not a section; set {where} whole"
        node = child
    node[path[-1]] = value
    return None


def trial_name(path: str, limit: int) -> str:
    """Where ``--limit N`` writes instead of ``path``: ``out/first`` -> ``out/first.limit-N``,
    ``all.jsonl`` -> ``all.limit-N.jsonl`` (a directory or a URL alike)."""
    path = path.rstrip("/")
    head, name = posixpath.split(path)
    stem, dot, suffix = name.rpartition(".") if "." in name.lstrip(".") else (name, "", "")
    return posixpath.join(head, f"{stem}.limit-{limit}{dot}{suffix}")


def limit_outputs(raw: dict[str, Any], limit: int) -> None:
    """``output.dir`` and ``output.merge_to`` moved to their trial names, so the real run's files are
    never touched (left alone when the job has no such field: validation reports it)."""
    output = raw.get("output")
    if not isinstance(output, dict):
        return
    if isinstance(output.get("dir"), str):
        output["dir"] = output["dir"].rstrip("/") + f".limit-{limit}"
    if isinstance(output.get("merge_to"), str):
        output["merge_to"] = trial_name(output["merge_to"], limit)
