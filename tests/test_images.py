"""``batchgen.images.load_image``: every kind of value a row or a caller holds, decoded now as RGB, and one line
naming the image for each way it can fail (issue 55)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from batchgen.images import ImageError, ImageLimits, describe, image_nbytes, load_image


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


RED = encoded(Image.new("RGB", (6, 4), (255, 0, 0)))


def test_every_kind_of_value(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "red.png").write_bytes(RED)
    values = [RED, bytearray(RED), memoryview(RED), {"bytes": RED, "path": None},
              {"bytes": None, "path": "sub/red.png"}, "sub/red.png", tmp_path / "sub" / "red.png", f"file://{tmp_path}/sub/red.png",
              "data:image/png;base64," + base64.b64encode(RED).decode(), Image.open(io.BytesIO(RED))]
    for value in values:
        image = load_image(value, base=tmp_path)
        assert image.mode == "RGB" and image.size == (6, 4) and image.getpixel((0, 0)) == (255, 0, 0), describe(value)
        assert image_nbytes(image) == 6 * 4 * 3


def test_modes_become_rgb_transparency_on_white_and_exif_upright():
    upright = load_image(RED)
    assert load_image(upright) is upright  # an RGB image loaded already is not copied (the engine loads it again)
    clear = load_image(encoded(Image.new("RGBA", (3, 3), (0, 0, 0, 0))))
    assert clear.mode == "RGB" and clear.getpixel((1, 1)) == (255, 255, 255)
    assert load_image(encoded(Image.new("L", (3, 3), 128))).getpixel((0, 0)) == (128, 128, 128)
    assert load_image(encoded(Image.new("RGB", (4, 2)), "JPEG")).size == (4, 2)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the upright image is 2 wide, 4 high
    assert load_image(encoded(Image.new("RGB", (4, 2)), "JPEG", exif=exif)).size == (2, 4)


@pytest.mark.parametrize("value, message", [
    (b"<html>nope</html>", "image bytes (17 bytes): not an image file PIL can read (it looks like text: HTML, XML "
                           "or JSON)"),
    (RED[:30], "image bytes (30 bytes): not an image file PIL can read (PNG data, truncated or corrupt (30 bytes))"),
    (b"", "image bytes (0 bytes): empty (0 bytes)"),
    ("", "empty image path or URL"),
    (7, "expected image bytes, a path, a URL or an {bytes, path} object, got an integer"),
    ({"type": "image"}, "image object without bytes or path (keys: type); expected {bytes, path} as a Hugging Face "
                        "Image feature holds it"),
    ("https://example.com/cat.png", "image 'https://example.com/cat.png': http(s) URLs are not fetched; copy the "
                                    "images to a bucket (s3://, gs://) or a disk the job can read"),
    ("data:image/png,rawbytes", "data:image/png,... (23 characters): only base64 data URLs are read "
                                "(data:image/png;base64,...)"),
    ("data:text/html;base64,PGI+", "data:text/html;base64,... (26 characters): a data URL of text/html, not an "
                                   "image"),
    ("data:image/png;base64,!!", "data:image/png;base64,... (24 characters): not valid base64"),
])
def test_bad_values_are_one_line_naming_the_image(value, message):
    with pytest.raises(ImageError) as e:
        load_image(value, where="in.jsonl line 3: field 'image'")
    assert str(e.value) == f"in.jsonl line 3: field 'image': {message}"


def test_missing_files_directories_and_limits(tmp_path):
    with pytest.raises(ImageError, match=r"^image 'gone.png': not found \(looked for .*/gone.png\)$"):
        load_image("gone.png", base=tmp_path)
    with pytest.raises(ImageError, match="a directory, not an image file"):
        load_image(str(tmp_path))
    big = encoded(Image.new("RGB", (300, 200)))
    (tmp_path / "big.png").write_bytes(big)
    with pytest.raises(ImageError, match=r"^image 'big.png': 300x200 pixels, more than the 50,000 an image may have"):
        load_image("big.png", base=tmp_path, limits=ImageLimits(max_pixels=50_000))
    with pytest.raises(ImageError, match=r"^image 'big.png': larger than the 100 bytes an image may be"):
        load_image("big.png", base=tmp_path, limits=ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match=r"image bytes \(.*\): .* bytes, larger than the 100 bytes an image may be"):
        load_image(big, limits=ImageLimits(max_bytes=100))


def test_bucket_urls(bucket):
    from bucketkit import upload

    upload(f"{bucket}/a/red.png", RED)
    assert load_image(f"{bucket}/a/red.png").size == (6, 4)
    assert load_image("../a/red.png", base=f"{bucket}/b").size == (6, 4)  # relative to a bucket file's directory
    with pytest.raises(ImageError, match=f"^image '{bucket}/a/none.png': not found$"):
        load_image(f"{bucket}/a/none.png")
