"""docs/vision.md's Python examples run as written, on the tiny Qwen2-VL standing in for Qwen2-VL-2B-Instruct
in a HOME of their own, with a photo.jpg in the working directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def test_python_examples_run(home):
    """Both examples, one after the other in one interpreter (one start-up): three lines of text."""
    bodies = {m["name"]: m["body"] for m in BLOCK.finditer(DOC.read_text(encoding="utf-8"))}
    script = bodies["vision"] + "\n" + bodies["vision-chat"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HOME": str(home)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=home, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.strip() for line in lines), proc.stdout
