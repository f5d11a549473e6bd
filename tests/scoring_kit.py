"""What the scoring, embedding and classifier tests share: tiny models built on first use, random prompts,
and transformers' reference log-probabilities."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf
from conftest import build_tiny_model, save_random_model
from model_zoo import build_zoo_model


class ModelShelf:
    """Tiny random models under `root`, each built on first use: `shelf("llama")` -> its directory."""

    def __init__(self, root: Path):
        self.root, self.built = root, {}

    def __call__(self, arch: str) -> str:
        if arch not in self.built:
            build = build_zoo_model if arch in ("gemma2", "olmo2") else build_tiny_model
            self.built[arch] = str(build(self.root / arch, arch))
        return self.built[arch]


def make_prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


_forwards: dict[tuple[str, str], object] = {}


def transformers_forward(model_dir: str, cls, output):
    """A function: prompt -> `output` of transformers' `cls` run on it in float32 (the model loaded
    once per directory and class)."""
    key = (model_dir, cls.__name__)
    if key not in _forwards:
        hf = cls.from_pretrained(model_dir, dtype=torch.float32).eval()

        def run(prompt: list[int]) -> torch.Tensor:
            with torch.no_grad():
                return output(hf(torch.tensor([prompt])))

        _forwards[key] = run
    return _forwards[key]


def reference(model_dir: str):
    """A function: prompt -> log_softmax of transformers' logits for it (float32)."""
    return transformers_forward(model_dir, tf.AutoModelForCausalLM, lambda out: out.logits[0].float().log_softmax(-1))


def build_classifier(path: Path, base: str, labels: list[str]) -> str:
    """A tiny random `...ForSequenceClassification` model with `base`'s (a causal model dir's) config and
    tokenizer and `labels` as its classes (one label: a reward model)."""
    config = tf.AutoConfig.from_pretrained(base)
    cls = getattr(tf, config.architectures[0].replace("ForCausalLM", "ForSequenceClassification"))
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    config.architectures = None
    return str(save_random_model(path, cls, config, tf.AutoTokenizer.from_pretrained(base), 1))
