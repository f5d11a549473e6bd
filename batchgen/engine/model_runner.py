"""Executes what the scheduler decided: cache swaps and copies, one flat forward, last-token logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen import ops
from batchgen.layers.attention import AttentionMetadata


@dataclass
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Key and value, all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * itemsize


class ModelRunner:
    def __init__(self, model: torch.nn.Module, shape: CacheShape, num_device_blocks: int, num_cpu_blocks: int,
                 device: torch.device):
        self.model, self.shape, self.device = model, shape, device
        self.block_size = shape.block_size
        pin = device.type == "cuda"
        # On CPU the KV cache, and the swap space on any device (pinned excepted), take memory only as
        # their blocks are first written: start-up does not wait for gigabytes of zeros, and RSS
        # follows the blocks a run has used, not the budget (ops.allocate_kv_cache).
        self.device_caches = [self._allocate(num_device_blocks, device) for _ in range(shape.num_layers)]
        self.cpu_caches = (
            [self._allocate(num_cpu_blocks, torch.device("cpu"), pin) for _ in range(shape.num_layers)]
            if num_cpu_blocks else []
        )
        for layer, (key_cache, value_cache) in zip(model.attention_layers(), self.device_caches, strict=True):
            layer.key_cache, layer.value_cache = key_cache, value_cache

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        return ops.allocate_kv_cache(num_blocks, s.num_kv_heads, s.block_size, s.head_dim, s.dtype, device, pin)

    def _move_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                     copies: list[tuple[int, int]]) -> None:
        if swap_out:
            mapping = torch.tensor(swap_out, dtype=torch.int64)
            for (dk, dv), (ck, cv) in zip(self.device_caches, self.cpu_caches, strict=True):
                ops.swap_blocks(dk, ck, mapping)
                ops.swap_blocks(dv, cv, mapping)
        if swap_in:
            mapping = torch.tensor(swap_in, dtype=torch.int64)
            for (dk, dv), (ck, cv) in zip(self.device_caches, self.cpu_caches, strict=True):
                ops.swap_blocks(ck, dk, mapping)
                ops.swap_blocks(cv, dv, mapping)
        if copies:
            mapping = torch.tensor(copies, dtype=torch.int64, device=self.device)
            ops.copy_blocks([k for k, _ in self.device_caches], [v for _, v in self.device_caches], mapping)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32, device=self.device)

    def _group_ids(self, groups: list[int]) -> torch.Tensor | None:
        """Small ids of the decodes' requests (the scheduler keeps a request's samples side by
        side), or None when no request decodes more than one sample."""
        ids: dict[int, int] = {}
        numbered = [ids.setdefault(g, len(ids)) for g in groups]
        if len(ids) == len(groups):
            return None
        return torch.tensor(numbered, dtype=torch.int32, device=self.device)

    def _slots(self, block_table: list[int], start: int, count: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def prepare(self, scheduled) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat batch: decodes (one new token) first, then prefill chunks. Returns the input ids,
        positions, attention metadata and, per scheduled entry in the given order, the batch row of
        its last token."""
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_new_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row = [0] * len(scheduled)
        decode_tables, decode_lens, decode_groups, prefill_tables, prefill_lens, query_starts = [], [], [], [], [], [0]
        for i in order:
            s = scheduled[i]
            seq, start, n = s.seq, s.start, s.num_new_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += self._slots(seq.block_table, start, n)
            last_row[i] = len(input_ids) - 1
            if n == 1:
                decode_tables.append(seq.block_table)
                decode_lens.append(start + 1)
                decode_groups.append(id(s.group))
            else:
                prefill_tables.append(seq.block_table)
                prefill_lens.append(start + n)
                query_starts.append(query_starts[-1] + n)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=self._block_tables(decode_tables) if decode_tables else None,
            decode_seq_lens=ints(decode_lens) if decode_lens else None,
            decode_seq_groups=self._group_ids(decode_groups),
            prefill_block_tables=self._block_tables(prefill_tables) if prefill_tables else None,
            prefill_seq_lens=ints(prefill_lens) if prefill_lens else None,
            prefill_query_start_loc=ints(query_starts) if prefill_tables else None,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta, last_row

    @torch.inference_mode()
    def execute(self, out) -> torch.Tensor | None:
        """Runs one scheduler step; returns logits (float32 from batchgen's bf16 GEMM, else in the model's
        dtype), one row per scheduled entry that samples (in scheduled order), or None when nothing samples."""
        self._move_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        if not out.scheduled:
            return None
        ids, pos, meta, last_row = self.prepare(out.scheduled)
        hidden = self.model(ids, pos, meta)
        rows = [last_row[i] for i, s in enumerate(out.scheduled) if s.samples]
        if not rows:
            return None
        picked = hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(picked)
