"""Streaming input: rows of Parquet and JSONL files, sharded, skipping rows already done.

Nothing reads a whole file: Parquet goes through ``ParquetFile.iter_batches`` (only the needed
columns), JSONL line by line, so one malformed line becomes an error row instead of a failed
job. Bad rows are yielded with ``Row.error`` naming the file, the row and the field. Missing
files or columns are job-level problems (``check``), found before anything runs.

Row ids: the ``id_column`` value, or ``<file>:<row>`` (file relative to the job file, row
counted from 0; for JSONL the physical line, so ids stay put when lines are appended).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections import Counter
from collections.abc import Container, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ...storage import Location, StorageOptions, location
from .. import openai_batch
from ..errors import JobError, JobInvalid, Problem
from ..shard import Shard
from ..spec import InputSpec, Job

_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet",
               ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
_BATCH_ROWS = 1024
_INFER_LINES = 1000  # JSONL lines looked at to find the type of each carried column
_COUNT_LINES_LIMIT = 1 << 30  # count JSONL lines for the progress total only below this many bytes
_JSONL_KINDS = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
                "json": pa.string()}


class _BadUTF8:
    """Marks a Parquet value that could not be decoded as UTF-8."""


BAD_UTF8 = _BadUTF8()


@dataclass
class InputFile:
    path: Location
    format: str
    name: str  # as shown in messages and used in derived ids

    def where(self, index: int) -> str:
        """A row's place in messages: JSONL lines count from 1, Parquet rows from 0."""
        return f"{self.name} row {index}" if self.format == "parquet" else f"{self.name} line {index + 1}"


@dataclass(frozen=True)
class InputId:
    """A row's output id, and the id whose shard the row belongs to (another for a duplicate)."""

    id: str
    owner: str = ""
    duplicate: str | None = None  # for a row repeating an earlier row's id: the error row's message

    @property
    def shard_id(self) -> str:
        return self.owner or self.id


class _FirstSeen:
    """Where each id was first read. Ids are compared as read, in file then row order, so the
    first row of an id is the same in every run, whatever was done before."""

    def __init__(self, files: list[InputFile]):
        self._files = files
        self._first: dict[str, int] = {}

    def check(self, row_id: str, file_no: int, index: int, column: str) -> tuple[str, str | None]:
        """(row_id, None) for an id's first row; for a later one its own ``<file>:<row>`` id and
        the error naming the first row."""
        key = file_no << 40 | index
        first = self._first.setdefault(row_id, key)
        if first == key:
            return row_id, None
        f = self._files[file_no]
        where = self._files[first >> 40].where(first & ((1 << 40) - 1))
        return f"{f.name}:{index}", (f"field {column!r}: duplicate id {row_id!r}, first at {where}; "
                                     "only that row is generated")



@dataclass
class Row:
    id: str
    where: str  # "data/a.jsonl line 7" or "data/a.parquet row 6"
    prompt: str | list[int] | list[dict[str, Any]] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    carry: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    endpoint: str = openai_batch.COMPLETION  # chat (messages) or completion (a prompt): the OpenAI output shape
    prompt_field: str = ""  # where the prompt came from, for messages: a column, or body.messages
    sources: dict[str, str] = field(default_factory=dict)  # override -> the field it came from, when not a column
    top_logprobs: int | None = None  # the row's sampling logprobs, once its params are known


def file_format(path: Path | Location, given: str | None) -> str | None:
    if given:
        return given
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return _EXTENSIONS.get(suffixes[-1]) if suffixes else None


def discover(spec: InputSpec, base_dir: Path | Location, exclude: Location | None = None,
             storage: StorageOptions | None = None) -> tuple[list[InputFile], list[Problem]]:
    """Expand the input paths/globs, local or in a bucket (directories mean every known input
    file inside, sorted). Files under ``exclude`` (the job's output dir) are never input."""
    files: list[InputFile] = []
    problems: list[Problem] = []
    seen: set[Location] = set()
    base = location(base_dir)
    for i, pattern in enumerate(spec.paths):
        try:
            matches = _matches(location(pattern, base, storage))
        except OSError as e:
            problems.append(Problem(f"input.paths[{i}]", str(e)))
            continue
        if exclude is not None:
            matches = [p for p in matches if not p.is_under(exclude)]
        if not matches:
            problems.append(Problem(f"input.paths[{i}]", f"no input file matches {_shown(pattern, base, storage)!r}"))
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
    if len({f.format for f in files}) > 1:
        problems.append(Problem("input.paths", "all input files must have one format (parquet, jsonl or openai_batch)"))
    return files, problems


