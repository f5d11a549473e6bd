"""Types of carried columns in formats without a schema (JSONL): each column's kind is fixed by
its first values, and every later value must be of that kind, so each output part has the same
column types however the rows were split into parts."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from .rows import BadValue
from .values import type_name

KIND_TYPES = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
              "json": pa.string()}  # json: anything else (lists, objects), written as JSON text


def kind_of(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int64"
    if isinstance(v, float):
        return "float64"
    return "string" if isinstance(v, str) else "json"


def coerce(v: Any, kind: str) -> Any:
    """``v`` as a value of ``kind`` (an int where floats are expected becomes a float), or a
    ``BadValue`` saying what was expected."""
    if v is None or isinstance(v, BadValue):
        return v
    if kind == "json":
        return json.dumps(v, ensure_ascii=False)
    got = kind_of(v)
    if got == kind:
        return v
    if kind == "float64" and got == "int64":
        return float(v)
    return BadValue(f"expected {kind} as in the first rows, got {type_name(v)}")
