"""The step's block tables as one int32 array, kept from step to step (vLLM v1's persistent batch, for the tables).

Turning the Python lists of block ids into an array reads every id of every row at every step: ~30 ns an id
when the ids are in cache, and after the CPU sampler has run over the step's logits they are not (at batch 256
and ~10 blocks a sequence, ~180 us of a ~1.5 ms step; it grows with the context). From one step to the next
most rows are the same sequences with the same tables, and a decoding sequence's table gains a block every
block_size steps. So each table list seen is given a row (a slot) of a persistent array, written when the list
is new or has grown, and a step's tables are one gather of their slots.

This rests on one rule of the block manager's: a table list is only ever changed in place by appending to it;
every other change (copy-on-write, swap, free and reallocation) gives the sequence a new list. A list is held
while it has a slot, so its id() cannot be taken by another list meanwhile; a slot not used in a step is freed.
"""

from __future__ import annotations

import numpy as np


def padded_tables(tables: list[list[int]], lens: np.ndarray) -> np.ndarray:
    """int32 [len(tables), longest], each table's ids first, zeros after (`lens`: the tables' lengths)."""
    flat: list[int] = []
    for table in tables:  # list.extend, then one conversion: ~2x faster than np.fromiter over a chain
        flat += table
    out = np.zeros((len(tables), int(lens.max())), dtype=np.int32)
    out[np.arange(out.shape[1]) < lens[:, None]] = np.array(flat, dtype=np.int32)
    return out


def widened(array: np.ndarray, width: int) -> np.ndarray:
    """`array` with at least `width` columns: as it is, or zero-padded to twice its width or more."""
    if width <= array.shape[1]:
        return array
    return np.pad(array, ((0, 0), (0, max(width, 2 * array.shape[1]) - array.shape[1])))


class BlockTables:
    """Padded block tables of each step's rows, converted from Python lists only where a list is new or grew."""

    def __init__(self, slots: int = 64, width: int = 16) -> None:
        self._array = np.zeros((slots, width), dtype=np.int32)  # slot -> the ids of its table, zeros after
        self._lens = np.zeros(slots, dtype=np.int64)  # slot -> its list's length when its row was written
        self._lists: list[list[int] | None] = [None] * slots  # slot -> the table list it holds
        self._slot_of: dict[int, int] = {}  # id() of a held list -> its slot
        self._free = list(range(slots - 1, -1, -1))  # a stack: pop() is the lowest
        self._used = np.zeros(slots, dtype=bool)  # the slots of the last step's rows

    def padded(self, tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The tables as padded_tables gives them (a new array), and their lengths (int64)."""
        slot_of = self._slot_of
        slots = np.array([slot_of.get(id(t), -1) for t in tables], dtype=np.int64)
        lens = np.array([len(t) for t in tables], dtype=np.int64)
        stale = np.flatnonzero((slots < 0) | (self._lens[slots] != lens))  # slot -1 reads the last: no matter
        if len(stale):
            self._write(tables, slots, stale.tolist())
        self._release(slots)
        return self._array[slots, : int(lens.max())], lens

    def _write(self, tables: list[list[int]], slots: np.ndarray, rows: list[int]) -> None:
        """Writes the tables of this step's `rows` that are new (given a slot, written whole) or grew (their new
        ids only: a kept list changes by appends alone), all in one assignment."""
        at_slot: list[int] = []
        at_col: list[int] = []
        ids: list[int] = []
        for row in rows:
            table, slot = tables[row], int(slots[row])
            if slot < 0:
                slot = slots[row] = self._take(table)
                start = 0
            else:
                start = int(self._lens[slot])
            at_slot += [slot] * (len(table) - start)
            at_col += range(start, len(table))
            ids += table[start:]
        target = slots[rows]
        self._lens[target] = [len(tables[row]) for row in rows]
        self._array = widened(self._array, int(self._lens[target].max()))
        self._array[at_slot, at_col] = ids

    def _take(self, table: list[int]) -> int:
        if not self._free:  # twice the slots
            size = len(self._lists)
            self._array = np.concatenate([self._array, np.zeros_like(self._array)])
            self._lens = np.concatenate([self._lens, np.zeros_like(self._lens)])
            self._lists += [None] * size
            self._used = np.concatenate([self._used, np.zeros(size, dtype=bool)])
            self._free = list(range(2 * size - 1, size - 1, -1))
        slot = self._free.pop()
        self._array[slot] = 0  # what a list held here before
        self._lists[slot] = table
        self._slot_of[id(table)] = slot
        return slot

    def _release(self, index: np.ndarray) -> None:
        """Frees the slots the last step used and this one does not: their lists are gone from the batch."""
        used = np.zeros(len(self._lists), dtype=bool)
        used[index] = True
        for slot in np.flatnonzero(self._used & ~used).tolist():
            del self._slot_of[id(self._lists[slot])]
            self._lists[slot] = None
            self._free.append(slot)
        self._used = used
