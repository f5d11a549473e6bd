"""How a part file is laid out on disk: ``output.format`` parquet, jsonl or openai_batch.

Every format writes a part whole or not at all, and only if no part of that name exists (a local
temp file hard-linked into place; on a bucket one create-only PUT), and can read back, for each
line or row, the output id, the number of samples of its request and
whether it is an error: that is all recovery and ``status`` need. Parquet keeps the run's
metadata (config hash, model, shard) in the file's schema; a JSONL part keeps it in a hidden
sidecar ``.<part name>.meta`` written before the part, so a part that exists always has it.

The metadata also indexes the part (``PartIndex``): its complete ids and its number of error
rows, so a rerun and ``status`` read a few metadata bytes per part instead of its rows. The
index names the part's size (records for Parquet, bytes for JSONL); a part whose size differs,
or one written before the index existed, is read whole instead.

- ``parquet``: one row per (id, sample), typed columns.
- ``jsonl``: the same rows and columns, one JSON object per line.
- ``openai_batch``: one line per input row in the OpenAI Batch output shape
  (``batchgen.job.outputs.openai_batch``); its ``custom_id`` is the row id and it holds every sample.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from ...storage import Location
from .. import ids as row_ids
from ..errors import JobError
from .files import remove_file, write_whole

META_FORMAT = "batchgen.format"
META_IDS = "batchgen.ids"  # JSON list of the part's complete ids, each once
META_PACKED = "batchgen.packed_ids"  # the same with their hashes, packed (``PartIndex.packed``)
_DIGEST = b"batchgen.ids_digest"
META_ERRORS = "batchgen.errors"  # its error rows
META_ROWS = "batchgen.rows"  # its records (Parquet rows), to tell a part rewritten since
META_BYTES = "batchgen.bytes"  # a JSONL part's size, likewise
META_SHA256 = "batchgen.sha256"  # a JSONL part's content hash (parts written before it have none)


@dataclass
class PartIndex:
    """What recovery and ``status`` need of a part: its complete ids (each once) and error rows.
    ``listed``: the ids as the metadata lists them (JSON text) or as a list; ``packed``: the same
    ids with their hashes as an Arrow batch, which needs no parsing (None: not written with it)."""

    listed: str | list[str]
    errors: int
    packed: pa.RecordBatch | None = None

    @cached_property
    def ids(self) -> list[str]:
        return json.loads(self.listed) if isinstance(self.listed, str) else self.listed

    @cached_property
    def array(self) -> pa.Array:
        """The ids as an Arrow array."""
        return self.packed.column("id") if self.packed is not None else row_ids.id_array(self.ids)

    @cached_property
    def hashes(self) -> np.ndarray:
        return self.packed.column("hash").to_numpy() if self.packed is not None else row_ids.hash_ids(self.array)

    def __len__(self) -> int:
        return self.packed.num_rows if self.packed is not None else len(self.ids)


def index_meta(ids: list[str], errors: int, records: int) -> dict[str, str]:
    listed = json.dumps(ids, ensure_ascii=False, separators=(",", ":"))
    return {META_IDS: listed, META_PACKED: _packed(ids, listed), META_ERRORS: str(errors), META_ROWS: str(records)}


def _packed(ids: list[str], listed: str) -> str:
    """``ids`` and their hashes as a base64 Arrow IPC stream, naming a digest of ``listed`` so that
    it is used only beside that very list."""
    array = row_ids.id_array(ids)
    batch = pa.RecordBatch.from_arrays([array, pa.array(row_ids.hash_ids(array))], ["id", "hash"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema.with_metadata({_DIGEST: _digest(listed)})) as w:
        w.write_batch(batch)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode("ascii")


def _unpacked(meta: dict[str, str]) -> pa.RecordBatch | None:
    text = meta.get(META_PACKED)
    if text is None:
        return None
    try:
        reader = pa.ipc.open_stream(base64.b64decode(text))
        batch = reader.read_next_batch()
    except (ValueError, StopIteration, pa.ArrowException):
        return None
    ok = (reader.schema.metadata or {}).get(_DIGEST) == _digest(meta[META_IDS]).encode()
    return batch if ok and pa.types.is_string(batch.schema.field("id").type) else None


def _digest(listed: str) -> str:
    """The list's digest, with the hash function's name: hashes of another function are not used."""
    text = f"{row_ids.HASH_NAME}\n{listed}"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _index(meta: dict[str, str], size_key: str, size: int) -> PartIndex | None:
    if META_IDS not in meta or meta.get(size_key) != str(size):
        return None
    return PartIndex(meta[META_IDS], int(meta[META_ERRORS]), _unpacked(meta))


def sample_key(record: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(id, num_samples, error) of a record or line holding one sample."""
    return record.get("id"), record.get("num_samples"), record.get("error")


