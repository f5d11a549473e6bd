"""Reads a PEFT LoRA directory and checks it against the base model, refusing in one line what batchgen
cannot apply: other PEFT methods, DoRA, trained biases or whole modules, adapters on the embeddings or the
LM head, modules the model does not have, and shapes that are not the model's."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.errors import first_line
from batchgen.layers.lora import LoRAWeights
from batchgen.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter's own name on save;
# the decoder's own name is model, gpt_neox, transformer, ...); a vision-language model's decoder is
# model.language_model (transformers >= 4.52) or language_model.model (before)
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.)?(?:\w+\.)?"
                     r"layers\.(\d+)\.(?:\w+)\.(\w+)\.lora_([AB])\.weight$")
_HEAD_MODULES = ("embed_tokens", "lm_head", "wte", "word_embeddings")
# the vision side of a vision-language model (LLaVA's, Qwen2-VL's, Idefics3's, Mistral 3's module names)
_VISION_MODULES = ("vision_tower", "visual", "vision_model", "multi_modal_projector", "connector")


class AdapterError(ValueError):
    """An adapter batchgen cannot apply; its message is one line naming the adapter."""


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    modules: dict[tuple[int, str], LoRAWeights]  # (layer, checkpoint module name, e.g. "q_proj") -> weights

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())


def load_adapter(request: LoRARequest, shapes: dict[tuple[int, str], tuple[int, int]],
                 dtype: torch.dtype) -> Adapter:
    """The adapter of `request`, checked against `shapes` ((layer, module name) -> (in_features,
    out_features) of every projection the model can add a low-rank term to), in `dtype` on the CPU."""
    refuse = _refusal(request)
    path = Path(request.lora_path).expanduser()
    config = read_config(request)
    raw = _read_tensors(path, refuse)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        match = _TENSOR.match(name)
        if match is None:
            raise refuse(_misplaced(name))
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[half] = tensor
    if not pairs:
        raise refuse("its weights file holds no lora_A/lora_B tensors")
    known = {module for _, module in shapes}
    num_layers = 1 + max(layer for layer, _ in shapes)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    modules = {}
    for (layer, module), pair in sorted(pairs.items()):
        if module not in known:
            raise refuse(f"targets {module!r}, which this model does not have (LoRA applies to: "
                         f"{', '.join(sorted(known))})")
        if layer >= num_layers:
            raise refuse(f"has weights for layer {layer}; the base model has {num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise refuse(f"layer {layer} {module} has lora_{''.join(pair)} but not its pair")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[(layer, module)]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
            raise refuse(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                         f"the base model's [{out_features}, {in_features}] projection (another base model?)")
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        modules[(layer, module)] = LoRAWeights(a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return Adapter(request, modules)


def _refusal(request: LoRARequest):
    def refuse(why: str) -> AdapterError:
        return AdapterError(f"lora_request: adapter {request.lora_name!r} ({request.lora_path}): {why}")

    return refuse


def read_config(request: LoRARequest) -> dict:
    """The adapter's `adapter_config.json`, refused (AdapterError) when it describes what batchgen cannot apply
    or no weights file is beside it."""
    refuse = _refusal(request)
    path = Path(request.lora_path).expanduser()
    if not (path / CONFIG_FILE).is_file():
        raise refuse(f"no {CONFIG_FILE} in that directory" if path.is_dir() else "no such directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise refuse(f"cannot read {CONFIG_FILE}: {e}") from None
    if why := _unsupported(config):
        raise refuse(why)
    if not any((path / file).is_file() for file in WEIGHT_FILES):
        raise refuse(f"no {' or '.join(WEIGHT_FILES)} in that directory")
    return config


def _unsupported(config: dict) -> str | None:
    """Why a config describes an adapter batchgen cannot apply, or None."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    checks = [
        (peft_type != "LORA", f"is a {peft_type} adapter; batchgen applies LoRA adapters only"),
        (config.get("use_dora"), "is a DoRA adapter (use_dora), which batchgen does not apply"),
        (config.get("modules_to_save"), f"trains whole modules too (modules_to_save: {config.get('modules_to_save')}), "
                                        "which batchgen does not apply"),
        (config.get("bias", "none") != "none" or config.get("lora_bias"), "trains biases (bias / lora_bias), "
                                                                           "which batchgen does not apply"),
        (config.get("fan_in_fan_out"), "stores transposed weights (fan_in_fan_out), which batchgen does not read"),
        (config.get("alpha_pattern"), "has per-module alphas (alpha_pattern), which batchgen does not apply"),
        (config.get("layer_replication"), "replicates layers (layer_replication), which batchgen does not apply"),
        (any(t in _HEAD_MODULES for t in targets), f"targets the embeddings or the LM head ({targets}); batchgen "
                                                   "applies LoRA to the decoder layers' projections only"),
    ]
    return next((why for bad, why in checks if bad), None)


def _misplaced(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return "is a DoRA adapter (lora_magnitude_vector), which batchgen does not apply"
    if any(f".{module}." in f".{name}" for module in _VISION_MODULES):
        return (f"has weights for the vision tower or projector ({name}); batchgen applies LoRA to the language "
                "model's decoder layers only")
    if any(head in name for head in _HEAD_MODULES) or "lora_embedding" in name:
        return (f"has weights for the embeddings or the LM head ({name}); batchgen applies LoRA to the decoder "
                "layers' projections only")
    return f"has a tensor batchgen cannot place: {name}"


def _read_tensors(path: Path, refuse) -> dict[str, torch.Tensor]:
    for file in WEIGHT_FILES:
        if (path / file).is_file():
            try:
                if file.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(str(path / file))
                return torch.load(path / file, map_location="cpu", weights_only=True)
            except Exception as e:  # a truncated or foreign file: whatever the reader raises
                raise refuse(f"cannot read {file}: {first_line(e)}") from None
    raise refuse(f"no {' or '.join(WEIGHT_FILES)} in that directory")
