"""The seam every vision-language model shares: a native paged decoder (models/llama.py) fed input embeddings
in which a step's image tokens carry their image's embeddings, computed by the family's vision tower (the
model's own transformers modules), batched over the step's images that have none yet.

An image's embeddings are computed once per request and sliced for each prefill chunk, so a chunk boundary
may fall anywhere inside an image's tokens; they are dropped once the prefill has passed the image (a request
recomputed after a preemption computes them again)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from batchgen.layers.attention import AttentionMetadata, PagedAttention
from batchgen.layers.rotary import Rope
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.vision.inputs import ImageInput, MultiModalRow


class VisionLanguageModel(nn.Module):
    """A family's vision part (`encode_images`, `vision_weight`) over `language_model`, a native decoder."""

    takes_images = True
    has_lm_head = True
    class_labels = None

    def __init__(self, language_model: LlamaForCausalLM):
        super().__init__()
        self.language_model = language_model
        self.vision_stats = {"images_encoded": 0, "vision_seconds": 0.0}  # engine stats (benchmarks' share)

    # --- what the family adds -------------------------------------------------------------------
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings [image.length, hidden], in one pass of the vision tower where it can."""
        raise NotImplementedError

    def vision_weight(self, name: str) -> str | None:
        """A checkpoint tensor's name in this module if it belongs to the vision part, else None."""
        raise NotImplementedError

    def language_weight(self, name: str) -> str | None:
        """A checkpoint tensor's name as the language model's (`model.` then its own), or None."""
        for prefix, new in (("model.language_model.", ""), ("language_model.model.", ""),
                            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
            if name.startswith(prefix):
                return new + name.removeprefix(prefix)
        return None

    def rope(self, positions: torch.Tensor, images: list[MultiModalRow]) -> Rope:
        return self.language_model.rotary.angles(positions)

    # --- the runner's seam ----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                images: list[MultiModalRow] = ()) -> torch.Tensor:
        x = self.language_model.embed_tokens(input_ids)
        if images:
            self._place_images(x, images)
        return self.language_model.decode(x, self.rope(positions, images), meta)

    def _place_images(self, x: torch.Tensor, rows: list[MultiModalRow]) -> None:
        """Writes into `x` the embeddings of the image tokens the step feeds."""
        wanted: dict[tuple[int, int], tuple[Any, int]] = {}
        for r in rows:
            images = r.inputs.images
            for index, image in enumerate(images):
                if image.start < r.start + r.count and image.end > r.start and index not in r.inputs.features:
                    # with the runs sharing its image (Mistral 3's rows): the tower sees the whole image anyway
                    for j, other in enumerate(images):
                        if other.pixel_values is image.pixel_values and j not in r.inputs.features:
                            wanted[(id(r.inputs), j)] = (r.inputs, j)
        if wanted:
            started = time.perf_counter()
            with torch.no_grad():
                features = self.encode_images([inputs.images[index] for inputs, index in wanted.values()])
            if x.is_cuda:  # the time of the tower's kernels, not of their launch
                torch.cuda.synchronize(x.device)
            self.vision_stats["images_encoded"] += len(wanted)
            self.vision_stats["vision_seconds"] += time.perf_counter() - started
            for (inputs, index), feature in zip(wanted.values(), features, strict=True):
                inputs.features[index] = feature.to(x.dtype)
        for r in rows:
            end = r.start + r.count
            for index, image in enumerate(r.inputs.images):
                lo, hi = max(image.start, r.start), min(image.end, end)
                if lo < hi:
                    x[r.row + lo - r.start:r.row + hi - r.start] = r.inputs.features[index][lo - image.start:
                                                                                            hi - image.start]
            r.inputs.drop_features_before(end)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return self.language_model.attention_layers()

    @property
    def vocab_size(self) -> int:
        return self.language_model.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.language_model.hidden_size

    def pack_weights(self, for_lora: bool = False, quantization: str | None = None) -> None:
        """The decoder's projections packed as a text model's; the vision part stays transformers' modules."""
        self.language_model.pack_weights(for_lora, quantization)

    def lora_targets(self) -> Iterator:
        return self.language_model.lora_targets()

    def attach_lora(self, slots, batch) -> None:
        self.language_model.attach_lora(slots, batch)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors (transformers 5's names or the older ones) into the vision part and the decoder."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        language, loaded = [], set()
        for name, tensor in weights:
            if (own := self.vision_weight(name)) is not None:
                if own not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                params[own].copy_(tensor)
                loaded.add(own)
            elif (own := self.language_weight(name)) is not None:
                language.append((own, tensor))
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        self.language_model.load_weights(language)
        vision = {n for n in dict(self.named_parameters()) if not n.startswith("language_model.")}
        if missing := sorted(vision - loaded):
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
