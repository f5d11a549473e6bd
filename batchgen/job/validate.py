"""Everything ``batchgen validate`` checks, also run before every ``batchgen run``: the schema,
the sampling rules, the model directory, the input files and their columns. Each section is
checked on its own so one broken section does not hide the problems of another."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .errors import JobError, JobInvalid, Problem
from .reader import InputReader, discover
from .spec import (
    InputSpec,
    Job,
    JobSpec,
    ModelSpec,
    OutputSpec,
    SamplingSpec,
    parse_yaml,
    read_job_text,
    resolve_path,
    spec_problems,
    valid_part,
)


def validate_job_file(path: str | Path) -> Job:
    """The validated job; raises ``JobInvalid`` listing every problem found."""
    path = Path(path)
    text = read_job_text(path)
    raw = parse_yaml(text)
    base_dir = path.resolve().parent
    problems = spec_problems(raw)
    model_raw = raw.get("model")
    model = valid_part(ModelSpec, {"path": model_raw} if isinstance(model_raw, str) else model_raw)
    if model is not None:
        problems += model_problems(model, base_dir)
    inp = _part(InputSpec, raw.get("input"))
    if inp is not None:
        sampling = _part(SamplingSpec, raw.get("sampling") or {})
        output = _part(OutputSpec, raw.get("output"))
        exclude = None if output is None else resolve_path(base_dir, output.dir)
        problems += input_problems(inp, base_dir, sampling.overrides if sampling is not None else {}, exclude)
    if problems:
        raise JobInvalid(sorted(problems, key=_section_rank))
    return Job(spec=JobSpec.model_validate(raw), base_dir=base_dir, text=text, source=path.resolve())


def model_problems(model: ModelSpec, base_dir: Path) -> list[Problem]:
    p = resolve_path(base_dir, model.path)
    problems = []
    if not p.exists():
        problems.append(Problem("model.path", f"no model directory at {p}"))
    elif not p.is_dir():
        problems.append(Problem("model.path", f"{p} is not a directory (need a Hugging Face model dir)"))
    return problems + engine_option_problems(model.engine_kwargs(p))


def engine_option_problems(kwargs: dict[str, Any]) -> list[Problem]:
    """The engine's own option checks (``batchgen.config.EngineConfig``), every field reported:
    on an error, note it, reset that option to its default and ask again. Skipped when the
    engine's config is not importable (the job layer needs only the engine's public API)."""
    try:
        from ..config import EngineConfig
    except ImportError:
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name in kwargs}
    kwargs = dict(kwargs)
    problems: list[Problem] = []
    for _ in range(len(kwargs) + 1):
        try:
            EngineConfig(**kwargs)
            break
        except (ValueError, TypeError) as e:
            m = re.match(r"(\w+): (.*)$", str(e), re.DOTALL)
            name = m.group(1) if m else None
            if name not in defaults or kwargs[name] == defaults[name]:
                problems.append(Problem("model", str(e)))
                break
            problems.append(Problem(f"model.{name}", m.group(2)))
            kwargs[name] = defaults[name]
    return problems


def input_problems(inp: InputSpec, base_dir: Path, overrides: dict[str, str],
                   exclude: Path | None = None) -> list[Problem]:
    files, problems = discover(inp, base_dir, exclude)
    try:
        return problems + InputReader(inp, base_dir, overrides, files=files).check()
    except JobError as e:
        return [*problems, Problem("input", str(e))]


_SECTIONS = ["", "model", "input", "sampling", "output", "shard"]


def _section_rank(p: Problem) -> int:
    """Problems grouped by section in job-file order (the sort is stable within a section)."""
    head = re.split(r"[.\[]", p.path, maxsplit=1)[0]
    return _SECTIONS.index(head) if head in _SECTIONS else len(_SECTIONS)


def _part(model: Any, raw: Any) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None
