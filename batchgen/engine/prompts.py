"""Prompts into token ids: a text (the tokenizer's special tokens added), a chat conversation (rendered
with the model's chat template, whose text carries its own special tokens), token ids (checked against
the vocabulary, never trusted), vLLM's prompt dicts, and prompts with images for a vision-language model.

`normalize` is the one place a prompt's shape is read: str | list[int] | `{"prompt": ...}` |
`{"prompt_token_ids": ...}` | `{"prompt": ..., "multi_modal_data": {"image": ...}}` | a chat conversation
(whose message content may be a list of OpenAI content parts, images among them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.models.vision.inputs import MultiModalInputs
from batchgen.models.vision.processing import ImagePreprocessor

Prompt = str | list[int] | list[dict] | dict


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as `PromptEncoder.encode_batch` encoded it: its text and its token ids (and, with images,
    their preprocessed inputs), which adding it neither encodes nor checks again."""

    text: str | None
    token_ids: list[int]
    multi_modal: MultiModalInputs | None = None


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images, normalized: its text (placeholders in it; a chat already rendered) and its images."""

    text: str
    images: list[Any]
    rendered: bool  # a rendered chat: its text carries its own special tokens


def is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


IMAGE_PART_TYPES = ("image", "image_url")


def chat_images(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """The conversation with each image content part as a bare `{"type": "image"}` (what chat templates
    render as the model's placeholder), and the images in order: `{"type": "image", "image": <PIL image>}`
    as it is, `{"type": "image_url", "image_url": {"url": ...}}` loaded with `batchgen.images.load_image`."""
    images: list[Any] = []
    out = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(
                isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            images.append(_part_image(part, f"messages[{m}].content[{p}]"))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def _part_image(part: dict, where: str) -> Any:
    if part["type"] == "image":
        if part.get("image") is None:
            raise ValueError(f"{where}: an image part needs its image under 'image'")
        return rgb_image(part["image"], where)
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not url:
        raise ValueError(f"{where}: an image_url part needs {{'image_url': {{'url': ...}}}}")
    return rgb_image(url, where)


def rgb_image(value: Any, where: str) -> Any:
    """An image as the image processors want it: an RGB PIL image (a grayscale or RGBA one converted; bytes, paths
    and data: URLs loaded), through `batchgen.images.load_image`, whose ImageError is a ValueError."""
    from batchgen.images import load_image

    return load_image(value, where=where)


class PromptEncoder:
    def __init__(self, tokenizer: Any, vocab_size: int, images: ImagePreprocessor | None = None):
        self.tokenizer = tokenizer  # None: token ids only (skip_tokenizer_init)
        self.vocab_size = vocab_size
        self.images = images  # a vision-language model's image preprocessing; None: text only
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # What transformers' first encode would do anyway (it encodes without truncation or padding),
            # done now so that no later encode changes the Rust tokenizer while another thread is using it
            # (a "borrowed" error there); the job's row reader encodes on a thread of its own.
            if backend.truncation is not None:
                backend.no_truncation()
            if backend.padding is not None:
                backend.no_padding()

    def normalize(self, prompt: Prompt) -> str | list[int] | list[dict] | ImagePrompt:
        """A prompt of any accepted shape as a text, token ids, a text-only conversation or an `ImagePrompt`.
        A text prompt with images and no placeholder of the model gets one placeholder per image in front."""
        if isinstance(prompt, dict):
            images = _dict_images(prompt)
            if images:
                text = prompt.get("prompt")
                if not isinstance(text, str):
                    raise ValueError("prompt: a prompt with multi_modal_data needs its text under 'prompt'")
                placeholder = self.image_preprocessor().placeholder
                if placeholder not in text and self.images.placeholder_token not in text:
                    text = placeholder * len(images) + text
                return ImagePrompt(text, images, rendered=False)
            for key in ("prompt_token_ids", "prompt"):
                if key in prompt:
                    return prompt[key]
            raise ValueError(f"prompt: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if is_chat(prompt):
            messages, images = chat_images(prompt)
            if images:
                self.image_preprocessor()
                return ImagePrompt(self.chat_text(messages), images, rendered=True)
        return prompt

    def image_preprocessor(self) -> ImagePreprocessor:
        if self.images is None:
            raise ValueError("prompt: images (multi_modal_data or image content parts) need a vision-language model; "
                             "this model takes text only")
        return self.images

    def encode_prompt(self, prompt: Prompt | EncodedPrompt) -> EncodedPrompt:
        """A prompt encoded (and checked); raises what `encode_batch` would return for it."""
        if isinstance(prompt, EncodedPrompt):
            return prompt
        normal = self.normalize(prompt)
        if not isinstance(normal, (str, ImagePrompt)) and not is_chat(normal):
            return EncodedPrompt(None, self.checked_token_ids("prompt", normal))
        encoded = self.encode_batch([normal])[0]
        if isinstance(encoded, Exception):
            raise encoded
        return encoded

    def encode(self, prompt: Prompt | EncodedPrompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt without images (scoring, embedding and classification take none)."""
        encoded = self.encode_prompt(prompt)
        if encoded.multi_modal is not None:
            raise ValueError("prompt: images are taken by generation (generate, chat, beam search) only, "
                             "not by scoring, embedding or classification")
        return encoded.text, encoded.token_ids

    def encode_batch(self, prompts: Sequence[Any]) -> list[Any]:
        """Every text, chat and image prompt as an `EncodedPrompt`, the texts in one call of the tokenizer and
        the rendered chats in another: a fast tokenizer then splits the work over its threads, in Rust, without
        the GIL, and the per-call cost is paid once. Images go through the model's image processor here (pixel
        values, placeholder expansion, content hashes), so that the caller's thread does that work too. Token ids
        come back as they are (adding them checks them); a prompt that cannot be encoded comes back as the
        ValueError (or TypeError) that `encode_prompt` would raise."""
        out: list[Any] = list(prompts)
        texts: list[tuple[int, str]] = []
        chats: list[tuple[int, str]] = []
        with_images: dict[int, list[Any]] = {}
        for i, prompt in enumerate(prompts):
            try:
                normal = self.normalize(prompt)
                if isinstance(normal, ImagePrompt):
                    with_images[i] = normal.images
                    (chats if normal.rendered else texts).append((i, normal.text))
                elif isinstance(normal, str):
                    self.needs_tokenizer("a text prompt")
                    texts.append((i, normal))
                elif is_chat(normal):
                    chats.append((i, self.chat_text(normal)))
                else:
                    out[i] = normal
            except (ValueError, TypeError) as e:
                out[i] = e
        for batch, special in ((texts, True), (chats, False)):
            if not batch:
                continue
            ids = self.tokenizer([text for _, text in batch], add_special_tokens=special)["input_ids"]
            for (i, text), token_ids in zip(batch, ids, strict=True):
                out[i] = EncodedPrompt(text, token_ids)
        for i, images in with_images.items():
            if isinstance(out[i], EncodedPrompt):
                try:
                    token_ids, inputs = self.images.expand(out[i].token_ids, images)
                    out[i] = EncodedPrompt(out[i].text, token_ids, inputs)
                except (ValueError, TypeError) as e:
                    out[i] = e
        return out

    def chat_text(self, messages: list[dict]) -> str:
        return self.needs_tokenizer("a chat prompt").apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)

    def needs_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"prompt: {what} needs a tokenizer, and this engine has none "
                             "(skip_tokenizer_init=True); give token ids")
        return self.tokenizer

    def checked_token_ids(self, field: str, ids: object, allow_empty: bool = False) -> list[int]:
        """Token ids the embedding can look up: a ValueError naming the field and the bad id
        here, instead of an IndexError in a step that holds other requests."""
        if not isinstance(ids, (list, tuple)) or (not ids and not allow_empty):
            raise ValueError(f"{field}: expected a non-empty list of token ids, got {type(ids).__name__}")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{field}: [{i}] is {t!r}, not an integer token id")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}: token id {t} at [{i}] is outside the model's vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        return list(ids)


def _dict_images(prompt: dict) -> list[Any]:
    """The images of a vLLM prompt dict's multi_modal_data (a list, even of one)."""
    data = prompt.get("multi_modal_data")
    if not data:
        return []
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"prompt: multi_modal_data takes 'image' (an image or a list of images), got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data["image"]
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return [rgb_image(image, f"multi_modal_data.image[{i}]") for i, image in enumerate(images)]
