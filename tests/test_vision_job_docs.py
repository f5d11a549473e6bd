"""docs/vision.md's job files, data files and run-batch command, run as written on a tiny random Qwen2-VL in place
of the Hub model they name (tests/vision_kit.py), with small pictures where they name pictures."""

from __future__ import annotations

import io
import json
import re
import shlex

import pyarrow as pa
import pytest
import yaml
from jobkit import REPO, cli, read, write_parquet
from vision_kit import build_qwen2_vl, image

GUIDE = (REPO / "docs" / "vision.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"<!-- readme-test: (?P<kind>vision-[\w-]+) ?(?P<arg>\S*) -->\n```\w*\n(?P<body>.*?)```", re.S)
BLOCKS = {(m["kind"], m["arg"]): m["body"] for m in BLOCK.finditer(GUIDE)}
DOC_MODEL = "Qwen/Qwen2-VL-2B-Instruct"
ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 512}


def png(seed: int) -> bytes:
    out = io.BytesIO()
    image(seed, (40, 30)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The guide's working directory: its pictures in pics/, the real engine."""
    monkeypatch.delenv("BATCHGEN_ENGINE", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "cat.png").write_bytes(png(1))
    (tmp_path / "pics" / "dog.png").write_bytes(png(2))
    return tmp_path


def job_file(here, name: str, model) -> object:
    """The guide's job file ``name`` with the tiny model in place of the Hub one (and a small KV cache)."""
    spec = yaml.safe_load(BLOCKS[("vision-job", name)])
    assert spec["model"] == DOC_MODEL
    spec["model"] = {"path": str(model), **ENGINE}
    path = here / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_the_guide_has_its_examples():
    assert set(BLOCKS) == {("vision-job", "caption"), ("vision-job", "questions"), ("vision-data", "questions.jsonl"),
                           ("vision-data", "requests.jsonl"), ("vision-run-batch", "")}


def test_caption_job(here, model):
    write_parquet(here / "photos.parquet", pa.table({
        "id": ["p1", "p2", "p3"], "prompt": ["A photo of"] * 3, "image": pa.array([png(i) for i in range(3)])}))
    result = cli("run", job_file(here, "caption", model))
    assert result.exit_code == 0, result.output
    rows = read(here / "out" / "captions")[1]
    assert sorted(rows) == ["p1", "p2", "p3"] and all(r["error"] is None and r["text"] for r in rows.values())


def test_questions_job(here, model):
    (here / "questions.jsonl").write_text(BLOCKS[("vision-data", "questions.jsonl")])
    result = cli("run", job_file(here, "questions", model))
    assert result.exit_code == 0, result.output
    rows = read(here / "out" / "answers")[1]
    assert sorted(rows) == ["q1", "q2", "q3"] and all(r["error"] is None and r["text"] for r in rows.values())


def test_run_batch(here, model):
    requests = BLOCKS[("vision-data", "requests.jsonl")]
    gone = json.loads(requests.splitlines()[0])
    gone["custom_id"] = "gone"
    gone["body"]["messages"][0]["content"][1]["image_url"]["url"] = "pics/gone.png"
    (here / "requests.jsonl").write_text(requests + "\n" + json.dumps(gone) + "\n")
    command = BLOCKS[("vision-run-batch", "")].strip()
    args = shlex.split(command.replace(DOC_MODEL, str(model)))
    assert args[:2] == ["batchgen", "run-batch"]
    result = cli(*args[1:], "--max-model-len", "512", "--kv-cache-memory", "16MiB", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    results = (here / "out" / "vision" / "results.jsonl").read_text().splitlines()
    lines = {x["custom_id"]: x for x in map(json.loads, results)}
    assert lines["cat"]["error"] is None and lines["dot"]["error"] is None
    assert lines["cat"]["response"]["body"]["choices"][0]["message"]["content"]
    assert lines["gone"]["error"]["message"].endswith(  # the request file as run-batch was given it, then:
        f"requests.jsonl line 4: field 'body.messages': message [0].content[1]: image 'pics/gone.png': not found "
        f"(looked for {here}/pics/gone.png)")