def _matches(full: Location) -> list[Location]:
    if glob.has_magic(full.path):
        return full.expand()
    if full.is_dir():
        return sorted((p for p in full.list_files() if not p.name.startswith((".", "_")) and file_format(p, None)),
                      key=lambda p: p.path)
    return [full] if full.is_file() else []


def _shown(pattern: str, base: Location, storage: StorageOptions | None) -> str:
    return str(location(pattern, base, storage))


def _display_name(path: Location, base: Location) -> str:
    if not path.is_local:
        return str(path)
    return path.relative_to(base) or os.path.realpath(path.path)


class InputReader:
    """Rows of all input files of a job, in file order then row order."""

    def __init__(self, spec: InputSpec, base_dir: Path | Location, overrides: Mapping[str, str] | None = None,
                 files: list[InputFile] | None = None, exclude: Location | None = None,
                 model_name: str | None = None, storage: StorageOptions | None = None):
        """Finds the input files (raising ``JobInvalid`` if any pattern fails) unless given.
        ``model_name``: OpenAI batch requests naming another ``body.model`` are error rows."""
        self.spec = spec
        self.overrides = dict(overrides or {})
        self.model_name = model_name
        self.ignored_fields: Counter[str] = Counter()  # OpenAI batch body fields that change nothing
        if files is None:
            files, problems = discover(spec, base_dir, exclude, storage)
            if problems:
                raise JobInvalid(problems)
        self.files = files
        self.warnings: list[str] = []
        self._carry_kinds: dict[str, str] = {}
        self._carry_types: dict[str, pa.DataType] = {}

    @classmethod
    def for_job(cls, job: Job) -> InputReader:
        return cls(job.spec.input, job.base_dir, job.spec.sampling.overrides, exclude=job.output_dir,
                   model_name=job.model_name if job.spec.input.check_model else None, storage=job.spec.storage)

    # ----------------------------------------------------------------------------- checks, schema

    def needed_columns(self) -> list[tuple[str, str]]:
        """(job file path, column) for every column the job reads."""
        s = self.spec
        if s.format == "openai_batch":
            cols = [("input.format", "custom_id"), ("input.format", "url"), ("input.format", "body")]
        else:
            cols = [("input.id_column", s.id_column)] if s.id_column else []
            cols.append(("input.prompt_column" if s.prompt_column else "input.messages_column", s.source_column))
        cols += [(f"sampling.overrides.{k}", v) for k, v in self.overrides.items()]
        cols += [(f"input.carry_columns[{i}]", c) for i, c in enumerate(s.carry_columns)]
        return cols

    def check(self) -> list[Problem]:
        """Missing columns and unreadable files, as problems naming the job-file field.

        A Parquet file must have every column the job reads. A JSONL line may lack any column,
        which then is null in its row (an override's null means the job's value), so a JSONL file
        is refused only when none of its first lines has the id or prompt column (surely a
        misspelt name); an optional column found in none of them is a warning.
        """
        problems: list[Problem] = []
        required = {self.spec.id_key, self.spec.source_column}
        for f in self.files:
            try:
                names = self._column_names(f)
            except JobError as e:
                problems.append(Problem("input.paths", str(e)))
                continue
            if names is None:  # empty JSONL file: nothing to check yet
                continue
            for where, col in self.needed_columns():
                if col in names:
                    continue
                if f.format != "parquet" and col not in required:
                    self.warnings.append(f"{where}: column {col!r} is in none of the first {_INFER_LINES} "
                                         f"lines of {f.name}; rows without it take null there")
                    continue
                have = ", ".join(sorted(names)[:20]) or "none"
                problems.append(Problem(where, f"column {col!r} not found in {f.name} (columns: {have})"))
        return problems

    def _column_names(self, f: InputFile) -> set[str] | None:
        """The Parquet schema's names, or every key of the first JSONL objects (None: no object)."""
        if f.format == "parquet":
            return set(_parquet(f).schema_arrow.names)
        names: set[str] | None = None
        for obj in self._objects(f, _INFER_LINES):
            names = (names or set()) | set(obj)
        return names

    @property
    def carry_fields(self) -> list[pa.Field]:
        """Arrow fields of the carried columns: the first Parquet file's types, or for JSONL the
        type of the first non-null value (strings, ints, floats, bools; anything else as JSON)."""
        cols = self.spec.carry_columns
        if not cols or not self.files:
            return [pa.field(c, pa.string()) for c in cols]
        if self.files[0].format == "parquet":
            schema = _parquet(self.files[0]).schema_arrow
            self._carry_types = {c: schema.field(c).type for c in cols}
            return [schema.field(c) for c in cols]
        if not self._carry_kinds:
            self._carry_kinds = self._infer_kinds()
        return [pa.field(c, _JSONL_KINDS[self._carry_kinds[c]]) for c in cols]

    def _infer_kinds(self) -> dict[str, str]:
        kinds: dict[str, str] = {}
        budget = _INFER_LINES
        for f in self.files:
            for obj in self._objects(f, budget):
                budget -= 1
                for c in self.spec.carry_columns:
                    if c not in kinds and obj.get(c) is not None:
                        kinds[c] = _kind_of(obj[c])
            if budget <= 0 or len(kinds) == len(self.spec.carry_columns):
                break
        return {c: kinds.get(c, "json") for c in self.spec.carry_columns}

    def total_rows(self) -> tuple[int | None, bool]:
        """(rows in all files, exact?) cheaply: Parquet footers, or a newline count for small JSONL."""
        total = 0
        exact = True
        jsonl_bytes = sum(f.path.info().size for f in self.files if f.format != "parquet")
        if jsonl_bytes > _COUNT_LINES_LIMIT:
            return None, False
        for f in self.files:
            if f.format == "parquet":
                total += _parquet(f).metadata.num_rows
                continue
            if f.path.suffix == ".gz":
                return None, False
            with _open_binary(f) as fh:
                total += sum(chunk.count(b"\n") for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""))
            exact = False  # blank lines and a last line without newline blur it
        return total, exact

    # ------------------------------------------------------------------------------------- rows

    def rows(self, shard: Shard | None = None, skip: Container[str] = ()) -> Iterator[Row]:
        """Rows of this shard whose id is not in ``skip``, bad ones with ``error`` set.

        A row repeating the id of an earlier row is an error row under its own ``<file>:<row>``
        id, so each id is generated once, from its first row, and a rerun skips both.
        """
        if self.spec.carry_columns:
            _ = self.carry_fields  # fixes the carried types before the first row
        seen = _FirstSeen(self.files) if self.spec.id_key else None
        for file_no, f in enumerate(self.files):
            source = self._parquet_records(f) if f.format == "parquet" else self._jsonl_records(f)
            for index, record, error in source:
                row_id, id_error = self._row_id(f, index, record)
                if shard is not None and not shard.owns(row_id):
                    continue
                if seen is not None and id_error is None:
                    row_id, id_error = seen.check(row_id, file_no, index, self.spec.id_key or "")
                if row_id in skip:
                    continue
                where = f.where(index)
                row = Row(id=row_id, where=where)
                row.error = error or id_error or self._fill(row, record)
                if row.error:
                    row.error = f"{where}: {row.error}"
                    row.prompt, row.overrides, row.carry = None, {}, {}
                yield row

    def ids(self) -> Iterator[InputId]:
        """Every row's ids (bad rows included), reading as little as possible; for ``status``."""
        id_key = self.spec.id_key
        seen = _FirstSeen(self.files) if id_key else None
        for file_no, f in enumerate(self.files):
            if f.format == "parquet" and id_key is None:
                yield from (InputId(f"{f.name}:{i}") for i in range(_parquet(f).metadata.num_rows))
                continue
            cols = [id_key] if id_key else []
            source = self._parquet_records(f, cols) if f.format == "parquet" else self._jsonl_records(
                f, parse=id_key is not None)
            for index, record, _ in source:
                row_id, id_error = self._row_id(f, index, record)
                if seen is None or id_error is not None:
                    yield InputId(row_id)
                    continue
                out_id, dup_error = seen.check(row_id, file_no, index, id_key or "")
                yield InputId(out_id, row_id, dup_error and f"{f.where(index)}: {dup_error}")

    def _row_id(self, f: InputFile, index: int, record: Mapping[str, Any] | None) -> tuple[str, str | None]:
        fallback = f"{f.name}:{index}"
        col = self.spec.id_key
        if col is None or record is None:
            return fallback, None
        v = _decode(record.get(col))
        if v is None:
            return fallback, f"field {col!r}: missing id"
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            return fallback, f"field {col!r}: id must be a string or an integer, got {_type_name(v)}"
        v = str(v)
        if not v or not _encodable(v):
            return fallback, f"field {col!r}: id is empty or not valid Unicode"
        return v, None

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
            row.overrides, row.sources = request.overrides, request.sources
        else:
            value, row.prompt_field = _decode(record.get(s.source_column)), s.source_column
            row.endpoint = openai_batch.CHAT if s.messages_column else openai_batch.COMPLETION
        chat = row.endpoint == openai_batch.CHAT
        error = _check_messages(value) if chat else _check_prompt(value)
        if error:
            return f"field {row.prompt_field!r}: {error}"
        if request is not None:
            if self.model_name is not None and request.model not in (None, self.model_name):
                return f"field 'body.model': {request.model!r} is not this job's model {self.model_name!r}"
            self.ignored_fields.update(request.ignored)
        row.prompt = _clean_messages(value) if chat else value
        for key, col in self.overrides.items():
            if record.get(col) is not None:
                row.overrides[key] = _decode(record[col])
                row.sources.pop(key, None)
        for col in s.carry_columns:
            v = record.get(col)
            if self._carry_kinds and v is not None:
                v, error = _coerce(v, self._carry_kinds[col])
                if error:
                    return f"field {col!r}: {error}"
            if isinstance(v, _BadUTF8) or (isinstance(v, str) and not _encodable(v)):
                return f"field {col!r}: invalid UTF-8 or Unicode"
            row.carry[col] = v
        return None

    # ----------------------------------------------------------------------------- file formats

    def _parquet_records(self, f: InputFile, columns: list[str] | None = None
                         ) -> Iterator[tuple[int, dict[str, Any], None]]:
        pf = _parquet(f)
        if columns is None:
            columns = list(dict.fromkeys(c for _, c in self.needed_columns()))
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise JobError(f"input file {f.name} has no column {missing[0]!r}")
        index = 0
        try:
            for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
                values = {c: _to_python(self._cast(f, c, batch.column(c))) for c in columns}
                for j in range(batch.num_rows):
                    yield index, {c: values[c][j] for c in columns}, None
                    index += 1
        except (OSError, pa.ArrowException) as e:
            raise JobError(f"cannot read input file {f.name} near row {index}: {e}") from None

    def _cast(self, f: InputFile, col: str, arr: pa.Array) -> pa.Array:
        want = self._carry_types.get(col)
        if want is None or arr.type == want:
            return arr
        try:
            return arr.cast(want)
        except pa.ArrowException:
            raise JobError(f"input file {f.name}: column {col!r} is {arr.type}, "
                           f"but the first input file has {want}") from None

    def _jsonl_records(self, f: InputFile, parse: bool = True
                       ) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
        with _open_lines(f) as fh:
            pending: tuple[int, bytes] | None = None
            for index, line in enumerate(fh):
                if pending is not None:
                    yield self._jsonl_record(*pending, parse)
                pending = None
                if not line.strip():
                    continue
                if line.endswith(b"\n"):
                    yield self._jsonl_record(index, line, parse)
                else:
                    pending = (index, line)
            if pending is not None:  # last line without newline: maybe still being written
                if _parse_line(pending[1])[1] is None:
                    yield self._jsonl_record(*pending, parse)
                else:
                    self.warnings.append(f"{f.name} line {pending[0] + 1}: incomplete last line skipped "
                                         "(no newline yet); it is read again next run")

    @staticmethod
    def _jsonl_record(index: int, line: bytes, parse: bool) -> tuple[int, dict[str, Any] | None, str | None]:
        if not parse:
            return index, None, None
        obj, error = _parse_line(line)
        return index, obj, error

    def _objects(self, f: InputFile, limit: int) -> Iterator[dict[str, Any]]:
        """Up to ``limit`` well-formed JSON objects from the start of a JSONL file."""
        seen = 0
        for _, obj, error in self._jsonl_records(f):
            if obj is not None and error is None:
                yield obj
            seen += 1
            if seen >= limit:
                return


