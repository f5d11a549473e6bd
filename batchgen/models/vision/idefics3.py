"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`): transformers' SigLIP-style vision transformer and
connector (pixel shuffle, then a linear projection), and a Llama decoder, native. An image arrives as tiles
(models/vision/processing.Idefics3Preprocessor), each tile its own run of image tokens: the step's tiles go
through the tower as one batch, padded to the largest, with a patch mask for the padding."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.vision.inputs import ImageInput
from batchgen.models.vision.model import VisionLanguageModel


class Idefics3Model(VisionLanguageModel):
    def __init__(self, hf_config: Any, language_model: LlamaForCausalLM):
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        super().__init__(language_model)
        self.patch_size = hf_config.vision_config.patch_size
        self.vision_model = Idefics3VisionTransformer._from_config(hf_config.vision_config)
        self.connector = Idefics3Connector(hf_config)

    def vision_weight(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        return name if name.startswith(("vision_model.", "connector.")) else None

    def language_weight(self, name: str) -> str | None:
        if name.startswith("model.text_model."):
            return name.removeprefix("model.text_model.")
        return super().language_weight(name)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        height = max(image.pixel_values.shape[-2] for image in images)
        width = max(image.pixel_values.shape[-1] for image in images)
        pixels = torch.cat([_pad(image.pixel_values, height, width) for image in images])
        masks = torch.cat([_pad(_mask(image), height, width) for image in images])
        # A patch belongs to the image when any of its pixels does.
        size = self.patch_size
        patches = masks.unfold(1, size, size).unfold(2, size, size).sum(dim=(-1, -2)) > 0
        states = self.vision_model(pixel_values=pixels.to(self.connector.modality_projection.proj.weight),
                                   patch_attention_mask=patches).last_hidden_state
        return list(self.connector(states))


def _mask(image: ImageInput) -> torch.Tensor:
    if image.pixel_mask is not None:
        return image.pixel_mask.to(torch.int64)
    return torch.ones(image.pixel_values.shape[0], *image.pixel_values.shape[-2:], dtype=torch.int64)


def _pad(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """x's last two dims padded with zeros at the bottom and the right to height x width."""
    return F.pad(x, (0, width - x.shape[-1], 0, height - x.shape[-2]))
