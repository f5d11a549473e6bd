"""Row ids held compactly but exactly, for what a job keeps per row: the ids already done and the
ids read so far (duplicate detection), at tens of millions of rows.

An id is held as a 64-bit hash in sorted numpy arrays (8 bytes a row, where a Python ``str`` in a
set costs about 100) and answered in batches. A hash only says "maybe": every match is confirmed
against the real id, read back from where its owner keeps it (a part of the output, or a run of
ids this process spilled to a temporary file), so a hash collision never drops or wrongly flags a
row. The hash is Python's own ``hash`` of the string: these structures live in one process, and
it costs nothing (a ``str`` caches it).
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from itertools import compress, islice
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa

RUN_CAP = 1 << 20  # sorted runs are merged up to this many hashes (8 MiB), so a merge never doubles memory
CONFIRM_CACHE_IDS = 1 << 18  # ids of recently confirmed parts kept for the next confirmations
BATCH = 4096  # ids looked up together
T = TypeVar("T")


id_hash = hash  # a row id's hash (the builtin itself: ``map`` calls it without a Python frame)


def hashes_of(ids: Iterable[str]) -> np.ndarray:
    return np.fromiter(map(id_hash, ids), dtype=np.int64)


def batches(items: Iterable[T], first: int = 16, size: int = BATCH) -> Iterator[list[T]]:
    """Lists of ``items``, doubling from ``first`` to ``size`` items: the first rows of a stream
    come as soon as they are read, and a stream is read ahead of what is used by one batch at most."""
    it = iter(items)
    n = first
    while batch := list(islice(it, n)):
        yield batch
        n = min(2 * n, size)


class SortedRuns:
    """A multiset of hashes, each with a uint32 value, as a few sorted runs (LSM-style: a new run
    is merged into the last ones while the result stays under ``RUN_CAP``). With ``dtype`` int32
    only the hashes' low 32 bits are kept (4 bytes a row), for a caller that can afford a false
    match in about n / 2**32 lookups."""

    def __init__(self, dtype: type[np.integer] = np.int64) -> None:
        self.dtype = dtype
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self.size = 0

    def add(self, hashes: np.ndarray, value: int = 0) -> None:
        if not len(hashes):
            return
        run = (np.sort(hashes.astype(self.dtype)), np.full(len(hashes), value, dtype=np.uint32))
        self.size += len(hashes)
        while self.runs and len(self.runs[-1][0]) <= len(run[0]) and len(self.runs[-1][0]) + len(run[0]) <= RUN_CAP:
            last = self.runs.pop()
            merged = np.concatenate([last[0], run[0]])
            order = np.argsort(merged, kind="stable")
            run = (merged[order], np.concatenate([last[1], run[1]])[order])
        self.runs.append(run)

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """Per hash: is it (maybe: another id may have the same hash) in the set?"""
        found = np.zeros(len(hashes), dtype=bool)
        hashes = hashes.astype(self.dtype)
        for keys, _ in self.runs:
            at = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
            found |= keys[at] == hashes
        return found


class DoneIds(AbstractSet[str]):
    """The ids complete in an output dir's parts: each id's hash with the number of the part that
    holds it. A hash match is confirmed against the ids of that part, read back through the part's
    ``load`` function (recently read parts are cached: a rerun reads the input in about the order
    the parts were written). Ask many ids at once (``contains_many``): one lookup per batch."""

    def __init__(self) -> None:
        self._hashes = SortedRuns()
        self._loaders: list[Callable[[], Iterable[str]]] = []
        self._cache: OrderedDict[int, frozenset[str]] = OrderedDict()
        self._cached_ids = 0
        self._count = 0
        self.twice = 0  # ids complete in more than one part (should never happen)

    def add_part(self, ids: list[str], load: Callable[[], Iterable[str]]) -> None:
        """A part's complete ids, each once (``load`` gives them again to confirm a match)."""
        hashes = hashes_of(ids)
        maybe = self._hashes.contains(hashes)
        again = sum(self.contains_many(list(compress(ids, maybe)))) if maybe.any() else 0
        self._hashes.add(hashes, len(self._loaders))
        self._loaders.append(load)
        self._count += len(ids) - again
        self.twice += again

    def contains_many(self, ids: list[str], hashes: np.ndarray | None = None) -> list[bool]:
        """Per id (``hashes``: theirs, if the caller has them): is it done?"""
        hashes = hashes_of(ids) if hashes is None else hashes
        found = [False] * len(ids)
        for keys, parts in self._hashes.runs:
            lo, hi = np.searchsorted(keys, hashes), np.searchsorted(keys, hashes, side="right")
            matched = np.flatnonzero(hi > lo)
            # (id, part) pairs to confirm: one per match, several where hashes collide in this run
            repeat = (hi - lo)[matched]
            rows = np.repeat(matched, repeat)
            at = np.repeat(lo[matched] - np.cumsum(repeat) + repeat, repeat) + np.arange(len(rows))
            last, last_ids = -1, frozenset[str]()
            for i, part in zip(rows.tolist(), parts[at].tolist(), strict=True):
                if not found[i]:
                    if part != last:
                        last, last_ids = part, self._part_ids(part)
                    found[i] = ids[i] in last_ids
        return found

    def __contains__(self, row_id: object) -> bool:
        return isinstance(row_id, str) and self.contains_many([row_id])[0]

    def _part_ids(self, part: int) -> frozenset[str]:
        ids = self._cache.get(part)
        if ids is not None:
            self._cache.move_to_end(part)
            return ids
        ids = frozenset(self._loaders[part]())
        self._cache[part] = ids
        self._cached_ids += len(ids)
        while self._cached_ids > CONFIRM_CACHE_IDS and len(self._cache) > 1:
            self._cached_ids -= len(self._cache.popitem(last=False)[1])
        return ids

    def __len__(self) -> int:
        return self._count

    @classmethod
    def _from_iterable(cls, it: Iterable[str]) -> set[str]:
        return set(it)

    def __iter__(self) -> Iterator[str]:
        """Every id once (through a set of them all: for small outputs and tests)."""
        seen: set[str] = set()
        for load in self._loaders:
            for row_id in load():
                if row_id not in seen:
                    seen.add(row_id)
                    yield row_id


