"""The OpenAI batch format: request lines in, response lines out (checked with the `openai`
package's own types), `batchgen run-batch`, SIGKILL and rerun, bad lines as error lines."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from jobkit import (
    FAKE,
    batchgen_cmd,
    cli,
    job_dict,
    make_model,
    run,
    setup_job,
    subprocess_env,
    write_job,
    write_jsonl,
)
from openai.types import Completion
from openai.types.chat import ChatCompletion


def chat(custom_id: str, content, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "model", "messages": [{"role": "user", "content": content}], **body}}


def completion(custom_id: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "model", "prompt": prompt, **body}}


def run_batch(root, requests, *args, engine=FAKE):
    make_model(root / "model")
    write_jsonl(root / "req.jsonl", requests)
    return cli("run-batch", "-i", root / "req.jsonl", "-o", root / "out.jsonl", "--model", root / "model",
               "--engine", engine, *args)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_line_parses_with_the_openai_types(tmp_path):
    requests = [
        chat("chat-n2", "hello there", n=2, max_tokens=5, stop=["zeta"], logprobs=True, top_logprobs=2),
        chat("chat-parts", [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
             max_completion_tokens=3),
        completion("cmpl-lp", "once upon a time", max_tokens=4, logprobs=1, n=3),
        completion("cmpl-ids", [72, 101, 108, 108, 111], max_tokens=2, echo=False, user="u"),
        chat("chat-plain", "no extras"),
    ]
    result = run_batch(tmp_path, requests, "--max-tokens", "6")
    assert result.exit_code == 0, result.output
    assert "body fields ignored (they change nothing here): user (1 rows)" in result.output
    lines = read_lines(tmp_path / "out.jsonl")
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in requests]
    for line, req in zip(lines, requests, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"]
        body = line["response"]["body"]
        parsed = (ChatCompletion if req["url"] == "/v1/chat/completions" else Completion).model_validate(body)
        n = req["body"].get("n", 1)
        assert [c.index for c in parsed.choices] == list(range(n))
        assert parsed.model == "model"
        completion_tokens = parsed.usage.completion_tokens
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + completion_tokens > completion_tokens
        limit = req["body"].get("max_tokens") or req["body"].get("max_completion_tokens") or 6
        assert all(c.finish_reason in ("stop", "length") for c in parsed.choices)
        if isinstance(parsed, ChatCompletion):
            assert all(c.message.role == "assistant" and c.message.content for c in parsed.choices)
        else:
            assert all(c.text for c in parsed.choices)
        assert completion_tokens <= n * limit
    chat_lp = ChatCompletion.model_validate(lines[0]["response"]["body"])
    for choice in chat_lp.choices:
        content = choice.logprobs.content
        assert content and all(1 <= len(t.top_logprobs) <= 2 for t in content)  # the fake knows 2 at most
        assert "".join(t.token for t in content).replace(" ", "") == choice.message.content.replace(" ", "")
    cmpl_lp = Completion.model_validate(lines[2]["response"]["body"])
    for choice in cmpl_lp.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(len(top) == 1 for top in lp.top_logprobs)
    assert ChatCompletion.model_validate(lines[4]["response"]["body"]).choices[0].logprobs is None


def test_bad_lines_become_error_lines_naming_the_line(tmp_path):
    good = chat("ok", "fine")
    requests = [
        good,
        "this is not json",
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no custom_id"}},
        {"custom_id": "mod", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}},
        {"custom_id": "shape", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "hi"}},
        {"custom_id": "role", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"content": "x"}]}},
        chat("ok", "a duplicate of the first line"),
        chat("badn", "x", n=0),
        chat("toplp", "x", top_logprobs=3),
        chat("image", [{"type": "image_url", "image_url": {"url": "http://x"}}]),
        completion("batch", ["two", "prompts"]),
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
        completion("last", "also fine"),
    ]
    result = run_batch(tmp_path, requests)
    assert result.exit_code == 0, result.output
    lines = read_lines(tmp_path / "out.jsonl")
    assert len(lines) == len(requests)
    by_id = {x["custom_id"]: x for x in lines}
    assert by_id["ok"]["error"] is None and by_id["last"]["error"] is None
    expected = {
        "req.jsonl:2": "req.jsonl line 2: malformed JSON",
        "req.jsonl:3": "req.jsonl line 3: field 'custom_id': missing id",
        "mod": "req.jsonl line 4: field 'url': must be one of /v1/chat/completions, /v1/completions, "
               "/v1/embeddings",
        "shape": "req.jsonl line 5: field 'body.messages': expected a non-empty list",
        "role": "req.jsonl line 6: field 'body.messages': message [0].role",
        "req.jsonl:7": "req.jsonl line 7: field 'custom_id': duplicate id 'ok', first at req.jsonl line 1",
        "badn": "req.jsonl line 8: field 'body.n': must be an integer >= 1",
        "toplp": "req.jsonl line 9: field 'body.top_logprobs': needs \"logprobs\": true",
        "image": "req.jsonl line 10: field 'body.messages': model model takes no images",
        "batch": "req.jsonl line 11: field 'body.prompt': one prompt per line",
        "get": "req.jsonl line 12: field 'method': must be POST",
    }
    for custom_id, message in expected.items():
        line = by_id[custom_id]
        assert line["response"] is None and line["error"]["code"] == "invalid_request"
        assert line["error"]["message"].startswith(message), line["error"]["message"]
    derived = [cid for cid in by_id if cid.startswith("req.jsonl:")]
    assert len(derived) == 3, derived  # one numbering: the id's number is the line's in the message
    for cid in derived:
        line_no = int(cid.rsplit(":", 1)[1])
        assert by_id[cid]["error"]["message"].startswith(f"req.jsonl line {line_no}: "), by_id[cid]
    # a rerun finds nothing to do and leaves the file as it is
    before = (tmp_path / "out.jsonl").read_bytes()
    again = run_batch(tmp_path, requests)
    assert again.exit_code == 0, again.output
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_a_missing_request_file_is_one_line(tmp_path):
    make_model(tmp_path / "model")
    result = cli("run-batch", "-i", tmp_path / "nope.jsonl", "-o", tmp_path / "out.jsonl", "--model",
                 tmp_path / "model", "--engine", FAKE)
    assert result.exit_code == 1
    assert result.output.strip() == f"batchgen: error: --input: no such request file: {tmp_path / 'nope.jsonl'}"


def test_check_model_and_column_overrides(tmp_path):
    write_jsonl(tmp_path / "req.jsonl", [
        {**chat("a", "x"), "budget": 2},
        {**chat("b", "y"), "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "y"}]}},
        completion("c", "z"),
    ])
    make_model(tmp_path / "model")
    job = write_job(tmp_path / "job.yaml", {
        "model": {"path": "model", "name": "model"},
        "input": {"paths": "req.jsonl", "format": "openai_batch", "check_model": True},
        "sampling": {"seed": 1, "max_tokens": 8, "overrides": {"max_tokens": "budget"}},
        "output": {"dir": "out", "format": "openai_batch", "merge_to": "results.jsonl"},
        "progress_interval": 3600,
    })
    assert run(job).exit_code == 0
    by_id = {x["custom_id"]: x for x in read_lines(tmp_path / "results.jsonl")}
    assert by_id["a"]["response"]["body"]["usage"]["completion_tokens"] <= 2
    assert by_id["b"]["error"]["message"].endswith("field 'body.model': 'gpt-4o' is not this job's model 'model'")
    assert by_id["c"]["error"] is None


@pytest.mark.parametrize("change, problem", [
    ({"input": {"paths": ["req.jsonl"], "format": "openai_batch", "prompt_column": "prompt"}},
     "input: format openai_batch reads custom_id and the body's messages or prompt; remove prompt_column"),
    ({"input": {"paths": ["req.jsonl"], "prompt_column": "p", "check_model": True}},
     "input: check_model applies to format openai_batch only"),
    ({"input": {"paths": ["req.jsonl"], "format": "openai_batch", "carry_columns": ["x"]}},
     "input.carry_columns: output.format openai_batch has no place for carried columns"),
    ({"output": {"dir": "out", "format": "openai_batch", "fields": ["text"]}},
     "output.fields: output.format openai_batch writes the OpenAI response shape"),
    ({"output": {"dir": "out", "merge_to": "all.jsonl"}},
     "output.merge_to: merging into one file needs output.format jsonl or openai_batch"),
])
def test_format_combinations_that_cannot_work_are_refused(tmp_path, change, problem):
    make_model(tmp_path / "model")
    write_jsonl(tmp_path / "req.jsonl", [chat("a", "x")])
    job = {"model": "model", "input": {"paths": ["req.jsonl"], "format": "openai_batch"},
           "output": {"dir": "out", "format": "openai_batch"}}
    job.update(change)
    result = cli("validate", write_job(tmp_path / "job.yaml", job), "--engine", FAKE)
    assert result.exit_code == 1
    assert problem in result.output


def _jsonl_rows(out_dir) -> list[dict]:
    return [json.loads(line) for p in sorted(out_dir.glob("part-*.jsonl")) for line in p.read_text().splitlines()]


def test_jsonl_output_resumes_retries_and_merges_in_input_order(tmp_path):
    ref = setup_job(tmp_path / "ref", rows=40)
    assert run(ref).exit_code == 0
    from jobkit import read_rows

    expected = {(r["id"], r["sample_index"]): r["text"] for r in read_rows(tmp_path / "ref" / "out")}

    root = tmp_path / "jsonl"
    job = setup_job(root, rows=40, output={"dir": "out", "rows_per_part": 7, "format": "jsonl",
                                           "merge_to": "all.jsonl"})
    with open(root / "in.jsonl", "a") as f:
        f.write('{"id": "bad", "prompt": ""}\n')
    first = run(job)
    assert first.exit_code == 0, first.output
    rows = _jsonl_rows(root / "out")
    assert not list((root / "out").glob("*.parquet"))
    assert {(r["id"], r["sample_index"]): r["text"] for r in rows if r["error"] is None} == expected
    assert list(rows[0]) == ["id", "sample_index", "num_samples", "topic", "text", "token_ids", "finish_reason",
                             "stop_reason", "num_prompt_tokens", "num_output_tokens", "error"]
    merged = read_lines(root / "all.jsonl")
    assert [r["id"] for r in merged] == [f"q{i:04d}" for i in range(40) for _ in range(2)] + ["bad"]
    assert merged[-1]["error"].endswith("field 'prompt': empty prompt")

    status = cli("status", root / "out")
    assert status.exit_code == 0 and "41" in status.output and "done" in status.output

    # a part lost (e.g. a node-local write that never made it) is redone by the next run, and merged again
    part = sorted((root / "out").glob("part-*.jsonl"))[2]
    lost = {json.loads(line)["id"] for line in part.read_text().splitlines()}
    part.unlink()
    partial = cli("merge", root / "out", "-o", root / "partial.jsonl")
    assert partial.exit_code == 1 and f"{len(lost)} input rows of" in partial.output
    assert cli("merge", root / "out", "-o", root / "partial.jsonl", "--partial").exit_code == 0
    assert len(read_lines(root / "partial.jsonl")) == len(merged) - 2 * len(lost)
    assert run(job).exit_code == 0
    assert read_lines(root / "all.jsonl") == merged

    # --retry-errors drops the error line from its JSONL part and generates the row again
    (root / "in.jsonl").write_text((root / "in.jsonl").read_text().replace('"prompt": ""', '"prompt": "fixed"'))
    retried = run(job, "--retry-errors")
    assert retried.exit_code == 0, retried.output
    rows = _jsonl_rows(root / "out")
    assert [r["error"] for r in rows if r["id"] == "bad"] == [None, None]
    assert read_lines(root / "all.jsonl")[-1]["id"] == "bad"


def test_a_parquet_dir_is_not_merged(tmp_path):
    job = setup_job(tmp_path, rows=3)
    assert run(job).exit_code == 0
    result = cli("merge", tmp_path / "out", "-o", tmp_path / "x.jsonl")
    assert result.exit_code == 1 and "is a Parquet part: merge joins jsonl and openai_batch parts" in result.output


def test_output_format_is_part_of_the_configuration(tmp_path):
    from batchgen.job.spec import parse_job

    def hash_of(**output) -> str:
        job = {"model": "m", "input": {"paths": "x.jsonl", "prompt_column": "p"}, "output": {"dir": "o", **output}}
        return parse_job(json.dumps(job), tmp_path).config_hash

    assert hash_of() == hash_of(format="parquet")  # dirs written before formats existed still match
    assert hash_of() != hash_of(format="jsonl") != hash_of(format="openai_batch")


def test_sigkill_mid_run_then_rerun_gives_each_custom_id_once(tmp_path):
    requests = []
    for i in range(240):
        make = chat if i % 2 else completion
        requests.append(make(f"req-{i:03d}", f"prompt number {i}", max_tokens=6, n=1 + i % 3, temperature=0.9))
    reference = run_batch(tmp_path / "ref", requests, "--rows-per-part", "5")
    assert reference.exit_code == 0, reference.output

    def texts(path) -> dict:
        out = {}
        for line in read_lines(path):
            body = line["response"]["body"]
            out[line["custom_id"]] = [c.get("text") or c["message"]["content"] for c in body["choices"]]
        return out

    expected = texts(tmp_path / "ref" / "out.jsonl")
    root = tmp_path / "run"
    make_model(root / "model")
    write_jsonl(root / "req.jsonl", requests)
    cmd = batchgen_cmd("run-batch", "-i", root / "req.jsonl", "-o", root / "out.jsonl", "--model", root / "model",
                       "--rows-per-part", "5", "--max-num-seqs", "8")
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.004")
    parts = root / "out.jsonl.parts"
    for _ in range(3):
        before = len(list(parts.glob("part-*.jsonl")))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while len(list(parts.glob("part-*.jsonl"))) < before + 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "no part appeared"
            time.sleep(0.005)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.kill()
        proc.wait()
    assert not (root / "out.jsonl").exists()
    final = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    lines = read_lines(root / "out.jsonl")
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in requests]
    assert texts(root / "out.jsonl") == expected


def test_run_batch_on_the_real_engine(tmp_path, tiny_model_dirs):
    """Greedy responses equal LLM.chat / LLM.generate; logprobs have exactly the asked top k, with
    the chosen token's own logprob, and decoded token strings."""
    from batchgen import LLM, SamplingParams

    model = tiny_model_dirs["llama"]
    requests = [
        chat("c", "tell me a story", max_tokens=8, temperature=0, logprobs=True, top_logprobs=3),
        completion("p", "The capital of France is", max_tokens=6, temperature=0, logprobs=2),
        chat("s", "sample this", max_tokens=5, n=2, temperature=1.0, seed=5),
    ]
    write_jsonl(tmp_path / "req.jsonl", requests)
    result = cli("run-batch", "-i", tmp_path / "req.jsonl", "-o", tmp_path / "out.jsonl", "--model", model,
                 "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256")
    assert result.exit_code == 0, result.output
    lines = {x["custom_id"]: x["response"]["body"] for x in read_lines(tmp_path / "out.jsonl")}
    llm = LLM(str(model), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    greedy = SamplingParams(temperature=0, logprobs=3, max_tokens=8)
    want_chat = llm.chat([[{"role": "user", "content": "tell me a story"}]], greedy)[0].outputs[0]
    got_chat = ChatCompletion.model_validate(lines["c"]).choices[0]
    assert got_chat.message.content == want_chat.text
    assert lines["c"]["usage"]["completion_tokens"] == len(want_chat.token_ids)
    for token, tid, lps in zip(got_chat.logprobs.content, want_chat.token_ids, want_chat.logprobs, strict=True):
        assert token.token == llm.tokenizer.decode([tid])
        assert token.logprob == pytest.approx(lps[tid])
        assert [t.logprob for t in token.top_logprobs] == pytest.approx(sorted(lps.values(), reverse=True)[:3])
    want_text = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    got_text = Completion.model_validate(lines["p"]).choices[0]
    assert got_text.text == want_text.text
    lp = got_text.logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == len(want_text.token_ids)
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):  # greedy: the chosen is the best
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(chosen)
    sampled = ChatCompletion.model_validate(lines["s"])
    seeded = llm.chat([[{"role": "user", "content": "sample this"}]],
                      SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=5))[0]
    assert [c.message.content for c in sampled.choices] == [c.text for c in seeded.outputs]


