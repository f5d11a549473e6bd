"""Images for vision-language prompts: any value a row, a chat message or a caller can hold, loaded as an
RGB ``PIL.Image`` decoded now (not lazily), or an ``ImageError`` in one line naming the image.

Accepted values:
- a ``PIL.Image.Image`` (as it is, converted to RGB);
- raw bytes of an encoded image (a Parquet binary column);
- a Hugging Face datasets ``Image`` feature value, ``{"bytes": ..., "path": ...}`` (its bytes, else its path);
- a ``data:image/...;base64,...`` URL;
- a path or URL read through batchgen's storage layer: a local path (a relative one is relative to
  ``base``, a job's input file's directory; without ``base``, to the working directory),
  ``file://``, ``s3://``, ``gs://`` (and any store the storage layer knows).

``http(s)://`` URLs are refused: an offline batch node often has no internet access, and a job that
silently depends on a web server is not reproducible; copy the images to a bucket or a disk.

Bounds, against decompression bombs and runaway memory: an encoded image of more than
``ImageLimits.max_bytes`` is refused before it is read whole, and one of more than
``ImageLimits.max_pixels`` before it is decoded. Images with transparency are laid on white (as vLLM
does), and a photo's EXIF orientation is applied (as transformers' ``load_image`` does).

This module is a low layer: it knows the storage layer and PIL, nothing of the engine or of jobs.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from PIL import Image, ImageOps, UnidentifiedImageError

from .storage import Location, StorageOptions, location

MiB = 1 << 20
_DATA_URL = re.compile(r"^data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)
_WEB = re.compile(r"^https?://", re.IGNORECASE)
_SHOWN = 80  # characters of a value shown in a message
_ORIENTATION = 0x0112  # the EXIF tag of a photo's orientation


class ImageError(ValueError):
    """An image that cannot be used; the message is one line naming the image (and where it came from)."""


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be. Defaults fit any camera photo (a 48-megapixel phone photo is
    8000 x 6000) and refuse a bomb: 64 MiB encoded, 64 megapixels decoded (192 MiB as RGB)."""

    max_bytes: int = 64 * MiB
    max_pixels: int = 64_000_000


def load_image(value: Any, *, where: str = "", base: Location | Path | str | None = None,
               storage: StorageOptions | None = None, limits: ImageLimits | None = None) -> Image.Image:
    """``value`` as an RGB image, decoded now. ``where`` leads the error message (``"in.jsonl line 7:
    field 'images' [1]"``); ``base`` is the directory relative paths are read from; ``storage`` how to
    reach buckets. Raises ``ImageError``."""
    limits = limits or ImageLimits()
    try:
        return _load(value, base, storage, limits)
    except ImageError as e:
        raise ImageError(f"{where}: {e}" if where else str(e)) from None


def image_nbytes(image: Image.Image) -> int:
    """The memory a decoded image holds (its pixels), for bounding how many are in flight."""
    width, height = image.size
    return width * height * len(image.getbands())


def describe(value: Any) -> str:
    """An image value as messages name it: its path or URL (shortened), or what kind of value it is."""
    if isinstance(value, Image.Image):
        return f"PIL image {value.size[0]}x{value.size[1]}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"image bytes ({len(value):,} bytes)"
    if isinstance(value, dict):
        if isinstance(value.get("path"), str) and value["path"]:
            return describe(value["path"])
        if value.get("bytes") is not None:
            return describe(value["bytes"])
        return "image object"
    if isinstance(value, str):
        if _DATA_URL.match(value):
            head = value.split(",", 1)[0]
            return f"{head},... ({len(value):,} characters)"
        shown = value if len(value) <= _SHOWN else "..." + value[-(_SHOWN - 3):]
        return f"image {shown!r}"
    return f"{type(value).__name__} value"


# ------------------------------------------------------------------------------------ internals


