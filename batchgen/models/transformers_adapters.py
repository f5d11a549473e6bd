"""Attention for transformers implementations that do not call transformers' attention interface.

Falcon's attention (before transformers 5.25) computes its scores inline; its forward is replaced
by one that keeps Falcon's own projections, head split and rotary embedding and hands q/k/v to the
attention function instead
(models with ALiBi are refused before this: see architectures.transformers_refusal).
"""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn


def adapt_attention(hf_model: nn.Module, attention: Callable) -> None:
    model_type = hf_model.config.model_type
    if model_type != "falcon":
        raise ValueError(f"no attention adapter for model type {model_type!r}")
    from transformers.models.falcon.modeling_falcon import FalconAttention, apply_rotary_pos_emb

    if not hasattr(FalconAttention, "_split_heads"):  # transformers 5.25+: Falcon calls the attention interface
        return

    # `alibi` and `attention_mask` by keyword or not at all: transformers 5.25 no longer passes alibi
    # (ALiBi Falcons are refused before this), older versions pass both by position.
    def forward(self, hidden_states, alibi=None, attention_mask=None, position_ids=None, layer_past=None,
                use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
        batch, length, _ = hidden_states.shape
        query, key, value = self._split_heads(self.query_key_value(hidden_states))  # [B, T, heads, D]
        if self.new_decoder_architecture:  # keys and values come broadcast to every query head: one per group
            group = self.num_heads // self.config.num_kv_heads
            key, value = key[:, :, ::group], value[:, :, ::group]
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        out, _ = attention(self, query, key, value, None, scaling=self.inv_norm_factor)
        return self.dense(out.reshape(batch, length, self.num_heads * self.head_dim)), None

    for module in hf_model.modules():
        if isinstance(module, FalconAttention):
            module.forward = types.MethodType(forward, module)

