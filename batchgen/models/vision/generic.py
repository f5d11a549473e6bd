"""The generic path: a vision-language family whose language model is a plain causal decoder with 1-D positions and
whose images enter as embeddings at its image tokens (LLaVA-NeXT, Aya Vision), run with transformers' own model
API rather than modules of batchgen's: the model's `get_image_features` turns an image's pixel values (and the
processor's other tensors, `ImageInput.extras`) into the embeddings of its image tokens, in prompt order, as the
family's forward scatters them at its placeholder mask; the processor expands the placeholder
(processing.ProcessorPreprocessor); the language model runs on the transformers backend (models/vision/backend.py).
Which families take this path, and which are refused and why: models/architectures.py."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from batchgen.models.vision.backend import BackendDecoder, OnBackend
from batchgen.models.vision.inputs import ImageInput
from batchgen.models.vision.model import VisionLanguageModel


class GenericVisionModel(OnBackend, VisionLanguageModel):
    def __init__(self, hf_vlm: nn.Module, decoder: BackendDecoder):
        super().__init__(decoder)
        self.hf_config = hf_vlm.config
        # the vision modules (the language model is `decoder`'s), and the method that runs them
        self.vision = nn.ModuleDict({name: module for name, module in hf_vlm.model.named_children()
                                     if name != "language_model"})
        self.image_features = hf_vlm.model.get_image_features

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each run's slice of its image's embeddings; the images of one pixel shape through the tower together."""
        unique = {id(image.pixel_values): image for image in images}
        groups: dict[tuple, list[ImageInput]] = defaultdict(list)
        for image in unique.values():
            groups[(tuple(image.pixel_values.shape), *((k, tuple(v.shape)) for k, v in image.extras.items()))].append(
                image)
        by_image: dict[int, torch.Tensor] = {}
        for group in groups.values():
            for image, features in zip(group, self._encode_group(group), strict=True):
                by_image[id(image.pixel_values)] = features
        out = []
        for image in images:
            features = by_image[id(image.pixel_values)]
            if image.feature_offset + image.length > len(features):
                raise ValueError(f"{type(self.hf_config).__name__}: get_image_features gave {len(features)} "
                                 f"embeddings for an image whose tokens need {image.feature_offset + image.length}")
            out.append(features[image.feature_offset:image.feature_offset + image.length])
        return out

    def _encode_group(self, group: list[ImageInput]) -> list[torch.Tensor]:
        """One `get_image_features` call over images of one shape: each image's embeddings [tokens, hidden]. Its
        output is one tensor per image (LLaVA-NeXT's crops of different layouts) or one tensor whose rows follow
        the pixel values' first dimension (Aya Vision's tiles)."""
        weight = next(self.vision.parameters())
        pixels = torch.cat([image.pixel_values for image in group]).to(weight)
        extras = {key: torch.cat([image.extras[key] for image in group]).to(weight.device)
                  for key in group[0].extras}
        pooled = self.image_features(pixel_values=pixels, **extras, return_dict=True).pooler_output
        if isinstance(pooled, torch.Tensor):
            pooled = torch.split(pooled, [image.pixel_values.shape[0] for image in group])
        hidden = self.hidden_size
        return [features.reshape(-1, hidden) for features in pooled]

    def vision_weight(self, name: str) -> str | None:
        return None  # transformers loaded the checkpoint (load_backend_vision_model)