class SpilledIds:
    """(id, key) pairs in sorted runs in a temporary directory: where ``FirstSeen`` keeps the
    real ids behind its hashes once it has more than it holds in memory."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._runs: list[pa.Table] = []
        self._keys: list[np.ndarray] = []

    def spill(self, ids: list[str], keys: list[int]) -> np.ndarray:
        """Write a run; its hashes (for the caller's in-memory set)."""
        hashes = hashes_of(ids)
        order = np.argsort(hashes, kind="stable")
        table = pa.table({"hash": hashes[order], "key": np.asarray(keys, dtype=np.int64)[order],
                          "id": pa.array(ids, pa.string()).take(order)})
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="batchgen-ids-")
        path = Path(self._dir.name) / f"run-{len(self._runs):05d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        mapped = pa.ipc.open_file(pa.memory_map(str(path))).read_all()  # one batch, read as pages are touched
        self._runs.append(mapped)
        self._keys.append(mapped.column("hash").chunk(0).to_numpy())
        return hashes

    def key_of(self, row_id: str) -> int | None:
        """The key spilled with ``row_id``, or None."""
        h = id_hash(row_id)
        for table, hashes in zip(self._runs, self._keys, strict=True):
            lo, hi = int(np.searchsorted(hashes, h)), int(np.searchsorted(hashes, h, side="right"))
            for i in range(lo, hi):
                if table.column("id")[i].as_py() == row_id:
                    return int(table.column("key")[i].as_py())
        return None

    def close(self) -> None:
        self._runs, self._keys = [], []
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
