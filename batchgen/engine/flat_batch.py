"""A step's flat batch built in bulk: one numpy array per input instead of per-token Python lists.

The rows come in batch order (decodes first, see ModelRunner.prepare); what is per row in Python is what
only Python holds: each sequence's token ids and block table (which the runner converts only where it changed
since the last step: engine/block_tables.py). Positions, slot mapping, the padded block tables and sequence
lengths are array arithmetic over the whole step, so their cost per sequence stays flat as the batch grows
(scripts/bench_host.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.engine.block_tables import BlockTables, padded_tables


@dataclass
class FlatBatch:
    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    first_row: np.ndarray  # int64 [num_rows]: the batch row of each row's first token
    num_decodes: int  # the leading rows with one new token
    decode_tables: np.ndarray | None  # int32 [num_decodes, widest decode table], zero-padded
    decode_lens: np.ndarray | None  # int32 [num_decodes]
    prefill_tables: np.ndarray | None  # int32 [num_prefills, widest prefill table]
    prefill_lens: np.ndarray | None  # int32 [num_prefills]
    query_starts: np.ndarray | None  # int32 [num_prefills + 1]


def flat_batch(rows, block_size: int, news: np.ndarray | None = None, tables: BlockTables | None = None) -> FlatBatch:
    """`rows`: (seq, start, num_new_tokens) objects in batch order, the one-token ones first; `news`: their
    num_new_tokens (int64), where the caller has them; `tables`: the runner's tables kept from step to step."""
    count = len(rows)
    starts = np.array([r.start for r in rows], dtype=np.int64)  # np.array of a list: faster than np.fromiter
    if news is None:
        news = np.array([r.num_new_tokens for r in rows], dtype=np.int64)
    num_decodes = int(np.argmax(news != 1)) if (news != 1).any() else count
    ends = np.cumsum(news)
    first_row = ends - news
    input_ids = [r.seq.token_ids[r.start] for r in rows[:num_decodes]]
    for r in rows[num_decodes:]:
        input_ids += r.seq.token_ids[r.start:r.start + r.num_new_tokens]
    seq_tables = [r.seq.block_table for r in rows]
    if tables is not None:
        table, lens = tables.padded(seq_tables)
    else:
        lens = np.array([len(t) for t in seq_tables], dtype=np.int64)
        table = padded_tables(seq_tables, lens)
    if num_decodes == count:  # a decode-only step: one token a row
        positions, row_of_token = starts, np.arange(count)
    else:
        positions = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(first_row - starts, news)
        row_of_token = np.repeat(np.arange(count), news)
    slot_mapping = table[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    decode, prefill = slice(0, num_decodes), slice(num_decodes, count)
    has_decodes, has_prefills = num_decodes > 0, num_decodes < count
    return FlatBatch(
        input_ids=np.array(input_ids, dtype=np.int64), positions=positions, slot_mapping=slot_mapping,
        first_row=first_row, num_decodes=num_decodes,
        # a decode-only step's tables are as wide as their longest and contiguous already
        decode_tables=(_narrowed(table[decode], lens[decode]) if has_prefills else table) if has_decodes else None,
        decode_lens=(starts[decode] + 1).astype(np.int32) if has_decodes else None,
        prefill_tables=_narrowed(table[prefill], lens[prefill]) if has_prefills else None,
        prefill_lens=(starts[prefill] + news[prefill]).astype(np.int32) if has_prefills else None,
        query_starts=np.concatenate([[0], np.cumsum(news[prefill])]).astype(np.int32) if has_prefills else None,
    )


def _narrowed(table: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Rows of the step's padded tables, as wide as their own longest table (`lens`), contiguous."""
    return np.ascontiguousarray(table[:, :int(lens.max())])
