"""Streaming input: the rows of a job's input files, sharded, skipping rows already done.

Each format (``parquet.py``, ``jsonl.py``, ...) reads its files as streams and hands over
records; this module makes rows of them: ids, duplicates, the prompt, overrides and carried
values. Bad rows are yielded with ``Row.error`` naming the file, the row and the field. Missing
files or columns are job-level problems (``check``), found before anything runs.

Row ids: the ``id_column`` value, or ``<file>:<row>`` (file relative to the job file, row as its
format numbers it: from 0; for JSONL the physical line, so ids stay put when lines are appended).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ...storage import Location, StorageOptions
from ..errors import JobError, JobInvalid, Problem
from ..ids import BATCH, DoneIds, batches, hash_ids, id_array
from ..line_ids import FIRST_LINE
from ..outputs.saved import dir_line_ids_from
from ..shard import Shard
from ..spec import InputSpec, Job
from . import openai_batch
from .csv import DELIMITERS, CsvColumns, CsvSource
from .discover import discover
from .hf_dataset import DatasetSource
from .id_batches import IdBatch, InputIds, RowsAt, column_ids
from .id_index import INDEX_DIR, IndexDir, IndexedBatch
from .image_values import image_list
from .jsonl import INFER_LINES, JsonlSource, infer_kinds
from .kinds import KIND_TYPES, coerce
from .parquet import ParquetSource
from .rows import CHAT, COMPLETION, EMBEDDING, BadValue, InputFile, InputId, Record, Row, Source
from .seen import FirstSeen, row_key
from .values import (
    chat_as_prompt,
    check_carried,
    check_inputs,
    check_messages,
    check_prompt,
    clean_messages,
    decode,
    encodable,
    type_name,
)

_COUNT_BYTES_LIMIT = 1 << 30  # count the rows of files without a row count only below this many bytes
_COUNTED = frozenset({"parquet", "dataset"})  # formats that know their row count without a scan
IMAGE_BATCH_ROWS = 256  # a job reading images reads rows this many at a time at most: their bytes are large


class InputReader:
    """Rows of all input files of a job, in file order then row order."""

    def __init__(self, spec: InputSpec, base_dir: Path | Location, overrides: Mapping[str, str] | None = None,
                 files: list[InputFile] | None = None, exclude: Location | None = None,
                 model_name: str | None = None, storage: StorageOptions | None = None,
                 base_names: set[str] | None = None, index_dir: IndexDir | None = None):
        """Finds the input files (raising ``JobInvalid`` if any pattern fails) unless given.
        ``model_name``: OpenAI batch requests naming another ``body.model`` are error rows.
        ``base_names`` (a job with LoRA adapters): the names of the base model; an OpenAI batch request's
        ``body.model`` naming anything else names its adapter. ``index_dir``: where the files' id
        indexes are read and written (None: every file is read)."""
        self.spec = spec
        self.overrides = dict(overrides or {})
        self.model_name = model_name
        self.base_names = base_names
        self.ignored_fields: Counter[str] = Counter()  # OpenAI batch body fields that change nothing
        if files is None:
            files, problems = discover(spec, base_dir, exclude, storage)
            if problems:
                raise JobInvalid(problems)
        self.files = files
        self.index_dir = index_dir
        self.warnings: list[str] = []
        self._carry_kinds: dict[str, str] = {}  # formats without a schema: each carried column's kind
        self._carry_types: dict[str, pa.DataType] = {}  # formats with one: the first file's Arrow types
        self._batch_rows = IMAGE_BATCH_ROWS if spec.images_column else None

    @classmethod
    def for_job(cls, job: Job, read_only: bool = False) -> InputReader:
        """The job's reader; ``read_only``: without the id indexes kept in the output dir (``run --dry-run``)."""
        index_dir = None if read_only else IndexDir(job.output_dir / INDEX_DIR, job.spec.input.id_key or "")
        reader = cls(job.spec.input, job.base_dir, job.spec.sampling.overrides, exclude=job.output_dir,
                   model_name=job.model_name if job.spec.input.check_model else None, storage=job.spec.storage,
                   base_names=job.base_model_names if job.spec.model.lora_modules else None, index_dir=index_dir)
        first_line = dir_line_ids_from(job.output_dir)
        if first_line != FIRST_LINE:  # an output dir begun when derived ids counted lines from 0
            reader.files = [replace(f, line_ids_from=first_line) for f in reader.files]
        return reader

    def _source(self, f: InputFile) -> Source:
        if f.format == "parquet":
            return ParquetSource(f, self._carry_types, self._batch_rows)
        if f.format == "dataset":
            return DatasetSource(f, self._carry_types, self._batch_rows)
        if f.format in DELIMITERS:
            return CsvSource(f, self._csv_columns())
        return JsonlSource(f, self.warnings)

    def _csv_columns(self) -> CsvColumns:
        s = self.spec
        return CsvColumns(json=frozenset([s.messages_column] if s.messages_column else []),
                          optional=frozenset(self.overrides.values()),
                          kinds={c: k for c, k in self._carry_kinds.items() if c not in self._read_otherwise()})

    def _read_otherwise(self) -> set[str]:
        """Columns read for the id, the prompt or an override: carried as read for that."""
        s = self.spec
        return {c for c in (s.id_key, s.prompt_column, s.messages_column, s.completion_column, s.lora_column,
                            s.images_column, *self.overrides.values()) if c}

    # ----------------------------------------------------------------------------- checks, schema

    def needed_columns(self) -> list[tuple[str, str]]:
        """(job file path, column) for every column the job reads."""
        s = self.spec
        if s.format == "openai_batch":
            cols = [("input.format", "custom_id"), ("input.format", "url"), ("input.format", "body")]
        else:
            cols = [("input.id_column", s.id_column)] if s.id_column else []
            cols.append(("input.prompt_column" if s.prompt_column else "input.messages_column", s.source_column))
            if s.completion_column:
                cols.append(("input.completion_column", s.completion_column))
            if s.lora_column:
                cols.append(("input.lora_column", s.lora_column))
            if s.images_column:
                cols.append(("input.images_column", s.images_column))
        cols += [(f"sampling.overrides.{k}", v) for k, v in self.overrides.items()]
        cols += [(f"input.carry_columns[{i}]", c) for i, c in enumerate(s.carry_columns)]
        return cols

    def _columns(self) -> list[str]:
        return list(dict.fromkeys(c for _, c in self.needed_columns()))

    def check(self) -> list[Problem]:
        """Missing columns and unreadable files, as problems naming the job-file field.

        A file with a schema or header (Parquet) must have every column the job reads. A JSONL
        line may lack any column, which then is null in its row (an override's null means the
        job's value), so a JSONL file is refused only when none of its first lines has the id
        or prompt column (surely a misspelt name); an optional column found in none of them is
        a warning.
        """
        problems: list[Problem] = []
        required = {self.spec.id_key, self.spec.source_column, self.spec.completion_column, self.spec.images_column}
        for f in self.files:
            source = self._source(f)
            try:
                names = source.column_names()
            except JobError as e:
                problems.append(Problem("input.paths", str(e)))
                continue
            if names is None:  # an empty file: nothing to check yet
                continue
            for where, col in self.needed_columns():
                if col in names:
                    continue
                if not source.strict and col not in required:
                    self.warnings.append(f"{where}: column {col!r} is in none of the first {INFER_LINES} "
                                         f"lines of {f.shown}; rows without it take null there")
                    continue
                have = ", ".join(sorted(names)[:20]) or "none"
                problems.append(Problem(where, f"column {col!r} not found in {f.shown} (columns: {have})"))
        return problems

    @property
    def carry_fields(self) -> list[pa.Field]:
        """Arrow fields of the carried columns: the first Parquet file's types, or the dataset's;
        for CSV the types pyarrow infers from the first block of the first file (int64, float64,
        bool, else text); for JSONL the kind of the first non-null value (strings, ints, floats,
        bools; anything else as JSON)."""
        cols = self.spec.carry_columns
        if not cols or not self.files:
            return [pa.field(c, pa.string()) for c in cols]
        first = self._source(self.files[0])
        if isinstance(first, (ParquetSource, DatasetSource)):
            schema = first.schema
            self._carry_types.update({c: schema.field(c).type for c in cols})
            return [schema.field(c) for c in cols]
        if not self._carry_kinds:
            if isinstance(first, CsvSource):
                other = self._read_otherwise()
                inferred = first.infer_kinds([c for c in cols if c not in other])
                json_col = self.spec.messages_column
                kinds = {c: inferred.get(c, "json" if c == json_col else "string") for c in cols}
            else:
                kinds = infer_kinds([JsonlSource(f, self.warnings) for f in self.files], cols)
            self._carry_kinds.update(kinds)
        return [pa.field(c, KIND_TYPES[self._carry_kinds[c]]) for c in cols]

    def total_rows(self) -> tuple[int | None, bool]:
        """(rows in all files, exact?) cheaply: Parquet footers, or a newline count for small JSONL."""
        total = 0
        exact = True
        sources = [self._source(f) for f in self.files]
        scanned = sum(s.file.path.info().size for s in sources if s.file.format not in _COUNTED)
        if scanned > _COUNT_BYTES_LIMIT:
            return None, False
        for s in sources:
            n, n_exact = s.count()
            if n is None:
                return None, False
            total += n
            exact = exact and n_exact
        return total, exact

    # ------------------------------------------------------------------------------------- rows

    def rows(self, shard: Shard | None = None, skip: Container[str] = (), limit: int | None = None) -> Iterator[Row]:
        """Rows of this shard whose id is not in ``skip``, bad ones with ``error`` set; with ``limit``,
        of the shard's first ``limit`` rows only (done or not, so a rerun takes the same rows).

        A row repeating the id of an earlier row is an error row under its own ``<file>:<row>``
        id, so each id is generated once, from its first row, and a rerun skips both. Ids are
        read, looked up and checked for repeats a batch at a time (columnar for a Parquet id
        column, or from the file's id index when it holds); only the rows not in ``skip`` are read whole.
        """
        if self.spec.carry_columns:
            _ = self.carry_fields  # fixes the carried types before the first row
        left = limit
        for f, b, read in self._file_batches(self._columns(), parse=True):
            if left is not None and left <= 0:
                break
            mine = (np.arange(len(b.ids)) if shard is None or shard.count == 1 else
                    np.flatnonzero(np.fromiter(map(shard.owns, b.owners.to_pylist()), bool, len(b.ids))))
            if left is not None:
                mine, left = mine[:left], left - min(left, len(mine))
            ids = b.ids.take(pa.array(mine)) if len(mine) < len(b.ids) else b.ids
            done = (skip.contains(ids, b.hashes[mine]) if isinstance(skip, DoneIds)
                    else np.fromiter((i in skip for i in ids.to_pylist()), bool, len(ids)))
            for todo in _chunks(mine[~done]):
                for record, at, row_id in zip(read(todo), todo.tolist(), b.ids.take(pa.array(todo)).to_pylist(),
                                              strict=True):
                    yield self._row(f, record, row_id, b.errors.get(at))

    def _file_batches(self, columns: list[str], parse: bool
                      ) -> Iterator[tuple[InputFile, IndexedBatch, Callable[[np.ndarray], list[Record]]]]:
        """(file, a batch's ids, how to read its rows at positions) for every file: from
        the file's index where one holds, else read (and an index written once the file is read whole)."""
        seen = FirstSeen(self.files) if self.spec.id_key else None
        keys = self.index_dir.keys_for(self.files) if self.index_dir is not None else None
        indexed = [self.index_dir.read(f, keys, i) if self.index_dir is not None else None
                   for i, f in enumerate(self.files)]
        remember = seen is not None and any(batches is None for batches in indexed)
        try:
            for file_no, f in enumerate(self.files):
                batches = indexed[file_no]
                if batches is not None:
                    rows_at = RowsAt(lambda f=f: self._id_batches(f, columns, parse), f)
                    for b in batches:
                        if remember and seen is not None:
                            new = np.flatnonzero(b.checked & (b.first < 0))
                            seen.add(b.ids.take(pa.array(new)), b.hashes[new], row_key(file_no, b.index[new]))
                        yield f, b, lambda at, b=b, rows_at=rows_at: rows_at.read(b.index[at])
                    continue
                writer = self.index_dir.writer(f, keys, file_no) if self.index_dir is not None else None
                warnings = len(self.warnings)
                try:
                    for ib in self._id_batches(f, columns, parse):
                        b = self._first_rows(seen, file_no, f, ib)
                        if writer is not None:
                            writer.add(b)
                        yield f, b, ib.read
                    if writer is not None and len(self.warnings) == warnings:  # read whole, nothing left for later
                        writer.publish()
                finally:
                    if writer is not None:
                        writer.close()
        finally:
            if seen is not None:
                seen.close()

    def _id_batches(self, f: InputFile, columns: list[str], parse: bool = True) -> Iterator[IdBatch]:
        """The file's rows by their ids: a Parquet id column columnar, other rows record by record."""
        source = self._source(f)
        id_key = self.spec.id_key
        if not (id_key and parse and isinstance(source, ParquetSource)):
            for batch in batches(source.records(columns, parse), size=self._batch_rows or BATCH):
                yield self._record_batch(f, batch)
            return
        for cb in source.column_batches(columns):
            got = column_ids(cb.columns.column(id_key), f, cb.start, id_key)
            if got is None:
                yield self._record_batch(f, cb.records(None))
                continue
            ids, errors = got
            checked = np.ones(len(ids), dtype=bool)
            checked[list(errors)] = False
            yield IdBatch(ids, cb.start + np.arange(len(ids), dtype=np.int64), checked, errors, cb.records)

    def _record_batch(self, f: InputFile, records: list[Record]) -> IdBatch:
        read = [self._row_id(f, record) for record in records]
        checked = [self.spec.id_key is not None and error is None and record.values is not None
                   for record, (_, error) in zip(records, read, strict=True)]
        return IdBatch(id_array([row_id for row_id, _ in read]),
                       np.fromiter((record.index for record in records), np.int64, len(records)),
                       np.array(checked, dtype=bool), {i: e for i, (_, e) in enumerate(read) if e is not None},
                       lambda at: [records[i] for i in at.tolist()])

    def _first_rows(self, seen: FirstSeen | None, file_no: int, f: InputFile, b: IdBatch) -> IndexedBatch:
        """The output ids of a batch, their hashes and errors: a row repeating an earlier row's id gets
        its own ``<file>:<row>`` id and the error naming the first row."""
        hashes = hash_ids(b.ids)
        checked = np.flatnonzero(b.checked)
        first = np.full(len(b.ids), -1, dtype=np.int64)
        if seen is None or not len(checked):
            return IndexedBatch(b.ids, hashes, b.ids, b.index, first, b.checked, b.errors)
        first[checked] = seen.first_of(b.ids.take(pa.array(checked)), hashes[checked],
                                       row_key(file_no, b.index[checked]))
        repeats = np.flatnonzero(first >= 0)
        if not len(repeats):
            return IndexedBatch(b.ids, hashes, b.ids, b.index, first, b.checked, b.errors)
        ids, errors = b.ids.to_pylist(), dict(b.errors)
        column = self.spec.id_key or ""
        for at, key in zip(repeats.tolist(), first[repeats].tolist(), strict=True):
            errors[at] = (f"field {column!r}: duplicate id {ids[at]!r}, first at {seen.where(key)}; "
                          "only that row is generated")
            ids[at] = f.derived_id(int(b.index[at]))
        out = id_array(ids)
        hashes[repeats] = hash_ids(out.take(pa.array(repeats)))
        return IndexedBatch(out, hashes, b.ids, b.index, first, b.checked, errors)

    def _row(self, f: InputFile, record: Record, row_id: str, id_error: str | None) -> Row:
        where = f.place_for(record, row_id)
        row = Row(id=row_id, where=where, image_base=_image_base(f))
        row.error = record.error or id_error or self._fill(row, record.values or {})
        if row.error:
            row.error = f"{where}: {row.error}"
            row.prompt, row.overrides, row.carry = None, {}, {}
        return row

    def id_batches(self) -> Iterator[InputIds]:
        """Every row's output ids (bad rows included), a batch at a time, reading as little as
        possible (an index, or a Parquet id column alone, columnar); for ``status`` and ``merge``."""
        id_key = self.spec.id_key
        for f, b, _ in self._file_batches([id_key] if id_key else [], parse=id_key is not None):
            duplicates = {}
            for at in np.flatnonzero(b.first >= 0).tolist():
                place = f.place_for(Record(int(b.index[at]), None), b.ids[at].as_py())
                duplicates[at] = f"{place}: {b.errors[at]}"
            yield InputIds(b.ids, b.hashes, b.owners, duplicates)

    def ids(self) -> Iterator[InputId]:
        """Every row's ids, one by one (``id_batches``)."""
        for batch in self.id_batches():
            for at, (row_id, owner) in enumerate(zip(batch.ids.to_pylist(), batch.owners.to_pylist(), strict=True)):
                if at in batch.duplicates:
                    yield InputId(row_id, owner, batch.duplicates[at])
                else:
                    yield InputId(row_id)

    def _row_id(self, f: InputFile, record: Record) -> tuple[str, str | None]:
        col = self.spec.id_key
        if col is None or record.values is None:
            return f.place(record)[0], None
        v = decode(record.values.get(col))
        if type(v) is str and v and encodable(v):  # the common case first
            return v, None
        fallback = f.place(record)[0]
        if v is None:
            return fallback, f"field {col!r}: missing id"
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            return fallback, f"field {col!r}: id must be a string or an integer, got {type_name(v)}"
        v = str(v)
        if not v or not encodable(v):
            return fallback, f"field {col!r}: id is empty or not valid Unicode"
        return v, None

    def _fill_lora(self, row: Row, value: Any) -> str | None:
        """The row's adapter column: a name, or empty or null for the base model."""
        col = self.spec.lora_column
        if isinstance(value, BadValue):
            return f"field {col!r}: {value.why}"
        if value is not None and not isinstance(value, str):
            return f"field {col!r}: expected an adapter name (a string), got {type_name(value)}"
        row.lora, row.lora_field = value or None, col or ""
        return None

    def _fill(self, row: Row, record: Mapping[str, Any]) -> str | None:
        """Set prompt, overrides and carried values from a record; return an error or None.

        An OpenAI batch request line brings its prompt in its body and the body's sampling
        fields as overrides; a column override still wins (the job chose that column)."""
        s = self.spec
        request = None
        if s.format == "openai_batch":
            try:
                request = openai_batch.parse_request(dict(record))
            except openai_batch.RequestError as e:
                return str(e)
            value, row.prompt_field, row.endpoint = request.prompt, request.prompt_field, request.endpoint
            row.overrides, row.sources, row.options = request.overrides, request.sources, request.options
        else:
            value, row.prompt_field = decode(record.get(s.source_column)), s.source_column
            row.endpoint = CHAT if s.messages_column else COMPLETION
        chat = row.endpoint == CHAT
        error = check_messages(value) if chat else check_inputs(value) if row.endpoint == EMBEDDING else \
            check_prompt(value)
        if error and request is None and not chat:
            error = chat_as_prompt(value, s.source_column) or error
        if error:
            return f"field {row.prompt_field!r}: {error}"
        if s.completion_column:
            row.completion = decode(record.get(s.completion_column))
            if error := check_prompt(row.completion, "completion"):
                return f"field {s.completion_column!r}: {error}"
        if request is not None:
            if self.base_names is not None:
                if request.model is not None:  # the base model's name chooses the base model
                    row.lora = None if request.model in self.base_names else request.model
                    row.lora_field = "body.model"
            elif self.model_name is not None and request.model not in (None, self.model_name):
                return f"field 'body.model': {request.model!r} is not this job's model {self.model_name!r}"
            self.ignored_fields.update(request.ignored)
        if s.lora_column:
            if error := self._fill_lora(row, decode(record.get(s.lora_column))):
                return error
        row.prompt = clean_messages(value) if chat else value
        if s.images_column:
            row.images, error = image_list(record.get(s.images_column))
            if error:
                return f"field {s.images_column!r}: {error}"
        for key, col in self.overrides.items():
            v = decode(record.get(col))
            if isinstance(v, BadValue):
                return f"field {col!r}: {v.why}"
            if v is not None:
                row.overrides[key] = v
                row.sources.pop(key, None)
        for col in s.carry_columns:
            v = record.get(col)
            if col in self._carry_kinds:
                v = coerce(v, self._carry_kinds[col])
            if error := check_carried(v):
                return f"field {col!r}: {error}"
            row.carry[col] = v
        return None


@lru_cache(maxsize=64)
def _image_base(f: InputFile) -> Location | None:
    """Where a row's relative image paths are read from: its input file's directory (a local dataset's own)."""
    if f.path is not None:
        return f.path.parent
    if f.dataset is not None and Path(f.dataset.path).is_dir():
        return Location.local_path(f.dataset.path)
    return None


def repeated_ids(count: int) -> str:
    """What ``count`` input rows repeating an earlier row's id come to (``validate`` and ``status`` say it)."""
    rows = "1 input row repeats" if count == 1 else f"{count:,} input rows repeat"
    return (f"{rows} the id of an earlier row; only the first row of an id is generated, the others are "
            "error rows")


def _chunks(positions: np.ndarray, first: int = 16) -> Iterator[np.ndarray]:
    """``positions`` in slices doubling from ``first`` to ``BATCH``: the first rows come at once."""
    start, n = 0, first
    while start < len(positions):
        yield positions[start:start + n]
        start, n = start + n, min(2 * n, BATCH)
