"""docs/scoring-embeddings.md: its Python examples run as written on the real SmolLM2 (the reward-model
example on a tiny random Qwen3 reward model in place of the Hub one), and print what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import transformers as tf
from conftest import _tiny_tokenizer, save_random_model
from jobkit import REPO

GUIDE = (REPO / "docs" / "scoring-embeddings.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"<!-- readme-test: python (?P<arg>\S+) -->\n```python\n(?P<body>.*?)```", re.S)
EXAMPLES = {m["arg"]: m["body"] for m in BLOCK.finditer(GUIDE)}
DOC_MODEL = "~/.cache/batchgen/models/SmolLM2-135M-Instruct"
HUB_REWARD_MODEL = "Skywork/Skywork-Reward-V2-Qwen3-0.6B"


def run(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_the_guide_has_its_examples():
    assert set(EXAMPLES) == {"prompt-logprobs", "score", "embed", "classify", "mixed"}
    assert all(DOC_MODEL in body for arg, body in EXAMPLES.items() if arg != "classify")


@pytest.mark.slow
@pytest.mark.parametrize("arg", ["prompt-logprobs", "score", "embed", "mixed"])
def test_smollm2_examples(smollm2_dir, arg):
    lines = run(EXAMPLES[arg].replace(DOC_MODEL, str(smollm2_dir)))
    if arg == "prompt-logprobs":
        assert lines[0] == "None" and len(lines) > 5
        assert all(line.rsplit(" ", 1)[1] in ("2", "3") for line in lines[1:])  # top 2, and the token itself
    elif arg == "score":
        assert lines[-1] == "more likely: The capital of France is Paris."
    elif arg == "embed":
        assert lines[0] == "torch.Size([3, 576])"
    else:
        assert sorted(line.split()[0] for line in lines) == ["emb", "gen", "score"]


def test_reward_model_example(tmp_path):
    config = tf.Qwen3Config(vocab_size=len(_tiny_tokenizer()), hidden_size=128, intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_labels=1, pad_token_id=0)
    model_dir = save_random_model(tmp_path / "reward", tf.Qwen3ForSequenceClassification, config, _tiny_tokenizer(), 0)
    lines = run(EXAMPLES["classify"].replace(HUB_REWARD_MODEL, str(model_dir)))
    labels, logits = lines[0].split("] ")
    assert labels == "['LABEL_0'" and len(eval(logits)) == 1
