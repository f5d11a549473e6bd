"""``batchgen validate`` catches what ``run`` would fail on or turn into error rows only (issue 56,
item 1): a key given twice, a chat column read as prompts, embed.dimensions beyond the model's hidden
size, and repeated ids (a warning, as ``status`` gives)."""

from __future__ import annotations

import json

from jobkit import FAKE, cli, job_dict, make_model, read_rows, run, setup_job, write_job, write_jsonl


def validate(job, *args):
    return cli("validate", job, "--engine", FAKE, *args)


def test_a_key_given_twice_is_one_line_naming_it_and_its_line(tmp_path):
    job = setup_job(tmp_path, rows=3)
    text = job.read_text().replace("  max_tokens: 6\n", "  max_tokens: 0\n  max_tokens: 6\n")
    job.write_text(text)
    line = text.splitlines().index("  max_tokens: 6") + 1
    for r in (validate(job), run(job)):
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert f"invalid YAML at line {line}, column 3: duplicate key 'max_tokens' (first at line {line - 1}); " \
               "give each key once" in r.stderr.splitlines()[0]
    job.write_text("model: model\nsampling: {max_tokens: 0, max_tokens: 8}\n")
    assert "line 2, column 27: duplicate key 'max_tokens' (first at line 2)" in validate(job).stderr


def test_a_chat_column_given_as_prompt_column_is_named(tmp_path):
    job = setup_job(tmp_path, rows=0, input={"prompt_column": "messages", "carry_columns": []})
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "messages": [{"role": "user", "content": f"hi {i}"}]}
                                        for i in range(3)])
    r = validate(job)
    assert r.exit_code == 1
    assert r.stderr.splitlines()[0] == (
        "input.prompt_column: column 'messages' holds chat messages (in.jsonl line 1); "
        "set input.messages_column: messages instead")
    ran = run(job)  # a run reads no row before it starts: each row's error says it
    assert ran.exit_code == 0
    errors = {row["error"] for row in read_rows(tmp_path / "out")}
    assert errors == {f"in.jsonl line {i + 1}: field 'messages': chat messages in input.prompt_column; read this "
                      "column with input.messages_column: messages instead" for i in range(3)}
    fixed = setup_job(tmp_path, name="fixed.yaml", input={"prompt_column": None, "messages_column": "messages",
                                                          "carry_columns": []})
    assert validate(fixed).exit_code == 0, validate(fixed).output


def test_embed_dimensions_beyond_the_hidden_size(tmp_path):
    make_model(tmp_path / "model", hidden_size=16)
    setup_job(tmp_path, rows=3)
    job = job_dict(task="embed", embed={"dimensions": 32}, output={"dir": "out"})
    del job["sampling"], job["output"]["fields"]
    path = write_job(tmp_path / "embed.yaml", job)
    r = validate(path)
    assert r.exit_code == 1, r.output
    assert "embed.dimensions: 32 is more than the model's hidden size (16) (its config.json)" in r.stderr.splitlines()
    job["embed"]["dimensions"] = 16
    assert validate(write_job(path, job)).exit_code == 0


def test_repeated_ids_are_a_warning_of_validate(tmp_path):
    job = setup_job(tmp_path, rows=0)
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "p", "topic": 1} for i in ("a", "b", "a", "c", "b")])
    r = validate(job)
    assert r.exit_code == 0 and r.stdout == "ok\n"
    assert r.stderr.splitlines() == [
        "warning: input.id_column: 2 input rows repeat the id of an earlier row; only the first row of an id is "
        "generated, the others are error rows (the first: in.jsonl line 3: field 'id': duplicate id 'a', "
        "first at in.jsonl line 1; only that row is generated)"]
    result = json.loads(validate(job, "--json").stdout)
    assert result["ok"] and len(result["warnings"]) == 1


def test_an_unclosed_bracket_is_named_at_the_line_it_opens(tmp_path):
    job = setup_job(tmp_path, rows=3)
    text = job.read_text().replace("  temperature: 0.8\n", "  stop: [END\n  temperature: 0.8\n")
    job.write_text(text)
    opened = text.splitlines().index("  stop: [END") + 1
    r = validate(job)
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 2
    assert r.stderr.startswith(f"invalid YAML at line {opened + 1}, column 14: expected ',' or ']', but got ':' "
                               f"(parsing a flow sequence begun at line {opened}, column 9)"), r.stderr


def test_a_missing_or_misnamed_input_bucket_says_so(tmp_path, bucket):
    """docs/buckets.md: a bucket that is not there is "no such bucket", for the input as for the output."""
    cases = (("s3://no-such-input-bucket-56/prompts/*.jsonl", "s3://no-such-input-bucket-56: no such bucket"),
             (f"{bucket}/nothing/*.jsonl", f"no input file matches '{bucket}/nothing/*.jsonl'"))
    for where, said in cases:
        job = setup_job(tmp_path, rows=3, input={"paths": [where]})
        r = validate(job)
        assert r.exit_code == 1 and r.stderr.splitlines()[0].startswith(f"input.paths[0]: {said}"), r.stderr
    misnamed = setup_job(tmp_path, rows=3, input={"paths": ["s3://Not_A_Bucket/prompts/a.jsonl"]})
    r = validate(misnamed)
    assert r.exit_code == 1 and "s3://Not_A_Bucket: no such bucket" in r.stderr, r.stderr
