"""Tiny random models of architectures beyond the Llama family, from transformers configs (2 layers,
4 query and 2 KV heads of 64, hidden 256), saved with conftest's tiny tokenizer. Sizes that change a
model's attention are small enough to matter in short prompts: sliding windows of 16-40 tokens,
Gemma 2's soft caps, Gemma's and Granite's attention scales, GPT-OSS's attention sinks; and mixtures of experts
of 4-8 experts."""

from __future__ import annotations

import torch
from conftest import _tiny_tokenizer, save_random_model

SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=1024)
KV = dict(num_key_value_heads=2)
ALTERNATING = ["sliding_attention", "full_attention"]
GEMMA3_GLOBAL_ROPE = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}  # as Gemma 3 4B's


def _configs(tf, tokens: dict) -> dict:
    """arch -> (config, model class); `tokens`: the vocabulary size and special token ids."""
    gemma = dict(SIZES, **KV, **tokens, head_dim=64, hidden_activation="gelu_pytorch_tanh")
    return {
        "gemma2": (tf.Gemma2Config(**gemma, query_pre_attn_scalar=80, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=3.0, sliding_window=16, layer_types=ALTERNATING),
                   tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig(**gemma, query_pre_attn_scalar=80, sliding_window=16, layer_types=ALTERNATING,
                                       rope_parameters={"full_attention": GEMMA3_GLOBAL_ROPE,
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0}}),
                   tf.Gemma3ForCausalLM),
        "phi3": (tf.Phi3Config(**SIZES, **KV, **tokens, partial_rotary_factor=0.5, sliding_window=None),
                 tf.Phi3ForCausalLM),
        "olmo2": (tf.Olmo2Config(**SIZES, **KV, **tokens), tf.Olmo2ForCausalLM),
        "granite": (tf.GraniteConfig(**SIZES, **KV, **tokens, attention_multiplier=0.1,
                                     embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
                    tf.GraniteForCausalLM),
        "gpt_neox": (tf.GPTNeoXConfig(**SIZES, **tokens, rotary_pct=0.25, use_parallel_residual=True),
                     tf.GPTNeoXForCausalLM),
        "starcoder2": (tf.Starcoder2Config(**SIZES, **KV, **tokens, sliding_window=40),
                       tf.Starcoder2ForCausalLM),
        "cohere": (tf.CohereConfig(**SIZES, **KV, **tokens, logit_scale=0.5), tf.CohereForCausalLM),
        "falcon": (tf.FalconConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                   new_decoder_architecture=True, alibi=False, bias=False, **tokens,
                                   max_position_embeddings=1024), tf.FalconForCausalLM),
        "mistral_window": (tf.MistralConfig(**SIZES, **KV, head_dim=64, **tokens, sliding_window=24),
                           tf.MistralForCausalLM),
        # Mixtures of experts (layers/experts.py): routers of F.linear over their own weight (Mixtral, Qwen3-MoE),
        # an nn.Linear subclass with its own forward (Phi-3.5-MoE), a gate that reads its linear's dtype (Hunyuan).
        "mixtral": (tf.MixtralConfig(**SIZES, **KV, **tokens, num_local_experts=8, num_experts_per_tok=2),
                    tf.MixtralForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig(**SIZES, **KV, **tokens, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=128), tf.Qwen3MoeForCausalLM),
        "phimoe": (tf.PhimoeConfig(**SIZES, **KV, **tokens, num_local_experts=4, num_experts_per_tok=2),
                   tf.PhimoeForCausalLM),
        "hunyuan_moe": (tf.HunYuanMoEV1Config(**SIZES, **KV, **tokens, head_dim=64, num_experts=4, moe_topk=2),
                        tf.HunYuanMoEV1ForCausalLM),
        # Attention sinks, a window on every other layer, experts with biases and a clamped SwiGLU (per-expert loop).
        "gpt_oss": (tf.GptOssConfig(**SIZES, **KV, **tokens, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=16, layer_types=ALTERNATING), tf.GptOssForCausalLM),
        # A shared expert beside the routed ones, weighed by a linear of one output (not in MOE: tests/test_moe.py).
        "qwen2_moe": (tf.Qwen2MoeConfig(**SIZES, **KV, **tokens, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=128, shared_expert_intermediate_size=128),
                      tf.Qwen2MoeForCausalLM),
    }


MOE = ["mixtral", "qwen3_moe", "phimoe", "hunyuan_moe", "gpt_oss"]
ZOO = ["gemma2", "gemma3", "phi3", "olmo2", "granite", "gpt_neox", "starcoder2", "cohere", "falcon",
       "mistral_window", *MOE]


def build_zoo_model(path, arch: str, seed: int = 0):
    import transformers as tf

    tokenizer = _tiny_tokenizer()
    tokens = {"vocab_size": len(tokenizer), **{name: getattr(tokenizer, name)
                                               for name in ("bos_token_id", "eos_token_id", "pad_token_id")}}
    config, cls = _configs(tf, tokens)[arch]
    return save_random_model(path, cls, config, tokenizer, seed, _large_sinks if arch == "gpt_oss" else None)


def _large_sinks(model) -> None:
    """Attention sinks from -3 to 3 (the default init's are ~0.02: too small to change a token), some heads
    giving the sink most of their weight."""
    for layer in model.model.layers:
        sinks = layer.self_attn.sinks
        sinks.copy_(torch.linspace(-3.0, 3.0, sinks.numel())[torch.randperm(sinks.numel())])


FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1; codes 8-15 are their negatives


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [experts, out, in] in MXFP4 as GPT-OSS's checkpoints hold it: (blocks uint8 [experts, out, in / 32,
    16], two E2M1 codes a byte, the even element in the low nibble; scales uint8 [experts, out, in / 32], a power of
    two's exponent + 127 per 32 elements; the values they decode to, float32 [experts, out, in])."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    index = (scaled.abs()[..., None] - FP4_MAGNITUDES).abs().argmin(-1)
    codes = index + 8 * (scaled < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    values = torch.where(scaled < 0, -1.0, 1.0) * FP4_MAGNITUDES[index] * torch.exp2(exponent)[..., None]
    return blocks, (exponent + 127).to(torch.uint8), values.reshape(weight.shape)


def save_mxfp4_gpt_oss(source, path) -> dict[str, torch.Tensor]:
    """The GPT-OSS at `source` (build_zoo_model) saved at `path` as the released checkpoints are: its experts'
    projections in MXFP4 (`*_blocks`, `*_scales`), the rest as it was, `quantization_config` naming mxfp4. Returns
    each expert weight's decoded values, in the model's layout ([experts, in, out])."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    source, path = Path(source), Path(path)
    shutil.copytree(source, path)
    tensors = load_file(source / "model.safetensors")
    decoded = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, values = mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        decoded[name] = values.transpose(1, 2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return decoded

