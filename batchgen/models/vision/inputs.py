"""What a prompt's images become before the engine sees them, and what a step hands the model.

`MultiModalInputs` is made once per prompt on the reader's thread (models/vision/processing.py): the
processor's pixel values of each image, where its tokens sit in the prompt, a hash of its content and,
for M-RoPE models, the prompt's 3-section positions. A step gives the model one `MultiModalRow` per
scheduled sequence that has images; the model computes an image's embeddings once per request (kept in
`MultiModalInputs.features` until the prefill has passed the image) and slices them for each chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt, preprocessed: its tokens are prompt positions [start, start + length)."""

    pixel_values: torch.Tensor  # as the model's image processor gave it, for this image alone
    start: int
    length: int
    content_hash: int  # 128 bits of the pixel values: what the prefix cache keys the image's blocks by
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL: patches in time, height, width
    pixel_mask: torch.Tensor | None = None  # Idefics3: which pixels are the image's, not padding
    # Mistral 3: one image's tokens in several runs (one a row), each an ImageInput sharing the image's pixel
    # values (the same tensor) and hash; its embeddings start at this row of the image's.
    feature_offset: int = 0
    # The generic path (models/vision/generic.py): the processor's other tensors for this image (LLaVA-NeXT's
    # image_sizes), handed to the model's `get_image_features` with the pixel values.
    extras: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(eq=False)
class MultiModalInputs:
    """The images of one prompt (in prompt order) and, for M-RoPE models, the prompt's positions."""

    images: list[ImageInput]
    mrope_positions: torch.Tensor | None = None  # int64 [3, prompt tokens]
    rope_delta: int = 0  # M-RoPE: a token at index i >= the prompt's length sits at position i + rope_delta
    # Gemma 3: an image's tokens attend to each other both ways, so a prefill chunk holds all of an image's tokens
    # from its first one it feeds on (see chunk_end), and their attention sees up to the image's last position.
    bidirectional: bool = False
    # image index -> its embeddings [length, hidden], computed once for the request's prefill
    features: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return 0 if self.mrope_positions is None else self.mrope_positions.shape[1]

    def seen_from(self, start: int) -> bool:
        """Whether positions from `start` on need the model's image handling: image tokens among them, or M-RoPE."""
        return self.mrope_positions is not None or start < self.images[-1].end

    def block_extra_key(self, start: int, end: int) -> tuple[int, ...]:
        """The content hashes of the images whose tokens fall in positions [start, end): what a KV block of
        those positions depends on besides its tokens (and its parent block)."""
        return tuple(image.content_hash for image in self.images if image.start < end and image.end > start)

    def chunk_end(self, start: int, end: int) -> int:
        """The end of the prefill chunk that may feed positions [start, end) at most: with bidirectional images,
        `end` pulled back to the start of an image it would cut, or to `start` (nothing this step) when the chunk
        begins at or inside that image (a prefix-cache hit may end inside one): the K/V of an image's later
        tokens must be in the cache when its earlier tokens attend."""
        if not self.bidirectional:
            return end
        for image in self.images:
            if image.start < end < image.end:
                return max(start, image.start)
        return end

    def key_limits(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """With bidirectional images: (first, stop, last) for each image with tokens among positions [start,
        end): those tokens, positions [first, stop), see the keys up to position `last`, the image's last."""
        if not self.bidirectional:
            return []
        return [(max(image.start, start), min(image.end, end), image.end - 1) for image in self.images
                if image.start < end and image.end > start]

    def drop_features_before(self, position: int) -> None:
        """Forgets the embeddings of images wholly before `position` (their prefill is done)."""
        for index in [i for i in self.features if self.images[i].end <= position]:
            del self.features[index]


@dataclass(frozen=True)
class MultiModalRow:
    """A scheduled sequence with images: batch rows [row, row + count) hold its positions [start, start + count)."""

    row: int
    start: int
    count: int
    inputs: MultiModalInputs
