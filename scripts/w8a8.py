#!/usr/bin/env python
"""Writes a float model as an int8 W8A8 checkpoint with the compressed-tensors library (pip install
compressed-tensors): the scheme llm-compressor's `W8A8` preset names (weights per output feature, activations
per token, dynamic, symmetric), each weight's scales from its own range (round to nearest; llm-compressor's
SmoothQuant and GPTQ calibrate before this step), compressed and saved as llm-compressor saves. The head stays
in float. For scripts/bench_int8.py --w8a8 and tests/test_int8_checkpoint.py: batchgen reads such checkpoints
(docs/int8.md), it does not write them.

    .venv/bin/python scripts/w8a8.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def write_w8a8(src: Path, dst: Path, ignore: tuple[str, ...] = ("lm_head",), strategy: str = "channel") -> Path:
    """`strategy`: the weights' scales, "channel" (one per output feature, the preset's) or "tensor" (one)."""
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    weights = INT8_W8A8["weights"].model_copy(update={"strategy": strategy})
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=INT8_W8A8["input_activations"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                w = module.weight.float()
                per_row = strategy == "channel"
                low, high = (w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)) if per_row else (
                    w.amin().reshape(1), w.amax().reshape(1))
                scale, _ = calculate_qparams(low, high, scheme.weights)
                module.weight_scale.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    copy_tokenizer(src, dst)
    return dst


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer's (and generation config's) files of the model at `src`, where it has them."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(write_w8a8(Path(sys.argv[1]).expanduser(), Path(sys.argv[2]).expanduser()))
