"""Gemma 2 and Gemma 3 (text) on paged attention, built from the Llama family's layers.

What Gemma changes: RMSNorm scales by (1 + w) (folded into the weights at load), the embeddings are
multiplied by sqrt(hidden_size), the MLP is gelu(tanh) gated, each sublayer's output is normalised
again before it joins the residual stream (four norms a layer), attention scales by
query_pre_attn_scalar ** -0.5, sliding-window layers alternate with global ones, and Gemma 2
soft-caps the attention scores and the final logits. Gemma 3 adds q/k norms and a rotary base of its
own for the sliding layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from batchgen.layers.attention import AttentionMetadata
from batchgen.layers.elementwise import gelu_tanh, invariant
from batchgen.layers.rotary import Rope, RotaryEmbedding
from batchgen.models.llama import MLP, Attention, LlamaConfig, LlamaForCausalLM, RMSNorm


@dataclass
class GemmaConfig(LlamaConfig):
    final_logit_soft_cap: float = 0.0
    local_rope_theta: float | None = None  # Gemma 3's sliding layers; None: the global rotary
    local_rope_scaling: dict | None = None


class GeluMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(invariant(gelu_tanh, gate) * up)

    def pack(self, quantization: str | None = None) -> None:
        """The fused SiLU GEMMs do not apply: gate_up_proj packs (or quantizes) as a plain projection."""


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, window: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GeluMLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer: returns the MLP's output not yet added to the residual stream."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rope, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: GemmaConfig):
        super().__init__(cfg)
        windows = cfg.sliding_windows or (0,) * cfg.num_layers
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, window) for window in windows)
        self.local_rotary = (None if cfg.local_rope_theta is None else
                             RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.local_rope_theta,
                                             cfg.local_rope_scaling))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.run_layers(self.scaled_embeddings(input_ids), positions, meta)

    def scaled_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder on input embeddings `x` (Gemma 3's images are placed after the scaling)."""
        global_rope = self.rotary.angles(positions)
        local_rope = global_rope if self.local_rotary is None else self.local_rotary.angles(positions)
        residual = None
        for layer in self.layers:
            rope = local_rope if layer.self_attn.attn.variant.sliding_window else global_rope
            x, residual = layer(x, residual, rope, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if cap := self.cfg.final_logit_soft_cap:
            logits = invariant(torch.tanh, logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Gemma's norms scale by (1 + w): the weights take the 1 once here, computed in float32."""
        super().load_weights(weights)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(module.weight.float() + 1)

    def _build_decoder_stack(self) -> None:
        """The fused stack runs Llama's layers only."""
