"""JSONL parts read back by Arrow's JSON reader (``keys``, ``drop_errors``): the same table as parsing
line by line, which still decides every part the reader cannot read as it would."""

from __future__ import annotations

import json

import pytest

from batchgen.job.errors import JobError
from batchgen.job.outputs.formats import JsonlParts, OpenAIBatchParts, meta_path
from batchgen.storage import location

PARTS = JsonlParts()


def _part(tmp_path, lines: list[str], name: str = "part-00000-of-00001-000000.jsonl"):
    path = tmp_path / name
    path.write_bytes("".join(lines).encode())
    (tmp_path / f".{name}.meta").write_text(json.dumps({"batchgen.format": "jsonl"}))
    return location(path)


def _line(**fields) -> str:
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")) + "\n"


GOOD = [_line(id="a", sample_index=0, num_samples=2, text="x\u00e9", error=None),
        _line(id="a", sample_index=1, num_samples=2, text="y", error=None),
        _line(id="b", sample_index=0, num_samples=None, text=None, error="in.jsonl line 2: no prompt"),
        _line(id="c", sample_index=0, text={"nested": [1, {"x": None}]}, error=None),
        _line(id="d", sample_index=0, num_samples=0, error=None)]


@pytest.mark.parametrize("lines, columnar", [
    (GOOD, True),
    (GOOD[:-1] + [GOOD[-1].rstrip("\n")], True),  # no newline at the end
    (GOOD[:2] + ["\n"] + GOOD[2:], False),  # a blank line
    (GOOD[:2] + ["   \n"] + GOOD[2:], False),
    (GOOD + [_line(id=7, error=None)], False),  # an id that is not a string
    (GOOD + [_line(id="e", error={"code": "x"})], False),  # an error that is not a string
    (GOOD + [_line(id="e", num_samples="2", error=None)], False),
])
def test_arrow_keys_equal_the_line_by_line_keys(tmp_path, lines, columnar):
    path = _part(tmp_path, lines)
    data = path.read_bytes()
    parsed = PARTS._parsed_keys(path, data)
    assert (PARTS._columnar_keys(data) is not None) == columnar
    assert PARTS.keys(path).equals(parsed)
    assert parsed.column("num_samples").to_pylist()[:5] == [2, 2, 1, 1, 1]
    assert parsed.column("offset").to_pylist()[:2] == [0, len(lines[0].encode())]


def test_openai_batch_parts_are_parsed_line_by_line(tmp_path):
    line = _line(id="batch_req_1", custom_id="row-1", response=None, error={"code": "x", "message": "m"})
    path = _part(tmp_path, [line])
    keys = OpenAIBatchParts().keys(path)
    assert keys.column("id").to_pylist() == ["row-1"]
    assert keys.column("error").to_pylist() == [json.dumps({"code": "x", "message": "m"})]


def test_a_line_that_is_not_json_names_the_part_and_line(tmp_path):
    path = _part(tmp_path, GOOD[:2] + ["{not json\n"])
    with pytest.raises(JobError, match=r"line 3 is not JSON"):
        PARTS.keys(path)


def test_drop_errors_keeps_the_other_lines_byte_for_byte(tmp_path):
    path = _part(tmp_path, GOOD)
    assert PARTS.drop_errors(path) == 1
    assert path.read_bytes() == "".join(GOOD[:2] + GOOD[3:]).encode()
    meta = json.loads(meta_path(path).read_text())
    assert meta["batchgen.format"] == "jsonl"
    assert PARTS.drop_errors(path) == 0
    only_errors = _part(tmp_path, [GOOD[2]], "part-00000-of-00001-000001.jsonl")
    assert PARTS.drop_errors(only_errors) == 1
    assert not (tmp_path / only_errors.name).exists() and not (tmp_path / meta_path(only_errors).name).exists()
