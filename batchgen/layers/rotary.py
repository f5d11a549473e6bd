"""Rotary position embedding (the rotate-half layout Llama uses), with linear and Llama 3 frequency scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from batchgen import ops

ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3 keeps high frequencies, divides low ones by `factor`, and blends in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


@dataclass(frozen=True)
class Rope:
    """What every layer needs to rotate a step's q and k: the tokens' positions and the table."""

    positions: torch.Tensor  # int64 [T]
    cos_sin: torch.Tensor  # [max_position, head_dim], cos then sin of each position's angles


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        scaling = self.scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        angles = torch.arange(self.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return torch.cat([angles.cos(), angles.sin()], dim=-1)

    def reset_table(self) -> None:
        """Recomputes the table in place, in the buffer's dtype and device (after `Module.to_empty`)."""
        with torch.device("cpu"):
            self.cos_sin.copy_(self._table())

    def angles(self, positions: torch.Tensor) -> Rope:
        return Rope(positions, self.cos_sin)


def rotate(x: torch.Tensor, rope: Rope) -> None:
    """Rotates x `[T, H, D]` in place, any number of heads (q and k together), by the step's angles."""
    ops.rotary_embedding(rope.positions, x, rope.cos_sin)
