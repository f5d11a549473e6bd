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

import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import compress, islice
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

RUN_CAP = 1 << 20  # sorted runs are merged up to this many hashes (8 MiB), so a merge never doubles memory
CONFIRM_CACHE_IDS = 1 << 18  # ids of recently confirmed parts kept for the next confirmations
BATCH = 4096  # ids looked up together
FENCE = 256  # spilled hashes per block read back
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
    """A multiset of hashes, each with a uint32 value (or none), as a few sorted runs (LSM-style: a new run
    is merged into the last ones while the result stays under ``RUN_CAP``). With ``dtype`` int32
    only the hashes' low 32 bits are kept (4 bytes a row), for a caller that can afford a false
    match in about n / 2**32 lookups."""

    def __init__(self, dtype: type[np.integer] = np.int64, values: bool = True) -> None:
        self.dtype = dtype
        self.values = values  # False: hashes only (the values read as 0 and cost nothing)
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self.size = 0

    def add(self, hashes: np.ndarray, value: int = 0) -> None:
        if not len(hashes):
            return
        vals = np.full(len(hashes), value, dtype=np.uint32) if self.values else np.empty(0, np.uint32)
        run = (np.sort(hashes.astype(self.dtype)), vals)
        self.size += len(hashes)
        while self.runs and len(self.runs[-1][0]) <= len(run[0]) and len(self.runs[-1][0]) + len(run[0]) <= RUN_CAP:
            last = self.runs.pop()
            merged = np.concatenate([last[0], run[0]])
            if not self.values:
                run = (np.sort(merged), run[1])
                continue
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


@dataclass
class _Run:
    """One spilled run's place in the spill file: n sorted hashes, then their keys, then the ids'
    n + 1 byte offsets, then the ids (UTF-8); ``fence`` is every ``FENCE``-th hash."""

    at: int
    n: int
    fence: np.ndarray

    def section(self, which: int) -> int:
        return self.at + which * 8 * self.n


class SpilledIds:
    """(id, key) pairs in sorted runs in a temporary file: where ``FirstSeen`` keeps the real ids
    behind its hashes once it has more than it holds in memory. Read back with ``pread`` (the
    page cache, not this process's memory, holds what was read)."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._file: BinaryIO | None = None
        self._size = 0
        self._runs: list[_Run] = []

    def spill(self, ids: list[str], keys: list[int]) -> np.ndarray:
        """Write a run; its hashes (for the caller's in-memory set)."""
        hashes = hashes_of(ids)
        order = np.argsort(hashes, kind="stable")
        encoded = [ids[i].encode("utf-8", "surrogatepass") for i in order.tolist()]
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
        if self._file is None:
            self._dir = tempfile.TemporaryDirectory(prefix="batchgen-ids-")
            self._file = open(Path(self._dir.name) / "spilled", "w+b")  # closed by close()
        data = [hashes[order].tobytes(), np.asarray(keys, dtype=np.int64)[order].tobytes(), offsets.tobytes(),
                b"".join(encoded)]
        self._file.seek(self._size)
        self._file.writelines(data)
        self._file.flush()
        self._runs.append(_Run(self._size, len(ids), hashes[order][::FENCE].copy()))
        self._size += sum(map(len, data))
        return hashes

    def key_of(self, row_id: str) -> int | None:
        """The key spilled with ``row_id``, or None."""
        if self._file is None:
            return None
        h, fd, wanted = id_hash(row_id), self._file.fileno(), row_id.encode("utf-8", "surrogatepass")
        for run in self._runs:
            start = max(int(np.searchsorted(run.fence, h)) - 1, 0) * FENCE
            while start < run.n:
                block = np.frombuffer(os.pread(fd, 8 * min(FENCE, run.n - start), run.section(0) + 8 * start), np.int64)
                for i in (start + np.flatnonzero(block == h)).tolist():
                    lo, hi = np.frombuffer(os.pread(fd, 16, run.section(2) + 8 * i), np.int64).tolist()
                    if os.pread(fd, hi - lo, run.section(3) + 8 + lo) == wanted:
                        return int(np.frombuffer(os.pread(fd, 8, run.section(1) + 8 * i), np.int64)[0])
                if block[-1] > h:
                    break
                start += FENCE
        return None

    def close(self) -> None:
        self._runs = []
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
