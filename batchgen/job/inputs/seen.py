"""Duplicate ids: where each id of the input was first read, held compactly at any input size."""

from __future__ import annotations

from bisect import bisect_right
from itertools import groupby

import numpy as np
import pyarrow as pa

from ..errors import JobError
from ..ids import SortedRuns, SpilledIds, as_bytes
from .rows import InputFile

SPILL_IDS = 1 << 16  # ids held in memory as Arrow arrays; past this they go to a temp file, their hashes stay
KEY_BITS = 40  # a row's key: its file's number above these bits, its number in the file below


def row_key(file_no: int, index: np.ndarray) -> np.ndarray:
    return (np.int64(file_no) << np.int64(KEY_BITS)) | index.astype(np.int64)


class FirstSeen:
    """Where each id was first read. Ids are compared as read, in file then row order, so the
    first row of an id is the same in every run, whatever was done before.

    A batch of ids is looked up at once (``first_of``) by its hashes: against the newest
    ``SPILL_IDS`` ids (Arrow arrays and their 64-bit hashes), the older ones spilled with their keys
    to sorted runs in a temporary file (32 bits of their hashes and the number of their run stay in
    memory: 6 bytes an id), and the batch itself. Only a hash match is looked at row by row,
    settled on the id itself.
    """

    def __init__(self, files: list[InputFile]):
        self._files = files
        self._recent = SortedRuns(filtered=False)  # hash -> number among the recent ids
        self._recent_ids: list[pa.Array] = []
        self._recent_hashes: list[np.ndarray] = []
        self._recent_keys: list[np.ndarray] = []
        self._recent_starts: list[int] = []
        self._recent_count = 0
        # hash -> spilled run: a false match costs one look there; no filters (a byte a row, read once)
        self._hashes = SortedRuns(np.int32, np.uint16, filtered=False)
        self._spilled = SpilledIds()

    def first_of(self, ids: pa.Array, hashes: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Per id of a batch (in reading order, each with its hash and its row's key, ``row_key``):
        the key of the first row with that id, or -1 where this row is that first row."""
        first = np.full(len(ids), -1, dtype=np.int64)
        if not len(ids):
            return first
        ids = as_bytes(ids)
        for rows, runs in self._hashes.matches(hashes):
            for i, run_no in zip(rows.tolist(), runs.tolist(), strict=True):
                if first[i] < 0:
                    key = self._spilled.key_of(ids[i].as_py(), int(hashes[i]), run_no)
                    if key is not None:
                        first[i] = key
        for rows, at in self._recent.matches(hashes):
            for i, a in zip(rows.tolist(), at.tolist(), strict=True):
                if first[i] < 0 and self._recent_id(a) == ids[i].as_py():
                    first[i] = self._recent_key(a)
        order = np.argsort(hashes, kind="stable")
        same = hashes[order][1:] == hashes[order][:-1]
        repeated = order[np.concatenate([same, [False]]) | np.concatenate([[False], same])]
        for _, group in groupby(repeated.tolist(), key=lambda i: int(hashes[i])):
            firsts: dict[bytes, int] = {}
            for i in group:
                if first[i] < 0:
                    key = firsts.setdefault(ids[i].as_py(), int(keys[i]))
                    if key != keys[i]:
                        first[i] = key
        self._remember(ids, hashes, keys, np.flatnonzero(first < 0))
        return first

    def add(self, ids: pa.Array, hashes: np.ndarray, keys: np.ndarray) -> None:
        """Ids known to be first seen at ``keys`` (from an index), so later rows are checked against them."""
        if len(ids):
            self._remember(as_bytes(ids), hashes, keys, np.arange(len(ids)))

    def where(self, key: int) -> str:
        """The row of a key, in messages."""
        return self._files[key >> KEY_BITS].where(key & ((1 << KEY_BITS) - 1))

    def _remember(self, ids: pa.Array, hashes: np.ndarray, keys: np.ndarray, new: np.ndarray) -> None:
        """Keep the ids first seen in this batch; spill the recent ones once there are enough."""
        self._recent.add(hashes[new], self._recent_count + np.arange(len(new), dtype=np.uint32))
        self._recent_starts.append(self._recent_count)
        self._recent_ids.append(ids.take(pa.array(new)))
        self._recent_hashes.append(hashes[new])
        self._recent_keys.append(keys[new])
        self._recent_count += len(new)
        if self._recent_count >= SPILL_IDS:
            if self._spilled.runs >= 1 << 16:
                raise JobError(f"more than {SPILL_IDS * (1 << 16):,} distinct ids in one job's input")
            hashes = np.concatenate(self._recent_hashes)
            self._hashes.add(hashes, self._spilled.runs)
            self._spilled.spill(pa.concat_arrays(self._recent_ids), hashes, np.concatenate(self._recent_keys))
            self._recent = SortedRuns(filtered=False)
            self._recent_ids, self._recent_hashes, self._recent_keys, self._recent_starts = [], [], [], []
            self._recent_count = 0

    def _recent_at(self, at: int) -> tuple[int, int]:
        chunk = bisect_right(self._recent_starts, at) - 1
        return chunk, at - self._recent_starts[chunk]

    def _recent_id(self, at: int) -> bytes:
        chunk, i = self._recent_at(at)
        return self._recent_ids[chunk][i].as_py()

    def _recent_key(self, at: int) -> int:
        chunk, i = self._recent_at(at)
        return int(self._recent_keys[chunk][i])

    def close(self) -> None:
        self._spilled.close()
