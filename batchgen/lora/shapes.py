"""The projections a native model offers LoRA, from its config alone: what `batchgen validate` checks an
adapter's shapes against without loading the model (the engine checks the same against the loaded model's
`lora_targets`)."""

from __future__ import annotations

from typing import Any

from batchgen.models.architectures import attention_geometry, text_config


def projection_shapes(hf_config: Any) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, checkpoint module name) -> (in_features, out_features), fused names (qkv_proj, gate_up_proj)
    beside their parts."""
    geometry = attention_geometry(hf_config)
    cfg = text_config(hf_config)
    hidden, ffn = cfg.hidden_size, cfg.intermediate_size
    q, kv = geometry.num_heads * geometry.head_dim, geometry.num_kv_heads * geometry.head_dim
    per_layer = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                 "qkv_proj": (hidden, q + 2 * kv), "o_proj": (q, hidden), "gate_proj": (hidden, ffn),
                 "up_proj": (hidden, ffn), "gate_up_proj": (hidden, 2 * ffn), "down_proj": (ffn, hidden)}
    return {(layer, name): shape for layer in range(geometry.num_layers) for name, shape in per_layer.items()}
