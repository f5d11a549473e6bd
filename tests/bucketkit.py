"""Helpers for tests whose job input and output live in a bucket of the S3 test server."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from jobkit import keyed

from batchgen.job.outputs.writer import list_parts
from batchgen.storage import location


def upload(url: str, data: bytes | str | Path) -> str:
    """Put ``data`` (bytes, text or a local file's content) at ``url``; the URL."""
    if isinstance(data, Path):
        data = data.read_bytes()
    location(url).publish_bytes(data.encode() if isinstance(data, str) else data)
    return url


def download(url: str) -> bytes:
    return location(url).read_bytes()


def bucket_rows(out_url: str) -> list[dict[str, Any]]:
    """Every output row of a Parquet or JSONL output dir in a bucket."""
    rows: list[dict[str, Any]] = []
    for part in list_parts(location(out_url)):
        data = part.path.read_bytes()
        if part.path.suffix == ".parquet":
            rows += pq.read_table(io.BytesIO(data)).to_pylist()
        else:
            rows += [json.loads(line) for line in data.splitlines() if line.strip()]
    return rows


def bucket_outputs(out_url: str) -> dict[tuple[str, int], Any]:
    """(id, sample_index) -> (text, error), asserting each key appears exactly once."""
    return keyed(bucket_rows(out_url))
