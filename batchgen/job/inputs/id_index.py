"""Input id indexes: what reading an input file's ids gave, kept beside the output, so a rerun,
``status`` and ``merge`` need not read, parse and hash the ids of an unchanged file again.

Once the reader has read every row of a file (not sharded), it writes the file's index: each row's
output id, its 64-bit hash, the id read (where a repeat got its own id), the row's number, the key
of the first row with its id (-1: this row is that first row), whether its id was checked for
repeats, and its id's error. Duplicate detection runs in file order across all files, so an
index holds for its file *after the files before it*: it names the key (size, time or ETag) of
its file and of every file before it, and is used only while all of them still match. A rewritten
or appended file, or one inserted before it, makes the reader read the file again (and write a new
index). Arrow IPC, compressed, one batch per batch read: read back a batch at a time.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ...storage import Location
from ...storage.scratch import scratch_dir
from ..ids import HASH_NAME
from .rows import InputFile

INDEX_DIR = "_input_ids"  # in the output dir; "_" so Parquet dataset readers skip it
VERSION = 1
INDEXED_FORMATS = frozenset({"parquet", "jsonl", "openai_batch"})
_META = b"batchgen.input_index"
_COMPRESSION = pa.ipc.IpcWriteOptions(compression="lz4")


@dataclass
class IndexedBatch:
    """One batch of an index: what ``InputReader._first_rows`` gave for these rows."""

    ids: pa.Array  # output ids
    hashes: np.ndarray
    owners: pa.Array  # the ids read (a repeat's output id is its own)
    index: np.ndarray  # the rows' numbers in the file
    first: np.ndarray  # key of the first row with the id, or -1
    checked: np.ndarray  # bool: the id was checked for repeats
    errors: dict[int, str]  # position -> the id's error

    def table(self) -> pa.RecordBatch:
        errors = [None] * len(self.ids)
        for at, message in self.errors.items():
            errors[at] = message
        owners = pa.array([None if o == i else o for o, i in zip(self.owners.to_pylist(), self.ids.to_pylist(),
                                                                  strict=True)], self.ids.type) \
            if (self.first >= 0).any() else pa.nulls(len(self.ids), self.ids.type)
        return pa.RecordBatch.from_arrays(
            [self.ids, pa.array(self.hashes), owners, pa.array(self.index), pa.array(self.first),
             pa.array(self.checked), pa.array(errors, pa.string())],
            ["id", "hash", "owner", "index", "first", "checked", "error"])

    @classmethod
    def of(cls, batch: pa.RecordBatch) -> IndexedBatch:
        ids = batch.column("id")
        owner = batch.column("owner")
        owners = owner.fill_null(ids) if owner.null_count < len(owner) else ids
        errors = batch.column("error")
        bad = np.flatnonzero(errors.is_valid().to_numpy(zero_copy_only=False))
        return cls(ids, batch.column("hash").to_numpy(), owners, batch.column("index").to_numpy(),
                   batch.column("first").to_numpy(), batch.column("checked").to_numpy(zero_copy_only=False),
                   dict(zip(bad.tolist(), errors.take(pa.array(bad)).to_pylist(), strict=True)))


def file_key(f: InputFile) -> list[object]:
    """What must be unchanged for an index of ``f`` to hold: its name, format, size and ETag or time."""
    info = f.path.info()
    return [f.name, f.format, info.size, info.etag or info.mtime]


@dataclass
class IndexDir:
    """The indexes of a job's input files, in ``<output dir>/_input_ids``; ``reading``: what the
    reader reads as ids (the id column, or none), part of every index's key."""

    root: Location
    reading: str

    def keys_for(self, files: list[InputFile]) -> list[list[object]] | None:
        """Each file's key (None when a file cannot be asked: a dataset split, a file gone)."""
        if any(f.path is None for f in files):
            return None
        try:
            return [file_key(f) for f in files]
        except OSError:
            return None

    def _path(self, f: InputFile) -> Location:
        return self.root / (hashlib.sha256(f.name.encode("utf-8", "surrogatepass")).hexdigest()[:32] + ".arrow")

    def _meta(self, keys: list[list[object]], file_no: int) -> str:
        return json.dumps({"version": VERSION, "hash": HASH_NAME, "reading": self.reading,
                           "files": keys[:file_no + 1]})

    def read(self, f: InputFile, keys: list[list[object]] | None, file_no: int) -> Iterator[IndexedBatch] | None:
        """The file's index batches, if an index holds for it and every file before it; else None."""
        if keys is None or f.format not in INDEXED_FORMATS:
            return None
        path = self._path(f)
        try:
            reader = pa.ipc.open_file(path.arrow_source())
            meta = (reader.schema.metadata or {}).get(_META)
        except (OSError, pa.ArrowException):
            return None
        if meta is None or meta.decode() != self._meta(keys, file_no):
            return None
        return (IndexedBatch.of(reader.get_batch(i)) for i in range(reader.num_record_batches))

    def writer(self, f: InputFile, keys: list[list[object]] | None, file_no: int) -> IndexWriter | None:
        if keys is None or f.format not in INDEXED_FORMATS:
            return None
        return IndexWriter(self._path(f), self._meta(keys, file_no))


class IndexWriter:
    """Writes one file's index to a temp file as its batches come; ``publish`` once all are in."""

    def __init__(self, final: Location, meta: str):
        self.final = final
        self.meta = meta
        self._dir = scratch_dir("index")
        self._path = Path(self._dir.name) / "index.arrow"
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self.usable = True

    def add(self, batch: IndexedBatch) -> None:
        if not self.usable:
            return
        table = batch.table()
        if not pa.types.is_string(table.schema.field("id").type):  # ids that are not UTF-8: not indexed
            self.usable = False
            return
        if self._writer is None:
            schema = table.schema.with_metadata({_META: self.meta.encode()})
            self._writer = pa.ipc.new_file(str(self._path), schema, options=_COMPRESSION)
        self._writer.write_batch(table)

    def publish(self) -> None:
        """Make the index visible (a failure to write it only costs the next run a full read)."""
        try:
            if self.usable and self._writer is not None:
                self._writer.close()
                self._writer = None
                self.final.parent.prepare_dir()
                self.final.publish(lambda tmp: shutil.copyfile(self._path, tmp))
        except (OSError, pa.ArrowException):
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._dir.cleanup()
