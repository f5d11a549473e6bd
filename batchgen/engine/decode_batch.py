"""The rows of a steady decode step kept from step to step: vLLM v1's persistent batch, for decoding.

In steady decoding the running sequences are the same from one step to the next, each one token longer, and a
decode step's inputs follow from a few arrays: each row's length (its position is the length less one), its
block table, and which tables must grow this step. Building them again from the sequences at every step walks
every sequence, its token list and its block table in Python several times over (scheduling, the flat batch,
the engine's rows), each walk a cache miss per object after the CPU sampler's pass over the logits.

So once a step decodes every running sequence, the scheduler keeps its rows here, and while nothing but the
engine's one token a row has happened since (the scheduler drops the batch at every other change: a request in
or out, a preemption, a swap, a fork, a finished sequence), the next step is this batch advanced: the lengths read
in one pass over the token lists (and checked: each one token longer), the rows whose table is full found by
array arithmetic, their new blocks written into a kept int32 table array. Only those rows touch Python objects.

Rows are kept only where the step's consumers need nothing per row beyond these arrays: no LoRA adapter, no
images, no hidden states read (prompt logprobs, scoring, pooling), no beam search, no prefill-only request.
The block manager's rule holds here too: a table list changes in place only by appends (engine/block_tables.py).
"""

from __future__ import annotations

import numpy as np

from batchgen.engine.block_tables import padded_tables, widened
from batchgen.engine.sequence import Sequence, SequenceGroup


def keepable(group: SequenceGroup, seq: Sequence) -> bool:
    """Whether a decoding row can be kept in a DecodeBatch (see the module's docstring)."""
    return not (seq.lora_id or seq.multi_modal is not None or seq.keep_hidden_from is not None
                or group.beam_width or group.prefill_only)


class DecodeBatch:
    """The rows of the last all-decode step, in its order, and their arrays; `valid` until the scheduler drops it."""

    __slots__ = ("seqs", "groups", "token_lists", "lengths", "table_lens", "tables", "valid")

    def __init__(self, seqs: list[Sequence], groups: list[SequenceGroup]) -> None:
        self.seqs, self.groups = seqs, groups
        self.token_lists = [seq.token_ids for seq in seqs]
        self.lengths = self.read_lengths()  # each row's length at the last step scheduled
        tables = [seq.block_table for seq in seqs]
        self.table_lens = np.array([len(t) for t in tables], dtype=np.int64)
        self.tables = padded_tables(tables, self.table_lens)  # int32 [rows, >= longest table], zeros after
        self.valid = True

    def __len__(self) -> int:
        return len(self.seqs)

    def read_lengths(self) -> np.ndarray:
        """The rows' token counts now (int64)."""
        return np.array([len(t) for t in self.token_lists], dtype=np.int64)

    def rows_to_grow(self, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The rows whose table holds no block for their position (ascending): their write takes a new block."""
        return np.flatnonzero(positions // block_size >= self.table_lens)

    def grown(self, rows: list[int]) -> None:
        """Rows whose tables grew this step: their tables into the array again, whole (a few ids a row, and right
        whatever happened to the list)."""
        for row in rows:
            table = self.seqs[row].block_table
            self.tables = widened(self.tables, len(table))
            self.tables[row, :len(table)] = table
            self.table_lens[row] = len(table)

    def width(self) -> int:
        """The longest table's length."""
        return int(self.table_lens.max())


class DecodeStep:
    """One step of a DecodeBatch: every row feeds its last token at `positions` (int64, its length less one)."""

    __slots__ = ("batch", "positions")

    def __init__(self, batch: DecodeBatch, positions: np.ndarray) -> None:
        self.batch, self.positions = batch, positions

    def __len__(self) -> int:
        return len(self.positions)
