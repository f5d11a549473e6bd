"""Finds a model (Hugging Face directory or .gguf file), builds the native model and loads weights."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import torch

from batchgen.errors import first_line
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
from batchgen.models.gguf import convert_gguf
from batchgen.models.llama import LlamaConfig, LlamaForCausalLM
from batchgen.models.quantized import (
    add_weight_scales,
    checkpoint_quantization,
    dequantize_heads,
    int8_checkpoint_tensors,
    quantized_projections,
)

# Files that hold a tokenizer's vocabulary, in the formats transformers loads for these models.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken", "*spiece*.model",
                   "sentencepiece*.model")


def resolve_model_dir(model: str | os.PathLike) -> Path:
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model path {str(path)!r} is a file but not a .gguf file")
        return convert_gguf(path)
    if not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return path


def missing_tokenizer(model_dir: Path) -> str | None:
    """Why the directory cannot give a tokenizer (None if it has one's files)."""
    if any(next(model_dir.glob(pattern), None) for pattern in TOKENIZER_FILES):
        return None
    return (f"model directory {str(model_dir)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
            "add them, or pass skip_tokenizer_init=True to give token ids and get token ids back")


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer; a one-line ValueError when it has none or it cannot be loaded."""
    from transformers import AutoTokenizer

    missing = missing_tokenizer(model_dir)
    if missing:
        raise ValueError(missing)
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot load the tokenizer of {str(model_dir)!r}: {first_line(e)}") from None


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


def load_model(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
               model_impl: str = "native", for_lora: bool = False, quantization: str | None = None) -> torch.nn.Module:
    """The model the runner drives: `model(input_ids, positions, meta)` -> hidden states, `compute_logits` (where
    `has_lm_head`), `compute_scores` (a classifier's head, where `class_labels` is set), `attention_layers()`,
    `vocab_size` and `hidden_size`; `model_impl` "native" or "transformers" (see architectures.pick_impl);
    `for_lora`: packed for LoRA layers, `quantization`: "int8" or None (native models only, see
    LlamaForCausalLM.pack_weights); a checkpoint quantized ahead (models/quantized.py) runs in its mode whatever
    `quantization` says (preflight refuses a contradiction)."""
    if NATIVE_ARCHITECTURES.get(decoder_architecture(hf_config)) == "vision":
        from batchgen.models.vision.loader import load_vision_model

        return load_vision_model(model_dir, hf_config, dtype, device, max_model_len, for_lora, quantization)
    if model_impl == "transformers":
        from batchgen.models.transformers_backend import load_transformers_model

        return load_transformers_model(model_dir, hf_config, dtype, device)
    return _load_native(model_dir, hf_config, dtype, device, max_model_len, for_lora, quantization)


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


def _load_native(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, for_lora: bool = False, quantization: str | None = None) -> LlamaForCausalLM:
    cfg = native_config(hf_config, max_model_len)
    prequantized = checkpoint_quantization(hf_config)
    model = empty_native(cfg, dtype, device, quantized_projections(model_dir) if prequantized else None)
    model.load_weights(int8_checkpoint_tensors(checkpoint_tensors(model_dir)) if prequantized
                       else checkpoint_tensors(model_dir))
    model.eval().requires_grad_(False)
    if prequantized:
        dequantize_heads(model)
    model.pack_weights(for_lora, quantization or prequantized)
    return model
