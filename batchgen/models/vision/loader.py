"""Builds a vision-language model from a Hugging Face directory: the native decoder from the text config, the
family's vision part from transformers' own modules, the checkpoint's tensors into both."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from batchgen.models.architectures import GENERIC_VISION_FAMILIES, VISION_DECODERS
from batchgen.models.native import checkpoint_tensors, empty_native, native_config
from batchgen.models.vision.backend import load_backend_vision_model
from batchgen.models.vision.gemma3 import Gemma3Model
from batchgen.models.vision.generic import GenericVisionModel
from batchgen.models.vision.idefics3 import Idefics3Model
from batchgen.models.vision.llava import LlavaModel
from batchgen.models.vision.mistral3 import Mistral3Model
from batchgen.models.vision.model import VisionLanguageModel
from batchgen.models.vision.qwen2_vl import Qwen2VLModel

FAMILIES = {"llava": LlavaModel, "qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2VLModel,
            "idefics3": Idefics3Model, "smolvlm": Idefics3Model, "mistral3": Mistral3Model, "gemma3": Gemma3Model}


def load_vision_model(model_dir: Path, hf_config: Any, dtype: torch.dtype, device: torch.device, max_model_len: int,
                      for_lora: bool = False, quantization: str | None = None) -> VisionLanguageModel:
    text = hf_config.get_text_config()
    if quantization:
        raise ValueError("quantization: int8 compute is not available for vision-language models yet")
    if hf_config.model_type in GENERIC_VISION_FAMILIES:  # transformers' own model API, on the backend
        return load_backend_vision_model(model_dir, hf_config, dtype, device, GenericVisionModel)
    if text.model_type not in VISION_DECODERS:  # preflight let it through: a family the backend runs
        return load_backend_vision_model(model_dir, hf_config, dtype, device)
    arch = VISION_DECODERS[text.model_type]
    # A composite model ties its head by its own config's flag (Qwen2-VL-2B's is there, its text config has none).
    text_cfg = replace(native_config(text, max_model_len, arch),
                       tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
    language_model = empty_native(text_cfg, dtype, device)
    with torch.device(device):
        model = FAMILIES[hf_config.model_type](hf_config, language_model)
    model.to(dtype)  # the vision part; the decoder is in `dtype` already
    model.load_weights(checkpoint_tensors(model_dir))
    model.eval().requires_grad_(False)
    model.pack_weights(for_lora)
    return model
