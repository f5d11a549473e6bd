"""Finds a model (Hugging Face directory or .gguf file), builds the native model and loads weights."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import torch

from batchgen.models.architectures import NATIVE_ARCHITECTURES, architecture, layer_windows
from batchgen.models.gguf import convert_gguf
from batchgen.models.llama import LlamaConfig, LlamaForCausalLM

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


def first_line(error: Exception) -> str:
    """An error's first line (transformers' messages run to many), or its type when empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _rope(hf_config) -> tuple[float, dict | None]:
    """rope theta and scaling, from either the transformers 5 `rope_parameters` or the older fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = None if params.get("rope_type", "default") == "default" else params
        return float(params["rope_theta"]), scaling
    return float(getattr(hf_config, "rope_theta", 10000.0)), getattr(hf_config, "rope_scaling", None)


def native_config(hf_config, max_model_len: int | None = None) -> LlamaConfig:
    arch = architecture(hf_config)
    if NATIVE_ARCHITECTURES.get(arch) != "llama":
        raise ValueError(f"architecture {arch!r} is not of the Llama family")
    theta, scaling = _rope(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return LlamaConfig(
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
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_windows=tuple(layer_windows(hf_config)),
    )


def missing_weights(model_dir: Path) -> str | None:
    """Why the directory cannot give weights (None if it has safetensors files)."""
    if glob.glob(str(model_dir / "*.safetensors")):
        return None
    return f"model directory {str(model_dir)!r} has no *.safetensors files"


def _checkpoint_tensors(model_dir: Path):
    from safetensors import safe_open

    if missing := missing_weights(model_dir):
        raise ValueError(missing)
    for file in sorted(glob.glob(str(model_dir / "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
               model_impl: str = "native") -> torch.nn.Module:
    """The model the runner drives: `model(input_ids, positions, meta)` -> hidden states, `compute_logits`,
    `attention_layers()` and `vocab_size`; `model_impl` "native" or "transformers" (see architectures.pick_impl)."""
    if model_impl == "transformers":
        from batchgen.models.transformers_backend import load_transformers_model

        return load_transformers_model(model_dir, hf_config, dtype, device)
    return _load_llama(model_dir, hf_config, dtype, device, max_model_len)


def _load_llama(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device,
                max_model_len: int) -> LlamaForCausalLM:
    cfg = native_config(hf_config, max_model_len)
    with torch.device("meta"):  # no random init of parameters the checkpoint overwrites (~1.7 s for 135M)
        model = LlamaForCausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    model.rotary.reset_table()
    model.load_weights(_checkpoint_tensors(model_dir))
    model.eval().requires_grad_(False)
    model.pack_weights()
    return model
