"""The engine's checks of its options against the model, made before anything heavy is loaded.

LLMEngine makes them when it is built, and `LLM.check_config` makes the same ones without
building anything (for `batchgen validate`): options that cannot work are refused once, each
named, instead of failing every request or the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen import _C, ops
from batchgen.config import ConfigError, ConfigProblem, EngineConfig
from batchgen.engine.model_runner import CacheShape
from batchgen.errors import first_line
from batchgen.models.architectures import architecture, attention_geometry, pick_impl, text_config
from batchgen.models.loader import missing_tokenizer, resolve_model_dir
from batchgen.models.native import missing_weights
from batchgen.models.quantized import checkpoint_quantization
from batchgen.ops import SUPPORTED_HEAD_DIMS


@dataclass(frozen=True)
class ModelPlan:
    """What the options come to for this model."""

    model_dir: Path
    hf_config: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    cache_shape: CacheShape
    model_impl: str  # "native" or "transformers"
    quantization: str | None  # "int8" where asked for or where the checkpoint was quantized ahead


def plan_model(config: EngineConfig) -> ModelPlan:
    """Resolves the options against the model; raises ConfigError naming every option that
    cannot work (FileNotFoundError when there is no model at that path)."""
    model_dir = resolve_model_dir(config.model)
    hf_config = read_hf_config(model_dir)
    try:
        impl = pick_impl(config.model_impl, hf_config)
    except ValueError as e:
        option, message = str(e).split(": ", 1)
        raise ConfigError([ConfigProblem(option, message)]) from None
    geometry = attention_geometry(hf_config)
    no_tokenizer = None if config.skip_tokenizer_init else missing_tokenizer(model_dir)
    problems = [ConfigProblem("model", missing) for missing in (missing_weights(model_dir), no_tokenizer) if missing]
    device = _pick_device(config.device, problems)
    dtype = _pick_dtype(config.dtype, hf_config, device)
    max_model_len = _max_model_len(config.max_model_len, hf_config, problems)
    if geometry.head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(ConfigProblem("model", f"architecture {architecture(hf_config)} has head_dim "
                                               f"{geometry.head_dim}; batchgen's attention kernels take "
                                               f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}"))
    quantization, refused = _quantization(config, hf_config, impl, device, dtype)
    problems += refused
    problems += _image_chunk_problems(config, hf_config)
    shape = CacheShape(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, config.block_size,
                       kv_cache_dtype(config.kv_cache_dtype, dtype))
    if (device.type == "cpu" and config.num_gpu_blocks_override is None
            and (few := too_few_blocks(config.kv_cache_bytes // shape.bytes_per_block, shape))):
        problems.append(few)
    if problems:
        raise ConfigError(problems)
    return ModelPlan(model_dir, hf_config, device, dtype, max_model_len, shape, impl, quantization)



def _quantization(config: EngineConfig, hf_config: Any, impl: str, device: torch.device,
                  dtype: torch.dtype) -> tuple[str | None, list[ConfigProblem]]:
    """The quantization the model will run in, and why it cannot. int8 compute runs batchgen's own CPU kernels
    on float32 or bf16 activations, in the models' plain linear layers (which LoRA replaces), native or through
    the transformers backend; a checkpoint quantized ahead asks for it itself in the native models (transformers
    loads a quantized checkpoint its own way)."""
    try:
        prequantized = checkpoint_quantization(hf_config) if impl == "native" else None
    except ValueError as e:
        return None, [ConfigProblem("model", str(e))]
    quantization = config.quantization or prequantized
    if quantization != "int8":
        return quantization, []
    option = "quantization" if config.quantization else "model"
    mode = "int8" if config.quantization else "the checkpoint's int8 quantization (quantization_config)"
    why = ("runs on CPU only" if device.type != "cpu"
           else "takes float32 or bfloat16 (the activations' dtype)" if dtype not in (torch.float32, torch.bfloat16)
           else "cannot be combined with enable_lora" if config.enable_lora else None)
    return quantization, [ConfigProblem(option, f"{mode} {why}")] if why else []


_FP8_CACHES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for `kv_cache_dtype` (auto: the model's dtype)."""
    return _FP8_CACHES.get(name, model_dtype)


