"""Structured outputs in job files: validation by field path, schema files, per-row constraint
columns (a bad one becomes that row's error), the valid and parsed columns, the README's example."""

from __future__ import annotations

import json

import jsonschema
import pytest
from jobkit import FAKE, REPO, cli, job_dict, read_rows, setup_job, write_job, write_jsonl
from test_readme import bash, block, make_home

from batchgen.job.structured import parsed_json, row_constraint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


def _problems(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_validate_names_the_field_of_a_bad_constraint(tmp_path):
    setup_job(tmp_path)
    cases = {
        "schema": ({"json": {"type": "nope"}}, 'sampling.structured_outputs.json: Unsupported type "nope"'),
        "regex": ({"regex": "[a-"}, "sampling.structured_outputs.regex: "),
        "two": ({"regex": "a", "choice": ["b"]}, "sampling.structured_outputs: set exactly one of json, regex"),
        "typo": ({"jsn": {}}, "sampling.structured_outputs.jsn: unknown field"),
        "file": ({"json": "missing.json"}, "sampling.structured_outputs.json: no schema file at"),
    }
    for name, (constraint, message) in cases.items():
        job = write_job(tmp_path / f"{name}.yaml", job_dict(sampling={"structured_outputs": constraint}))
        r = cli("validate", job, "--engine", FAKE)
        assert r.exit_code == 1 and "Traceback" not in r.output, (name, r.output)
        assert any(line.startswith(message) for line in _problems(r)), (name, _problems(r))
    bad_override = job_dict(sampling={"overrides": {"structured_outputs.jsn": "topic"}})
    r = cli("validate", write_job(tmp_path / "override.yaml", bad_override), "--engine", FAKE)
    assert "did you mean 'structured_outputs.json'?" in r.stderr


def test_a_schema_file_is_read_relative_to_the_job_file(tmp_path):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "n.json").write_text(json.dumps(SCHEMA))
    setup_job(tmp_path, sampling={"structured_outputs": {"json": "schemas/n.json"}},
              output={"fields": ["text", "valid", "parsed"]})
    r = cli("validate", tmp_path / "job.yaml", "--engine", FAKE)
    assert r.exit_code == 0, r.output
    (tmp_path / "schemas" / "n.json").write_text("{oops")
    r = cli("validate", tmp_path / "job.yaml", "--engine", FAKE)
    assert "sampling.structured_outputs.json:" in r.stderr and "is not valid JSON" in r.stderr


def test_a_bad_schema_file_is_one_problem_in_validate_and_run(tmp_path):
    """Its path is not checked a second time as inline JSON ("not valid JSON: Expecting value")."""
    setup_job(tmp_path, sampling={"structured_outputs": {"json": "n.json"}})
    for content, message in ((None, "no schema file at"), ("{oops", "is not valid JSON: Expecting property name")):
        if content is not None:
            (tmp_path / "n.json").write_text(content)
        r = cli("validate", tmp_path / "job.yaml", "--engine", FAKE)
        assert r.exit_code == 1
        problem, count = _problems(r)
        assert problem.startswith("sampling.structured_outputs.json: ") and message in problem, problem
        assert str(tmp_path / "n.json") in problem and count == f"1 problem in {tmp_path / 'job.yaml'}"
        r = cli("run", tmp_path / "job.yaml", "--engine", FAKE)
        assert r.exit_code == 1 and _problems(r) == [f"batchgen: error: {problem}"]


def test_row_constraint_gathers_the_constraint_columns():
    assert row_constraint({"max_tokens": 3, "structured_outputs.choice": '["a", "b"]'}) == {
        "max_tokens": 3, "structured_outputs": {"choice": ["a", "b"]}}
    assert row_constraint({"structured_outputs.json": "{}"}) == {"structured_outputs": {"json": "{}"}}
    assert row_constraint({"seed": 1}) == {"seed": 1}
    assert row_constraint({"structured_outputs": '{"regex": "a+"}'}) == {"structured_outputs": {"regex": "a+"}}


def test_parsed_is_null_unless_the_output_is_whole_json():
    assert parsed_json('{ "a" : [1, 2] }', "stop", True) == '{"a":[1,2]}'
    assert parsed_json('{"a": 1', "length", False) is None
    assert parsed_json('{"a": 1}', "stop", False) is None
    assert parsed_json("yes", "stop", True) is None
    assert parsed_json('"é"', "stop", None) == '"é"'


def test_job_with_per_row_schemas_on_the_real_engine(tmp_path, tiny_model_dirs):
    shared = json.dumps(SCHEMA)
    rows = [{"id": f"r{i}", "prompt": f"number {i}", "schema": shared if i % 3 else None} for i in range(12)]
    rows.append({"id": "bad-schema", "prompt": "x", "schema": '{"type": "nope"}'})
    rows.append({"id": "choice-row", "prompt": "y", "choices": '["left", "right"]'})
    write_jsonl(tmp_path / "in.jsonl", rows)
    job = job_dict(
        model={"path": str(tiny_model_dirs["llama"]), "dtype": "float32", "kv_cache_memory": "32MiB"},
        input={"carry_columns": []},
        sampling={"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 12, "structured_outputs": {"regex": "[ab]{1,4}"},
                  "overrides": {"structured_outputs.json": "schema", "structured_outputs.choice": "choices"}},
        output={"fields": ["text", "finish_reason", "valid", "parsed"]},
    )
    r = cli("run", write_job(tmp_path / "job.yaml", job))
    assert r.exit_code == 0, r.output
    out = {(row["id"], row["sample_index"]): row for row in read_rows(tmp_path / "out")}
    assert len(out) == 12 * 2 + 1 + 2
    assert out[("bad-schema", 0)]["error"].endswith(
        "field 'schema' (sampling.structured_outputs.json override): Unsupported type \"nope\"")
    for (row_id, _), row in out.items():
        if row_id == "bad-schema":
            continue
        assert row["error"] is None and row["valid"] == (row["finish_reason"] == "stop"), row
        if not row["valid"]:
            assert row["parsed"] is None
        elif row_id == "choice-row":
            assert row["text"] in ("left", "right")
        elif int(row_id[1:]) % 3:
            jsonschema.validate(json.loads(row["text"]), SCHEMA)
            assert row["parsed"] == json.dumps(json.loads(row["text"]), separators=(",", ":"))
        else:
            assert set(row["text"]) <= {"a", "b"} and 1 <= len(row["text"]) <= 4
    assert sum(row["valid"] is True for row in out.values()) >= 6, "too few outputs ended to check anything"


@pytest.mark.slow
def test_readme_structured_outputs_example(tmp_path, smollm2_dir):
    """On the README's own model (a random tiny one writes JSON that never ends within max_tokens):
    the records finish, and every finished one is valid and matches the schema."""
    home = make_home(tmp_path, smollm2_dir)
    proc = bash(block("structured"), home, PYTHONPATH=str(REPO))  # this checkout, whichever one the venv installed
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(block("file", "person.schema.json"))
    rows = read_rows(home / "first-job" / "out" / "people")
    assert len(rows) == 3 * 4 and all(row["error"] is None for row in rows)
    finished = [row for row in rows if row["finish_reason"] == "stop"]
    assert len(finished) >= 9, f"only {len(finished)} of 12 records ended within max_tokens"
    for row in rows:
        assert row["valid"] == (row["finish_reason"] == "stop")
    for row in finished:
        record = json.loads(row["parsed"])
        jsonschema.validate(record, schema)
        assert record == json.loads(row["text"])
