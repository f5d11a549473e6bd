"""Image values as the reader sees them, before anything is decoded: an ``input.images_column`` value
(one image or a list of them) and chat messages whose content is a list of OpenAI content parts.

Only shapes are checked here (cheap, on every row); the images themselves are read and decoded when the
row is prepared for the engine (``job/images.py``). Each check returns why a value is refused, or None,
as ``values.py``'s checks do.

Content parts: ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``
(OpenAI; a bare string as ``image_url`` is taken too), ``{"type": "image", "image": ...}`` and a bare
``{"type": "image"}``: a placeholder, as Hugging Face chat datasets write it, filled from
``input.images_column`` in order. Content of text parts alone becomes one string (parts joined by
newlines), so a text-only model reads it as before.
"""

from __future__ import annotations

import json
from typing import Any

from .rows import BadValue, decode, type_name

TEXT, IMAGE_URL, IMAGE = "text", "image_url", "image"
IMAGE_KINDS = (IMAGE_URL, IMAGE)


def image_list(value: Any) -> tuple[list[Any], str | None]:
    """An images column's value as a list of image values, and why it is refused (None: it is not).
    Null is refused (a row without images holds an empty list); a text holding a JSON list of strings
    (a CSV cell) is that list."""
    if value is None:
        return [], "missing or null (a row without images holds an empty list [])"
    if isinstance(value, BadValue):
        return [], value.why
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list) and all(isinstance(v, str) for v in parsed):
            value = parsed
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if why := _image_value_problem(item):
            return [], f"[{i}]: {why}" if isinstance(value, list) else why
    return items, None


def _image_value_problem(v: Any) -> str | None:
    if isinstance(v, (bytes, str)):
        return None if v else "empty image value"
    if isinstance(v, dict):
        if v.get("bytes") is None and not v.get("path"):
            return "an image object needs bytes or path (a Hugging Face Image feature's {bytes, path})"
        return None
    return f"expected image bytes, a path, a URL or an {{bytes, path}} object, got {type_name(v)}"


def content_problem(i: int, parts: list[Any]) -> str | None:
    """Why message ``i``'s list of content parts is refused (``message [0].content[1].type: ...``), or None."""
    why = check_content_parts(parts)
    return None if why is None else f"message [{i}].content{why}"


def check_content_parts(parts: list[Any]) -> str | None:
    """Why a list of content parts is refused (``[1].type: ...`` or ``: an empty list ...``), or None."""
    if not parts:
        return ": an empty list of content parts"
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            return f"[{i}]: expected a content part object with a type, got {type_name(part)}"
        kind = decode(part.get("type"))
        if kind == TEXT:
            text = decode(part.get("text"))
            if not isinstance(text, str):
                return f"[{i}].text: expected a string, got {type_name(text)}"
        elif kind == IMAGE_URL:
            url = part.get(IMAGE_URL)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(decode(url), str) or not url:
                return f"[{i}].image_url.url: expected a URL, a data URL or a path, got {type_name(url)}"
        elif kind == IMAGE:
            if part.get(IMAGE) is not None and (why := _image_value_problem(part[IMAGE])):
                return f"[{i}].image: {why}"
        else:
            return f"[{i}].type: expected text, image_url or image, got {kind!r}"
    return None


def clean_content(content: Any) -> Any:
    """Parts without their null keys (Parquet structs have every field); text parts alone as one string."""
    if not isinstance(content, list):
        return content
    parts = [{k: (decode(v) if k != IMAGE else v) for k, v in p.items() if v is not None} for p in content]
    if all(p.get("type") == TEXT for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def part_image(part: dict[str, Any]) -> Any:
    """The image value a content part holds (None: a bare placeholder)."""
    if part.get("type") == IMAGE_URL:
        url = part[IMAGE_URL]
        return url.get("url") if isinstance(url, dict) else url
    return part.get(IMAGE)


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_KINDS


def has_image_parts(messages: Any) -> bool:
    """Whether chat messages hold any image part (placeholders included)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(is_image_part, m["content"]))
        for m in messages)
