"""Mistral 3 (`Mistral3ForConditionalGeneration`, Mistral Small 3.1's vision): transformers' Pixtral vision model
(images at their own aspect, patches attended within each image) and patch-merging projector, and a Mistral
decoder, native. An image's tokens come in one run a row (models/vision/processing.Mistral3Preprocessor): the
tower runs once per image, over the step's images together, and each row takes its slice."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.vision.inputs import ImageInput
from batchgen.models.vision.llava import LlavaModel


class Mistral3Model(LlavaModel):
    def __init__(self, hf_config: Any, language_model: LlamaForCausalLM):
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        super().__init__(hf_config, language_model, Mistral3MultiModalProjector)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        cfg, weight = self.hf_config, self.multi_modal_projector.linear_1.weight
        unique = list({id(image.pixel_values): image.pixel_values for image in images}.values())
        sizes = torch.tensor([list(p.shape[-2:]) for p in unique])
        height, width = sizes.max(dim=0).values.tolist()
        pixels = torch.cat([F.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in unique]).to(weight)
        states = self.vision_tower(pixels, image_sizes=sizes, output_hidden_states=True).hidden_states
        layers = cfg.vision_feature_layer if isinstance(cfg.vision_feature_layer, list) else [cfg.vision_feature_layer]
        features = self.multi_modal_projector(torch.cat([states[i] for i in layers], dim=-1).squeeze(0), sizes)
        per_token = self.vision_tower.patch_size * cfg.spatial_merge_size
        split = torch.split(features, (sizes // per_token).prod(dim=-1).tolist())
        by_image = {id(p): f for p, f in zip(unique, split, strict=True)}
        return [by_image[id(image.pixel_values)][image.feature_offset:image.feature_offset + image.length]
                for image in images]
