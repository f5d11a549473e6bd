"""Finds a model (Hugging Face directory or .gguf file), builds the native model and loads weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from batchgen.errors import first_line
from batchgen.models.architectures import (
    NATIVE_ARCHITECTURES,
    decoder_architecture,
)
from batchgen.models.gguf import convert_gguf
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.native import checkpoint_tensors, empty_native, native_config
from batchgen.models.quantized import (
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


def load_model(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
               model_impl: str = "native", for_lora: bool = False, quantization: str | None = None) -> torch.nn.Module:
    """The model the runner drives: `model(input_ids, positions, meta)` -> hidden states, `compute_logits` (where
    `has_lm_head`), `compute_scores` (a classifier's head, where `class_labels` is set), `attention_layers()`,
    `vocab_size` and `hidden_size`; `model_impl` "native" or "transformers" (see architectures.pick_impl);
    `for_lora`: packed for LoRA layers, `quantization`: "int8" or None (LlamaForCausalLM.pack_weights,
    TransformersModel.pack_weights); a checkpoint quantized ahead (models/quantized.py) runs in its mode whatever
    `quantization` says (preflight refuses a contradiction)."""
    if NATIVE_ARCHITECTURES.get(decoder_architecture(hf_config)) == "vision":
        from batchgen.models.vision.loader import load_vision_model

        return load_vision_model(model_dir, hf_config, dtype, device, max_model_len, for_lora, quantization)
    if model_impl == "transformers":
        from batchgen.models.transformers_backend import load_transformers_model

        return load_transformers_model(model_dir, hf_config, dtype, device, quantization)
    return _load_native(model_dir, hf_config, dtype, device, max_model_len, for_lora, quantization)


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
