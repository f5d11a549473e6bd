"""Turns a .gguf file into a cached Hugging Face model directory (float weights, tokenizer).

transformers dequantizes GGUF weights on load; we save the result once as safetensors so later
runs load a plain directory in seconds. The cache key is the file's absolute path, size and mtime.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE", Path.home() / ".cache" / "batchgen"))


def converted_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def convert_gguf(gguf_path: str | os.PathLike) -> Path:
    """Returns the converted directory for `gguf_path`, converting on first use."""
    gguf_path = Path(gguf_path)
    target = converted_dir(gguf_path)
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
        model.hf_quantizer = None  # save_pretrained refuses a model that still looks quantized
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except FileExistsError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
