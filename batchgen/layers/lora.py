"""The low-rank terms inside the model's linears, for rows of many adapters in one step.

The base projection runs once over the whole flat batch; then each segment of contiguous rows that share
an adapter adds its own x A^T B^T (a segmented shrink and expand, as in Punica / S-LoRA). The runner orders
a step's rows so each adapter's rows sit side by side (`LoRABatch.segments`). A packed projection (q/k/v,
gate/up) takes one pair for all its parts: the parts' A stacked, their B block-diagonal, so one shrink and one
expand serve every part the adapter targets.

Batch invariance: each segment's shrink and expand are `PackedLinear`s (oneDNN's packed GEMM, or batchgen's
bf16 GEMM), whose rows do not depend on how many rows they run with (tests/test_linear.py), and every output
row gets exactly one add; so a row's result is the same whatever other adapters, or how many rows of its own,
share the step. This is the reference path, and the one models without batchgen's C++ decoder stack take;
where the stack runs (bf16 weights on x86-64), `StackedLoRA` hands it every slot's weights instead and it adds
the terms inside its GEMMs (`ops.lora_shrink_expand`, engine_src/csrc/cpu/lora_ops.cpp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import nn

from batchgen import ops
from batchgen.layers.linear import PackedLinear, can_pack, linear


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's low-rank pair: its delta is x A^T B^T, the adapter's scaling folded into B."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


class AdapterWeights(Protocol):
    """What the layers read of an adapter: its pairs (batchgen/lora/checkpoint.py's `Adapter` is one, read from
    a PEFT directory)."""

    modules: dict[tuple[int, str], LoRAWeights]  # (layer, checkpoint module name, e.g. "q_proj") -> weights


@dataclass(frozen=True)
class LoRATarget:
    """A linear an adapter may add to: its decoder layer, input width, and by checkpoint module name the
    output rows each name covers (several names for a packed projection, e.g. q_proj, k_proj, v_proj and
    qkv_proj for the fused qkv_proj)."""

    layer: int
    in_features: int
    parts: dict[str, tuple[int, int]]  # module name -> (first output row, rows)

    @property
    def out_features(self) -> int:
        return max(first + rows for first, rows in self.parts.values())

    def pieces(self) -> list[tuple[int, int]]:
        """The output rows as the parts cut them, (first, count) in order: q, k and v of a fused qkv_proj (an
        adapter on the whole of it reaches into each), or the whole of a projection of one part."""
        pieces = sorted({part for part in self.parts.values() if part[1] < self.out_features})
        return pieces or [(0, self.out_features)]


@dataclass
class Segment:
    start: int  # first row of the flat batch
    end: int
    slot: int


class LoRABatch:
    """The step being run, shared by every LoRALinear of one model: its rows' adapter segments (base-model
    rows are in none). The runner assigns `segments` once a step; `table()` is built once from them (and
    copied once to each device that asks)."""

    def __init__(self, segments: list[Segment] | None = None):
        self.segments = segments or []

    @property
    def segments(self) -> list[Segment]:
        return self._segments

    @segments.setter
    def segments(self, segments: list[Segment]) -> None:
        self._segments, self._tables = segments, {}

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The segments as `ops.lora_shrink_expand` takes them, on `device`: int32 [count, 3] (first row, end
        row, slot)."""
        device = torch.device(device)
        if device not in self._tables:
            if device.type == "cpu":
                rows = [(s.start, s.end, s.slot) for s in self._segments]
                self._tables[device] = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3)
            else:
                self._tables[device] = self.table().to(device, non_blocking=True)
        return self._tables[device]