# ------------------------------------------------------------------------------------- helpers


def _parquet(f: InputFile) -> pq.ParquetFile:
    """Footer first, then row groups as they are read (a bucket object is fetched in ranges)."""
    try:
        source = f.path.local if f.path.is_local else f.path.open_read()
        return pq.ParquetFile(source)
    except (OSError, pa.ArrowException) as e:
        raise JobError(f"cannot read input file {f.name}: {e}") from None


def _open_binary(f: InputFile) -> IO[bytes]:
    try:
        return f.path.open_read()
    except OSError as e:
        raise JobError(f"cannot read input file {f.name}: {e}") from None


@contextmanager
def _open_lines(f: InputFile) -> Iterator[IO[bytes]]:
    with _open_binary(f) as raw:
        yield gzip.GzipFile(fileobj=raw, mode="rb") if f.path.suffix == ".gz" else raw  # type: ignore[misc]


def _parse_line(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start} of the line"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg} (column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {_type_name(obj)}"
    return obj, None


def _to_python(arr: pa.Array) -> list[Any]:
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return arr.to_pylist()  # decoded (or rejected) per value by _decode
    try:
        return arr.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException):
        out: list[Any] = []
        for k in range(len(arr)):
            try:
                out.append(arr[k].as_py())
            except (UnicodeDecodeError, pa.ArrowException):
                out.append(BAD_UTF8)
        return out


