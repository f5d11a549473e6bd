"""The native models' pieces that every loader shares: a native config from a Hugging Face config, a checkpoint's
tensors, an empty native model to load them into (the text models' loader and the vision-language one both build
on them)."""

from __future__ import annotations

import glob
from pathlib import Path

import torch

from batchgen.layers.rotary import RotaryEmbedding
from batchgen.models.architectures import (
    NATIVE_ARCHITECTURES,
    class_labels,
    decoder_architecture,
    is_classifier,
    layer_windows,
    rope,
)
from batchgen.models.gemma import GemmaConfig, GemmaForCausalLM
from batchgen.models.llama import LlamaConfig, LlamaForCausalLM
from batchgen.models.quantized import add_weight_scales


def native_config(hf_config, max_model_len: int | None = None, arch: str | None = None) -> LlamaConfig:
    """The native model's config (a GemmaConfig for the Gemma family); a classifier's has its labels. `arch`:
    the decoder's architecture where the config does not name it (a vision-language model's text config)."""
    arch = arch or decoder_architecture(hf_config)
    family = NATIVE_ARCHITECTURES.get(arch)
    if family is None:
        raise ValueError(f"architecture {arch!r} has no native implementation")
    theta, scaling = rope(hf_config, "full_attention")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    common = dict(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=min(hf_config.max_position_embeddings, max_model_len or hf_config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        sliding_windows=tuple(layer_windows(hf_config)),
        rotary_dim=_rotary_dim(hf_config, head_dim),
        class_labels=tuple(class_labels(hf_config)) if is_classifier(hf_config) else (),
    )
    if family == "llama":
        return LlamaConfig(**common)
    local_theta, local_scaling = rope(hf_config, "sliding_attention")
    return GemmaConfig(
        **common,
        attn_scale=hf_config.query_pre_attn_scalar**-0.5,
        attn_soft_cap=getattr(hf_config, "attn_logit_softcapping", None) or 0.0,
        final_logit_soft_cap=getattr(hf_config, "final_logit_softcapping", None) or 0.0,
        local_rope_theta=local_theta if arch == "Gemma3ForCausalLM" else None,
        local_rope_scaling=local_scaling,
    )


def _rotary_dim(hf_config, head_dim: int) -> int | None:
    """Phi-3's partial rotary embedding: the leading dims it turns (None: all)."""
    factor = getattr(hf_config, "partial_rotary_factor", None)
    return int(head_dim * factor) if factor and factor < 1 else None


def missing_weights(model_dir: Path) -> str | None:
    """Why the directory cannot give weights (None if it has safetensors files)."""
    if glob.glob(str(model_dir / "*.safetensors")):
        return None
    return f"model directory {str(model_dir)!r} has no *.safetensors files"


def checkpoint_tensors(model_dir: Path):
    from safetensors import safe_open

    if missing := missing_weights(model_dir):
        raise ValueError(missing)
    for file in sorted(glob.glob(str(model_dir / "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def empty_native(cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
                 weight_scales: dict | None = None) -> LlamaForCausalLM:
    """The native model of `cfg`, its weights uninitialised (`weight_scales`: an int8 checkpoint's
    `quantized_projections`, which get places of their own)."""
    model_class = GemmaForCausalLM if isinstance(cfg, GemmaConfig) else LlamaForCausalLM
    with torch.device("meta"):  # no random init of parameters the checkpoint overwrites (~1.7 s for 135M)
        model = model_class(cfg).to(dtype)
    if weight_scales is not None:
        add_weight_scales(model, weight_scales)
    model.to_empty(device=device)
    for rotary in model.modules():
        if isinstance(rotary, RotaryEmbedding):
            rotary.reset_table()
    return model
