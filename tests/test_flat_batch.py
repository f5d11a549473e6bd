"""engine/flat_batch.py: the bulk flat batch equals one built token by token from the same rows."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from batchgen.engine.block_tables import BlockTables
from batchgen.engine.flat_batch import flat_batch


@dataclass
class _Seq:
    token_ids: list[int]
    block_table: list[int]


@dataclass
class _Row:
    seq: _Seq
    start: int
    num_new_tokens: int


def _rows(rng: random.Random, decodes: int, prefills: int, bs: int) -> list[_Row]:
    rows = []
    for i in range(decodes + prefills):
        length = rng.randint(1, 90)
        n = 1 if i < decodes else rng.randint(1, length)  # a one-token chunk sits among the decodes
        tokens = [rng.randrange(1000) for _ in range(length)]
        blocks = -(-length // bs) + rng.randint(0, 2)  # tables may hold more blocks than the tokens need
        rows.append(_Row(_Seq(tokens, rng.sample(range(500), blocks)), length - n, n))
    rows.sort(key=lambda r: r.num_new_tokens != 1)  # the runner's order: one-token rows first
    return rows


def _reference(rows: list[_Row], bs: int) -> dict:
    """Token by token, as ModelRunner.prepare built it before the bulk version."""
    ids, positions, slots, first_row = [], [], [], []
    for r in rows:
        first_row.append(len(ids))
        ids += r.seq.token_ids[r.start:r.start + r.num_new_tokens]
        positions += range(r.start, r.start + r.num_new_tokens)
        slots += [r.seq.block_table[p // bs] * bs + p % bs for p in range(r.start, r.start + r.num_new_tokens)]

    def padded(tables):
        width = max(len(t) for t in tables)
        return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)

    dec = [r for r in rows if r.num_new_tokens == 1]
    pre = [r for r in rows if r.num_new_tokens != 1]
    return dict(
        input_ids=ids, positions=positions, slot_mapping=slots, first_row=first_row, num_decodes=len(dec),
        decode_tables=padded([r.seq.block_table for r in dec]) if dec else None,
        decode_lens=[r.start + 1 for r in dec] if dec else None,
        prefill_tables=padded([r.seq.block_table for r in pre]) if pre else None,
        prefill_lens=[r.start + r.num_new_tokens for r in pre] if pre else None,
        query_starts=list(np.cumsum([0] + [r.num_new_tokens for r in pre])) if pre else None,
    )


@pytest.mark.parametrize("decodes,prefills", [(7, 0), (0, 5), (6, 4), (1, 1), (64, 3)])
@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("kept", [False, True], ids=["fresh", "kept-tables"])
def test_flat_batch_matches_a_token_by_token_build(decodes, prefills, bs, kept):
    rng = random.Random(decodes * 100 + prefills + bs)
    rows = _rows(rng, decodes, prefills, bs)
    tables = BlockTables() if kept else None
    if tables is not None:  # a step before, with half the rows and one of their tables grown since
        flat_batch(rows[::2], bs, tables=tables)
        rows[0].seq.block_table.append(499)
    got, want = flat_batch(rows, bs, tables=tables), _reference(rows, bs)
    for name, expected in want.items():
        value = getattr(got, name)
        if expected is None:
            assert value is None, name
        elif isinstance(value, np.ndarray):
            assert value.dtype == (np.int32 if name in ("decode_tables", "prefill_tables", "decode_lens",
                                                        "prefill_lens", "query_starts") else np.int64), name
            assert value.flags.c_contiguous and np.array_equal(value, np.asarray(expected)), name
        else:
            assert value == expected, name
