"""Row ids held compactly but exactly, for what a job keeps per row: the ids already done and the
ids read so far (duplicate detection), at tens of millions of rows.

An id is held as a 64-bit hash in sorted numpy arrays (8 bytes a row, where a Python ``str`` in a
set costs about 100) and answered in batches. A hash only says "maybe": every match is confirmed
against the real id, read back from where its owner keeps it (a part of the output, or a run of
ids this process spilled to a temporary file), so a hash collision never drops or wrongly flags a
row. Ids travel in batches as Arrow arrays and are hashed columnar (``hash_ids``), so a batch read
from a Parquet column is looked up without making a Python object per row.
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..storage.scratch import scratch_dir

RUN_CAP = 1 << 20  # sorted runs are merged up to this many hashes (8 MiB), so a merge never doubles memory
CONFIRM_CACHE_IDS = 1 << 18  # ids of recently confirmed parts kept for the next confirmations
BATCH = 4096  # ids looked up together
FENCE = 256  # spilled hashes per block read back
HASH_BYTES = 1 << 16  # bytes of ids hashed together
FILTERED_RUN = 1 << 14  # runs of at least this many hashes have a filter
FILTER_BITS = 8  # the filter's bits a hash: ~12% of the hashes not in a run pass it
HASH_NAME = "poly-splitmix64/1"  # names ``hash_ids``: hashes kept on disk say which function made them
T = TypeVar("T")

_BASE = np.uint64(0x100000001B3)  # odd: the polynomial's base (FNV's 64-bit prime)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))  # splitmix64's finalizer
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_powers = np.ones(1, dtype=np.uint64)  # _BASE ** k (mod 2**64), grown on demand


def id_array(ids: Iterable[str]) -> pa.Array:
    """Ids as an Arrow array: UTF-8 text, or bytes (lone surrogates kept) where some are not UTF-8."""
    ids = ids if isinstance(ids, list) else list(ids)
    try:
        return pa.array(ids, pa.string())
    except (UnicodeEncodeError, pa.ArrowException):
        return pa.array([i.encode("utf-8", "surrogatepass") for i in ids], pa.binary())


def as_bytes(ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The ids' bytes (a view of a string array), for comparing ids of either kind."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    return ids if pa.types.is_large_binary(ids.type) else ids.cast(pa.large_binary())


def hash_ids(ids: pa.Array) -> np.ndarray:
    """Each id's 64-bit hash (int64), computed over the whole array at once: a polynomial over its
    UTF-8 bytes (mod 2**64), its length mixed in, then splitmix64's finalizer. The same in every
    process; not meant to resist ids chosen to collide (a collision costs one confirmation).
    Hashed ``HASH_BYTES`` of ids at a time, so the per-byte temporaries stay small."""
    ids = as_bytes(ids)
    n = len(ids)
    offsets = np.frombuffer(ids.buffers()[1], np.int64, n + 1, ids.offset * 8)
    total = int(offsets[-1] - offsets[0])
    data = np.frombuffer(ids.buffers()[2], np.uint8, total, int(offsets[0])) if total else np.zeros(0, np.uint8)
    out = np.empty(n, dtype=np.int64)
    start = 0
    while start < n:
        end = min(max(int(np.searchsorted(offsets, offsets[start] + HASH_BYTES, side="right")) - 1, start + 1), n)
        out[start:end] = _hash_range(data, offsets[start:end + 1] - offsets[0])
        start = end
    return out


def _hash_range(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    global _powers
    lengths = np.diff(offsets)
    longest = int(lengths.max())
    if longest > len(_powers):
        grown = np.full(longest, _BASE, dtype=np.uint64)
        grown[0] = 1
        _powers = np.cumprod(grown, dtype=np.uint64)
    lo, total = int(offsets[0]), int(offsets[-1] - offsets[0])
    ends = np.repeat(offsets[1:] - lo, lengths)
    terms = (data[lo:lo + total].astype(np.uint64) + np.uint64(1)) * _powers[ends - 1 - np.arange(total)]
    sums = np.zeros(total + 1, dtype=np.uint64)
    np.cumsum(terms, out=sums[1:])
    starts = offsets - lo
    h = (sums[starts[1:]] - sums[starts[:-1]]) ^ (lengths.astype(np.uint64) * _GOLDEN)
    h ^= h >> np.uint64(30)
    h *= _MIX[0]
    h ^= h >> np.uint64(27)
    h *= _MIX[1]
    h ^= h >> np.uint64(31)
    return h.view(np.int64)


def hashes_of(ids: Iterable[str]) -> np.ndarray:
    return hash_ids(id_array(ids))


def batches(items: Iterable[T], first: int = 16, size: int = BATCH) -> Iterator[list[T]]:
    """Lists of ``items``, doubling from ``first`` to ``size`` items: the first rows of a stream
    come as soon as they are read, and a stream is read ahead of what is used by one batch at most."""
    it = iter(items)
    n = first
    while batch := list(islice(it, n)):
        yield batch
        n = min(2 * n, size)


class SortedRuns:
    """A multiset of hashes, each with a value, as a few sorted runs (LSM-style: a new run is
    merged into the last ones while the result stays under ``RUN_CAP``). With ``dtype`` int32 only
    the hashes' low 32 bits are kept (4 bytes a row), for a caller that can afford a false match
    in about n / 2**32 lookups; ``values`` is the values' type (uint16: 2 bytes a row).

    Each run of ``FILTERED_RUN`` hashes or more has a filter beside it (``FILTER_BITS`` bits a
    hash: ~1 byte): a lookup searches a run only for the hashes its filter lets through (~1 in 8
    that are not there), so a batch asked of many runs costs about one search, not one a run."""

    def __init__(self, dtype: type[np.integer] = np.int64, values: type[np.integer] = np.uint32,
                 filtered: bool = True) -> None:
        """``filtered``: keep filters (a structure asked in many runs, where a byte a hash pays)."""
        self.dtype = dtype
        self.value_type = values
        self.filtered = filtered
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self.filters: list[np.ndarray | None] = []
        self.size = 0

    def add(self, hashes: np.ndarray, value: int | np.ndarray = 0) -> None:
        """Add ``hashes``, each with ``value`` (one for all, or one each)."""
        if not len(hashes):
            return
        keys = hashes.astype(self.dtype)
        order = np.argsort(keys, kind="stable")
        run = (keys[order], np.broadcast_to(np.asarray(value, dtype=self.value_type), len(keys))[order])
        self.size += len(hashes)
        while self.runs and len(self.runs[-1][0]) <= len(run[0]) and len(self.runs[-1][0]) + len(run[0]) <= RUN_CAP:
            last = self.runs.pop()
            self.filters.pop()
            merged = np.concatenate([last[0], run[0]])
            order = np.argsort(merged, kind="stable")
            run = (merged[order], np.concatenate([last[1], run[1]])[order])
        self.runs.append(run)
        self.filters.append(_filter(run[0]) if self.filtered and len(run[0]) >= FILTERED_RUN else None)

    def candidates(self, run: int, query: np.ndarray) -> np.ndarray:
        """Positions in ``query`` that may be in run ``run``."""
        bits = self.filters[run]
        return np.arange(len(query)) if bits is None else np.flatnonzero(_maybe_in(bits, query))

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """Per hash: is it (maybe: another id may have the same hash) in the set?"""
        found = np.zeros(len(hashes), dtype=bool)
        for at, _ in self.matches(hashes):
            found[at] = True
        return found

    def matches(self, hashes: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(positions in ``hashes``, values) of every match, run by run; several for a position
        whose hash is in a run more than once."""
        if not self.runs or not len(hashes):
            return
        query = hashes.astype(self.dtype)
        order = np.argsort(query)
        query = query[order]
        for run, (keys, values) in enumerate(self.runs):
            maybe = self.candidates(run, query)
            at = np.searchsorted(keys, query[maybe])
            hit = np.flatnonzero(keys[np.minimum(at, len(keys) - 1)] == query[maybe])
            hit, at = maybe[hit], at[hit]
            while len(hit):  # the first match of each, then the next ones where a hash repeats in the run
                yield order[hit], values[at]
                at = at + 1
                more = np.flatnonzero(keys[np.minimum(at, len(keys) - 1)] == query[hit])
                more = more[at[more] < len(keys)]
                hit, at = hit[more], at[more]


