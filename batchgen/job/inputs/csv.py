"""CSV and TSV input, streamed with pyarrow's CSV reader (a block at a time, ``.gz`` unzipped on
the fly, a bucket object read as it goes).

Rows are the data rows, numbered from 0 (the header is no row; a quoted value may span lines).
Every cell is read as bytes and made a value here, row by row, so one bad cell is one error row:
ids, prompts and override columns are text ("007" stays "007"; an empty override cell means
the job's value); a messages column holds the JSON text of the list; a carried column keeps the
type pyarrow infers from the first block of the first file (int64, float64 or bool; anything
else is text), and a later cell that does not parse as that type is an error row. A line with
another number of fields than the header is an error row too, but pyarrow does not say where it
was, so it is not numbered: its id is ``<file>:malformed-<k>``, ``k`` counting such lines from 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from ..errors import JobError
from .kinds import KIND_TYPES
from .rows import BadValue, InputFile, Record
from .streams import open_decompressed
from .values import decode

DELIMITERS = {"csv": ",", "tsv": "\t"}
BLOCK_BYTES = 1 << 20  # pyarrow's block: types are inferred from the first; it reads ~32 ahead
HEADER_BLOCK_BYTES = 1 << 18  # enough for a header: validation reads no more than it needs
NULLS = frozenset(pacsv.ConvertOptions().null_values)  # pyarrow's: empty, NA, NULL, NaN, ...
_INFERRED = {pa.int64(): "int64", pa.float64(): "float64", pa.bool_(): "bool"}
_SHOWN_CHARS = 120  # of a malformed line, in its error


@dataclass(frozen=True)
class CsvColumns:
    """How cells become values, per column the job reads (any other column: text)."""

    json: frozenset[str] = frozenset()  # JSON text: a messages column
    optional: frozenset[str] = frozenset()  # an empty cell is null: override columns
    kinds: Mapping[str, str] = field(default_factory=dict)  # carried columns: int64, float64, bool


class CsvSource:
    strict = True  # the header names the columns

    def __init__(self, f: InputFile, columns: CsvColumns | None = None):
        self.file = f
        self.columns = columns or CsvColumns()
        self._malformed: list[pacsv.InvalidRow] = []

    @contextmanager
    def _reader(self, convert: pacsv.ConvertOptions, block_bytes: int = 0
                ) -> Iterator[pacsv.CSVStreamingReader | None]:
        """pyarrow's reader over the file's stream (None: an empty file). Serial, so malformed
        lines are met in file order and numbered the same in every run."""
        parse = pacsv.ParseOptions(delimiter=DELIMITERS[self.file.format], newlines_in_values=True,
                                   invalid_row_handler=self._on_malformed)
        read = pacsv.ReadOptions(use_threads=False, block_size=block_bytes or BLOCK_BYTES)
        with open_decompressed(self.file) as raw:
            try:
                reader = pacsv.open_csv(raw, read_options=read, parse_options=parse, convert_options=convert)
            except pa.ArrowInvalid as e:
                if "Empty CSV" not in str(e):
                    raise JobError(f"cannot read input file {self.file.name}: {_one_line(e)}") from None
                reader = None
            except (OSError, pa.ArrowException) as e:
                raise JobError(f"cannot read input file {self.file.name}: {_one_line(e)}") from None
            yield reader

    def _on_malformed(self, row: pacsv.InvalidRow) -> str:
        self._malformed.append(row)
        return "skip"

    def column_names(self) -> set[str] | None:
        with self._reader(pacsv.ConvertOptions(), HEADER_BLOCK_BYTES) as reader:
            return None if reader is None else set(reader.schema.names)

    def count(self) -> tuple[int | None, bool]:
        """Lines but the header (a value spanning lines blurs it), of a local file that is not
        gzipped: nothing is read twice from a bucket, nor unzipped twice, for a progress bar."""
        if not self.file.path.is_local or self.file.path.suffix == ".gz":
            return None, False
        with open_decompressed(self.file) as fh:
            lines = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
        return max(lines - 1, 0), False

    def infer_kinds(self, columns: list[str]) -> dict[str, str]:
        """The kind pyarrow infers for each column from the file's first block."""
        if not columns:
            return {}
        with self._reader(pacsv.ConvertOptions(include_columns=columns)) as reader:
            if reader is None:
                return {}
            try:
                reader.read_next_batch()
            except StopIteration:
                pass
            except (OSError, pa.ArrowException) as e:
                raise JobError(f"cannot read input file {self.file.name}: {_one_line(e)}") from None
            return {c: _INFERRED.get(reader.schema.field(c).type, "string") for c in columns}

    def records(self, columns: list[str], parse: bool = True) -> Iterator[Record]:
        read = columns
        if not read:  # pyarrow reads every column when given none; counting rows needs one
            names = self.column_names()
            if not names:
                return
            read = sorted(names)[:1]
        convert = pacsv.ConvertOptions(include_columns=read, column_types={c: pa.binary() for c in read},
                                       strings_can_be_null=False)
        self._malformed = []
        index = malformed = 0
        with self._reader(convert) as reader:
            while reader is not None:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except (OSError, pa.ArrowException) as e:
                    why = _one_line(e)
                    raise JobError(f"cannot read input file {self.file.name} near row {index}: {why}") from None
                values = {c: self._values(c, batch.column(c)) for c in columns} if parse else {}
                for j in range(batch.num_rows):
                    yield Record(index, {c: values[c][j] for c in columns} if parse else None)
                    index += 1
                for row in self._malformed:
                    why = (f"malformed {self.file.format.upper()} line: {row.actual_columns} fields where the "
                           f"header has {row.expected_columns}: {_shorten(row.text)!r}")
                    yield Record(malformed, None, why, unnumbered=f"malformed-{malformed}")
                    malformed += 1
                self._malformed = []

    def _values(self, col: str, cells: pa.Array) -> list[Any]:
        texts = _texts(cells)
        if col in self.columns.json:
            return [_json(t) for t in texts]
        if col in self.columns.optional:
            return [None if t == "" else t for t in texts]
        kind = self.columns.kinds.get(col)
        if kind is None or kind == "string":
            return texts
        return _typed(texts, kind)


def _texts(cells: pa.Array) -> list[Any]:
    """Cells as text; one that is not UTF-8 as ``BAD_UTF8``."""
    try:
        return cells.cast(pa.string()).to_pylist()
    except pa.ArrowInvalid:
        return [decode(b) for b in cells.to_pylist()]


def _json(text: Any) -> Any:
    if not isinstance(text, str) or text == "":
        return text or None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadValue(f"malformed JSON: {e.msg} (column {e.colno})")


def _typed(texts: list[Any], kind: str) -> list[Any]:
    """Texts as ``kind`` values, as pyarrow parses them; pyarrow's null markers are null."""
    cells = [None if isinstance(t, str) and t in NULLS else t for t in texts]
    try:
        parsed = pa.array([t if isinstance(t, str) else None for t in cells], pa.string()).cast(KIND_TYPES[kind])
    except pa.ArrowInvalid:
        return [_typed_one(t, kind) for t in cells]
    return [t if isinstance(t, BadValue) else v for t, v in zip(cells, parsed.to_pylist(), strict=True)]


def _typed_one(text: Any, kind: str) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return pa.array([text], pa.string()).cast(KIND_TYPES[kind])[0].as_py()
    except pa.ArrowInvalid:
        return BadValue(f"expected {kind} as in the first rows, got {_shorten(text)!r}")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _shorten(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
