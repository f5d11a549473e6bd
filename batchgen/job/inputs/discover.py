"""Finding a job's input files: paths, globs and directories, local or in a bucket, and the
format of each file (from its name, or ``input.format``)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from ...storage import Location, StorageOptions, location
from ..errors import Problem
from ..spec import InputSpec
from . import hf_dataset
from .rows import InputFile

EXTENSIONS = {".parquet": "parquet", ".pq": "parquet",
              ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}


def file_format(path: Path | Location, given: str | None) -> str | None:
    if given:
        return given
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return EXTENSIONS.get(suffixes[-1]) if suffixes else None


def discover(spec: InputSpec, base_dir: Path | Location, exclude: Location | None = None,
             storage: StorageOptions | None = None) -> tuple[list[InputFile], list[Problem]]:
    """Expand the input paths/globs, local or in a bucket (directories mean every known input
    file inside, sorted). Files under ``exclude`` (the job's output dir) are never input.
    ``input.dataset`` instead: its split, as one input file."""
    if spec.dataset is not None:
        local_base = base_dir.local if isinstance(base_dir, Location) else Path(base_dir)
        try:
            return [hf_dataset.find(spec.dataset, local_base)], []
        except hf_dataset.DatasetProblem as e:
            return [], [Problem(e.field, e.message)]
    files: list[InputFile] = []
    problems: list[Problem] = []
    seen: set[Location] = set()
    base = location(base_dir)
    for i, pattern in enumerate(spec.paths or []):
        try:
            matches = _matches(location(pattern, base, storage))
        except OSError as e:
            problems.append(Problem(f"input.paths[{i}]", str(e)))
            continue
        if exclude is not None:
            matches = [p for p in matches if not p.is_under(exclude)]
        if not matches:
            problems.append(Problem(f"input.paths[{i}]", _no_match(location(pattern, base, storage))))
        for p in matches:
            if p in seen:
                continue
            seen.add(p)
            fmt = file_format(p, spec.format)
            if fmt is None:
                problems.append(Problem(f"input.paths[{i}]",
                                        f"cannot tell the format of {p.name!r}; set input.format"))
                continue
            files.append(InputFile(p, fmt, _display_name(p, base)))
    formats = sorted({f.format for f in files})
    if len(formats) > 1:
        problems.append(Problem("input.paths", f"all input files must have one format; found {', '.join(formats)}"))
    return files, problems


def _no_match(pattern: Location) -> str:
    """Why nothing matches ``pattern``: its bucket is not there (or cannot be named so), as the store
    says; else no file matches."""
    if not pattern.is_local:
        try:
            pattern.prepare_dir()  # creates nothing: asks whether the bucket exists
        except OSError as e:
            return str(e)
    return f"no input file matches {str(pattern)!r}"


def _matches(full: Location) -> list[Location]:
    if glob.has_magic(full.path):
        return full.expand()
    if full.is_dir():
        return sorted((p for p in full.list_files() if not p.name.startswith((".", "_")) and file_format(p, None)),
                      key=lambda p: p.path)
    return [full] if full.is_file() else []


def _display_name(path: Location, base: Location) -> str:
    """The name in messages and derived ids: relative to the job file's directory when below it."""
    if not path.is_local:
        return str(path)
    return path.relative_to(base) or os.path.realpath(path.path)