def _decode(v: Any) -> Any:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return BAD_UTF8
    return v


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _check_prompt(v: Any) -> str | None:
    if v is None:
        return "missing or null"
    if isinstance(v, _BadUTF8):
        return "invalid UTF-8"
    if isinstance(v, str):
        if not v.strip():
            return "empty prompt"
        return None if _encodable(v) else "not valid Unicode (lone surrogate)"
    if isinstance(v, list) and v and all(type(t) is int and t >= 0 for t in v):
        return None
    return f"expected a string or a non-empty list of token ids, got {_type_name(v)}"


def _check_messages(v: Any) -> str | None:
    if v is None:
        return "missing or null"
    if isinstance(v, _BadUTF8):
        return "invalid UTF-8"
    if not isinstance(v, list) or not v:
        return f"expected a non-empty list of {{role, content}} messages, got {_type_name(v)}"
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            return f"message [{i}]: expected an object with role and content, got {_type_name(m)}"
        for key in ("role", "content"):
            x = _decode(m.get(key))
            if not isinstance(x, str) or (key == "role" and not x):
                return f"message [{i}].{key}: expected a string, got {_type_name(x)}"
            if not _encodable(x):
                return f"message [{i}].{key}: not valid Unicode"
    return None


def _clean_messages(v: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop null keys (Parquet structs have every field) and decode bytes."""
    return [{k: _decode(x) for k, x in m.items() if x is not None} for m in v]


def _kind_of(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int64"
    if isinstance(v, float):
        return "float64"
    return "string" if isinstance(v, str) else "json"


def _coerce(v: Any, kind: str) -> tuple[Any, str | None]:
    if kind == "json":
        return json.dumps(v, ensure_ascii=False), None
    got = _kind_of(v)
    if got == kind:
        return v, None
    if kind == "float64" and got == "int64":
        return float(v), None
    return None, f"expected {kind} as in the first rows, got {_type_name(v)}"
