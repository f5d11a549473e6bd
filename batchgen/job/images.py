"""A row's images loaded and placed in its prompt, in the shapes the engine takes (``batchgen.LLM``,
as vLLM's): runs where the row is prepared for the engine (the feeder's thread), ahead of the engine.

- ``prompt_column`` + ``images_column``: ``{"prompt": text, "multi_modal_data": {"image": [PIL, ...]}}``
  (text without the model's image placeholder: the engine puts the images first);
- chat messages: each image part becomes ``{"type": "image", "image": PIL}``. With ``images_column``, the
  column's images fill the messages' bare ``{"type": "image"}`` placeholders in order (Hugging Face chat
  datasets' way); a conversation without placeholders gets them at the start of its first user message,
  before its text.

An image that cannot be had is an ``ImageError`` naming the row, the field and the image: the row's error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import parse_bytes
from ..images import ImageError, ImageLimits, image_nbytes, load_image
from ..storage import StorageOptions
from .inputs import Row
from .inputs.image_values import IMAGE, TEXT, has_image_parts, is_image_part, part_image
from .inputs.rows import CHAT
from .spec import InputSpec, JobSpec


def image_limits(spec: InputSpec) -> ImageLimits:
    return ImageLimits(max_bytes=parse_bytes(spec.max_image_size, "input.max_image_size"),
                       max_pixels=spec.max_image_pixels)


def image_memory(spec: InputSpec) -> int:
    """``input.image_memory`` in bytes: decoded images held at once, read ahead and in the engine."""
    return parse_bytes(spec.image_memory, "input.image_memory")


def takes_images(llm: Any) -> bool:
    """Whether the engine's model reads images (``LLM.supports_images``); an engine that does not say takes none."""
    return bool(getattr(llm, "supports_images", False))


def has_images(row: Row) -> bool:
    """Whether the row brings images: from ``images_column``, or as parts of its chat messages."""
    return bool(row.images) or (row.endpoint == CHAT and has_image_parts(row.prompt))


def image_count(row: Row) -> int:
    """The images a row brings (its images column's and its messages' image parts, placeholders not counted twice)."""
    parts = 0
    if row.endpoint == CHAT and isinstance(row.prompt, list):
        parts = sum(1 for m in row.prompt if isinstance(m.get("content"), list)
                    for p in m["content"] if is_image_part(p) and part_image(p) is not None)
    return len(row.images) + parts


def as_placeholders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages with each image part as a bare ``{"type": "image"}``, as chat templates render them, for
    counting their text's tokens without reading the images (``run --dry-run``)."""
    return [{**m, "content": [{"type": IMAGE} if is_image_part(p) else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]


@dataclass
class LoadedPrompt:
    prompt: Any
    nbytes: int = 0  # what its decoded images hold


@dataclass(frozen=True)
class RowImages:
    """How a job's rows get their images: the job's limits and storage, and its images column."""

    column: str | None = None
    limits: ImageLimits = field(default_factory=ImageLimits)
    storage: StorageOptions | None = None

    @classmethod
    def for_job(cls, spec: JobSpec) -> RowImages:
        return cls(spec.input.images_column, image_limits(spec.input), spec.storage)

    def prompt(self, row: Row) -> LoadedPrompt:
        """The row's prompt with its images decoded, in the engine's shapes; raises ``ImageError``."""
        loaded = LoadedPrompt(None)
        images = [self._load(value, self._column_where(row, i), row, loaded) for i, value in enumerate(row.images)]
        if row.endpoint == CHAT:
            loaded.prompt = self._chat(row, images, loaded)
            return loaded
        if not images:
            loaded.prompt = row.prompt
        elif isinstance(row.prompt, str):
            loaded.prompt = {"prompt": row.prompt, "multi_modal_data": {"image": images}}
        else:
            raise ImageError(f"{row.where}: field {row.prompt_field!r}: token ids cannot come with images; "
                             "give the prompt as text")
        return loaded

    def _column_where(self, row: Row, i: int) -> str:
        return f"{row.where}: field {self.column!r}" + (f" [{i}]" if len(row.images) > 1 else "")

    def _load(self, value: Any, where: str, row: Row, loaded: LoadedPrompt) -> Any:
        image = load_image(value, where=where, base=row.image_base, storage=self.storage, limits=self.limits)
        loaded.nbytes += image_nbytes(image)
        return image

    def _chat(self, row: Row, column_images: list[Any], loaded: LoadedPrompt) -> list[dict[str, Any]]:
        """The messages with image parts holding decoded images."""
        assert isinstance(row.prompt, list)
        left = list(column_images)
        placeholders = 0
        messages = []
        for i, message in enumerate(row.prompt):
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if not is_image_part(part):
                        parts.append(part)
                        continue
                    value = part_image(part)
                    if value is None:
                        placeholders += 1
                        if not left:
                            raise ImageError(f"{row.where}: field {row.prompt_field!r}: message [{i}].content[{j}]: "
                                             f"image placeholder {placeholders}, but {self._column_count(row)}")
                        parts.append({"type": IMAGE, IMAGE: left.pop(0)})
                        continue
                    where = f"{row.where}: field {row.prompt_field!r}: message [{i}].content[{j}]"
                    parts.append({"type": IMAGE, IMAGE: self._load(value, where, row, loaded)})
                message = {**message, "content": parts}
            messages.append(message)
        if placeholders and left:
            raise ImageError(f"{row.where}: field {self.column!r}: {len(column_images)} images for "
                             f"{placeholders} image placeholders in field {row.prompt_field!r}")
        if left:
            self._first_user(row, messages, left)
        return messages

    def _column_count(self, row: Row) -> str:
        n = len(row.images)
        if self.column is None:
            return "the job has no input.images_column to fill it"
        return f"field {self.column!r} has {n} image{'s' if n != 1 else ''}"

    def _first_user(self, row: Row, messages: list[dict[str, Any]], images: list[Any]) -> None:
        """``images`` at the start of the first user message, before its text."""
        at = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if at is None:
            raise ImageError(f"{row.where}: field {self.column!r}: no user message to put the images in "
                             f"(field {row.prompt_field!r})")
        content = messages[at].get("content")
        text = content if isinstance(content, list) else [{"type": TEXT, TEXT: content}]
        messages[at] = {**messages[at], "content": [*({"type": IMAGE, IMAGE: im} for im in images), *text]}