def _image_chunk_problems(config: EngineConfig, hf_config: Any) -> list[ConfigProblem]:
    """Gemma 3's image tokens attend to each other both ways, so a prefill chunk holds an image's tokens whole
    (scheduler._chunk): a step's token budget must hold one image."""
    if getattr(hf_config, "model_type", "") != "gemma3":
        return []
    image_tokens = hf_config.mm_tokens_per_image
    if config.max_num_batched_tokens >= image_tokens:
        return []
    return [ConfigProblem("max_num_batched_tokens", f"{config.max_num_batched_tokens} is less than one image's "
                                                    f"{image_tokens} tokens, which Gemma 3 prefills in one step")]


def too_few_blocks(num_blocks: int, shape: CacheShape) -> ConfigProblem | None:
    if num_blocks >= 2:
        return None
    return ConfigProblem("kv_cache_memory", f"the KV cache budget leaves {max(num_blocks, 0)} blocks of "
                                            f"{shape.bytes_per_block} bytes; raise kv_cache_memory (CPU) or "
                                            "gpu_memory_utilization (CUDA)")


def read_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        problem = ConfigProblem("model", f"cannot read {model_dir / 'config.json'}: {first_line(e)}")
        raise ConfigError([problem]) from None


def _pick_device(name: str, problems: list[ConfigProblem]) -> torch.device:
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif name.startswith("cuda") and not torch.cuda.is_available():
        problems.append(ConfigProblem("device", "cuda was asked for but torch sees no CUDA device"))
        return torch.device("cpu")
    else:
        device = torch.device(name)
    if device.type == "cuda" and (problem := _cuda_kernels_problem(name, device)):
        problems.append(problem)
    return device


def _cuda_kernels_problem(name: str, device: torch.device) -> ConfigProblem | None:
    """Why batchgen._C cannot run on this GPU, found before the weights load: otherwise the first step's kernels
    fail, and every row in it."""
    if not _C.has_cuda():
        return ConfigProblem("device", f"{name} gives this machine's GPU, but batchgen._C was built without its CUDA "
                                       "kernels (a CPU torch or no nvcc at build time): rebuild it (docs/gpu.md, "
                                       "Install) or set device: cpu")
    try:
        _probe_cuda_kernels(device)
    except RuntimeError as e:
        major, minor = torch.cuda.get_device_capability(device)
        return ConfigProblem("device", f"batchgen._C has no kernel this GPU (sm_{major}{minor}) can run "
                                       f"({first_line(e)}): rebuild it with BATCHGEN_CUDA_ARCHS=\"{major}{minor}\" "
                                       "(docs/gpu.md, Install)")
    return None


def _probe_cuda_kernels(device: torch.device) -> None:
    """One cache write on the device: raises where batchgen._C holds no machine code (nor PTX) for this GPU's
    architecture, which would otherwise fail the first step and every row in it."""
    key = torch.zeros(1, 1, 64, device=device)
    cache = torch.zeros(1, 1, 16, 64, device=device)
    ops.reshape_and_cache(key, key, cache, cache.clone(), torch.zeros(1, dtype=torch.int64, device=device))
    torch.cuda.synchronize(device)


def _pick_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16  # CPU float16 GEMMs are slow; bf16 keeps the range and is fast
    return dtype


def _max_model_len(asked: int | None, hf_config: Any, problems: list[ConfigProblem]) -> int:
    limit = text_config(hf_config).max_position_embeddings
    if asked is not None and asked > limit:
        problems.append(ConfigProblem("max_model_len", f"{asked} is more than the model supports ({limit})"))
        return limit
    return asked or limit
