"""`batchgen run-batch` with `/v1/embeddings` requests (mixed with completions in one file) and
`/v1/completions` with `echo`, on the real engine: every line validates with the `openai` package's types,
the vectors are LLM.embed's (base64: the same float32 bytes), and a run killed at random moments resumes to
each custom_id exactly once, line for line the uninterrupted run's."""

from __future__ import annotations

import base64
import json
import os
import random

import numpy as np
import pytest
from jobkit import REPO, batchgen_cmd, cli, kill_at_random_moments, write_jsonl
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from batchgen import LLM, SamplingParams

ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256}
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
                "--max-num-seqs", "4", "--rows-per-part", "3"]


def embeddings(custom_id: str, value, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"input": value, **body}}


def requests() -> list[dict]:
    """60 embeddings requests of every input shape, an echoed completion, a chat request, and bad requests."""
    out = []
    for i in range(60):
        text = f"sentence number {i} about " + "things " * (i % 7)
        shape = i % 4
        if shape == 0:
            out.append(embeddings(f"e{i}", text))
        elif shape == 1:
            out.append(embeddings(f"e{i}", [text, "and another one"], encoding_format="base64"))
        elif shape == 2:
            out.append(embeddings(f"e{i}", [5 + i, 6, 7, 8], dimensions=32))
        else:
            out.append(embeddings(f"e{i}", [[5, 6], [9 + i, 10, 11]], encoding_format="float", user="u"))
    out += [
        {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "echo": True,
                  "logprobs": 2}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}},
        embeddings("bad-format", "x", encoding_format="hex"),
        embeddings("too-wide", "x", dimensions=4096),
        embeddings("empty-input", ["ok", ""]),
        embeddings("bad-second", [[5, 6], [10 ** 6]]),
    ]
    return out


def run_batch_cmd(root, model) -> list[str]:
    return [str(a) for a in ("run-batch", "-i", root / "req.jsonl", "-o", root / "out.jsonl", "--model", model,
                             *ENGINE_FLAGS)]


def lines_by_id(path) -> dict[str, dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == len(set(ids)), "a custom_id was written twice"
    return {x["custom_id"]: x for x in lines}


def decoded(text: str) -> list[float]:
    """A base64 embedding as OpenAI's SDK decodes it: little-endian float32."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()


def without_created(line: dict) -> dict:
    """A response line without its completion body's creation time (the clock's, not the model's)."""
    body = (line.get("response") or {}).get("body") or {}
    return {**line, "response": line["response"] and {**line["response"], "body": {**body, "created": None}}}


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_model_dirs):
    root = tmp_path_factory.mktemp("embeddings_whole")
    write_jsonl(root / "req.jsonl", requests())
    r = cli(*run_batch_cmd(root, tiny_model_dirs["llama"]))
    assert r.exit_code == 0, r.output
    return lines_by_id(root / "out.jsonl")


def test_embedding_lines_are_openai_responses_with_llm_embed_vectors(whole, tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), **ENGINE)
    checked = 0
    for request in requests()[:60]:
        line = whole[request["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        if request["body"].get("encoding_format") == "base64":  # a string, which the SDK decodes into the list
            assert all(isinstance(d["embedding"], str) for d in body["data"])
            body = {**body, "data": [{**d, "embedding": decoded(d["embedding"])} for d in body["data"]]}
        response = CreateEmbeddingResponse.model_validate(body)
        value = request["body"]["input"]
        inputs = [value] if isinstance(value, str) or isinstance(value[0], int) else value
        expected = llm.embed(inputs, dimensions=request["body"].get("dimensions"), use_tqdm=False)
        assert [d.index for d in response.data] == list(range(len(inputs)))
        for data, out in zip(response.data, expected, strict=True):
            assert data.embedding == out.outputs.embedding
            checked += 1
        tokens = sum(len(out.prompt_token_ids) for out in expected)
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
        assert response.model == tiny_model_dirs["llama"].name
    assert checked == 90  # 15 requests of each shape: 1, 2, 1 and 2 inputs


def test_echo_returns_the_prompt_and_its_logprobs_first(whole, tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), **ENGINE)
    prompt = "The capital of France is"
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                        use_tqdm=False)[0]
    body = whole["echo"]["response"]["body"]
    lp = body["choices"][0]["logprobs"]
    # Nothing comes before the first token: OpenAI's API writes null there, which the SDK's type does not model.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    first_known = {**lp, "token_logprobs": lp["token_logprobs"][1:], "top_logprobs": lp["top_logprobs"][1:]}
    choices = [{**body["choices"][0], "logprobs": first_known}]
    choice = Completion.model_validate({**body, "choices": choices}).choices[0]
    assert choice.text == prompt + want.outputs[0].text
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    assert choice.logprobs.tokens == [llm.tokenizer.decode([t]) for t in ids]
    prompt_part = [entry[t] for t, entry in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:], strict=True)]
    output_part = [entry[t] for t, entry in zip(want.outputs[0].token_ids, want.outputs[0].logprobs, strict=True)]
    assert choice.logprobs.token_logprobs == prompt_part + output_part
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert len(choice.logprobs.text_offset) == len(ids)
    ChatCompletion.model_validate(whole["chat"]["response"]["body"])  # a mixed file: chat next to embeddings


