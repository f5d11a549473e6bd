"""Executes what the scheduler decided: cache swaps and copies, one flat forward, last-token logits.

The step's hidden states come back too: prompt logprobs, scoring and pooling read rows of them
(engine/prompt_logprobs.py, engine/pooling.py), so the runner itself never makes more logits than
the sampled rows'."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen import ops
from batchgen.engine.block_tables import BlockTables
from batchgen.engine.cuda_graphs import DecodeGraphs
from batchgen.engine.decode_batch import DecodeBatch, DecodeStep
from batchgen.engine.flat_batch import flat_batch
from batchgen.engine.step_inputs import StepInputs
from batchgen.layers.attention import AttentionMetadata, fp8_kv_scales
from batchgen.layers.lora import Segment
from batchgen.lora.manager import LoRAManager
from batchgen.models.vision.inputs import MultiModalRow


@dataclass
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the cached elements': the model's dtype, or an fp8 one (ops.FP8_CACHE_DTYPES)

    @property
    def fp8(self) -> bool:
        return self.dtype in ops.FP8_CACHE_DTYPES

    @property
    def bytes_per_block(self) -> int:
        """Key and value, all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * itemsize


@dataclass
class StepOutput:
    """What one forward gives the engine."""

    logits: torch.Tensor | None  # one row per scheduled entry that samples (scheduled order); None if none does
    hidden: torch.Tensor | None  # [num_tokens, hidden]: the whole flat batch's final hidden states
    first_row: list[int]  # per scheduled entry (scheduled order): the hidden row of its first fed token

    def rows_of(self, index: int, start: int, end: int, entry_start: int) -> slice:
        """The hidden rows of positions [start, end) of scheduled entry `index`, which fed from `entry_start`."""
        first = self.first_row[index] - entry_start
        return slice(first + start, first + end)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, shape: CacheShape, num_device_blocks: int, num_cpu_blocks: int,
                 device: torch.device, lora: LoRAManager | None = None, graphs: DecodeGraphs | None = None):
        self.model, self.shape, self.device, self.lora = model, shape, device, lora
        self.graphs = graphs  # decode-only steps replayed as CUDA graphs (engine/cuda_graphs.py), or None
        self.block_size = shape.block_size
        self._tables = BlockTables()  # the block tables of the steps' rows, kept from step to step
        self._kept_groups: tuple[DecodeBatch | None, torch.Tensor | None] = (None, None)  # _group_ids of kept rows
        self._inputs = StepInputs(device)  # a step's input arrays onto the device in one copy
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
            if shape.fp8:  # the checkpoint's scales where it ships them (native models), else 1.0
                shipped = getattr(layer, "checkpoint_kv_scales", None)
                layer.kv_scales = fp8_kv_scales(shape.num_kv_heads, device, shipped)

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

    def _group_ids(self, groups: list) -> torch.Tensor | None:
        """Small ids of the decodes' requests (`groups`: their SequenceGroups, hashed by identity; the scheduler
        keeps a request's samples side by side), or None when no request decodes more than one sample."""
        if len(set(groups)) == len(groups):
            return None
        ids: dict = {}
        numbered = [ids.setdefault(g, len(ids)) for g in groups]
        return torch.tensor(numbered, dtype=torch.int32, device=self.device)

    def prepare(self, scheduled, lora_slots: dict[int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat batch: decodes (one new token) first, then prefill chunks, each part's rows grouped by
        LoRA slot (`lora_slots`: lora id -> slot; the base model's rows first). Returns the input ids,
        positions, attention metadata and, per scheduled entry in the given order, the batch row of
        its first token (its last is that plus num_new_tokens - 1). `scheduled` may be a DecodeStep, the
        scheduler's kept rows of a steady decode step (engine/decode_batch.py), read from their arrays."""
        if isinstance(scheduled, DecodeStep):
            return self._prepare_decode(scheduled)
        adapter_slot = lora_slots or {}
        news = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        if adapter_slot:
            order = sorted(range(len(scheduled)), key=lambda i: (scheduled[i].num_new_tokens != 1,
                                                                 adapter_slot.get(scheduled[i].seq.lora_id, -1)))
        else:  # no adapter in this step: the one-token rows first, which the scheduler's order mostly is already
            multi = news != 1
            order = np.argsort(multi, kind="stable") if (multi[:-1] & ~multi[1:]).any() else None
        rows = scheduled if order is None else [scheduled[i] for i in order]
        batch = flat_batch(rows, self.block_size, news if order is None else news[order], self._tables)
        if order is None:
            first_row = batch.first_row
        else:
            first_row = np.empty(len(scheduled), dtype=np.int64)
            first_row[order] = batch.first_row
        arrays = [batch.input_ids, batch.positions, batch.slot_mapping, batch.decode_tables, batch.decode_lens,
                  batch.prefill_tables, batch.prefill_lens, batch.query_starts]
        ids, positions, slots, decode_tables, decode_lens, prefill_tables, prefill_lens, starts = \
            self._inputs.to_device(arrays)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=batch.num_decodes,
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_lens,
            decode_seq_groups=self._group_ids([s.group for s in rows[:batch.num_decodes]]),
            prefill_block_tables=prefill_tables,
            prefill_seq_lens=prefill_lens,
            prefill_query_start_loc=starts,
        )
        return ids, positions, meta, first_row.tolist()

    def _prepare_decode(self, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """prepare() of a steady decode step: each row's last token at its position, its table from the batch's
        array (which changes in place only once the step has run), no reordering (no adapters)."""
        batch, positions, bs = step.batch, step.positions, self.block_size
        count = len(positions)
        input_ids = np.array([tokens[-1] for tokens in batch.token_lists], dtype=np.int64)
        tables = batch.tables[:, :batch.width()]  # a view: to_device packs it, or copies it where not contiguous
        slot_mapping = tables[np.arange(count), positions // bs].astype(np.int64) * bs + positions % bs
        if self._kept_groups[0] is not batch:
            self._kept_groups = (batch, self._group_ids(batch.groups))
        ids, positions_on_device, slots, tables, lens = self._inputs.to_device(
            [input_ids, positions, slot_mapping, tables, (positions + 1).astype(np.int32)])
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=count,
            decode_block_tables=tables,
            decode_seq_lens=lens,
            decode_seq_groups=self._kept_groups[1],
            prefill_block_tables=None,
            prefill_seq_lens=None,
            prefill_query_start_loc=None,
        )
        return ids, positions_on_device, meta, list(range(count))

    @torch.inference_mode()
    def execute(self, out) -> StepOutput:
        """Runs one scheduler step: logits (float32 from batchgen's bf16 GEMM, else in the model's dtype) of
        the last fed token of every scheduled entry that samples, and the step's hidden states."""
        self._move_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        for slot, lora_id in out.adapters_to_load:
            self.lora.load(slot, lora_id)
        decode = out.decode  # a steady decode step: no adapter, no image, every row samples (decode_batch.keepable)
        if decode is None and not out.scheduled:
            return StepOutput(None, None, [])
        ids, pos, meta, first_row = self.prepare(decode if decode is not None else out.scheduled, out.lora_slots)
        if self.lora is not None:
            self.lora.batch.segments = (lora_segments(out.scheduled, first_row, out.lora_slots)
                                        if decode is None else [])
        images = (multi_modal_rows(out.scheduled, first_row)
                  if decode is None and getattr(self.model, "takes_images", False) else [])
        if images:
            hidden = self.model(ids, pos, meta, images)
        elif self.graphs is not None and not out.lora_slots and self.graphs.fits(meta, ids.shape[0]):
            hidden = self.graphs.forward(ids, pos, meta)
        else:
            hidden = self.model(ids, pos, meta)
        if decode is not None or len(first_row) == hidden.shape[0] and all([s.samples for s in out.scheduled]) \
                and first_row == list(range(len(first_row))):  # every row one token that samples, in order (decode)
            picked, rows = hidden, first_row
        else:
            rows = [first_row[i] + s.num_new_tokens - 1 for i, s in enumerate(out.scheduled) if s.samples]
            picked = hidden[torch.from_numpy(np.array(rows, dtype=np.int64)).to(self.device)] if rows else None
        logits = self.model.compute_logits(picked) if rows else None
        return StepOutput(logits, hidden, first_row)


def multi_modal_rows(scheduled, first_row: list[int]) -> list[MultiModalRow]:
    """The step's sequences with images that the model must see: those feeding image tokens, and with M-RoPE
    every one (its positions are not its token indices). A step with none runs as a text model's (decode steps of
    a LLaVA-style model replay CUDA graphs)."""
    return [MultiModalRow(first_row[i], s.start, s.num_new_tokens, s.seq.multi_modal)
            for i, s in enumerate(scheduled) if s.seq.multi_modal is not None and s.seq.multi_modal.seen_from(s.start)]


def lora_segments(scheduled, first_row: list[int], lora_slots: dict[int, int]) -> list[Segment]:
    """The flat batch's runs of rows under one adapter, in row order (see ModelRunner.prepare)."""
    segments: list[Segment] = []
    for i in sorted((i for i, s in enumerate(scheduled) if s.seq.lora_id), key=first_row.__getitem__):
        s = scheduled[i]
        start, end, slot = first_row[i], first_row[i] + s.num_new_tokens, lora_slots[s.seq.lora_id]
        if segments and segments[-1].end == start and segments[-1].slot == slot:
            segments[-1].end = end
        else:
            segments.append(Segment(start, end, slot))
    return segments