def _load(value: Any, base: Location | Path | str | None, storage: StorageOptions | None,
          limits: ImageLimits) -> Image.Image:
    if isinstance(value, Image.Image):
        _check_pixels(value, describe(value), limits)
        return _finish(value, describe(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        _check_bytes(len(data), describe(data), limits)
        return _decode(data, describe(data), limits)
    if isinstance(value, dict):
        return _load_feature(value, base, storage, limits)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ImageError(f"expected image bytes, a path, a URL or an {{bytes, path}} object, got "
                         f"{_type_name(value)}")
    text = value.strip()
    if not text:
        raise ImageError("empty image path or URL")
    if _DATA_URL.match(text):
        return _decode(_data_url_bytes(text, limits), describe(text), limits)
    if _WEB.match(text):
        raise ImageError(f"{describe(text)}: http(s) URLs are not fetched; copy the images to a bucket "
                         "(s3://, gs://) or a disk the job can read")
    return _decode(_read(text, base, storage, limits), describe(text), limits)


def _load_feature(value: dict[str, Any], base: Location | Path | str | None, storage: StorageOptions | None,
                  limits: ImageLimits) -> Image.Image:
    """A Hugging Face ``Image`` feature value: its bytes when it has them (a dataset's own copy), else its path."""
    data, path = value.get("bytes"), value.get("path")
    if data is not None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ImageError(f"image object: 'bytes' must be binary, got {_type_name(data)}")
        shown = describe(path) if isinstance(path, str) and path else describe(data)
        _check_bytes(len(data), shown, limits)
        return _decode(bytes(data), shown, limits)
    if isinstance(path, str) and path:
        return _load(path, base, storage, limits)
    keys = ", ".join(sorted(map(str, value))) or "none"
    raise ImageError(f"image object without bytes or path (keys: {keys}); expected {{bytes, path}} as a "
                     "Hugging Face Image feature holds it")


def _data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    m = _DATA_URL.match(url)
    assert m is not None
    shown = describe(url)
    mime, params = m.group(1).lower(), m.group(2).lower().split(";")
    if mime and not mime.startswith("image/"):
        raise ImageError(f"{shown}: a data URL of {mime}, not an image")
    if "base64" not in params:
        raise ImageError(f"{shown}: only base64 data URLs are read (data:image/png;base64,...)")
    payload = url[m.end():]
    _check_bytes(len(payload) * 3 // 4, shown, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{shown}: not valid base64") from None


def _read(text: str, base: Location | Path | str | None, storage: StorageOptions | None,
          limits: ImageLimits) -> bytes:
    """The bytes of a path or URL, refused past ``max_bytes`` without reading further."""
    shown = describe(text)
    try:
        loc = location(text, base, storage)
    except OSError as e:  # a store the storage layer cannot open (a missing library)
        raise ImageError(f"{shown}: {e}") from None
    if not loc.is_local and ".." in loc.path.split("/"):  # a path relative to a bucket file's directory
        loc = Location(loc.store, posixpath.normpath(loc.path))
    where = "" if str(loc) == text else f" (looked for {loc})"
    try:
        with loc.open_read() as f:
            data = _read_bounded(f, limits.max_bytes)
    except FileNotFoundError:
        raise ImageError(f"{shown}: not found{where}") from None
    except IsADirectoryError:
        raise ImageError(f"{shown}: a directory, not an image file{where}") from None
    except PermissionError:
        raise ImageError(f"{shown}: permission denied{where}") from None
    except OSError as e:  # StorageError: one line naming the URL already
        why = str(e) if str(loc) in str(e) else f"{e.strerror or e}{where}"
        raise ImageError(f"{shown}: cannot read it: {why}") from None
    if data is None:
        raise ImageError(f"{shown}: larger than the {_size(limits.max_bytes)} an image may be{where}")
    return data


def _read_bounded(f: IO[bytes], limit: int) -> bytes | None:
    data = f.read(limit + 1)
    return None if len(data) > limit else data


def _decode(data: bytes, shown: str, limits: ImageLimits) -> Image.Image:
    if not data:
        raise ImageError(f"{shown}: empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageError(f"{shown}: more pixels than PIL decodes (Image.MAX_IMAGE_PIXELS); a decompression "
                         "bomb or a huge scan") from None
    except UnidentifiedImageError:
        raise ImageError(f"{shown}: not an image file PIL can read ({_magic(data)})") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{shown}: cannot decode it: {_one_line(e)}") from None
    _check_pixels(image, shown, limits)
    return _finish(image, shown)


def _finish(image: Image.Image, shown: str) -> Image.Image:
    """Decoded now (a lazily decoded image fails later, on another thread), upright and RGB."""
    try:
        image.load()
        if image.getexif().get(_ORIENTATION, 1) != 1:  # exif_transpose copies even an upright image
            image = ImageOps.exif_transpose(image)
        if image.mode == "RGB":
            return image
        if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
            rgba = image.convert("RGBA")
            out = Image.new("RGB", rgba.size, (255, 255, 255))
            out.paste(rgba, mask=rgba.getchannel("A"))
            return out
        return image.convert("RGB")
    except Image.DecompressionBombError:
        raise ImageError(f"{shown}: more pixels than PIL decodes (Image.MAX_IMAGE_PIXELS)") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated data, a broken stream
        raise ImageError(f"{shown}: truncated or corrupt: {_one_line(e)}") from None


def _check_bytes(n: int, shown: str, limits: ImageLimits) -> None:
    if n > limits.max_bytes:
        raise ImageError(f"{shown}: {_size(n)}, larger than the {_size(limits.max_bytes)} an image may be")


def _check_pixels(image: Image.Image, shown: str, limits: ImageLimits) -> None:
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(f"{shown}: {width}x{height} pixels, more than the {limits.max_pixels:,} an image may "
                         "have (a decompression bomb, or a scan to shrink first)")
    if width == 0 or height == 0:
        raise ImageError(f"{shown}: {width}x{height} pixels, an empty image")


_SIGNATURES = {b"\x89PNG": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF8": "GIF", b"BM": "BMP"}


def _magic(data: bytes) -> str:
    head = data[:16]
    kind = next((name for sig, name in _SIGNATURES.items() if head.startswith(sig)), None)
    if kind is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        kind = "WebP"
    if kind is not None:
        return f"{kind} data, truncated or corrupt ({len(data):,} bytes)"
    if head.lstrip().startswith((b"<", b"{", b"[")):
        return "it looks like text: HTML, XML or JSON"
    return f"{len(data):,} bytes starting {head[:8].hex(' ')}"


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n:,} bytes"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _type_name(v: Any) -> str:
    return {list: "a list", int: "an integer", float: "a number", bool: "a boolean", type(None): "null"}.get(
        type(v), type(v).__name__)


__all__ = ["ImageError", "ImageLimits", "describe", "image_nbytes", "load_image"]
