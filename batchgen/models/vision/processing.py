"""A prompt's images through the model's own image processor (transformers'), on the reader's thread: pixel
values, each image's placeholder token expanded to as many image tokens as the model gives it embeddings, a
content hash per image, and M-RoPE positions where the model has them.

A family says three things: its placeholder (the text one image stands as in a prompt), what the placeholder's
token becomes (`replacements`: a run of image tokens, or Idefics3's tiles with their tags), and (Qwen2-VL) the
prompt's 3-section positions. The expansion works on token ids, after the tokenizer's one batched call: the
placeholder is a special token, so the text around it tokenizes the same either way."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.models.vision.inputs import ImageInput, MultiModalInputs


def content_hash(pixel_values: torch.Tensor) -> int:
    """A 128-bit hash of an image's preprocessed pixels (and their shape): equal images, equal hashes, whatever
    their file format or path was; two images sharing one is not to be expected (the prefix cache relies on it)."""
    digest = hashlib.blake2b(str(tuple(pixel_values.shape)).encode(), digest_size=16)
    digest.update(pixel_values.detach().contiguous().cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass
class Replacement:
    """What one placeholder token becomes: token ids, and the image inputs among them (their `start` counted from
    the replacement's first token)."""

    token_ids: list[int]
    images: list[ImageInput]


class ImagePreprocessor:
    """The model's image processor and its placeholder expansion (see the module's docstring)."""

    placeholder: str  # what one image stands as in a prompt's text
    bidirectional = False  # an image's tokens attend to each other both ways (Gemma 3; see MultiModalInputs)

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any):
        from transformers import AutoImageProcessor

        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_token_id: int = hf_config.image_token_id
        self.placeholder_id = self.image_token_id  # the token one image stands as (Gemma 3: <start_of_image>)
        self.placeholder_token = tokenizer.convert_ids_to_tokens(self.placeholder_id) if tokenizer else None

    def replacements(self, images: list[Any]) -> list[Replacement]:
        """Per image, in order: what its placeholder token becomes. By default one run of image tokens (`split`)."""
        pieces = self.split(self.image_processor(images=images, return_tensors="pt"), len(images))
        return [Replacement([self.image_token_id] * length, [ImageInput(pixels, 0, length, content_hash(pixels), grid)])
                for pixels, grid, length in pieces]

    def split(self, processed: Any, count: int) -> list[tuple[torch.Tensor, tuple[int, int, int] | None, int]]:
        """Per image: (its pixel values, its grid or None, its number of image tokens)."""
        raise NotImplementedError

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[torch.Tensor | None, int]:
        """M-RoPE models: the prompt's [3, len] positions and its rope delta; others: (None, 0)."""
        return None, 0

    def expand(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], MultiModalInputs]:
        """`token_ids` with each placeholder token replaced by its image's tokens, and the images' inputs. A
        one-line ValueError when the placeholders and the images differ in number."""
        slots = [i for i, t in enumerate(token_ids) if t == self.placeholder_id]
        if len(slots) != len(images):
            raise ValueError(f"prompt: {len(slots)} image placeholder(s) ({self.placeholder_token!r}) in the text "
                             f"for {len(images)} image(s)")
        try:
            replacements = self.replacements(images)
        except (ValueError, TypeError):
            raise
        except Exception as e:  # the prompt's, not the engine's: one line, as the reader reports a row's error
            raise ValueError(f"prompt: the image processor failed on its images: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
        out: list[int] = []
        inputs: list[ImageInput] = []
        last = 0
        for slot, replacement in zip(slots, replacements, strict=True):
            out += token_ids[last:slot]
            for image in replacement.images:
                image.start += len(out)
                inputs.append(image)
            out += replacement.token_ids
            last = slot + 1
        out += token_ids[last:]
        mrope, delta = self.positions(out, inputs)
        return out, MultiModalInputs(inputs, mrope, delta, bidirectional=self.bidirectional)


class LlavaPreprocessor(ImagePreprocessor):
    """LLaVA: one image, one crop, one token per vision patch (and the CLS token with the "full" strategy)."""

    placeholder = "<image>"

    def split(self, processed, count):
        vision = self.hf_config.vision_config
        length = (vision.image_size // vision.patch_size) ** 2
        if self.hf_config.vision_feature_select_strategy == "full":
            length += 1
        pixels = processed["pixel_values"]
        return [(pixels[i:i + 1], None, length) for i in range(count)]


class Qwen2VLPreprocessor(ImagePreprocessor):
    """Qwen2-VL and Qwen2.5-VL: an image is a grid of 14x14 patches (its size follows the image's), merged 2x2
    into one token."""

    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, model_dir, hf_config, tokenizer):
        super().__init__(model_dir, hf_config, tokenizer)
        self.merge = hf_config.vision_config.spatial_merge_size

    def split(self, processed, count):
        grids = [tuple(int(x) for x in g) for g in processed["image_grid_thw"]]
        sizes = [t * h * w for t, h, w in grids]
        pixels = torch.split(processed["pixel_values"], sizes)
        return [(p, g, n // self.merge**2) for p, g, n in zip(pixels, grids, sizes, strict=True)]

    def positions(self, token_ids, images):
        """Text tokens count up by one in all three sections; an image's tokens take (its first position, row,
        column) from where the text before it stopped, and the text after it goes on from the image's widest
        side (Qwen2-VL's `get_rope_index`, for still images)."""
        parts, position, index = [], 0, 0
        for image in images:
            text = image.start - index
            parts.append(torch.arange(position, position + text).expand(3, -1))
            position += text
            _, h, w = (g // m for g, m in zip(image.grid_thw, (1, self.merge, self.merge), strict=True))
            rows = torch.arange(h).repeat_interleave(w)
            cols = torch.arange(w).repeat(h)
            parts.append(torch.stack([torch.zeros_like(rows), rows, cols]) + position)
            position += max(h, w)
            index = image.end
        parts.append(torch.arange(position, position + len(token_ids) - index).expand(3, -1))
        mrope = torch.cat(parts, dim=1)
        return mrope, int(mrope.max()) + 1 - len(token_ids)


class Idefics3Preprocessor(ImagePreprocessor):
    """Idefics3 / SmolVLM: an image is split into tiles of the vision tower's size (rows x columns, row by row,
    each after its `<row_r_col_c>` tag) and a global view, each tile a run of image tokens; the tags and
    separators are the processor's text, tokenized once per grid shape."""

    placeholder = "<image>"

    def __init__(self, model_dir, hf_config, tokenizer):
        super().__init__(model_dir, hf_config, tokenizer)
        vision = hf_config.vision_config
        self.tile_tokens = (vision.image_size // vision.patch_size) ** 2 // hf_config.scale_factor**2
        self._layouts: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def layout(self, rows: int, cols: int) -> tuple[list[int], list[int]]:
        """The token ids of an image of rows x cols tiles, and where each tile's run of image tokens starts."""
        if (rows, cols) not in self._layouts:
            tiles = "<image>" * self.tile_tokens
            text = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{tiles}" for c in range(cols))
                           + "\n" for r in range(rows))
            text += ("\n" if rows or cols else "") + f"<fake_token_around_image><global-img>{tiles}"
            text += "<fake_token_around_image>"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            starts = [i for i, t in enumerate(ids) if t == self.image_token_id and (i == 0 or ids[i - 1] != t)]
            self._layouts[(rows, cols)] = (ids, starts)
        return self._layouts[(rows, cols)]

    def replacements(self, images):
        processed = self.image_processor(images=[images], return_tensors="pt", return_row_col_info=True)
        pixels, masks = processed["pixel_values"][0], processed["pixel_attention_mask"][0]
        out, tile = [], 0
        for rows, cols in zip(processed["rows"][0], processed["cols"][0], strict=True):
            ids, starts = self.layout(rows, cols)
            inputs = []
            for start in starts:
                tile_pixels = pixels[tile:tile + 1]
                inputs.append(ImageInput(tile_pixels, start, self.tile_tokens, content_hash(tile_pixels),
                                         pixel_mask=masks[tile:tile + 1]))
                tile += 1
            out.append(Replacement(list(ids), inputs))
        return out


class Mistral3Preprocessor(ImagePreprocessor):
    """Mistral 3 (Pixtral's vision): an image keeps its aspect, one token per 2x2 merged patches, written row by
    row, each row ending in `[IMG_BREAK]` and the last in `[IMG_END]`; each row's run is an ImageInput of the
    same image (see ImageInput.feature_offset)."""

    placeholder = "[IMG]"

    def __init__(self, model_dir, hf_config, tokenizer):
        super().__init__(model_dir, hf_config, tokenizer)
        self.token_size = hf_config.vision_config.patch_size * hf_config.spatial_merge_size
        self.break_id, self.end_id = tokenizer.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])

    def replacements(self, images):
        processed = self.image_processor(images=images, return_tensors="pt")
        out = []
        for pixels, (height, width) in zip(processed["pixel_values"], processed["image_sizes"].tolist(), strict=True):
            pixels = pixels[None, :, :height, :width]  # without the batch's padding
            rows, cols = height // self.token_size, width // self.token_size
            digest = content_hash(pixels)
            ids = ([self.image_token_id] * cols + [self.break_id]) * rows
            ids[-1] = self.end_id
            inputs = [ImageInput(pixels, r * (cols + 1), cols, digest, feature_offset=r * cols) for r in range(rows)]
            out.append(Replacement(ids, inputs))
        return out


class Gemma3Preprocessor(ImagePreprocessor):
    """Gemma 3: the prompt's `<start_of_image>` becomes `\n\n<start_of_image>`, `mm_tokens_per_image` image
    tokens, `<end_of_image>\n\n` (Gemma3Processor's `full_image_sequence`); one crop an image. The image's
    tokens attend to each other both ways."""

    placeholder = "<start_of_image>"
    bidirectional = True

    def __init__(self, model_dir, hf_config, tokenizer):
        super().__init__(model_dir, hf_config, tokenizer)
        if getattr(self.image_processor, "do_pan_and_scan", False):
            raise ValueError("model: Gemma 3's pan-and-scan crops (do_pan_and_scan) are not supported; set it to "
                             "false in preprocessor_config.json")
        self.placeholder_id = hf_config.boi_token_index
        self.placeholder_token = tokenizer.convert_ids_to_tokens(self.placeholder_id) if tokenizer else None
        self.length = hf_config.mm_tokens_per_image
        around = tokenizer("\n\n", add_special_tokens=False)["input_ids"] if tokenizer else []
        self.before = [*around, hf_config.boi_token_index]
        self.after = [hf_config.eoi_token_index, *around]

    def replacements(self, images):
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        out = []
        for i in range(len(images)):
            one = pixels[i:i + 1]
            ids = [*self.before, *[self.image_token_id] * self.length, *self.after]
            out.append(Replacement(ids, [ImageInput(one, len(self.before), self.length, content_hash(one))]))
        return out


class ProcessorPreprocessor(ImagePreprocessor):
    """The generic path's families (models/vision/generic.py): the model's own processor (`AutoProcessor`) expands
    one image's placeholder, alone; its image tokens come in one run (LLaVA-NeXT's crops and image newlines) or
    several (Aya Vision's tiles between their tags), each run an ImageInput sharing the image's pixel values (see
    ImageInput.feature_offset) and the processor's other tensors (`extras`)."""

    TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "pixel_values"})

    def __init__(self, model_dir, hf_config, tokenizer):
        from transformers import AutoProcessor

        super().__init__(model_dir, hf_config, tokenizer)
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.placeholder = self.processor.image_token
        self.placeholder_id = self.processor.tokenizer.convert_tokens_to_ids(self.placeholder)
        self.placeholder_token = self.placeholder

    def replacements(self, images):
        out = []
        for one in images:
            processed = self.processor(text=[self.placeholder], images=[one], return_tensors="pt",
                                       add_special_tokens=False)
            ids = processed["input_ids"][0].tolist()
            pixels = processed["pixel_values"]
            extras = {k: v for k, v in processed.items() if k not in self.TEXT_KEYS and isinstance(v, torch.Tensor)}
            digest, inputs, offset = content_hash(pixels), [], 0
            for start, length in token_runs(ids, self.image_token_id):
                inputs.append(ImageInput(pixels, start, length, digest, feature_offset=offset, extras=extras))
                offset += length
            out.append(Replacement(ids, inputs))
        return out


