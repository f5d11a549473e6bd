"""Checkpoints quantized ahead: compressed-tensors' int8 W8A8, as llm-compressor writes it and vLLM loads it.

Such a checkpoint holds each quantized projection's weight as int8 values with a `weight_scale` (one per
output feature, or one for the tensor), and its config asks for the activations to be quantized per token
on the fly, symmetrically: the definition of batchgen's int8 mode (docs/int8.md), so the layers run on the
int8 GEMMs with the checkpoint's own values and scales instead of values batchgen would round itself. Any
other scheme (static or asymmetric activations, groups, 4-bit or fp8 values, sparsity, a quantized KV cache)
is refused in one line naming what it asks for.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized")
ZERO_POINTS = ("weight_zero_point", "input_zero_point")


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The quantization a checkpoint was saved in, as batchgen runs it: "int8" for compressed-tensors int8 W8A8,
    None for a checkpoint that is not quantized; a one-line ValueError for one batchgen cannot run."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method != METHOD:
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported; batchgen runs "
                         f"{METHOD} int8 W8A8 checkpoints (docs/int8.md)")
    for key, why in (("sparsity_config", "sparsity"), ("kv_cache_scheme", "a quantized KV cache"),
                     ("transform_config", "transforms")):
        if config.get(key):
            raise ValueError(f"quantization_config: {key} ({why}) is not supported")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"quantization_config: quantization_status {status!r}: batchgen reads compressed "
                         "checkpoints (int8 values and their scales)")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config: config_groups is empty")
    for name, group in groups.items():
        problem = _group_problem(group, config.get("format"))
        if problem:
            raise ValueError(f"quantization_config: config_groups.{name}: {problem}; batchgen runs int8 weights "
                             "per channel or tensor with int8 activations per token, dynamic and symmetric")
    return "int8"


def _group_problem(group: dict, default_format: str | None) -> str | None:
    """Why one config group is not int8 W8A8 as batchgen runs it (None: it is)."""
    fmt = group.get("format") or default_format
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if fmt not in FORMATS:
        return f"format {fmt!r}"
    if group.get("output_activations"):
        return "output_activations are quantized"
    if inputs is None:
        return "weight-only (no input_activations)"
    for what, args, strategies in (("weights", weights, ("channel", "tensor")), ("input_activations", inputs,
                                                                                 ("token",))):
        kind = f"{args.get('num_bits')}-bit {args.get('type')}"
        if kind != "8-bit int":
            return f"{what} are {kind}"
        if not args.get("symmetric", True):
            return f"{what} are asymmetric"
        if args.get("strategy") not in strategies:
            return f"{what} strategy {args.get('strategy')!r}"
    if inputs.get("dynamic") is not True:
        return "input_activations are static (input_scale)"
    if weights.get("dynamic"):
        return "weights are dynamic"
    return None


def quantized_projections(model_dir: Path) -> set[str]:
    """The checkpoint's names of the projections it holds in int8 ("model.layers.0.self_attn.q_proj"): those
    with a weight_scale. Reads the files' headers only."""
    from safetensors import safe_open

    names = set()
    for file in sorted(glob.glob(str(model_dir / "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            names |= {key.removesuffix(".weight_scale") for key in f.keys() if key.endswith(".weight_scale")}
    return names


def add_weight_scales(model: nn.Module, projections: Iterable[str]) -> None:
    """Gives the linear holding each of the checkpoint's projections (a fused one for q/k/v and gate/up) a
    float32 `weight_scale` [out_features, 1] for load_weights to fill like the weight: the int8 values go into
    the weight itself, which holds them exactly in any float dtype."""
    for name in {model.native_name(f"{p}.weight")[0].removesuffix(".weight") for p in projections}:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"checkpoint quantizes {name!r}, which has no place in the model") from None
        if not isinstance(module, nn.Linear):
            raise ValueError(f"checkpoint quantizes {name!r}; batchgen runs int8 on linear projections only")
        weight = module.weight
        module.weight_scale = nn.Parameter(torch.empty(weight.shape[0], 1, dtype=torch.float32,
                                                       device=weight.device), requires_grad=False)


def int8_checkpoint_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as load_weights takes them: weight scales as columns ([out_features, 1], however
    the writer shaped them), less the zero points some writers keep for symmetric schemes (all zero: a
    symmetric scheme has none; a nonzero one is refused)."""
    for name, tensor in tensors:
        kind = name.rsplit(".", 1)[-1]
        if kind in ZERO_POINTS:
            if bool(tensor.any()):
                raise ValueError(f"checkpoint tensor {name!r} is not zero: asymmetric quantization is not supported")
            continue
        yield name, tensor.reshape(-1, 1) if kind == "weight_scale" else tensor


@torch.no_grad()
def dequantize_heads(model: nn.Module) -> None:
    """Turns each int8 weight outside the decoder layers (a head the checkpoint quantized) back into the
    model's dtype, w = q * scale: the head runs in the model's dtype in the int8 mode (docs/int8.md)."""
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale") and not name.startswith("layers."):
            weight = module.weight
            weight.copy_((weight.float() * module.weight_scale).to(weight.dtype))
            del module.weight_scale
