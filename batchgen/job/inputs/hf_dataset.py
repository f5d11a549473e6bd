"""Hugging Face datasets as input (``input.dataset``): one split of a dataset, read from its Arrow
files in batches (memory-mapped, never whole in Python), numbered from 0, ids ``<split>:<row>``.

``path`` is a ``save_to_disk`` directory (``datasets.load_from_disk``), another local
directory of data files, or a Hub id, which ``datasets`` finds in its local cache (``HF_HOME``,
``HF_DATASETS_CACHE``); offline (``HF_HUB_OFFLINE=1``) it uses that cache alone, as
``load_dataset`` does. Which dataset, config or split is missing is one problem at its field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow as pa

from ...extras import install_hint
from ..errors import JobError
from ..spec import DatasetSpec, resolve_path
from .arrow import BATCH_ROWS, batch_records
from .rows import DatasetRef, InputFile, Record

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes


class DatasetProblem(JobError):
    """A dataset, config or split that cannot be had; ``field`` is its place in the job file."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
        self.message = message


def find(spec: DatasetSpec, base_dir: Path) -> InputFile:
    """The split as an input file, opened once here so that a missing one is found by
    ``validate``; raises ``DatasetProblem``."""
    ref = resolve(spec, base_dir)
    open_split(ref)
    config = f" config {ref.name}" if ref.name else ""
    return InputFile(None, "dataset", ref.split, f"dataset {spec.path}{config} split {ref.split}", ref)


def resolve(spec: DatasetSpec, base_dir: Path) -> DatasetRef:
    local = resolve_path(base_dir, spec.path)
    if local.is_dir():
        saved = any((local / m).is_file() for m in _SAVED_MARKERS)
        if saved and spec.name is not None:
            raise DatasetProblem("input.dataset.name", f"{local} is a save_to_disk directory, which has no configs")
        if saved and spec.revision is not None:
            raise DatasetProblem("input.dataset.revision", f"{local} is a save_to_disk directory, which has no "
                                                           "revisions")
        return DatasetRef(str(local.resolve()), spec.name, spec.split, spec.revision, saved)
    if spec.path.startswith((".", "/", "~")) or not _HUB_ID.match(spec.path):
        raise DatasetProblem("input.dataset.path", f"no dataset directory at {local}")
    return DatasetRef(spec.path, spec.name, spec.split, spec.revision, saved=False)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        hint = install_hint("datasets", "datasets")
        raise DatasetProblem("input.dataset", f"needs the datasets library: {hint}") from None
    return datasets


@contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No "using the latest cached version" warnings from ``datasets`` on every run."""
    logging = datasets.utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _one_line(e: BaseException) -> str:
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


@lru_cache(maxsize=8)
def open_split(ref: DatasetRef) -> Any:
    """The split as a ``datasets.Dataset`` (memory-mapped Arrow); cached for the process, since
    validation and the run both open it."""
    datasets = _datasets()
    with _quiet(datasets):
        if ref.saved:
            return _saved_split(datasets, ref)
        builder = _builder(datasets, ref)
        try:
            builder.download_and_prepare()
        except Exception as e:  # datasets' builders raise anything
            raise DatasetProblem("input.dataset.path", f"cannot prepare dataset {ref.path!r}: {_one_line(e)}") from None
        splits = list(builder.info.splits or {})
        if splits and ref.split not in splits:
            raise DatasetProblem("input.dataset.split", f"no split {ref.split!r} in dataset {ref.path!r} "
                                                        f"(splits: {', '.join(splits)})")
        try:
            return builder.as_dataset(split=ref.split)
        except Exception as e:
            raise DatasetProblem("input.dataset.split", f"cannot read split {ref.split!r} of dataset {ref.path!r}: "
                                                        f"{_one_line(e)}") from None


def _builder(datasets: Any, ref: DatasetRef) -> Any:
    """The dataset's builder; a failure is put on the config when the dataset loads without it."""
    try:
        return datasets.load_dataset_builder(ref.path, ref.name, revision=ref.revision)
    except Exception as e:  # FileNotFoundError, ConnectionError, ValueError, ...
        error = e
    field = "input.dataset.path"
    if "config" in str(error).lower():
        field = "input.dataset.name"
    elif ref.name is not None:
        try:
            datasets.load_dataset_builder(ref.path, revision=ref.revision)
            field = "input.dataset.name"
        except Exception:  # the dataset itself is missing
            pass
    raise DatasetProblem(field, f"cannot load dataset {ref.path!r}: {_one_line(error)}")


def _saved_split(datasets: Any, ref: DatasetRef) -> Any:
    try:
        saved = datasets.load_from_disk(ref.path)
    except Exception as e:
        raise DatasetProblem("input.dataset.path", f"cannot load the saved dataset at {ref.path}: "
                                                   f"{_one_line(e)}") from None
    if isinstance(saved, datasets.DatasetDict):
        if ref.split not in saved:
            raise DatasetProblem("input.dataset.split", f"no split {ref.split!r} in {ref.path} "
                                                        f"(splits: {', '.join(saved)})")
        return saved[ref.split]
    if saved.split is not None and str(saved.split) != ref.split:
        raise DatasetProblem("input.dataset.split", f"{ref.path} holds split {str(saved.split)!r}, "
                                                    f"not {ref.split!r}")
    return saved


class DatasetSource:
    strict = True  # the dataset's features name its columns

    def __init__(self, f: InputFile, types: Mapping[str, pa.DataType] | None = None, batch_rows: int | None = None):
        """``batch_rows``: read at most this many rows at a time (``ParquetSource``'s)."""
        assert f.dataset is not None
        self.file = f
        self.types = types or {}
        self.batch_rows = batch_rows

    @property
    def dataset(self) -> Any:
        return open_split(self.file.dataset)

    @property
    def schema(self) -> pa.Schema:
        return self.dataset.data.schema

    def column_names(self) -> set[str]:
        return set(self.dataset.column_names)

    def count(self) -> tuple[int, bool]:
        return self.dataset.num_rows, True

    def records(self, columns: list[str], parse: bool = True) -> Iterator[Record]:
        if not parse:
            yield from (Record(i, None) for i in range(self.dataset.num_rows))
            return
        missing = [c for c in columns if c not in self.dataset.column_names]
        if missing:
            raise JobError(f"{self.file.shown} has no column {missing[0]!r}")
        size = min(BATCH_ROWS, self.batch_rows or BATCH_ROWS)
        batches = self.dataset.select_columns(columns).with_format("arrow").iter(batch_size=size)
        yield from batch_records(batches, columns, self.types, self.file.shown)