def _filter(keys: np.ndarray) -> np.ndarray:
    """A bitmap of ``keys``' low bits, ``FILTER_BITS`` bits a key (rounded up to a power of two)."""
    size = 1 << max(int(len(keys) * FILTER_BITS - 1).bit_length(), 3)
    bits = np.zeros(size, dtype=bool)
    bits[keys.astype(np.int64) & (size - 1)] = True
    return np.packbits(bits, bitorder="little")


def _maybe_in(bits: np.ndarray, query: np.ndarray) -> np.ndarray:
    slot = query.astype(np.int64) & (8 * len(bits) - 1)
    return ((bits[slot >> 3] >> (slot & 7).astype(np.uint8)) & 1).astype(bool)


class DoneIds(AbstractSet[str]):
    """The ids complete in an output dir's parts: each id's hash with the number of the part that
    holds it. A hash match is confirmed against the ids of that part, read back through the part's
    ``load`` function (recently read parts are cached as Arrow arrays: a rerun reads the input in
    about the order the parts were written). Ask many ids at once (``contains``): one lookup per batch."""

    def __init__(self) -> None:
        self._hashes = SortedRuns()
        self._loaders: list[Callable[[], Iterable[str]]] = []
        self._cache: OrderedDict[int, pa.Array] = OrderedDict()
        self._cached_ids = 0
        self._total = 0  # ids of all parts, an id complete in two parts counted twice
        self._twice: int | None = 0

    def add_part(self, ids: list[str] | None, load: Callable[[], Iterable[str] | pa.Array],
                 hashes: np.ndarray | None = None) -> None:
        """A part's complete ids, each once, or their ``hashes`` alone (``load`` gives the ids, as a
        list or an Arrow array, to confirm a match)."""
        hashes = hashes_of(ids or []) if hashes is None else hashes
        self._hashes.add(hashes, len(self._loaders))
        self._loaders.append(load)
        self._total += len(hashes)
        self._twice = None

    @property
    def twice(self) -> int:
        """Ids complete in more than one part (should never happen), counted once asked: the
        hashes found in two runs or twice in one, each confirmed on the ids of their parts."""
        if self._twice is None:
            self._twice = self._count_twice()
        return self._twice

    def _count_twice(self) -> int:
        runs = self._hashes.runs
        found = [keys[1:][keys[1:] == keys[:-1]] for keys, _ in runs]
        for i, (keys, _) in enumerate(runs):
            for later, _ in runs[i + 1:]:
                later = later[self._hashes.candidates(i, later)]
                at = np.minimum(np.searchsorted(keys, later), len(keys) - 1)
                found.append(later[keys[at] == later])
        suspects = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
        if not len(suspects):
            return 0
        parts = np.unique(np.concatenate([values[np.isin(keys, suspects)] for keys, values in runs]))
        seen: dict[bytes, int] = {}
        for part in parts.tolist():
            ids = self._part_ids(part)
            for row_id in ids.filter(pa.array(np.isin(hash_ids(ids), suspects))).to_pylist():
                seen[row_id] = seen.get(row_id, 0) + 1
        return sum(n - 1 for n in seen.values())

    def contains(self, ids: pa.Array, hashes: np.ndarray | None = None) -> np.ndarray:
        """Per id of an Arrow array (``hashes``: theirs, if the caller has them): is it done?"""
        return self.locate(ids, hashes) >= 0

    def locate(self, ids: pa.Array, hashes: np.ndarray | None = None) -> np.ndarray:
        """Per id of an Arrow array: the number of the first part (as added) holding it, or -1."""
        hashes = hash_ids(ids) if hashes is None else hashes
        found = np.full(len(ids), -1, dtype=np.int64)
        for rows, parts in self._hashes.matches(hashes):
            order = np.argsort(parts, kind="stable")
            rows, parts = rows[order], parts[order]
            cuts = np.flatnonzero(parts[1:] != parts[:-1]) + 1
            for asked, part in zip(np.split(rows, cuts), parts[np.concatenate([[0], cuts])].tolist(), strict=True):
                asked = asked[(found[asked] < 0) | (found[asked] > part)]
                if len(asked):
                    taken = as_bytes(ids.take(pa.array(asked)))
                    hit = pc.is_in(taken, value_set=self._part_ids(part)).to_numpy(zero_copy_only=False)
                    found[asked[hit]] = part
        return found

    def part_ids(self, part: int) -> pa.Array:
        """The complete ids of a part (its number as added), as bytes."""
        return self._part_ids(part)

    def contains_many(self, ids: list[str], hashes: np.ndarray | None = None) -> list[bool]:
        """Per id of a list: is it done?"""
        return self.contains(id_array(ids), hashes).tolist()

    def __contains__(self, row_id: object) -> bool:
        return isinstance(row_id, str) and self.contains_many([row_id])[0]

    def _part_ids(self, part: int) -> pa.Array:
        ids = self._cache.get(part)
        if ids is not None:
            self._cache.move_to_end(part)
            return ids
        loaded = self._loaders[part]()
        ids = as_bytes(loaded if isinstance(loaded, pa.Array) else id_array(loaded))
        self._cache[part] = ids
        self._cached_ids += len(ids)
        while self._cached_ids > CONFIRM_CACHE_IDS and len(self._cache) > 1:
            self._cached_ids -= len(self._cache.popitem(last=False)[1])
        return ids

    def __len__(self) -> int:
        return self._total - self.twice

    @classmethod
    def _from_iterable(cls, it: Iterable[str]) -> set[str]:
        return set(it)

    def __iter__(self) -> Iterator[str]:
        """Every id once (through a set of them all: for small outputs and tests)."""
        seen: set[str] = set()
        for load in self._loaders:
            loaded = load()
            for row_id in loaded.to_pylist() if isinstance(loaded, pa.Array) else loaded:
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

    def spill(self, ids: pa.Array, hashes: np.ndarray, keys: np.ndarray) -> None:
        """Write a run of ``ids`` with their ``hashes`` and ``keys``."""
        order = np.argsort(hashes, kind="stable")
        taken = as_bytes(ids.take(pa.array(order)))
        offsets = np.frombuffer(taken.buffers()[1], np.int64, len(taken) + 1, taken.offset * 8)
        data = taken.buffers()[2]
        body = b"" if data is None else data.to_pybytes()[int(offsets[0]):int(offsets[-1])]
        if self._file is None:
            self._dir = scratch_dir("ids")
            self._file = open(Path(self._dir.name) / "spilled", "w+b")  # closed by close()
        sections = [hashes[order].astype(np.int64).tobytes(), keys[order].astype(np.int64).tobytes(),
                    (offsets - offsets[0]).tobytes(), body]
        self._file.seek(self._size)
        self._file.writelines(sections)
        self._file.flush()
        self._runs.append(_Run(self._size, len(order), hashes[order][::FENCE].astype(np.int64)))
        self._size += sum(map(len, sections))

    @property
    def runs(self) -> int:
        return len(self._runs)

    def key_of(self, row_id: bytes, h: int, run_no: int) -> int | None:
        """The key spilled with ``row_id`` (its UTF-8 bytes; ``h`` its hash) in run ``run_no``, or None."""
        if self._file is None:
            return None
        fd, run = self._file.fileno(), self._runs[run_no]
        start = max(int(np.searchsorted(run.fence, h)) - 1, 0) * FENCE
        while start < run.n:
            block = np.frombuffer(os.pread(fd, 8 * min(FENCE, run.n - start), run.section(0) + 8 * start), np.int64)
            for i in (start + np.flatnonzero(block == h)).tolist():
                lo, hi = np.frombuffer(os.pread(fd, 16, run.section(2) + 8 * i), np.int64).tolist()
                if os.pread(fd, hi - lo, run.section(3) + 8 + lo) == row_id:
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
