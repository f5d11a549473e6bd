"""``batchgen merge OUT_DIR -o results.jsonl``: the JSONL or OpenAI batch parts of a job as one
file, in input order, each row once.

Parts are written in the order rows finish, by every shard; the merged file follows the input
instead (as the OpenAI batch output does). The parts' indexes say which part holds each complete
id (``DoneIds``: 12 bytes an id, the first part holding an id wins); the input's ids are read in
order a batch at a time, and each row's lines are copied from its part, whose line positions are
read when first needed and kept for a bounded number of parts. Rows in parts whose id is not in
the input (any more) follow at the end. The file is published whole (a renamed temp file locally,
one PUT on a bucket), so it is whole or absent, and merging again gives the same file.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...storage import Location, location
from ..errors import JobError
from ..ids import CONFIRM_CACHE_IDS, DoneIds, as_bytes
from ..inputs import InputReader
from ..spec import Job
from .files import write_whole
from .formats import format_of
from .saved import load_saved_job
from .writer import PartName, list_parts, part_ids, summarize


@dataclass
class Merged:
    path: Location
    rows: int = 0  # input rows written
    lines: int = 0
    missing: int = 0  # input rows in no part (not done yet)
    extra: int = 0  # rows in parts whose id is not in the input (any more); written at the end


class PartLines:
    """Where the lines of a part's complete ids are: by the id's place in the part's index."""

    def __init__(self, path: Location, index_ids: pa.Array):
        keys = format_of(path).keys(path)
        at = pc.index_in(as_bytes(keys.column("id")), value_set=index_ids).to_numpy(zero_copy_only=False)
        complete = ~np.isnan(at) if at.dtype.kind == "f" else np.ones(len(at), dtype=bool)
        at = np.nan_to_num(at, nan=-1).astype(np.int64)
        order = np.flatnonzero(complete)[np.argsort(at[complete], kind="stable")]
        self.offsets = keys.column("offset").to_numpy()[order]
        self.lengths = keys.column("length").to_numpy()[order]
        self.starts = np.searchsorted(at[order], np.arange(len(index_ids) + 1))

    def of(self, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, lengths) of the lines of the ids at ``places``, in that order (an id's in the part's)."""
        first, counts = self.starts[places], self.starts[places + 1] - self.starts[places]
        rows = np.arange(int(counts.sum())) + np.repeat(first - np.cumsum(counts) + counts, counts)
        return self.offsets[rows], self.lengths[rows]


class Parts:
    """The parts' complete ids (``DoneIds``), which ids were written, and their lines, read as needed."""

    def __init__(self, out_dir: Location):
        self.parts: list[PartName] = list_parts(out_dir)
        self.done = DoneIds()
        self.written: list[np.ndarray] = []  # per part, per id of its index
        for part in self.parts:
            if format_of(part.path).name == "parquet":
                raise JobError(f"{part.path.name} is a Parquet part: merge joins jsonl and openai_batch parts; "
                               "read a Parquet output dir as one dataset (pyarrow.dataset or pandas.read_parquet)")
            index = summarize(part.path, part.info.size)[1]
            self.done.add_part(None, partial(part_ids, part.path), index.hashes)
            self.written.append(np.zeros(len(index), dtype=bool))
        self._lines: OrderedDict[int, PartLines] = OrderedDict()
        self._handles: dict[int, IO[bytes]] = {}

    def lines(self, part: int) -> PartLines:
        got = self._lines.get(part)
        if got is None:
            got = self._lines[part] = PartLines(self.parts[part].path, self.done.part_ids(part))
            while sum(len(p.offsets) for p in self._lines.values()) > CONFIRM_CACHE_IDS and len(self._lines) > 1:
                self._lines.popitem(last=False)
        self._lines.move_to_end(part)
        return got

    def copy(self, parts: np.ndarray, places: np.ndarray, out: IO[bytes]) -> int:
        """Copy the lines of the id at each ``places[i]`` in ``parts[i]``'s index, in that order, each run of
        adjacent lines read at once; how many lines."""
        if not len(parts):
            return 0
        copied = 0
        cuts = np.flatnonzero(parts[1:] != parts[:-1]) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(parts)], strict=True):
            part, asked = int(parts[lo]), places[lo:hi]
            offsets, lengths = self.lines(part).of(asked)
            if len(offsets):
                ends = offsets + lengths
                breaks = np.flatnonzero(offsets[1:] != ends[:-1]) + 1
                starts, stops = offsets[np.r_[0, breaks]], ends[np.r_[breaks - 1, len(ends) - 1]]
                f = self._handles.get(part) or self._handles.setdefault(part, self.parts[part].path.open_read())
                for start, end in zip(starts.tolist(), stops.tolist(), strict=True):
                    f.seek(start)
                    out.write(f.read(end - start))
            self.written[part][asked] = True
            copied += len(offsets)
        return copied

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


def merge(out_dir: Location | Path, target: Location | Path, partial: bool = False) -> Merged:
    """Write ``target`` from the parts in ``out_dir``; refuses while rows are missing unless ``partial``."""
    out_dir, target = location(out_dir), location(target)
    job = load_saved_job(out_dir)
    parts = Parts(out_dir)
    result = Merged(target)
    if not partial:
        for batch in InputReader.for_job(job).id_batches():
            result.missing += int((~parts.done.contains(batch.ids, batch.hashes)).sum())
        if result.missing:
            raise JobError(f"{result.missing:,} input rows of {out_dir} are not done yet; run the job again "
                           "(or merge with --partial)")
    try:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as out:
                _write_input_order(job, parts, result, out)
                _write_extra(parts, result, out)

        target.parent.prepare_dir()
        write_whole(target, write)
    finally:
        parts.close()
    return result


def _write_input_order(job: Job, parts: Parts, result: Merged, out: IO[bytes]) -> None:
    result.missing = 0
    for batch in InputReader.for_job(job).id_batches():
        located = parts.done.locate(batch.ids, batch.hashes)
        result.missing += int((located < 0).sum())
        found = np.flatnonzero(located >= 0)
        by_part = located[found]
        places = np.empty(len(found), dtype=np.int64)
        for part in np.unique(by_part).tolist():
            mine = by_part == part
            asked = as_bytes(batch.ids.take(pa.array(found[mine])))
            places[mine] = pc.index_in(asked, value_set=parts.done.part_ids(part)).to_numpy(zero_copy_only=False)
        result.lines += parts.copy(by_part, places, out)
        result.rows += len(found)


def _write_extra(parts: Parts, result: Merged, out: IO[bytes]) -> None:
    """The ids of parts that no input row asked for, unless an earlier part holds them too."""
    for part, written in enumerate(parts.written):
        unwritten = np.flatnonzero(~written)
        if not len(unwritten):
            continue
        ids = parts.done.part_ids(part).take(pa.array(unwritten))
        extra = unwritten[parts.done.locate(ids) == part]
        result.lines += parts.copy(np.full(len(extra), part), extra, out)
        result.extra += len(extra)
