"""Part files: one row per (id, sample_index), written atomically, and read back on start.

A part either exists whole or not at all, and is only ever created, never replaced by another
writer: locally a temp file fsynced and hard-linked into place, on a bucket one create-only PUT
(``batchgen.storage``; the file layouts of Parquet, JSONL and OpenAI batch parts are in
``formats.py``). All samples of a request go into
the same part, which makes "the id is in a part with all its samples" the definition of done:
a run killed at any moment redoes exactly the rows that are in no part.

Part names carry the shard and a sequence number (``part-00002-of-00008-000013.parquet``), so
shards never collide; hidden (``.``) and ``_`` files are what Parquet readers skip, so the output
dir stays readable as one dataset (``pyarrow.dataset.dataset(out_dir)``).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ...outputs import RequestOutput
from ...storage import FileInfo, Location, location
from ..adapters import LORA_COLUMN
from ..errors import JobError
from ..ids import DoneIds
from ..inputs import Row
from ..shard import Shard
from ..structured import parsed_json
from .formats import ParquetParts, PartFormat, PartIndex, UnreadablePart, format_of, index_meta, meta_path
from .task_rows import TaskShape, task_rows, task_schema_columns

CORRUPT_DIR = ".corrupt"  # where parts that are not whole are set aside (hidden: readers skip it)
PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})-(\d{6})\.(parquet|jsonl)$")
META_HASH = "batchgen.config_hash"


@dataclass(frozen=True)
class PartName:
    path: Location
    shard: Shard
    seq: int
    info: FileInfo


def part_name(shard: Shard, seq: int, suffix: str = ".parquet") -> str:
    return f"part-{shard.tag}-{seq:06d}{suffix}"


def list_parts(out_dir: Location | Path, files: dict[Location, FileInfo] | None = None) -> list[PartName]:
    """The parts in an output dir (from one listing of it: ``files``, when the caller has it)."""
    out_dir = location(out_dir)
    parts = []
    for p, info in (out_dir.list_files() if files is None else files).items():
        m = PART_RE.match(p.name)
        if m:
            parts.append(PartName(p, Shard(int(m.group(1)), int(m.group(2))), int(m.group(3)), info))
    return sorted(parts, key=lambda x: (x.shard.count, x.shard.index, x.seq))


def output_schema(fields: Iterable[str], carry: list[pa.Field], shape: TaskShape | None = None,
                  lora: bool = False) -> pa.Schema:
    """The columns of a part: a generation's chosen ``fields``, or the columns of a task's ``shape``;
    ``lora``: a job with adapters names each row's (null: the base model)."""
    fields = set(fields)
    cols = [pa.field("id", pa.string(), nullable=False), pa.field("sample_index", pa.int32()),
            pa.field("num_samples", pa.int32()), *carry]
    if lora:
        cols.append(pa.field(LORA_COLUMN, pa.string()))
    if shape is not None:
        return pa.schema([*cols, *task_schema_columns(shape), pa.field("error", pa.string())])
    if "text" in fields:
        cols.append(pa.field("text", pa.string()))
    if "token_ids" in fields:
        cols.append(pa.field("token_ids", pa.list_(pa.int32())))
    if fields & {"logprobs", "score"}:
        cols.append(pa.field("cumulative_logprob", pa.float64()))
    if "score" in fields:
        cols.append(pa.field("score", pa.float64()))
    if "logprobs" in fields:
        cols.append(pa.field("logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))))
    if "finish_reason" in fields:
        cols += [pa.field("finish_reason", pa.string()), pa.field("stop_reason", pa.string())]
    if "token_counts" in fields:
        cols += [pa.field("num_prompt_tokens", pa.int32()), pa.field("num_output_tokens", pa.int32())]
    if "valid" in fields:
        cols.append(pa.field("valid", pa.bool_()))
    if "parsed" in fields:
        cols.append(pa.field("parsed", pa.string()))
    if "prompt_logprobs" in fields:
        cols.append(pa.field("prompt_logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))))
    cols.append(pa.field("error", pa.string()))
    return pa.schema(cols)


def result_rows(row: Row, out: RequestOutput, text_later: bool = False) -> list[dict[str, Any]]:
    """One dict per sample; columns the schema does not have are dropped when the part is built. ``text_later``:
    the engine did not decode the samples; their text is None until the part writer decodes it (texts.py)."""
    base = {"id": row.id, "num_samples": len(out.outputs), **row.carry}
    rows = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        rows.append({
            **base, "sample_index": c.index, "text": None if text_later else c.text, "token_ids": c.token_ids,
            "cumulative_logprob": c.cumulative_logprob, "score": c.score, "logprobs": c.logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": None if c.stop_reason is None else str(c.stop_reason),
            "num_prompt_tokens": len(out.prompt_token_ids), "num_output_tokens": len(c.token_ids),
            "valid": c.valid, "parsed": parsed_json(c.text, c.finish_reason, c.valid),
            "prompt_logprobs": out.prompt_logprobs,
        })
    return rows


def error_rows(row: Row, message: str) -> list[dict[str, Any]]:
    """A failed row is one output row (sample 0) with ``error`` set; it counts as done."""
    return [{"id": row.id, "sample_index": 0, "num_samples": 1, **row.carry, "error": message}]


@dataclass
class SampleRows:
    """What a finished or failed row becomes in Parquet and JSONL parts (``ResponseLines`` is the
    OpenAI batch counterpart): the samples of a generation, or a task's one row (``shape``)."""

    shape: TaskShape | None = None
    text_later: bool = False  # the part writer decodes the samples' text (texts.TextPlan)

    def result(self, row: Row, outputs: list[Any]) -> list[dict[str, Any]]:
        """``outputs``: the engine's outputs of the row's requests (one here)."""
        rows = (result_rows(row, outputs[0], self.text_later) if self.shape is None
                else task_rows(row, outputs[0], self.shape))
        return _with_adapter(row, rows)

    @staticmethod
    def error(row: Row, message: str, code: str) -> list[dict[str, Any]]:
        return _with_adapter(row, error_rows(row, message))


def _with_adapter(row: Row, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The adapter's column (dropped with the other columns a part's schema lacks when it has none)."""
    for r in rows:
        r[LORA_COLUMN] = row.lora
    return rows


# ------------------------------------------------------------------------------------ recovery


@dataclass
class Recovered:
    done: DoneIds = field(default_factory=DoneIds)  # ids to skip (for other shard counts, not only ours)
    done_here: int = 0  # of them, the ids this shard owns
    errors_here: int = 0  # of those, error rows (in parts of this shard count)
    next_seq: int = 0
    parts: int = 0
    retried: int = 0  # error rows removed so that their rows are generated again
    set_aside: list[str] = field(default_factory=list)  # one line per corrupt part moved to CORRUPT_DIR


def read_part(path: Location | Path) -> tuple[pa.Table, int]:
    """(ids with all their samples in this part, number of error rows)."""
    path = location(path)
    t = format_of(path).keys(path)
    errors = t.num_rows - t.column("error").null_count
    return pa.table({"id": complete_ids(t)}), errors


def complete_ids(keys: pa.Table) -> pa.Array:
    """The ids of a part's rows (``PartFormat.keys``) that have all their samples there."""
    g = keys.group_by("id").aggregate([("id", "count"), ("num_samples", "max")])
    return g.filter(pc.equal(g.column("id_count"), g.column("num_samples_max"))).column("id").combine_chunks()


def part_metadata(path: Location | Path) -> dict[str, str]:
    path = location(path)
    return format_of(path).metadata(path)


def summarize(path: Location, size: int | None = None) -> tuple[dict[str, str], PartIndex]:
    """A part's metadata and index (``size``: its bytes, if the caller listed them): the index
    written with it, or, for a part written before indexes or rewritten since, read from its rows."""
    meta, index = format_of(path).read_index(path, path.info().size if size is None else size)
    return meta, index or index_from_rows(path)


def index_from_rows(path: Location) -> PartIndex:
    ids, errors = read_part(path)
    return PartIndex(ids.column("id").to_pylist(), errors)


def part_ids(path: Location) -> pa.Array:
    """A part's complete ids, read again (``DoneIds`` confirms a hash match with them)."""
    return summarize(path)[1].array


def recover(out_dir: Location | Path, shard: Shard, config_hash: str, force: bool = False,
            retry_errors: bool = False, verify: bool = False) -> Recovered:
    """What this shard already did: complete ids and the next part number.

    Also reads parts written under another shard count (a re-sharded job); all their ids count
    as done, so re-sharding never duplicates rows. Deletes this shard's stale temp files (the
    caller holds the shard lock, so no writer of ours is alive). With ``retry_errors``, this
    shard's error rows are removed from its parts first, so those rows are generated again;
    error rows in parts of another shard count stay (another shard may be reading them). With ``verify``
    (``run --verify``), this shard's parts are read whole and checked (a flipped byte in a page), not only
    their footers and sizes.
    """
    out_dir = location(out_dir)
    files = out_dir.list_files()
    names = {p.name for p in files}
    for p in files:
        stale_tmp = p.name.startswith(f".part-{shard.tag}-") and p.name.endswith(".tmp")
        orphan_meta = p.name.startswith(f".part-{shard.tag}-") and p.name.endswith(".meta") \
            and p.name[1:].removesuffix(".meta") not in names  # a sidecar whose part was never published
        if stale_tmp or orphan_meta:
            p.remove()
    rec = Recovered()
    for part in list_parts(out_dir, files):
        same_count = part.shard.count == shard.count
        if same_count and part.shard.index != shard.index:
            continue
        if same_count:
            rec.next_seq = max(rec.next_seq, part.seq + 1)  # a set-aside part's name is not used again
        try:
            meta, indexed = format_of(part.path).read_index(part.path, part.info.size)
            index = indexed or index_from_rows(part.path)
            if verify and same_count:
                format_of(part.path).verify(part.path)
        except UnreadablePart as e:
            if not same_count:
                raise
            rec.set_aside.append(f"{e}; set aside as {set_aside(part.path)}, its rows are generated again")
            continue
        old = meta.get(META_HASH, "?")
        if old != config_hash and not force:
            raise JobError(
                f"{part.path.name} in {out_dir} was written by another job configuration (config {old}, "
                f"this job {config_hash}); use a new output.dir, or pass --force to keep its rows and "
                "do the rest with the new configuration")
        if same_count:
            if retry_errors and index.errors:
                rec.retried += drop_error_rows(part.path)
                if not part.path.exists():
                    continue
                index = summarize(part.path)[1]
            rec.parts += 1
        rec.done.add_part(None, partial(part_ids, part.path), index.hashes)
        rec.done_here += len(index) if same_count else sum(map(shard.owns, index.ids))
        rec.errors_here += index.errors if same_count else 0
    return rec


def set_aside(part: Location) -> Location:
    """Move a part that is not whole (and a JSONL part's sidecar) into ``CORRUPT_DIR``, never deleting it;
    where it went."""
    aside_dir = part.parent / CORRUPT_DIR
    aside_dir.prepare_dir()
    for path in (part, meta_path(part)):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        (aside_dir / path.name).publish_bytes(data)
        path.remove()
    return aside_dir / part.name


def drop_error_rows(path: Location | Path) -> int:
    """Rewrite a part without its error rows (atomically; deleted if nothing is left); how many."""
    path = location(path)
    return format_of(path).drop_errors(path)


# -------------------------------------------------------------------------------------- writing


@dataclass
class _Part:
    """A part taken from the writer's buffer, to be written."""

    records: list[dict[str, Any]]
    path: Location
    meta: dict[str, str]


class PartWriter:
    """Buffers finished requests and writes a part every ``rows_per_part`` of them.

    ``background``: parts are written on a thread of their own (building the table, compressing, the local
    write or the bucket's PUT) while the caller goes on, the engine's next steps among them; one part at a time,
    so at most two parts' rows are held. ``wait`` returns once the part is written and raises what writing it
    raised; ``flush`` waits for the part before it. Exactly-once is unchanged: a part's rows leave the buffer
    before it is written, so they can only be written once, and a run stopped before the part exists redoes
    them."""

    def __init__(self, out_dir: Location | Path, shard: Shard, schema: pa.Schema, rows_per_part: int,
                 next_seq: int, metadata: dict[str, str], part_format: PartFormat | None = None,
                 guard: Callable[[], None] | None = None, background: bool = False,
                 finish_rows: Callable[[list[dict[str, Any]]], None] | None = None):
        """``guard`` is called before each part is written and raises if this run may no longer
        write (its shard lock was lost). ``finish_rows`` completes a part's rows before they are written, on
        the writer's thread (texts.decode_texts)."""
        self.out_dir = location(out_dir)
        self.guard = guard
        self.finish_rows = finish_rows
        self.shard = shard
        self.schema = schema
        self.rows_per_part = rows_per_part
        self.seq = next_seq
        self.metadata = dict(metadata)
        self.format: PartFormat = part_format or ParquetParts()
        self._buffer: list[dict[str, Any]] = []
        self._requests = 0
        self._ids: list[str] = []  # of the buffered requests with all their samples: the part's index
        self._errors = 0
        self.parts_written = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgen-parts") if background else None
        self._writing: Future[None] | None = None

    @property
    def pending(self) -> int:
        return self._requests

    def add(self, rows: list[dict[str, Any]]) -> Location | None:
        """Add all rows (samples) of one finished request; flushes when the part is full."""
        self._buffer.extend(rows)
        keys = [self.format.key(r) for r in rows]
        self._requests += 1
        if len(keys) == (keys[0][1] or 1):  # complete: all its samples are here
            self._ids.append(str(keys[0][0]))
        self._errors += sum(k[2] is not None for k in keys)
        return self.flush() if self._requests >= self.rows_per_part else None

    def flush(self) -> Location | None:
        """Write the buffered rows as the next part (in the background: start writing it, once the part
        before is written). Signals are held off while a part is written here, so that an abort (third
        Ctrl-C) cannot leave a part half-counted."""
        if not self._buffer:
            return None
        self.wait()
        part = self._take()
        if self._pool is None:
            with _signals_deferred():
                self._write(part)
        else:
            self._writing = self._pool.submit(self._write, part)
        return part.path

    def wait(self) -> None:
        """Returns once the part being written in the background is written; raises its error (again on
        every call: a run whose part failed writes no more)."""
        if self._writing is not None:
            self._writing.result()
            self._writing = None

    def shutdown(self) -> None:
        """Ends the background thread once its part is written (what writing it raised is for `wait`)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _take(self) -> _Part:
        meta = {**self.metadata, "batchgen.created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **index_meta(self._ids, self._errors, len(self._buffer))}
        part = _Part(self._buffer, self.out_dir / part_name(self.shard, self.seq, self.format.suffix), meta)
        self.seq += 1
        self._buffer = []
        self._requests = 0
        self._ids = []
        self._errors = 0
        return part

    def _write(self, part: _Part) -> None:
        if self.guard is not None:
            self.guard()
        if self.finish_rows is not None:
            self.finish_rows(part.records)
        self.format.write(part.records, part.path, self.schema, part.meta)
        self.parts_written += 1


@contextmanager
def _signals_deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
