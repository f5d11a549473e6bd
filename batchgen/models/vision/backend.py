"""LLaVA over a language model batchgen has no native decoder for (OLMo 2, GPT-NeoX, Phi, ... any decoder the
transformers backend runs), and the generic path's families (models/vision/generic.py): the whole model is
transformers' (`from_pretrained`, its own weight names and ties), its vision part runs as for the native LLaVA
(the generic path: by the model's own `get_image_features`), and its language model runs on batchgen's paged
attention through the transformers backend (models/transformers_backend.py), fed input embeddings in which the
image tokens carry their images' embeddings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchgen.config import ConfigError, ConfigProblem
from batchgen.layers.attention import AttentionMetadata
from batchgen.models.architectures import architecture
from batchgen.models.transformers_backend import (
    BACKEND,
    TransformersModel,
    _try_one_token,
    own_memory,
    register_attention,
)
from batchgen.models.vision.inputs import MultiModalRow
from batchgen.models.vision.llava import LlavaModel
from batchgen.models.vision.model import VisionLanguageModel


class TextModel(nn.Module):
    """A vision-language model's language model and head, shaped as the causal LM the transformers backend takes
    (`config`, `base_model`, input and output embeddings): the vision modules stay out of its layers."""

    def __init__(self, hf_vlm: nn.Module):
        super().__init__()
        self.model = hf_vlm.model.language_model
        self.lm_head = hf_vlm.lm_head
        self.config = hf_vlm.config.get_text_config()

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


class BackendDecoder(TransformersModel):
    """The transformers backend's model taking input embeddings (`decode`), as batchgen's native decoders do."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(input_ids)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.step.meta = meta
        try:  # TransformersModel.forward's call, on embeddings
            return self.hf.base_model(inputs_embeds=x[None], position_ids=positions[None], use_cache=False)[0][0]
        finally:
            self.step.meta = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.decode(self.embed_tokens(input_ids), positions, meta)


class OnBackend:
    """What a vision part over a `BackendDecoder` does differently from one over a native decoder."""

    language_model: BackendDecoder

    def rope(self, positions: torch.Tensor, images: list[MultiModalRow]) -> torch.Tensor:
        return positions  # the decoder's own rotary embedding turns them

    def pack_weights(self, for_lora: bool = False, quantization: str | None = None) -> None:
        self.language_model.pack_weights()  # LoRA wraps packed projections as unpacked ones


class BackendLlava(OnBackend, LlavaModel):
    """LLaVA's vision part (transformers' loaded modules) over a `BackendDecoder`."""

    def __init__(self, hf_vlm: nn.Module, decoder: BackendDecoder):
        VisionLanguageModel.__init__(self, decoder)
        self.hf_config = hf_vlm.config
        self.vision_tower = hf_vlm.model.vision_tower
        self.multi_modal_projector = hf_vlm.model.multi_modal_projector


def load_backend_vision_model(model_dir: Path, hf_config: Any, dtype: torch.dtype, device: torch.device,
                              family: Callable[[nn.Module, BackendDecoder], VisionLanguageModel] = BackendLlava
                              ) -> VisionLanguageModel:
    """The model from transformers' `AutoModelForImageTextToText`, its language model's attention batchgen's, its
    vision part `family`'s; a ConfigError naming the architecture when the language model's layers do not fit
    batchgen's attention."""
    from transformers import AutoModelForImageTextToText

    register_attention()
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, device_map={"": str(device)},
                                                     attn_implementation={"text_config": BACKEND})
    hf.eval().requires_grad_(False)
    try:
        decoder = BackendDecoder(TextModel(hf))
        _try_one_token(decoder)
    except NotImplementedError as e:
        message = f"architecture {architecture(hf_config)} cannot run in batchgen: its language model: {e}"
        raise ConfigError([ConfigProblem("model", message)]) from None
    model = family(hf, decoder)
    model.pack_weights()
    own_memory(hf)
    return model