def _gemm(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return PackedLinear(weight) if can_pack(weight) else partial(linear, weight=weight)


@dataclass
class SlotWeights:
    shrink: Callable[[torch.Tensor], torch.Tensor]  # x [n, in] -> [n, ranks of the targeted parts]
    expand: Callable[[torch.Tensor], torch.Tensor]  # -> [n, out]: block-diagonal over the parts


def adapter_pair(adapter: AdapterWeights | None, target: LoRATarget, rows: tuple[int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`adapter`'s low-rank pair on `target`'s output rows `rows` ((first, count); all by default) as one (A
    [ranks, in], B [count, ranks]): the A of the parts reaching into those rows stacked, their B block-diagonal
    over the parts' rows; None where the adapter does not touch them."""
    first, count = rows or (0, target.out_features)
    pairs = [] if adapter is None else [
        (adapter.modules[key], target.parts[key[1]]) for key in adapter.modules
        if key[0] == target.layer and key[1] in target.parts
        and target.parts[key[1]][0] < first + count and first < sum(target.parts[key[1]])]
    if not pairs:
        return None
    a = torch.cat([w.a for w, _ in pairs])
    b = torch.zeros(count, a.shape[0], dtype=a.dtype)
    col = 0
    for w, (start, size) in pairs:
        lo, hi = max(start, first), min(start + size, first + count)
        b[lo - first:hi - first, col:col + w.rank] = w.b[lo - start:hi - start]
        col += w.rank
    return a, b


class LoRALinear(nn.Module):
    """`base`'s output plus each segment's adapter term. `slots[i]` holds the adapter in device slot i, or
    None where that adapter does not touch this projection (or the slot is empty). With `stacked` (on CUDA)
    every slot's weights sit there instead and one segmented kernel call a piece adds all the segments' terms
    (engine_src/cuda/lora_kernels.cu) rather than two GEMM launches a segment."""

    def __init__(self, base: nn.Module, target: LoRATarget, batch: LoRABatch, num_slots: int,
                 stacked: StackedLoRA | None = None):
        super().__init__()
        self.base, self.target, self.batch, self.stacked = base, target, batch, stacked
        self.slots: list[SlotWeights | None] = [None] * num_slots

    def load(self, slot: int, adapter: AdapterWeights | None, device: torch.device) -> None:
        """Puts `adapter`'s pairs for this projection into `slot` (None empties it)."""
        if self.stacked is not None:
            self.stacked.load(slot, adapter, device)
            return
        pair = adapter_pair(adapter, self.target)
        self.slots[slot] = None if pair is None else SlotWeights(*(_gemm(w.to(device)) for w in pair))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        self.add_lora(x, out)
        return out

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.stacked is not None:
            if self.batch.segments:
                table = self.batch.table(x.device)
                for first, a, b_t, ranks in self.stacked.parts():
                    ops.lora_shrink_expand(out[:, first:first + b_t.shape[2]], x, table, a, b_t, ranks)
            return
        for seg in self.batch.segments:
            weights = self.slots[seg.slot]
            if weights is not None:
                rows = x[seg.start:seg.end]
                out[seg.start:seg.end] += weights.expand(weights.shrink(rows)).to(out.dtype)


class StackedLoRA:
    """One projection's adapters as batchgen's C++ decoder stack reads them: for each piece of its output rows
    (`LoRATarget.pieces`: q, k, v apart, so that no expand runs over another piece's zeros) every slot's pair,
    padded with zeros to `capacity` ranks, as `ops.lora_shrink_expand` takes them, and each slot's own rank in
    `ranks` (int32; 0 where its adapter does not reach the piece). In a bf16 model on the bf16 dot product the
    pairs are bf16 (exact: adapters load in the model's dtype) in `ops.pack_lora_bf16`'s form; otherwise
    float32 a [slots, capacity, in] and b_t [slots, capacity, rows] (B transposed). The stack holds these
    tensors; `load` rewrites a slot in place."""

    def __init__(self, target: LoRATarget, num_slots: int, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.target = target
        self.pieces = target.pieces()
        # bf16 pairs for the bf16 dot product; where the GEMM widens bf16 (AVX2, AVX-512 without AVX512-BF16),
        # float32 for the vector loops (the pairs' loop there is scalar).
        self.pairs = dtype == torch.bfloat16 and not ops.gemm_widens_bf16()
        whole = len(self.pieces) > 1 and (0, target.out_features) in target.parts.values()
        self.capacity = max_rank * (2 if whole else 1)  # a piece's own pair, and one on the whole projection
        self.weights = [tuple(w.to(device) for w in (
            *self._packed(torch.zeros(num_slots, self.capacity, target.in_features),
                          torch.zeros(num_slots, self.capacity, rows)),
            torch.zeros(num_slots, dtype=torch.int32))) for _, rows in self.pieces]

    def _packed(self, a: torch.Tensor, b_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's (or every slot's) a [s, r, in] and b_t [s, r, rows] in the stack's form, `capacity` ranks."""
        if self.pairs:
            return ops.pack_lora_bf16(a, b_t, self.capacity)
        padding = (0, 0, 0, self.capacity - a.shape[1])
        return torch.nn.functional.pad(a.float(), padding), torch.nn.functional.pad(b_t.float(), padding)

    def load(self, slot: int, adapter: AdapterWeights | None, device: torch.device) -> None:
        """Puts `adapter`'s pairs for this projection into `slot` (None empties it), on the weights' device."""
        for piece, (a, b_t, ranks) in zip(self.pieces, self.weights, strict=True):
            pair = adapter_pair(adapter, self.target, piece)
            rank = 0 if pair is None else pair[0].shape[0]
            if pair is None:
                a[slot].zero_()
                b_t[slot].zero_()
            else:
                a[slot], b_t[slot] = (w[0] for w in self._packed(pair[0][None], pair[1].T[None]))
            ranks[slot] = rank

    def parts(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(first output row, a, b_t, ranks) of each piece, as DecoderStack.set_lora takes them."""
        return [(first, *w) for (first, _), w in zip(self.pieces, self.weights, strict=True)]