def test_openai_output_of_a_prompt_job_in_three_shards_is_merged_by_the_last(tmp_path):
    """Any input can be written in the OpenAI output shape (a prompt column: text completions);
    with shards, the shard that finds every row done writes merge_to."""
    setup_job(tmp_path, rows=30)
    spec = job_dict(input={"carry_columns": []})
    spec["output"] = {"dir": "out", "format": "openai_batch", "merge_to": "all.jsonl", "rows_per_part": 4}
    job = write_job(tmp_path / "job.yaml", spec)
    for i in range(3):
        result = run(job, "--shard", f"{i}/3")
        assert result.exit_code == 0, result.output
        assert (tmp_path / "all.jsonl").exists() == (i == 2)
    lines = read_lines(tmp_path / "all.jsonl")
    assert [x["custom_id"] for x in lines] == [f"q{i:04d}" for i in range(30)]
    for line in lines:
        body = Completion.model_validate(line["response"]["body"])
        assert len(body.choices) == 2  # the job's n
    status = cli("status", tmp_path / "out")
    assert status.exit_code == 0 and len(re.findall(r"  done$", status.output, re.M)) == 3


def test_response_format_constrains_the_output(tmp_path, tiny_model_dirs):
    """`response_format` json_schema and json_object requests are structured outputs: a finished
    output parses and validates; a bad response_format is that request's error."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    enum = {"enum": ["a", "b"]}
    requests = [
        # sampled: greedy, this random model writes whitespace until max_tokens
        chat("schema", "answer", max_tokens=64, temperature=1.0, n=4, seed=1,
             response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}),
        chat("object", "answer", max_tokens=24, temperature=0, response_format={"type": "json_object"}),
        completion("enum", "pick", max_tokens=8, n=3, temperature=1.0,
                   response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": enum}}),
        chat("bad", "x", response_format={"type": "yaml"}),
        chat("badschema", "x", response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
    ]
    write_jsonl(tmp_path / "req.jsonl", requests)
    result = cli("run-batch", "-i", tmp_path / "req.jsonl", "-o", tmp_path / "out.jsonl", "--model",
                 tiny_model_dirs["llama"], "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256")
    assert result.exit_code == 0, result.output
    by_id = {x["custom_id"]: x for x in read_lines(tmp_path / "out.jsonl")}
    schema_choices = ChatCompletion.model_validate(by_id["schema"]["response"]["body"]).choices
    finished = [c for c in schema_choices if c.finish_reason == "stop"]
    assert finished, "no json_schema output ended within max_tokens: nothing was checked"
    for choice in finished:  # an object without "ok", as json_object allows, fails here
        jsonschema.validate(json.loads(choice.message.content), schema)
    object_choice = ChatCompletion.model_validate(by_id["object"]["response"]["body"]).choices[0]
    assert object_choice.finish_reason == "stop"
    assert isinstance(json.loads(object_choice.message.content), dict)
    picks = Completion.model_validate(by_id["enum"]["response"]["body"]).choices
    assert [json.loads(c.text) for c in picks if c.finish_reason == "stop"]
    assert all(json.loads(c.text) in ("a", "b") for c in picks if c.finish_reason == "stop")
    assert by_id["bad"]["error"]["message"].endswith(
        "field 'body.response_format': type must be text, json_object or json_schema, got 'yaml'")
    assert "field 'body.response_format.json_schema.schema'" in by_id["badschema"]["error"]["message"]


def _part_ids(parts) -> list[str]:
    parts = sorted(parts.glob("part-*.jsonl"))
    return [json.loads(line)["custom_id"] for p in parts for line in p.read_text().splitlines()]


def test_derived_ids_count_lines_from_1_and_old_dirs_keep_counting_from_0(tmp_path, monkeypatch):
    """A line without a usable custom_id is `req.jsonl:N` for line N, as its message says. An output dir begun
    when derived ids counted from 0 (its _job.json does not say) resumes with that numbering: nothing done
    before is generated again, each id is in the parts once, and new lines are numbered as the old ones."""
    from batchgen.job import line_ids

    requests = [chat("a", "one"), "not json", completion("b", "two"), "not json either"]
    new = run_batch(tmp_path / "new", requests)
    assert new.exit_code == 0, new.output
    errors = {x["custom_id"]: x["error"]["message"] for x in read_lines(tmp_path / "new" / "out.jsonl") if x["error"]}
    assert errors == {"req.jsonl:2": "req.jsonl line 2: malformed JSON: Expecting value (column 1)",
                      "req.jsonl:4": "req.jsonl line 4: malformed JSON: Expecting value (column 1)"}

    old = tmp_path / "old"
    with monkeypatch.context() as m:  # the numbering before, for an output dir of that time
        m.setattr(line_ids, "FIRST_LINE", 0)
        first = run_batch(old, requests[:3])
    assert first.exit_code == 0, first.output
    saved = old / "out.jsonl.parts" / "_job.json"
    saved.write_text(json.dumps({k: v for k, v in json.loads(saved.read_text()).items() if k != "line_ids_from"}))
    done_before = _part_ids(old / "out.jsonl.parts")
    assert sorted(done_before) == ["a", "b", "req.jsonl:1"]

    again = run_batch(old, requests + [chat("c", "three")])
    assert again.exit_code == 0, again.output
    assert "3 rows done before" in again.output
    ids = _part_ids(old / "out.jsonl.parts")
    assert sorted(ids) == ["a", "b", "c", "req.jsonl:1", "req.jsonl:3"] and ids[:3] == done_before
    lines = read_lines(old / "out.jsonl")
    assert [x["custom_id"] for x in lines] == ["a", "req.jsonl:1", "b", "req.jsonl:3", "c"]
    assert lines[3]["error"]["message"].startswith("req.jsonl:3 (line 4): malformed JSON")
    assert json.loads(saved.read_text())["line_ids_from"] == 0  # said from now on
