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
    # int32 [prefill rows], only in steps that feed image tokens attending both ways (Gemma 3): the last key
    # position each prefill row sees (its own for text, its image's last for an image token); None: causal
    prefill_key_limit: torch.Tensor | None = None


@dataclass(frozen=True)
class KVScales:
    """An fp8 KV cache's float32 scales per kv head (`[num_kv_heads]`): an element is stored as
    round(x / scale) and reads back as byte * scale."""

    k: torch.Tensor
    v: torch.Tensor


def fp8_kv_scales(num_kv_heads: int, device: torch.device, checkpoint: dict[str, torch.Tensor] | None = None
                  ) -> KVScales:
    """A layer's scales: the checkpoint's `k_scale`/`v_scale` where it ships them (one per tensor, spread over
    the heads, or one per kv head), else 1.0 (vLLM's default). Fixed before any request, so a sequence's
    cached bytes never depend on what else ran (batch invariance)."""
    def one(name: str) -> torch.Tensor:
        given = (checkpoint or {}).get(name)
        values = torch.ones(num_kv_heads) if given is None else given.detach().float().reshape(-1).cpu()
        if values.numel() == 1:
            values = values.expand(num_kv_heads)
        if values.numel() != num_kv_heads or not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"checkpoint {name} must hold 1 or {num_kv_heads} finite positive values, got "
                             f"{values.tolist()}")
        return values.contiguous().to(device)

    return KVScales(one("k_scale"), one("v_scale"))


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
        self.kv_scales: KVScales | None = None  # an fp8 cache's, set with the caches
        self.checkpoint_kv_scales: dict[str, torch.Tensor] = {}  # `k_scale`/`v_scale` the checkpoint ships

    @property
    def scale(self) -> float:
        return self.variant.scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]."""
        return paged_attention(q, k, v, self.key_cache, self.value_cache, meta, self.variant, self.kv_scales)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, variant: AttentionVariant,
                    scales: KVScales | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's step: K/V into the cache, then the decode rows and the prefill rows. `scales`: an fp8
    cache's (None for caches of the activations' dtype). `sinks`: the layer's attention sinks, float32
    `[num_heads]` on the query's device (ops.paged_attention_decode), or None."""
    k_scale, v_scale = (scales.k, scales.v) if scales is not None else (None, None)
    ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
    out = torch.empty_like(q)
    d = meta.num_decode_tokens
    if d:
        ops.paged_attention_decode(
            q[:d], key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, variant.scale,
            out=out[:d], seq_groups=meta.decode_seq_groups, sliding_window=variant.sliding_window,
            logits_soft_cap=variant.logits_soft_cap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    if d < q.shape[0]:
        ops.paged_attention_prefill(
            q[d:], key_cache, value_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
            meta.prefill_query_start_loc, variant.scale, out=out[d:], sliding_window=variant.sliding_window,
            logits_soft_cap=variant.logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
            key_limit=meta.prefill_key_limit, sinks=sinks)
    return out
