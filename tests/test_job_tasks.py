"""Job files with `task: score | embed | classify`, and generate jobs writing prompt logprobs, on the real
engine: every row exactly once through SIGKILL and resume and through two shards, the numbers bit for bit
those of an uninterrupted run and of the Python API (LLM.score_completions, embed, classify, generate)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import yaml
from jobkit import check_kill_resume_and_shards, cli, read, write_job, write_parquet
from openai.types import CreateEmbeddingResponse
from scoring_kit import ModelShelf, build_classifier, make_prompts

from batchgen import LLM, SamplingParams
from batchgen.job.engine import default_factory
from batchgen.job.run.runner import Runner
from batchgen.job.shard import Shard
from batchgen.job.spec import load_job
from batchgen.pooling_params import ScoringParams

ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256, "max_num_batched_tokens": 64,
          "max_num_seqs": 8}
TOO_LONG = 300  # tokens: more than max_model_len


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("job_task_models")
    shelf = ModelShelf(root)
    built = {"llama": shelf("llama")}
    built["classifier"] = build_classifier(root / "classifier", built["llama"], ["negative", "neutral", "positive"])
    built["reward"] = build_classifier(root / "reward", built["llama"], ["reward"])
    return built


def inputs(vocab: int) -> dict[str, list]:
    """40 rows: 10 prompts with 4 completions each (text or token ids), then a row whose completion is
    missing and one whose prompt is too long."""
    prompts = make_prompts(vocab, [3, 20, 35, 50, 64, 70, 18, 40, 9, 33], seed=5)
    completions = make_prompts(vocab, [1, 6, 17, 30], seed=6)
    rows = {"id": [], "prompt": [], "completion": [], "topic": []}
    for i, prompt in enumerate(prompts):
        for j, completion in enumerate(completions):
            rows["id"].append(f"p{i}c{j}")
            rows["prompt"].append(prompt)
            rows["completion"].append(completion)
            rows["topic"].append(i % 3)
    rows["id"] += ["no-completion", "too-long"]
    rows["prompt"] += [prompts[0], make_prompts(vocab, [TOO_LONG], seed=7)[0]]
    rows["completion"] += [None, completions[0]]
    rows["topic"] += [0, 1]
    return rows


def engine_and_prompts(model: str) -> tuple[LLM, dict[str, list]]:
    """The API's engine on `model` with the job's options, and the inputs without completions."""
    llm = LLM(model, **ENGINE)
    data = inputs(llm.engine.vocab_size)
    del data["completion"]
    return llm, data


def task_job(root, model: str, data: dict[str, list], **sections) -> object:
    """A job reading `data` as in.parquet; `sections` are added (input: merged into the input section)."""
    root.mkdir(parents=True, exist_ok=True)
    write_parquet(root / "in.parquet", data)
    inp = {"paths": ["in.parquet"], "id_column": "id", "prompt_column": "prompt", "carry_columns": ["topic"],
           **sections.pop("input", {})}
    job = {"model": {"path": model, **ENGINE}, "input": inp, "output": {"dir": "out", "rows_per_part": 3},
           "max_in_flight": 4, "progress_interval": 3600, **sections}
    return write_job(root / "job.yaml", job)


def run_whole(job) -> tuple[pa.Schema, dict[str, dict], object]:
    result = Runner(load_job(job), Shard(), default_factory).run()
    assert result.status == "complete"
    schema, rows = read(job.parent / "out")
    return schema, rows, result.snapshot


def test_score_job(tmp_path, models):
    model = models["llama"]
    llm = LLM(model, **ENGINE)
    vocab = llm.engine.vocab_size
    data = inputs(vocab)
    for column, value in (("id", "bad-token"), ("prompt", [5, 6]), ("completion", [vocab]), ("topic", 2)):
        data[column].append(value)

    def make_job(root):
        return task_job(root, model, data, task="score", score={"token_logprobs": True},
                        input={"completion_column": "completion"})

    schema, rows, snap = run_whole(make_job(tmp_path / "whole"))
    assert snap.prefix_cache_hits > 0  # a prompt's 4 completions share its blocks
    assert schema.field("completion_logprob").type == pa.float64()
    assert schema.field("token_logprobs").type == pa.list_(pa.float32())
    scored = range(40)  # the rows without a mistake
    api = llm.score_completions([data["prompt"][i] for i in scored], [data["completion"][i] for i in scored],
                                ScoringParams(token_logprobs=True), use_tqdm=False)
    for i, score in zip(scored, api, strict=True):
        row = rows[data["id"][i]]
        assert row["error"] is None and row["topic"] == data["topic"][i]
        assert (row["completion_logprob"], row["mean_logprob"], row["perplexity"], row["token_logprobs"]) == \
               (score.logprob, score.mean_logprob, score.perplexity, score.token_logprobs)
        assert (row["completion_tokens"], row["num_prompt_tokens"]) == (score.num_tokens, len(data["prompt"][i]))
    assert rows["too-long"]["error"] is not None and "max_model_len" in rows["too-long"]["error"]
    assert rows["too-long"]["completion_logprob"] is None
    assert rows["no-completion"]["error"] == "in.parquet row 40: field 'completion': missing or null"
    assert rows["bad-token"]["error"] == (f"in.parquet row 42: field 'completion': token id {vocab} at [0] is "
                                          f"outside the model's vocabulary (0..{vocab - 1})")
    assert len(rows) == len(data["id"])
    check_kill_resume_and_shards(tmp_path, make_job, rows)


def test_embed_job(tmp_path, models):
    model = models["llama"]
    llm, data = engine_and_prompts(model)

    def make_job(root):
        return task_job(root, model, data, task="embed", embed={"pooling": "mean", "dimensions": 96})

    schema, rows, _ = run_whole(make_job(tmp_path / "whole"))
    assert schema.field("embedding").type == pa.list_(pa.float32(), 96)
    api = llm.embed(data["prompt"][:-1], pooling="mean", dimensions=96, use_tqdm=False)
    for row_id, out in zip(data["id"], api, strict=False):
        assert rows[row_id]["error"] is None and rows[row_id]["embedding"] == out.outputs.embedding
    assert sum(x * x for x in api[0].outputs.embedding) == pytest.approx(1.0, abs=1e-5)  # normalised by default
    assert "max_model_len" in rows["too-long"]["error"] and rows["too-long"]["embedding"] is None
    # output.format openai_batch: OpenAI's embeddings response per row, the same vectors.
    job = make_job(tmp_path / "openai")
    openai_job = {**yaml.safe_load(job.read_text()), "output": {"dir": "out", "format": "openai_batch",
                                                                "merge_to": "out.jsonl"}}
    del openai_job["input"]["carry_columns"]
    assert cli("run", write_job(job, openai_job)).exit_code == 0
    lines = [json.loads(x) for x in (job.parent / "out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == data["id"]
    for line in lines[:-1]:
        response = CreateEmbeddingResponse.model_validate(line["response"]["body"])
        assert [d.embedding for d in response.data] == [rows[line["custom_id"]]["embedding"]]
    check_kill_resume_and_shards(tmp_path, make_job, rows)


@pytest.mark.parametrize("kind", ["classifier", "reward"])
def test_classify_job(tmp_path, models, kind):
    model = models[kind]
    llm, data = engine_and_prompts(model)

    def make_job(root):
        return task_job(root, model, data, task="classify")

    schema, rows, _ = run_whole(make_job(tmp_path / "whole"))
    api = llm.classify(data["prompt"][:-1], use_tqdm=False)
    for row_id, out in zip(data["id"], api, strict=False):
        row, result = rows[row_id], out.outputs
        assert row["error"] is None
        if kind == "reward":  # one column: the head's logit
            assert "probs" not in schema.names and row["score"] == result.logits[0]
        else:
            assert list(row["probs"]) == ["negative", "neutral", "positive"] == result.labels
            assert list(row["probs"].values()) == result.probs and row["label"] == result.label
    assert "max_model_len" in rows["too-long"]["error"]
    if kind == "classifier":  # the exactly-once machinery is the same for both heads
        check_kill_resume_and_shards(tmp_path, make_job, rows)


def test_generate_job_writes_prompt_logprobs(tmp_path, models):
    model = models["llama"]
    llm, data = engine_and_prompts(model)
    job = task_job(tmp_path, model, data, sampling={"temperature": 0, "max_tokens": 3, "prompt_logprobs": 2,
                                                    "ignore_eos": True})
    schema, rows, _ = run_whole(job)
    assert schema.field("prompt_logprobs").type == pa.list_(pa.map_(pa.int32(), pa.float32()))
    api = llm.generate(data["prompt"][:-1], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2,
                                                           ignore_eos=True), use_tqdm=False)
    for row_id, out in zip(data["id"], api, strict=False):
        written = rows[row_id]["prompt_logprobs"]
        assert written[0] is None and out.prompt_logprobs[0] is None
        assert [dict(x) for x in written[1:]] == out.prompt_logprobs[1:]
        assert rows[row_id]["text"] == out.outputs[0].text
    assert all(2 <= len(x) <= 3 for x in rows["p1c0"]["prompt_logprobs"][1:])  # the top 2 and the token itself


def test_task_mistakes_are_one_line_each(tmp_path, models):
    model = models["llama"]
    data = {"id": ["a"], "prompt": ["hello"], "completion": [" there"], "topic": [0]}
    cases = [
        ({"task": "embed", "sampling": {"temperature": 0.5}}, "sampling: task embed samples nothing"),
        ({"task": "score"}, "input.completion_column: task score needs the column"),
        ({"task": "embed", "input": {"completion_column": "completion"}},
         "input.completion_column: applies to task score only"),
        ({"task": "classify", "embed": {"pooling": "mean"}}, "embed: applies to task embed; set task: embed"),
        ({"task": "score", "input": {"completion_column": "completion"}, "output": {"dir": "out", "fields": ["text"]}},
         "output.fields: task score writes its own columns"),
        ({"task": "summarize"}, "task: input should be 'generate', 'score', 'embed' or 'classify'"),
        ({"task": "embed", "embed": {"dimensions": 0}}, "embed.dimensions: input should be greater than 0"),
    ]
    for sections, message in cases:
        job = task_job(tmp_path / "bad", model, data, **sections)
        r = cli("validate", job)
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert r.stderr.strip().splitlines()[0].startswith(message), (message, r.stderr)
    # What only the model knows is refused when the engine is built, before any row.
    for sections, message in [({"task": "classify"}, "task classify: model"),
                              ({"task": "embed", "embed": {"dimensions": 4096}},
                               "embed.dimensions: 4096 is more than the model's hidden size (128)")]:
        job = task_job(tmp_path / sections["task"], model, data, **sections)
        r = cli("run", job)
        assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
        assert not list((job.parent / "out").glob("part-*"))


def test_task_and_its_options_are_in_the_config_hash(tmp_path):
    from jobkit import job_dict

    def hash_of(**changes) -> str:
        job = job_dict(**changes)
        if changes.get("task", "generate") != "generate":
            del job["sampling"], job["output"]["fields"]
        return load_job(write_job(tmp_path / "j.yaml", job)).config_hash

    score = {"task": "score", "input": {"completion_column": "c"}}
    hashes = [hash_of(), hash_of(**score), hash_of(**score, score={"token_logprobs": True}), hash_of(task="embed"),
              hash_of(task="embed", embed={"normalize": False}), hash_of(task="classify")]
    assert len(set(hashes)) == len(hashes)
    assert hash_of(**score, score={}) == hash_of(**score) == hash_of(**score, score={"token_logprobs": False})
    assert hash_of(task="generate") == hashes[0]  # a job written before task: existed keeps its hash

