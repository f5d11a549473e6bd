"""The low-rank terms inside the model's linears, for rows of many adapters in one step.

The base projection runs once over the whole flat batch; then each segment of contiguous rows that share
an adapter adds its own x A^T B^T (a segmented shrink and expand, as in Punica / S-LoRA). The runner orders
a step's rows so each adapter's rows sit side by side (`LoRABatch.segments`). A packed projection (q/k/v,
gate/up) takes one pair for all its parts: the parts' A stacked, their B block-diagonal, so one shrink and one
expand serve every part the adapter targets.

Batch invariance: each segment's shrink and expand are `PackedLinear`s (oneDNN's packed GEMM, or batchgen's
bf16 GEMM), whose rows do not depend on how many rows they run with (tests/test_linear.py), and every output
row gets exactly one add; so a row's result is the same whatever other adapters, or how many rows of its own,
share the step. A C++ segmented kernel can replace `LoRALinear.add_lora` without touching anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.layers.linear import PackedLinear, can_pack, linear

if TYPE_CHECKING:
    from batchgen.lora.checkpoint import Adapter


@dataclass(frozen=True)
class LoRATarget:
    """A linear an adapter may add to: its decoder layer, input width, and by checkpoint module name the
    output rows each name covers (several names for a packed projection, e.g. q_proj, k_proj, v_proj and
    qkv_proj for the fused qkv_proj)."""

    layer: int
    in_features: int
    parts: dict[str, tuple[int, int]]  # module name -> (first output row, rows)


@dataclass
class Segment:
    start: int  # first row of the flat batch
    end: int
    slot: int


@dataclass
class LoRABatch:
    """The step being run, shared by every LoRALinear of one model: its rows' adapter segments (base-model
    rows are in none)."""

    segments: list[Segment] = field(default_factory=list)


def _gemm(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return PackedLinear(weight) if can_pack(weight) else partial(linear, weight=weight)


@dataclass
class SlotWeights:
    shrink: Callable[[torch.Tensor], torch.Tensor]  # x [n, in] -> [n, ranks of the targeted parts]
    expand: Callable[[torch.Tensor], torch.Tensor]  # -> [n, out]: block-diagonal over the parts


class LoRALinear(nn.Module):
    """`base`'s output plus each segment's adapter term. `slots[i]` holds the adapter in device slot i, or
    None where that adapter does not touch this projection (or the slot is empty)."""

    def __init__(self, base: nn.Module, target: LoRATarget, batch: LoRABatch, num_slots: int):
        super().__init__()
        self.base, self.target, self.batch = base, target, batch
        self.out_features = max(first + rows for first, rows in target.parts.values())
        self.slots: list[SlotWeights | None] = [None] * num_slots

    def load(self, slot: int, adapter: Adapter | None, device: torch.device) -> None:
        """Puts `adapter`'s pairs for this projection into `slot` (None empties it)."""
        pairs = [] if adapter is None else [
            (adapter.modules[key], self.target.parts[key[1]]) for key in adapter.modules
            if key[0] == self.target.layer and key[1] in self.target.parts]
        if not pairs:
            self.slots[slot] = None
            return
        a = torch.cat([w.a for w, _ in pairs]).to(device)
        b = torch.zeros(self.out_features, a.shape[0], dtype=a.dtype, device=device)
        col = 0
        for w, (first, rows) in pairs:
            b[first:first + rows, col:col + w.rank] = w.b
            col += w.rank
        self.slots[slot] = SlotWeights(_gemm(a), _gemm(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        self.add_lora(x, out)
        return out

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> None:
        for seg in self.batch.segments:
            weights = self.slots[seg.slot]
            if weights is not None:
                rows = x[seg.start:seg.end]
                out[seg.start:seg.end] += weights.expand(weights.shrink(rows)).to(out.dtype)
