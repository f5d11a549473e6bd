"""A fake vision-language engine for job tests: ``FakeLLM`` that takes images in the engine's two prompt
shapes and checks them (decoded RGB PIL images, nothing else). An image becomes the text ``<image:DIGEST>``
in front of the prompt (or in place of its part), DIGEST a hash of its pixels, so a row's output depends
on its images as on its text. Every prompt it is given is recorded in ``RECORDED`` (one process) and, when
``FAKE_VLM_LOG`` names a file, appended there as a JSON line (subprocess runs)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from fake_llm import FakeLLM
from PIL import Image

RECORDED: list[dict[str, Any]] = []


def digest(image: Any) -> str:
    assert isinstance(image, Image.Image), f"an image must come as a PIL image, got {type(image).__name__}"
    assert image.mode == "RGB", f"images come as RGB, got {image.mode}"
    assert getattr(image, "fp", None) is None or image.im is not None, "images come decoded"
    return hashlib.sha256(image.tobytes() + repr(image.size).encode()).hexdigest()[:8]


def _as_text(prompt: Any) -> tuple[Any, dict[str, Any]]:
    """The prompt with its images as ``<image:DIGEST>`` text, and what is recorded of it."""
    if isinstance(prompt, dict):
        assert set(prompt) == {"prompt", "multi_modal_data"}, prompt.keys()
        assert set(prompt["multi_modal_data"]) == {"image"}
        images = prompt["multi_modal_data"]["image"]
        assert isinstance(images, list) and images, "multi_modal_data.image is a non-empty list"
        tags = [f"<image:{digest(im)}>" for im in images]
        return "".join(tags) + prompt["prompt"], {"shape": "prompt", "text": prompt["prompt"], "images": tags,
                                                 "sizes": [list(im.size) for im in images]}
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        messages, record = [], {"shape": "chat", "messages": []}
        for m in prompt:
            content = m["content"]
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part["type"] == "image":
                        texts.append(f"<image:{digest(part['image'])}>")
                    else:
                        assert part["type"] == "text", part
                        texts.append(part["text"])
                content = "".join(texts)
            messages.append({"role": m["role"], "content": content})
            record["messages"].append(dict(messages[-1]))
        return messages, record
    return prompt, {"shape": "text", "prompt": prompt}


class FakeVLM(FakeLLM):
    supports_images = True

    def encode_batch(self, prompts: list[Any]) -> list[Any]:
        """As ``LLM.encode_batch``: prompts ready for ``add_request`` (here: checked, left as they are)."""
        out = []
        for p in prompts:
            try:
                _as_text(p)
                out.append(p)
            except AssertionError as e:  # a shape the engine would refuse
                out.append(ValueError(f"prompt: {e}"))
        return out

    def add_request(self, request_id: str, prompt: Any, params: Any, **extra: Any) -> None:
        text, record = _as_text(prompt)
        RECORDED.append(record)
        log = os.environ.get("FAKE_VLM_LOG")
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        super().add_request(request_id, text, params)
