"""docs/scoring-embeddings.md: its Python examples run as written on the real SmolLM2 (the reward-model
example on a tiny random Qwen3 reward model in place of the Hub one), and print what they say; its job files
and its run-batch command run on tiny random models and write what the guide says."""

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
TASK_BLOCK = re.compile(r"<!-- readme-test: (?P<kind>task-data|task-job|run-batch-embeddings) ?(?P<arg>\S*) -->\n"
                        r"```\w*\n(?P<body>.*?)```", re.S)
TASK_BLOCKS = {(m["kind"], m["arg"]): m["body"] for m in TASK_BLOCK.finditer(GUIDE)}
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


@pytest.fixture
def guide_dir(tmp_path, tiny_model_dirs, monkeypatch):
    """The guide's data files in a fresh directory (the working directory), and its job files and
    run-batch command with tiny random models in place of SmolLM2 and the Hub reward model."""
    from scoring_kit import build_classifier

    reward = build_classifier(tmp_path / "reward", str(tiny_model_dirs["llama"]), ["reward"])
    models = {DOC_MODEL: str(tiny_model_dirs["llama"]), HUB_REWARD_MODEL: reward}
    for (kind, arg), body in TASK_BLOCKS.items():
        for written, here in models.items():
            body = body.replace(written, here)
        name = {"task-data": arg, "task-job": f"{arg}.yaml", "run-batch-embeddings": "run-batch.sh"}[kind]
        (tmp_path / name).write_text(body)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_guide_job_files_run(guide_dir):
    import pyarrow.parquet as pq
    from jobkit import cli

    assert {arg for kind, arg in TASK_BLOCKS if kind == "task-job"} == {"score", "embed", "classify"}
    for task in ("score", "embed", "classify"):
        r = cli("run", guide_dir / f"{task}.yaml")
        assert r.exit_code == 0, r.output
    scores = {row["id"]: row for row in pq.read_table(guide_dir / "out" / "scores").to_pylist()}
    assert scores["none"]["error"] == "answers.jsonl line 3: field 'answer': missing or null"
    for row_id in ("paris", "berlin"):
        row = scores[row_id]
        assert row["error"] is None and len(row["token_logprobs"]) == row["completion_tokens"] > 0
        assert row["completion_logprob"] == pytest.approx(sum(row["token_logprobs"]), abs=1e-4)
    embeddings = pq.read_table(guide_dir / "out" / "embeddings")
    assert str(embeddings.schema.field("embedding").type) == "fixed_size_list<element: float>[64]"
    import numpy

    assert numpy.stack(embeddings["embedding"].to_numpy(zero_copy_only=False)).shape == (3, 64)
    rewards = {row["id"]: row for row in pq.read_table(guide_dir / "out" / "rewards").to_pylist()}
    assert isinstance(rewards["paris"]["score"], float) and "probs" not in rewards["paris"]


def test_the_guide_run_batch_command_runs(guide_dir):
    import json
    import shlex

    from jobkit import cli
    from openai.types import Completion, CreateEmbeddingResponse

    words = shlex.split((guide_dir / "run-batch.sh").read_text().replace("\\\n", " "))
    assert words[:2] == ["batchgen", "run-batch"]
    r = cli(*words[1:])
    assert r.exit_code == 0, r.output
    lines = {x["custom_id"]: x for x in map(json.loads, (guide_dir / "embeddings.jsonl").read_text().splitlines())}
    assert len(CreateEmbeddingResponse.model_validate(lines["one"]["response"]["body"]).data) == 1
    two = lines["two"]["response"]["body"]["data"]
    assert len(two) == 2 and all(isinstance(d["embedding"], str) for d in two)  # base64
    body = lines["echo"]["response"]["body"]
    assert body["choices"][0]["text"].startswith("The capital of France is")
    assert body["choices"][0]["logprobs"]["token_logprobs"][0] is None
    Completion.model_validate({**body, "choices": [{**body["choices"][0], "logprobs": None}]})