def token_runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `token_ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


PREPROCESSORS = {"llava": LlavaPreprocessor, "qwen2_vl": Qwen2VLPreprocessor, "qwen2_5_vl": Qwen2VLPreprocessor,
                 "idefics3": Idefics3Preprocessor, "smolvlm": Idefics3Preprocessor,
                 "mistral3": Mistral3Preprocessor, "gemma3": Gemma3Preprocessor,
                 "llava_next": ProcessorPreprocessor, "aya_vision": ProcessorPreprocessor}


def load_preprocessor(model_dir: Path, hf_config: Any, tokenizer: Any) -> ImagePreprocessor | None:
    """The image preprocessor of a vision-language model (None for a text model). A tokenizer without a chat
    template gets the processor's (`chat_template.json`, where llava-hf's models keep it)."""
    family = PREPROCESSORS.get(getattr(hf_config, "model_type", ""))
    if family is None:
        return None
    if tokenizer is not None and not tokenizer.chat_template:
        tokenizer.chat_template = processor_chat_template(Path(model_dir))
    return family(model_dir, hf_config, tokenizer)


def processor_chat_template(model_dir: Path) -> str | None:
    """The chat template a processor saved beside the model: chat_template.json's, else chat_template.jinja."""
    saved = model_dir / "chat_template.json"
    if saved.is_file():
        return json.loads(saved.read_text(encoding="utf-8")).get("chat_template")
    jinja = model_dir / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None
