"""Records from Arrow batches, for the formats pyarrow reads with their own types (Parquet).

Carried columns keep the first file's Arrow types: a later file's column is cast to them, or the
job stops naming the file (a file-level mismatch, not one row's fault)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import JobError
from .rows import BAD_UTF8, Record

BATCH_ROWS = 1024


def to_python(arr: pa.Array | pa.ChunkedArray) -> list[Any]:
    """Python values; a string that is not UTF-8 becomes ``BAD_UTF8``, binary stays bytes
    (decoded, or refused, per value where it is used)."""
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return arr.to_pylist()
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


def cast_column(arr: pa.Array, want: pa.DataType | None, file_name: str, col: str) -> pa.Array:
    if want is None or arr.type == want:
        return arr
    try:
        return arr.cast(want)
    except pa.ArrowException:
        raise JobError(f"input file {file_name}: column {col!r} is {arr.type}, "
                       f"but the first input file has {want}") from None


def batch_records(batches: Iterable[pa.RecordBatch | pa.Table], columns: list[str],
                  types: Mapping[str, pa.DataType], file_name: str) -> Iterator[Record]:
    """The rows of ``batches``, numbered from 0, with the values of ``columns``."""
    index = 0
    for batch in batches:
        yield from records_of(batch, columns, types, file_name, index)
        index += batch.num_rows


def records_of(batch: pa.RecordBatch | pa.Table, columns: list[str], types: Mapping[str, pa.DataType],
               file_name: str, start: int, positions: np.ndarray | None = None) -> list[Record]:
    """The rows of a batch whose first row is number ``start`` (only those at ``positions``, if given)."""
    if positions is not None:
        batch = batch.take(pa.array(positions, pa.int64()))
    values = {c: to_python(cast_column(batch.column(c), types.get(c), file_name, c)) for c in columns}
    numbers = range(start, start + batch.num_rows) if positions is None else (start + positions).tolist()
    return [Record(i, {c: values[c][j] for c in columns}) for j, i in enumerate(numbers)]
