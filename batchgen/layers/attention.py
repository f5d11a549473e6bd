"""Paged attention over a flat batch: decodes first, then prefill chunks.

The model runner builds one `AttentionMetadata` per step; every layer uses it with its own cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen import ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode_tokens: int  # the first rows of the batch, one token per sequence
    decode_block_tables: torch.Tensor | None  # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None  # int32 [num_decodes]
    # int32 [num_decodes]: the request of each decode, when some request decodes several samples
    # (side by side), whose shared prompt blocks the kernel then reads once for all of them
    decode_seq_groups: torch.Tensor | None
    prefill_block_tables: torch.Tensor | None  # int32 [num_prefills, max_blocks]
    prefill_seq_lens: torch.Tensor | None  # int32 [num_prefills]
    prefill_query_start_loc: torch.Tensor | None  # int32 [num_prefills + 1], rows after the decodes


@dataclass(frozen=True)
class AttentionVariant:
    """How a layer's scores differ from plain causal softmax(scale * q.k): a query at position p sees keys
    p - sliding_window < j <= p (0: all), and a score s becomes cap * tanh(s / cap) (0: unchanged)."""

    scale: float
    sliding_window: int = 0
    logits_soft_cap: float = 0.0


class PagedAttention(nn.Module):
    """Writes the step's K/V into this layer's cache, then attends through the block tables."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int = 0,
                 logits_soft_cap: float = 0.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.variant = AttentionVariant(scale, sliding_window, logits_soft_cap)
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    @property
    def scale(self) -> float:
        return self.variant.scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]."""
        return paged_attention(q, k, v, self.key_cache, self.value_cache, meta, self.variant)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, variant: AttentionVariant) -> torch.Tensor:
    """One layer's step: K/V into the cache, then the decode rows and the prefill rows."""
    ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    d = meta.num_decode_tokens
    if d:
        ops.paged_attention_decode(
            q[:d], key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, variant.scale,
            out=out[:d], seq_groups=meta.decode_seq_groups, sliding_window=variant.sliding_window,
            logits_soft_cap=variant.logits_soft_cap)
    if d < q.shape[0]:
        ops.paged_attention_prefill(
            q[d:], key_cache, value_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
            meta.prefill_query_start_loc, variant.scale, out=out[d:], sliding_window=variant.sliding_window,
            logits_soft_cap=variant.logits_soft_cap)
    return out
