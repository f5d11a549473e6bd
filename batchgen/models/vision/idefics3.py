"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, SmolVLM2's `SmolVLMForConditionalGeneration`):
transformers' SigLIP-style vision transformer and connector (pixel shuffle, then a linear projection), and a
Llama decoder, native. An image arrives as tiles (models/vision/processing.Idefics3Preprocessor), each tile its
own run of image tokens: the step's tiles go through the tower as one batch, padded to the largest, with a patch
mask for the padding."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.vision.inputs import ImageInput
from batchgen.models.vision.model import VisionLanguageModel


class Idefics3Model(VisionLanguageModel):
    def __init__(self, hf_config: Any, language_model: LlamaForCausalLM):
        super().__init__(language_model)
        vision_class, connector_class = vision_modules(hf_config.model_type)
        self.patch_size = hf_config.vision_config.patch_size
        self.vision_model = vision_class._from_config(hf_config.vision_config)
        self.connector = connector_class(hf_config)

    def vision_weight(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        return name if name.startswith(("vision_model.", "connector.")) else None

    def language_weight(self, name: str) -> str | None:
        if name.startswith("model.text_model."):
            return name.removeprefix("model.text_model.")
        return super().language_weight(name)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        weight = self.connector.modality_projection.proj.weight
        height = max(image.pixel_values.shape[-2] for image in images)
        width = max(image.pixel_values.shape[-1] for image in images)
        pixels = torch.cat([_pad(image.pixel_values, height, width) for image in images]).to(weight)
        masks = torch.cat([_pad(_mask(image), height, width) for image in images]).to(weight.device)
        # A patch belongs to the image when any of its pixels does.
        size = self.patch_size
        patches = masks.unfold(1, size, size).unfold(2, size, size).sum(dim=(-1, -2)) > 0
        states = self.vision_model(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state
        return list(self.connector(states))


def _mask(image: ImageInput) -> torch.Tensor:
    if image.pixel_mask is not None:
        return image.pixel_mask.to(torch.int64)
    return torch.ones(image.pixel_values.shape[0], *image.pixel_values.shape[-2:], dtype=torch.int64)


def _pad(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """x's last two dims padded with zeros at the bottom and the right to height x width."""
    return F.pad(x, (0, width - x.shape[-1], 0, height - x.shape[-2]))


def vision_modules(model_type: str) -> tuple[type, type]:
    """transformers' vision transformer and connector classes of Idefics3 ("idefics3") or SmolVLM ("smolvlm")."""
    if model_type == "smolvlm":
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

        return SmolVLMVisionTransformer, SmolVLMConnector
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

    return Idefics3VisionTransformer, Idefics3Connector