class PartFormat(Protocol):
    name: str
    suffix: str

    def key(self, record: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(id, num_samples, error) of a record as ``write`` takes it."""

    def read_index(self, path: Location, size: int) -> tuple[dict[str, str], PartIndex | None]:
        """The part's metadata and the index written with it (None: none, or the part's ``size``,
        its bytes as listed, says it was rewritten since)."""

    def write(self, records: list[dict[str, Any]], path: Location, schema: pa.Schema, meta: dict[str, str]) -> None:
        """The records of a part, written whole or not at all; ``PartExists`` if the name is taken."""

    def keys(self, path: Location) -> pa.Table:
        """Per row or line: id, num_samples and error (null where the row is not an error)."""

    def drop_errors(self, path: Location) -> int:
        """Rewrites the part without its error rows (removes it if none is left); how many."""

    def verify(self, path: Location) -> None:
        """Reads the whole part and checks it (``UnreadablePart`` if a byte changed since it was written): what
        ``status --verify`` and ``run --verify`` add to the footer and size checks every reader makes."""

    def metadata(self, path: Location) -> dict[str, str]: ...


class ParquetParts:
    name = "parquet"
    suffix = ".parquet"
    key = staticmethod(sample_key)

    def write(self, records: list[dict[str, Any]], path: Location, schema: pa.Schema, meta: dict[str, str]) -> None:
        schema = schema.with_metadata({k.encode(): v.encode() for k, v in meta.items()})
        table = pa.Table.from_pylist(records, schema=schema)
        create_part(path, lambda tmp: pq.write_table(table, tmp, compression="zstd", write_page_checksum=True))

    def keys(self, path: Location) -> pa.Table:
        try:
            return pq.read_table(path.arrow_source(), columns=["id", "num_samples", "error"],
                                 page_checksum_verification=True)
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(path, e) from None

    def drop_errors(self, path: Location) -> int:
        try:
            table = pq.read_table(path.arrow_source(), page_checksum_verification=True)
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(path, e) from None
        errors = table.num_rows - table.column("error").null_count
        if errors == 0:
            return 0
        kept = table.filter(pc.is_null(table.column("error")))
        if kept.num_rows:
            ids = pc.unique(kept.column("id")).to_pylist()
            meta = {**_decoded(kept.schema.metadata), **index_meta(ids, 0, kept.num_rows)}
            kept = kept.replace_schema_metadata(meta)
            write_whole(path, lambda tmp: pq.write_table(kept, tmp, compression="zstd", write_page_checksum=True))
        else:
            remove_file(path)
        return errors

    def verify(self, path: Location) -> None:
        """Every data page against the checksum written with it (a page's CRC-32)."""
        try:
            pq.read_table(path.arrow_source(), page_checksum_verification=True)
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(path, e) from None

    def metadata(self, path: Location) -> dict[str, str]:
        try:
            return _decoded(pq.read_schema(path.arrow_source()).metadata)
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(path, e) from None

    def read_index(self, path: Location, size: int) -> tuple[dict[str, str], PartIndex | None]:
        try:
            footer = pq.read_metadata(path.arrow_source())
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(path, e) from None
        meta = _decoded(footer.metadata)
        return meta, _index(meta, META_ROWS, footer.num_rows)


def _decoded(meta: dict[bytes, bytes] | None) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (meta or {}).items() if not k.startswith(b"ARROW:")}


