"""engine/block_tables.py: the tables kept from step to step equal the step's tables converted afresh."""

from __future__ import annotations

import random

import numpy as np

from batchgen.engine.block_tables import BlockTables, padded_tables


def _check(kept: BlockTables, tables: list[list[int]]) -> None:
    got, lens = kept.padded(tables)
    want_lens = np.array([len(t) for t in tables], dtype=np.int64)
    assert np.array_equal(lens, want_lens)
    assert np.array_equal(got, padded_tables(tables, want_lens))
    assert got.dtype == np.int32 and got.flags.c_contiguous


def test_kept_tables_follow_appends_new_lists_and_rows_that_come_and_go():
    """Steps of a changing batch, as the block manager changes tables: appends in place, new lists for every
    other change (copy-on-write, swap, reallocation), sequences joining, leaving and coming back; the slots and
    the width grow past their first sizes."""
    rng = random.Random(0)
    kept = BlockTables(slots=4, width=2)
    live = [[rng.randrange(1000) for _ in range(rng.randint(0, 5))] for _ in range(6)]
    for _ in range(300):
        for i, table in enumerate(live):
            move = rng.random()
            if move < 0.2:
                table.append(rng.randrange(1000))  # a decode's new block
            elif move < 0.25 and table:
                live[i] = [*table[:-1], rng.randrange(1000)]  # copy-on-write: a new list
            elif move < 0.27:
                live[i] = [rng.randrange(1000) for _ in range(rng.randint(0, 40))]  # swapped, or reallocated
        if rng.random() < 0.2:
            live.append([rng.randrange(1000) for _ in range(rng.randint(1, 8))])
        if len(live) > 1 and rng.random() < 0.2:
            live.pop(rng.randrange(len(live)))
        step = [t for t in live if rng.random() < 0.9] or live[:1]  # some rows sit a step out
        rng.shuffle(step)
        _check(kept, step)
