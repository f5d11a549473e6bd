"""Parquet input: the footer first, then only the needed columns, one batch at a time (a bucket
object is fetched in ranges as pyarrow asks for them). Rows are numbered from 0 in each file."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import JobError
from .arrow import BATCH_ROWS, batch_records, records_of
from .rows import InputFile, Record

COLUMN_BATCH_ROWS = 1 << 16  # rows read together as columns (``column_batches``)


@dataclass
class ColumnBatch:
    """Rows ``start``.. of a file as Arrow columns; ``records`` makes Records of the rows asked for."""

    start: int
    columns: pa.RecordBatch
    source: ParquetSource
    names: list[str]

    def records(self, positions: np.ndarray) -> list[Record]:
        s = self.source
        return records_of(self.columns, self.names, s.types, s.file.name, self.start, positions)


class ParquetSource:
    strict = True

    def __init__(self, f: InputFile, types: Mapping[str, pa.DataType] | None = None, batch_rows: int | None = None):
        """``types``: the Arrow types carried columns must have (the first file's). ``batch_rows``: read at most
        this many rows at a time (a job reading images: a batch's images are all in memory at once)."""
        self.file = f
        self.types = types or {}
        self.batch_rows = batch_rows

    @cached_property
    def parquet(self) -> pq.ParquetFile:
        try:
            # pyarrow's pre-buffering reads many row groups in one request: from a bucket that is
            # tens of MB before the first row; without it, one row group at a time.
            path = self.file.path
            return pq.ParquetFile(path.arrow_source(), pre_buffer=path.is_local)
        except (OSError, pa.ArrowException) as e:
            raise JobError(f"cannot read input file {self.file.name}: {e}") from None

    @property
    def schema(self) -> pa.Schema:
        return self.parquet.schema_arrow

    def column_names(self) -> set[str]:
        return set(self.schema.names)

    def count(self) -> tuple[int, bool]:
        return self.parquet.metadata.num_rows, True

    def column_batches(self, columns: list[str]) -> Iterator[ColumnBatch]:
        """The file's rows as column batches, read whole (the columnar path of the reader)."""
        self._check_columns(columns)
        start = 0
        try:
            for batch in self._batches(min(COLUMN_BATCH_ROWS, self.batch_rows or COLUMN_BATCH_ROWS), columns):
                yield ColumnBatch(start, batch, self, columns)
                start += batch.num_rows
        except (OSError, pa.ArrowException) as e:
            raise JobError(f"cannot read input file {self.file.name} near row {start}: {e}") from None

    def _batches(self, size: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """One row group at a time: pyarrow pre-buffers every row group it is asked for at once,
        so asking for all of them would hold the whole file's columns (~13 bytes a row of a
        10M-row file of short prompts) until the last batch."""
        for group in range(self.parquet.num_row_groups):
            yield from self.parquet.iter_batches(batch_size=size, row_groups=[group], columns=columns)

    def _check_columns(self, columns: list[str]) -> None:
        missing = [c for c in columns if c not in self.schema.names]
        if missing:
            raise JobError(f"input file {self.file.name} has no column {missing[0]!r}")

    def records(self, columns: list[str], parse: bool = True) -> Iterator[Record]:
        if not parse:
            yield from (Record(i, None) for i in range(self.parquet.metadata.num_rows))
            return
        self._check_columns(columns)
        index = 0
        try:
            batches = self._batches(min(BATCH_ROWS, self.batch_rows or BATCH_ROWS), columns)
            for record in batch_records(batches, columns, self.types, self.file.name):
                index = record.index
                yield record
        except (OSError, pa.ArrowException) as e:
            raise JobError(f"cannot read input file {self.file.name} near row {index}: {e}") from None