class JsonlParts:
    """Output rows as JSON lines: the schema's columns, in its order, nulls included."""

    name = "jsonl"
    suffix = ".jsonl"
    key = staticmethod(sample_key)
    # The fields ``key`` reads, for Arrow's JSON reader (None: lines are parsed one by one).
    key_schema: pa.Schema | None = pa.schema([("id", pa.string()), ("num_samples", pa.int32()),
                                              ("error", pa.string())])

    def write(self, records: list[dict[str, Any]], path: Location, schema: pa.Schema, meta: dict[str, str]) -> None:
        data = b"".join(self.line(r, schema.names) for r in records)
        self._write_meta(path, {**meta, META_BYTES: str(len(data)), META_SHA256: hashlib.sha256(data).hexdigest()})
        create_part(path, lambda tmp: tmp.write_bytes(data))

    def _write_meta(self, path: Location, meta: dict[str, str]) -> None:
        text = json.dumps({**meta, META_FORMAT: self.name})
        write_whole(meta_path(path), lambda tmp: tmp.write_text(text))

    @staticmethod
    def line(record: dict[str, Any], names: list[str]) -> bytes:
        obj = {k: record.get(k) for k in names}
        return json_line(obj)

    def keys(self, path: Location) -> pa.Table:
        """Also where each line is: its byte offset and length (``merge`` copies lines by them)."""
        return self._keys(path, self._read(path))

    def _keys(self, path: Location, data: bytes) -> pa.Table:
        return self._columnar_keys(data) or self._parsed_keys(path, data)

    def _columnar_keys(self, data: bytes) -> pa.Table | None:
        """``keys`` by Arrow's JSON reader (C++; ~10x the line-by-line parse). None where it cannot say the
        same as the line-by-line path (a blank line, an id that is not a string, an error that is not a
        string), which then decides."""
        if self.key_schema is None:
            return None
        ends = np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1
        if data and not data.endswith(b"\n"):
            ends = np.append(ends, len(data))
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        if not len(ends) or (ends - starts <= 1).any():
            return None
        try:
            table = pa_json.read_json(pa.BufferReader(data), pa_json.ReadOptions(block_size=len(data) + 1),
                                      pa_json.ParseOptions(explicit_schema=self.key_schema,
                                                           unexpected_field_behavior="ignore"))
        except pa.ArrowException:
            return None
        if table.num_rows != len(ends) or table.column("id").null_count:
            return None
        counts = pc.fill_null(table.column("num_samples"), 1).to_numpy()
        return pa.table({"id": table.column("id").combine_chunks(),
                         "num_samples": pa.array(np.where(counts == 0, 1, counts).astype(np.int32)),
                         "error": table.column("error").combine_chunks(), "offset": pa.array(starts),
                         "length": pa.array(ends - starts)})

    def _parsed_keys(self, path: Location, data: bytes) -> pa.Table:
        ids, counts, errors, offsets, lengths = [], [], [], [], []
        for offset, line, obj in self._objects(path, data):
            row_id, count, error = self.key(obj)
            ids.append(str(row_id))
            counts.append(int(count or 1))
            errors.append(None if error is None else json.dumps(error) if not isinstance(error, str) else error)
            offsets.append(offset)
            lengths.append(len(line))
        return pa.table({"id": pa.array(ids, pa.string()), "num_samples": pa.array(counts, pa.int32()),
                         "error": pa.array(errors, pa.string()), "offset": pa.array(offsets, pa.int64()),
                         "length": pa.array(lengths, pa.int64())})

    def drop_errors(self, path: Location) -> int:
        data = self._read(path)
        keys = self._keys(path, data)
        ok = pc.is_null(keys.column("error"))
        kept = keys.filter(ok)
        if kept.num_rows == keys.num_rows:
            return 0
        if kept.num_rows:
            view = memoryview(data)
            out = b"".join(view[o:o + n] for o, n in zip(kept.column("offset").to_pylist(),
                                                         kept.column("length").to_pylist(), strict=True))
            write_whole(path, lambda tmp: tmp.write_bytes(out))
            ids = list(dict.fromkeys(kept.column("id").to_pylist()))
            self._write_meta(path, {**read_meta(path), **index_meta(ids, 0, kept.num_rows), META_BYTES: str(len(out)),
                                    META_SHA256: hashlib.sha256(out).hexdigest()})
        else:
            remove_file(path)
            remove_file(meta_path(path))
        return keys.num_rows - kept.num_rows

    def metadata(self, path: Location) -> dict[str, str]:
        return read_meta(path)

    def read_index(self, path: Location, size: int) -> tuple[dict[str, str], PartIndex | None]:
        meta = read_meta(path)
        written = meta.get(META_BYTES)
        if written is not None and written != str(size):
            raise UnreadablePart(f"part {path} is {size:,} bytes, {int(written):,} when it was written: "
                                 "truncated or torn")
        return meta, _index(meta, META_BYTES, size)

    def verify(self, path: Location) -> None:
        """The content against the hash written with it; a part written before parts had one: every line parses."""
        data = self._read(path)
        written = read_meta(path).get(META_SHA256)
        if written is None:
            self._keys(path, data)
        elif hashlib.sha256(data).hexdigest() != written:
            raise UnreadablePart(f"part {path}: its content changed since it was written (sha256 differs): corrupt")

    @staticmethod
    def _read(path: Location) -> bytes:
        try:
            return path.read_bytes()
        except OSError as e:
            raise JobError(f"cannot read part {path}: {e}") from None

    @staticmethod
    def _objects(path: Location, data: bytes) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
        """(byte offset, line, parsed object) of every non-blank line of the part's ``data``."""
        offset = 0
        pieces = data.split(b"\n")
        for n, piece in enumerate(pieces, 1):
            line = piece + b"\n" if n < len(pieces) else piece
            at, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise UnreadablePart(f"cannot read part {path}: line {n} is not JSON (corrupt, or not a "
                                     "batchgen part)") from None
            if not isinstance(obj, dict):
                raise UnreadablePart(f"cannot read part {path}: line {n} is not a JSON object")
            yield at, line, obj


