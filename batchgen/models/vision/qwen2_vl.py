"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): transformers'
vision transformer of each (patches of any image size, merged 2x2 into tokens; Qwen2.5-VL's attends in windows)
and a Qwen2 decoder, native, with M-RoPE: each head's rotary frequencies fall in three
sections turned by three positions (time, row, column). Text tokens have the same three; an image's tokens have
its grid's. A position after the prompt is its token index plus the request's rope delta."""

from __future__ import annotations

from typing import Any

import torch

from batchgen.layers.rotary import Rope
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.vision.inputs import ImageInput, MultiModalRow
from batchgen.models.vision.model import VisionLanguageModel


class Qwen2VLModel(VisionLanguageModel):
    def __init__(self, hf_config: Any, language_model: LlamaForCausalLM):
        super().__init__(language_model)
        self.visual = vision_transformer(hf_config.model_type)._from_config(hf_config.vision_config)
        head_dim = language_model.cfg.rotated_dims
        sections = hf_config.text_config.rope_parameters["mrope_section"]
        if 2 * sum(sections) != head_dim:
            raise ValueError(f"model: mrope_section {sections} does not cover head_dim {head_dim}")
        half = torch.cat([torch.full((n,), s) for s, n in enumerate(sections)])
        self.register_buffer("section_of_dim", torch.cat([half, half]), persistent=False)  # cos half, sin half

    def vision_weight(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        return name if name.startswith("visual.") else None

    def language_weight(self, name: str) -> str | None:
        if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
            return name  # the older layout: the decoder's tensors under "model."
        return super().language_weight(name)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        pixels = torch.cat([image.pixel_values for image in images]).to(self.visual.device, self.visual.dtype)
        grids = torch.tensor([image.grid_thw for image in images], device=pixels.device)
        merged = self.visual(pixels, grid_thw=grids).pooler_output
        return list(torch.split(merged, [image.length for image in images]))

    def rope(self, positions: torch.Tensor, images: list[MultiModalRow]) -> Rope:
        """Per-token angles: row t of the table is cos/sin of the section-wise positions of token t, rotated with
        positions 0..T-1 (what the rotary op and the decoder stack take)."""
        table = self.language_model.rotary.cos_sin
        if not images:
            return Rope(positions, table)
        # Each section's position minus the token's index, built on the host and moved once: a decode row's is
        # its request's rope delta, a prompt row's comes from the prompt's positions.
        offsets = torch.zeros(3, positions.shape[0], dtype=torch.int64)
        for r in images:
            inputs, end = r.inputs, r.start + r.count
            in_prompt = max(0, min(end, inputs.num_prompt_tokens) - r.start)
            if in_prompt:
                index = torch.arange(r.start, r.start + in_prompt)
                offsets[:, r.row:r.row + in_prompt] = inputs.mrope_positions[:, r.start:r.start + in_prompt] - index
            offsets[:, r.row + in_prompt:r.row + r.count] = inputs.rope_delta
        three = positions + offsets.to(positions.device, non_blocking=True)
        per_section = table[three]  # [3, T, head_dim]
        choose = self.section_of_dim.expand(1, per_section.shape[1], -1)
        cos_sin = per_section.gather(0, choose).squeeze(0)
        return Rope(torch.arange(positions.shape[0], device=positions.device), cos_sin)


def vision_transformer(model_type: str) -> type:
    """transformers' vision transformer class of Qwen2-VL ("qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl")."""
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VisionTransformerPretrainedModel
