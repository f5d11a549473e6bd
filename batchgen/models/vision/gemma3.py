"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): transformers' SigLIP vision tower and Gemma 3's
multi-modal projector (its patches average-pooled to `mm_tokens_per_image` tokens, RMS-normed and projected), and
the Gemma 3 decoder, native (sliding and global layers). The text embeddings are scaled by sqrt(hidden_size) before
the images' are placed (those are not). An image's tokens attend to each other both ways: a step that feeds image
tokens gives the attention each prefill row's key limit (`AttentionMetadata.prefill_key_limit`), and the scheduler
keeps an image's tokens in one prefill chunk (MultiModalInputs.chunk_end)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from batchgen.layers.attention import AttentionMetadata
from batchgen.models.gemma import GemmaForCausalLM
from batchgen.models.vision.inputs import ImageInput, MultiModalRow
from batchgen.models.vision.model import VisionLanguageModel


class Gemma3Model(VisionLanguageModel):
    language_model: GemmaForCausalLM

    def __init__(self, hf_config: Any, language_model: GemmaForCausalLM):
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        super().__init__(language_model)
        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)

    def vision_weight(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.cat([image.pixel_values for image in images]).to(weight)
        states = self.vision_tower(pixel_values=pixels).last_hidden_state
        return list(self.multi_modal_projector(states))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                images: list[MultiModalRow] = ()) -> torch.Tensor:
        x = self.language_model.scaled_embeddings(input_ids)
        if images:
            self._place_images(x, images)
            meta = with_key_limits(meta, positions, images)
        return self.language_model.run_layers(x, positions, meta)


def with_key_limits(meta: AttentionMetadata, positions: torch.Tensor, rows: list[MultiModalRow]) -> AttentionMetadata:
    """`meta` with each prefill row's key limit where the step feeds image tokens: an image token sees the keys up
    to its image's last position, a text token up to its own (`meta` itself when no prefill row is an image's).
    Decode rows are not touched: a one-token chunk of an image is its last token (chunks never end inside an
    image), whose limit is its own position."""
    first = meta.num_decode_tokens
    limits = None
    for r in rows:
        for lo, hi, last in r.inputs.key_limits(r.start, r.start + r.count):
            if r.row < first or last == lo == hi - 1:
                continue
            if limits is None:
                limits = positions[first:].to(torch.int32, copy=True)  # never the positions themselves
            limits[r.row - first + lo - r.start:r.row - first + hi - r.start] = last
    return meta if limits is None else replace(meta, prefill_key_limit=limits)