def test_bad_embeddings_requests_are_error_lines(whole):
    errors = {k: v["error"]["message"] for k, v in whole.items() if v["error"] is not None}
    assert errors == {
        "bad-format": "req.jsonl line 63: field 'body.encoding_format': must be float or base64, got 'hex'",
        "too-wide": "req.jsonl line 64: the engine rejected the request: dimensions: 4096 is more than the "
                    "model's hidden size (128)",
        "empty-input": "req.jsonl line 65: field 'body.input': [1]: empty input",
        "bad-second": "req.jsonl line 66: input [1]: field 'body.input': token id 1000000 at [0] is outside the "
                      f"model's vocabulary (0..{errors['bad-second'].split('..')[-1][:-1]})",
    }


def test_killed_run_batch_resumes_to_each_line_once(tmp_path, whole, tiny_model_dirs):
    write_jsonl(tmp_path / "req.jsonl", requests())
    cmd = batchgen_cmd(*run_batch_cmd(tmp_path, tiny_model_dirs["llama"]))
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_ENGINE"}
    env["PYTHONPATH"] = str(REPO)
    parts_dir = tmp_path / "out.jsonl.parts"

    def parts() -> int:
        return len(list(parts_dir.glob("part-*.jsonl")))

    seen: list[int] = []

    def after_kill() -> None:
        done = sum(len(p.read_text().splitlines()) for p in parts_dir.glob("part-*.jsonl"))
        seen.append(done)

    kills = kill_at_random_moments(tmp_path / "unused", env, parts, random.Random(3), rounds=3, anywhere=0.2,
                                   after_kill=after_kill, cmd=cmd, linger=0.0)
    assert kills >= 1 and any(0 < n < len(whole) for n in seen), (kills, seen)
    r = cli(*run_batch_cmd(tmp_path, tiny_model_dirs["llama"]))
    assert r.exit_code == 0, r.output
    got = lines_by_id(tmp_path / "out.jsonl")
    assert {k: without_created(v) for k, v in got.items()} == {k: without_created(v) for k, v in whole.items()}


def test_embeddings_requests_need_the_openai_output(tmp_path):
    """A job reading an OpenAI batch file into Parquet or JSONL columns (a completion's) has no place
    for a vector: such a request is that row's error, and the other requests run."""
    from jobkit import job_dict, make_model, read_rows, run, write_job

    make_model(tmp_path / "model")
    write_jsonl(tmp_path / "req.jsonl", [
        embeddings("vec", "x"),
        {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}},
    ])
    job = job_dict(input={"paths": ["req.jsonl"], "format": "openai_batch"}, sampling={"max_tokens": 2})
    del job["input"]["id_column"], job["input"]["prompt_column"], job["input"]["carry_columns"]
    r = run(write_job(tmp_path / "job.yaml", job))
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for row in read_rows(tmp_path / "out")}
    assert rows["vec"]["error"] == ("req.jsonl line 1: field 'url': /v1/embeddings needs output.format "
                                    "openai_batch (this job's columns are a completion's)")
    assert rows["text"]["error"] is None and rows["text"]["text"]
