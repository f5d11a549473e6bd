"""Random PEFT LoRA adapters for the LoRA tests (tests/test_lora.py, tests/test_lora_jobs.py)."""

from __future__ import annotations

import peft
import torch
import transformers as tf


def make_adapter(base_dir, out_dir, rank: int, targets, seed: int, rslora: bool = False, **extra):
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False) on the base model, saved."""
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                             use_rslora=rslora, **extra)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # PEFT's random B is small; larger makes the adapter change the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir
