"""Input rows by their ids, a batch at a time and columnar: what the done check and duplicate
detection need, so that a row is made whole (a ``Record`` of Python values) only when it is to
be generated. A Parquet id column is taken as it is read (``column_ids``); other formats make
their records first and give their ids as a batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import JobError
from ..ids import id_array
from .rows import InputFile, Record


@dataclass
class IdBatch:
    """Rows of one file by their ids."""

    ids: pa.Array  # each row's id: its id column's value, or its derived id where that is bad or absent
    index: np.ndarray  # each row's number in its file (int64)
    checked: np.ndarray  # bool: the rows whose id is checked for duplicates (a good id of a readable row)
    errors: dict[int, str]  # position -> why the row's id is bad
    read: Callable[[np.ndarray], list[Record]]  # the records at these positions, read whole

    def take(self, positions: np.ndarray) -> IdBatch:
        where = {int(p): i for i, p in enumerate(positions.tolist())}
        return IdBatch(self.ids.take(pa.array(positions, pa.int64())), self.index[positions],
                       self.checked[positions], {where[p]: e for p, e in self.errors.items() if p in where},
                       lambda at: self.read(positions[at]))


@dataclass
class InputIds:
    """Output ids of a batch of input rows, for ``status`` and ``merge``."""

    ids: pa.Array  # each row's output id (a row repeating an earlier row's id has its own)
    hashes: np.ndarray  # theirs (``ids.hash_ids``)
    owners: pa.Array  # the ids whose shard each row belongs to (the repeated id, for a repeat)
    duplicates: dict[int, str]  # position -> a repeating row's error, with its place


def column_ids(column: pa.Array, f: InputFile, start: int, name: str) -> tuple[pa.Array, dict[int, str]] | None:
    """The ids of rows ``start``.. from their id column, as ``InputReader`` reads one id (text, or
    an integer as its decimal text), with the errors of missing or empty ones (their ids derived);
    None for a column of another type, or text that is not UTF-8, which is read row by row."""
    if pa.types.is_integer(column.type):
        text = column.cast(pa.string())
    elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            return None
        text = column
    else:
        return None
    missing = column.is_null().to_numpy(zero_copy_only=False)
    empty = pc.equal(pc.binary_length(text), 0).fill_null(False).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(missing | empty)
    if not len(bad):
        return text, {}
    ids = text.to_pylist()
    errors = {}
    for i in bad.tolist():
        ids[i] = f.derived_id(start + i)
        errors[i] = f"field {name!r}: missing id" if missing[i] else f"field {name!r}: id is empty or not valid Unicode"
    return id_array(ids), errors


class RowsAt:
    """Records of one file at increasing row numbers, for rows whose ids came from the file's index:
    the file is read forward once, from its first ask, a batch at a time (columnar for Parquet)."""

    def __init__(self, batches: Callable[[], Iterator[IdBatch]], f: InputFile):
        self._batches = batches
        self._file = f
        self._it: Iterator[IdBatch] | None = None
        self._batch: IdBatch | None = None

    def read(self, rows: np.ndarray) -> list[Record]:
        """The records of rows numbered ``rows`` (ascending, and after every row asked before)."""
        records: list[Record] = []
        while len(rows):
            b = self._batch_with(int(rows[0]))
            here = rows[:int(np.searchsorted(rows, b.index[-1], side="right"))]
            at = np.searchsorted(b.index, here)
            if not np.array_equal(b.index[np.minimum(at, len(b.index) - 1)], here):
                raise JobError(f"input file {self._file.name} changed while it was read (row {int(here[0])})")
            records += b.read(at)
            rows = rows[len(here):]
        return records

    def _batch_with(self, row: int) -> IdBatch:
        if self._it is None:
            self._it = self._batches()
        while self._batch is None or not len(self._batch.index) or self._batch.index[-1] < row:
            self._batch = next(self._it, None)
            if self._batch is None:
                raise JobError(f"input file {self._file.name} changed while it was read (row {row} is gone)")
        return self._batch
