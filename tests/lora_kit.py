"""Random PEFT LoRA adapters for the LoRA tests (tests/test_lora.py, tests/test_lora_jobs.py, tests/test_gpu.py),
and the transformers greedy reference they are checked against."""

from __future__ import annotations

import peft
import torch
import transformers as tf


def make_adapter(base_dir, out_dir, rank: int, targets, seed: int, rslora: bool = False,
                 auto_class=tf.AutoModelForCausalLM, **extra):
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False) on the base model (loaded by
    `auto_class`), saved."""
    base = auto_class.from_pretrained(base_dir, dtype=torch.float32)
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


def prompts_of(vocab: int, lens=(3, 17, 40, 90), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(model, prompts: list[list[int]], max_new: int = 16, **generate) -> list[list[int]]:
    """transformers' (or PEFT's) greedy continuation of each prompt alone, exactly max_new tokens, on the
    model's device; `generate`: more arguments of `generate` (a repetition penalty, bad words)."""
    outs = []
    for p in prompts:
        x = torch.tensor([p], device=model.device)
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0, **generate)
        outs.append(out[0, len(p):].tolist())
    return outs
