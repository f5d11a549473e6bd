"""Duplicate ids: where each id of the input was first read, held compactly at any input size."""

from __future__ import annotations

import numpy as np

from ..ids import SortedRuns, SpilledIds
from .rows import InputFile

SPILL_IDS = 1 << 16  # ids held in memory as strings; past this they go to a temp file, their hashes stay


class FirstSeen:
    """Where each id was first read. Ids are compared as read, in file then row order, so the
    first row of an id is the same in every run, whatever was done before.

    The newest ``SPILL_IDS`` ids are a dict (id -> place); older ones are spilled with their
    places to sorted runs in a temporary directory, and only 32 bits of their hashes stay in
    memory (4 bytes an id). Ids are checked in batches: ``spilled_maybe`` first for the batch's hashes,
    then ``check`` for each row; a hash match is settled on the spilled id itself.
    """

    def __init__(self, files: list[InputFile]):
        self._files = files
        self._recent: dict[str, int] = {}
        self._hashes = SortedRuns(np.int32, values=False)  # a false match costs one look at the spilled runs
        self._spilled = SpilledIds()

    def spilled_maybe(self, hashes: np.ndarray) -> list[bool]:
        if not self._hashes.size:
            return [False] * len(hashes)
        return self._hashes.contains(hashes).tolist()

    def check(self, row_id: str, file_no: int, index: int, column: str, spilled_maybe: bool = False
              ) -> tuple[str, str | None]:
        """(row_id, None) for an id's first row; for a later one its own ``<file>:<row>`` id and
        the error naming the first row. ``spilled_maybe``: the id's hash is among the spilled ones."""
        key = file_no << 40 | index
        first = self._recent.setdefault(row_id, key)
        if first == key and spilled_maybe:
            spilled = self._spilled.key_of(row_id)
            if spilled is not None:
                del self._recent[row_id]
                first = spilled
        if first == key:
            return row_id, None
        f = self._files[file_no]
        where = self._files[first >> 40].where(first & ((1 << 40) - 1))
        return f"{f.name}:{index}", (f"field {column!r}: duplicate id {row_id!r}, first at {where}; "
                                     "only that row is generated")

    def end_batch(self) -> None:
        """Between batches (never within one: its hashes were looked up against the spilled ones),
        spill the dict once it is full."""
        if len(self._recent) >= SPILL_IDS:
            self._hashes.add(self._spilled.spill(list(self._recent), list(self._recent.values())))
            self._recent.clear()

    def close(self) -> None:
        self._spilled.close()