class OpenAIBatchParts(JsonlParts):
    """Lines already in the OpenAI batch output shape, one per input row (all samples in it)."""

    name = "openai_batch"
    key_schema = None  # its error is an object, and its "id" is not the row's

    @staticmethod
    def line(record: dict[str, Any], names: list[str]) -> bytes:
        return json_line(record)

    def key(self, obj: dict[str, Any]) -> tuple[Any, Any, Any]:
        return obj.get("custom_id"), 1, obj.get("error")


class PartExists(JobError):
    """A part of this name exists already: another run is writing the same shard."""


class UnreadablePart(JobError):
    """A part that is not whole: truncated, torn or corrupt (its footer, a line, its size, a page checksum)."""


def _unreadable(path: Location, e: BaseException) -> JobError:
    """A Parquet part that cannot be read: corrupt (``UnreadablePart``), or the store failed (``JobError``)."""
    if isinstance(e, pa.ArrowException) or "checksum verification failed" in str(e):  # pyarrow: an OSError
        return UnreadablePart(f"cannot read part {path}: {str(e).splitlines()[0]} (truncated or corrupt)")
    return JobError(f"cannot read part {path}: {e}")


def create_part(path: Location, write: Any) -> None:
    if not write_whole(path, write, create_only=True):
        raise PartExists(f"{path} exists already: another run is writing this shard (or did, with the same "
                         "part numbers); this run stops so that no row is written twice")


_FORMATS: dict[str, PartFormat] = {f.name: f for f in (ParquetParts(), JsonlParts(), OpenAIBatchParts())}


def part_format(name: str) -> PartFormat:
    return _FORMATS[name]


def format_of(path: Location) -> PartFormat:
    """The format of an existing part: Parquet by its suffix, else as its sidecar says."""
    if path.suffix == ".parquet":
        return _FORMATS["parquet"]
    return _FORMATS.get(read_meta(path).get(META_FORMAT, "jsonl"), _FORMATS["jsonl"])


def meta_path(part: Location) -> Location:
    return part.with_name(f".{part.name}.meta")


def read_meta(part: Location) -> dict[str, str]:
    """A JSONL part's sidecar; empty when it is missing (the part then matches no configuration)."""
    try:
        return json.loads(meta_path(part).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise JobError(f"cannot read {meta_path(part)}: {e}") from None


def json_line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=_json_value) + "\n").encode()


def _json_value(v: Any) -> Any:
    """Values JSON has no type for, from carried Parquet columns."""
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    raise TypeError(f"cannot write {type(v).__name__} as JSON")
