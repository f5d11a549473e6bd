"""LLaVA (`LlavaForConditionalGeneration`): a vision tower (CLIP, SigLIP: transformers' own module), a projector
(transformers' `LlavaMultiModalProjector`), and a Llama-family decoder, native. Every image is one crop of the
tower's size: the images of a step go through the tower as one batch."""

from __future__ import annotations

from typing import Any

import torch

from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.vision.inputs import ImageInput
from batchgen.models.vision.model import VisionLanguageModel


class LlavaModel(VisionLanguageModel):
    def __init__(self, hf_config: Any, language_model: LlamaForCausalLM, projector: type | None = None):
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        super().__init__(language_model)
        self.hf_config = hf_config
        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = (projector or LlavaMultiModalProjector)(hf_config)

    def vision_weight(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        cfg = self.hf_config
        pixels = torch.cat([image.pixel_values for image in images]).to(self.multi_modal_projector.linear_1.weight)
        states = self.vision_tower(pixels, output_hidden_states=True).hidden_states
        layers = cfg.vision_feature_layer if isinstance(cfg.vision_feature_layer, list) else [cfg.vision_feature_layer]
        skip = 1 if cfg.vision_feature_select_strategy == "default" else 0  # the CLS token
        selected = torch.cat([states[layer][:, skip:] for layer in layers], dim=-1)
        return list(self.multi_modal_projector(selected))
