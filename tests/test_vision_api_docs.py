"""docs/vision.md's Python examples run as written, on the tiny Qwen2-VL standing in for Qwen2-VL-2B-Instruct
in a HOME of their own, with a photo.jpg in the working directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vision_kit import build_qwen2_vl, image

DOC = Path(__file__).resolve().parent.parent / "docs" / "vision.md"
BLOCK = re.compile(r"<!-- readme-test: python (?P<name>[\w-]+) -->\n```python\n(?P<body>.*?)```", re.S)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vision_home")
    model = root / ".cache" / "batchgen" / "models" / "Qwen2-VL-2B-Instruct"
    model.parent.mkdir(parents=True)
    model.symlink_to(build_qwen2_vl(root / "qwen2_vl"), target_is_directory=True)
    image(7, (120, 90)).save(root / "photo.jpg")
    return root


def test_python_examples_run(home, monkeypatch, capsys):
    """Both examples, one after the other, in this interpreter (no second start-up): three lines of text."""
    bodies = {m["name"]: m["body"] for m in BLOCK.finditer(DOC.read_text(encoding="utf-8"))}
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    for name in ("vision", "vision-chat"):
        exec(compile(bodies[name], f"docs/vision.md ({name})", "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(line.strip() for line in lines), lines
