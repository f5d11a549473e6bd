"""Input reading: bad rows become error rows naming file/row/field; sharding; skipping done ids."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from jobkit import write_jsonl, write_parquet

from batchgen.job.inputs import InputReader
from batchgen.job.shard import Shard
from batchgen.job.spec import InputSpec


def reader(tmp_path, **spec) -> InputReader:
    spec.setdefault("paths", ["in.jsonl"])
    if "messages_column" not in spec:
        spec.setdefault("prompt_column", "prompt")
    overrides = spec.pop("overrides", {})
    return InputReader(InputSpec(**spec), tmp_path, overrides)


def test_jsonl_bad_rows_are_error_rows(tmp_path):
    lines = [
        {"id": "ok", "prompt": "hello", "n": 1},
        {"id": "empty", "prompt": ""},
        {"id": "blank", "prompt": "   \n "},
        {"id": "null", "prompt": None},
        {"id": "absent"},
        {"id": "int", "prompt": 5},
        "",  # blank line: skipped, not an error
        '{"id": "trunc", "prompt": ',
        '["not", "an", "object"]',
        {"id": None, "prompt": "no id"},
        {"id": ["x"], "prompt": "list id"},
        {"id": "tokens", "prompt": [1, 2, 3]},
        {"id": "badtokens", "prompt": [1, "a"]},
        {"id": "surrogate", "prompt": "\ud800"},
    ]
    write_jsonl(tmp_path / "in.jsonl", [json.dumps(x) if isinstance(x, dict) else x for x in lines])
    with open(tmp_path / "in.jsonl", "ab") as f:
        f.write(b'{"id": "utf8", "prompt": "caf\xe9"}\n')
    rows = list(reader(tmp_path, id_column="id").rows())
    by_id = {r.id: r for r in rows}
    assert by_id["ok"].error is None and by_id["ok"].prompt == "hello"
    assert by_id["tokens"].error is None and by_id["tokens"].prompt == [1, 2, 3]
    expect = {
        "empty": "in.jsonl line 2: field 'prompt': empty prompt",
        "blank": "in.jsonl line 3: field 'prompt': empty prompt",
        "null": "in.jsonl line 4: field 'prompt': missing or null",
        "absent": "in.jsonl line 5: field 'prompt': missing or null",
        "int": ("in.jsonl line 6: field 'prompt': expected a string or a non-empty list of token ids, "
                "got an integer"),
        "in.jsonl:8": "in.jsonl line 8: malformed JSON",
        "in.jsonl:9": "in.jsonl line 9: expected a JSON object, got a list",
        "in.jsonl:10": "in.jsonl line 10: field 'id': missing id",
        "in.jsonl:11": "in.jsonl line 11: field 'id': id must be a string or an integer, got a list",
        "badtokens": "in.jsonl line 13: field 'prompt': expected a string or a non-empty list of token ids",
        "surrogate": "in.jsonl line 14: field 'prompt': not valid Unicode",
        "in.jsonl:15": "in.jsonl line 15: invalid UTF-8",
    }
    for row_id, message in expect.items():
        assert row_id in by_id, (row_id, sorted(by_id))
        error = by_id[row_id].error
        assert error is not None and error.startswith(message), error
    assert len(rows) == len(lines) - 1 + 1  # the blank line is no row; the UTF-8 line is


def test_messages_column_checks(tmp_path):
    good = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "good", "msgs": good},
        {"id": "str", "msgs": "hi"},
        {"id": "empty", "msgs": []},
        {"id": "norole", "msgs": [{"content": "hi"}]},
        {"id": "intcontent", "msgs": [{"role": "user", "content": 3}]},
        {"id": "notobj", "msgs": ["hi"]},
    ])
    rows = {r.id: r for r in reader(tmp_path, id_column="id", messages_column="msgs").rows()}
    assert rows["good"].error is None and rows["good"].prompt == good
    assert ("field 'msgs': expected a non-empty list of {role, content} messages, got a string"
            in rows["str"].error)
    assert "got a list" in rows["empty"].error
    assert "field 'msgs': message [0].role: expected a string, got null" in rows["norole"].error
    assert "message [0].content: expected a string, got an integer" in rows["intcontent"].error
    assert "message [0]: expected an object with role and content, got a string" in rows["notobj"].error
    assert all(r.error.startswith("in.jsonl line ") for r in rows.values() if r.error)


def test_parquet_rows_nulls_binary_and_structs(tmp_path):
    msgs = pa.array([[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}], None],
                    type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    write_parquet(tmp_path / "a.parquet", pa.table({"id": pa.array([1, 2, 3]), "msgs": msgs,
                                                     "raw": pa.array([b"ok", b"\xff\xfe", None])}))
    rows = list(reader(tmp_path, paths=["a.parquet"], id_column="id", messages_column="msgs").rows())
    assert [r.id for r in rows] == ["1", "2", "3"]
    assert rows[0].error is None and rows[0].prompt == [{"role": "user", "content": "hi"}]
    assert rows[1].error == "a.parquet row 1: field 'msgs': message [0].content: expected a string, got null"
    assert rows[2].error == "a.parquet row 2: field 'msgs': missing or null"
    rows = list(reader(tmp_path, paths=["a.parquet"], prompt_column="raw").rows())
    assert rows[0].error is None and rows[0].prompt == "ok" and rows[0].id == "a.parquet:0"
    assert rows[1].error == "a.parquet row 1: field 'raw': invalid UTF-8"


def test_missing_columns_are_job_level_problems(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    write_parquet(tmp_path / "b.parquet", {"id": [1], "prompt": ["x"]})
    r = reader(tmp_path, id_column="uid", carry_columns=["topic"], overrides={"max_tokens": "mt"})
    problems = r.check()
    assert [str(p).split(" (")[0] for p in problems] == ["input.id_column: column 'uid' not found in in.jsonl"]
    assert r.warnings == [  # optional JSONL columns may be missing on any line: null there
        "sampling.overrides.max_tokens: column 'mt' is in none of the first 1000 lines of in.jsonl; "
        "rows without it take null there",
        "input.carry_columns[0]: column 'topic' is in none of the first 1000 lines of in.jsonl; "
        "rows without it take null there",
    ]
    problems = reader(tmp_path, paths=["b.parquet"], prompt_column="text").check()
    assert [str(p) for p in problems] == [
        "input.prompt_column: column 'text' not found in b.parquet (columns: id, prompt)"]


def test_derived_ids_use_file_and_physical_line(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "in.jsonl", [{"prompt": "a"}, "", {"prompt": "b"}])
    ids = [r.id for r in reader(tmp_path, paths=["data/*.jsonl"]).rows()]
    assert ids == ["data/in.jsonl:1", "data/in.jsonl:3"]
    assert [k.id for k in reader(tmp_path, paths=["data"]).ids()] == ids  # a directory: the files in it


def test_incomplete_last_line_waits_for_its_newline(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    with open(path, "a") as f:
        f.write('{"id": "b", "prom')
    r = reader(tmp_path, id_column="id")
    assert [row.id for row in r.rows()] == ["a"]
    assert "incomplete last line skipped" in r.warnings[0]
    with open(path, "a") as f:
        f.write('pt": "y"}')  # complete JSON, still no newline: accepted
    assert [row.id for row in reader(tmp_path, id_column="id").rows()] == ["a", "b"]


def test_gzip_jsonl_and_skip_done(tmp_path):
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        for i in range(5):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"p{i}"}) + "\n")
    r = reader(tmp_path, paths=["in.jsonl.gz"], id_column="id")
    assert [row.id for row in r.rows(skip={"r1", "r3"})] == ["r0", "r2", "r4"]


def test_jsonl_carry_types_come_from_first_values(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "a", "k": None, "meta": {"x": 1}, "score": 1},
        {"prompt": "b", "k": 3, "meta": [1], "score": 2.5},
        {"prompt": "c", "k": "three", "meta": "s", "score": 1},
    ])
    r = reader(tmp_path, carry_columns=["k", "meta", "score"])
    assert [(f.name, str(f.type)) for f in r.carry_fields] == [("k", "int64"), ("meta", "string"),
                                                                ("score", "int64")]
    rows = list(r.rows())
    assert rows[0].carry == {"k": None, "meta": '{"x": 1}', "score": 1}
    assert rows[1].error == ("in.jsonl line 2: field 'score': expected int64 as in the first rows, "
                             "got a number")
    assert rows[2].error.startswith("in.jsonl line 3: field 'k': expected int64")


def test_parquet_streams_and_counts_cheaply(tmp_path):
    n = 5000
    write_parquet(tmp_path / "a.parquet", {"id": [f"x{i}" for i in range(n)], "prompt": ["p"] * n},
                  row_group_size=700)
    r = reader(tmp_path, paths=["a.parquet"], id_column="id")
    assert r.total_rows() == (n, True)
    rows = r.rows()
    first = next(rows)  # lazily: nothing beyond the first batch is read yet
    assert first.id == "x0"
    assert sum(1 for _ in rows) == n - 1


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=40, unique=True),
       count=st.integers(1, 6))
def test_shards_partition_the_rows(ids, count):
    owners = [[i for i in range(count) if Shard(i, count).owns(row_id)] for row_id in ids]
    assert all(len(o) == 1 for o in owners)


def test_sharded_reading_partitions_input(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "p"} for i in range(200)])
    parts = [{row.id for row in reader(tmp_path, id_column="id").rows(Shard(i, 3))} for i in range(3)]
    assert sum(len(p) for p in parts) == 200 and set().union(*parts) == {f"r{i}" for i in range(200)}
    assert all(len(p) > 30 for p in parts)
