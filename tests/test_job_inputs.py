"""Input formats: JSONL refused when it is not JSONL."""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path
from typing import Any

from jobkit import (
    FAKE,
    cli,
    job_dict,
    make_model,
    prompts,
    write_job,
)


def write_csv(path: Path, rows: list[dict[str, Any]] | list[list[Any]], delimiter: str = ",",
              header: list[str] | None = None) -> Path:
    """Rows as CSV (quoted where needed, as the csv module writes); ``.gz`` names are gzipped."""
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=delimiter, lineterminator="\n")
    if rows and isinstance(rows[0], dict):
        header = header or list(rows[0])
        w.writerow(header)
        w.writerows([[r.get(c, "") for c in header] for r in rows])
    else:
        w.writerow(header or [])
        w.writerows(rows)
    data = buf.getvalue().encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


# ----------------------------------------------------------------------------------------- JSONL


def test_jsonl_format_on_a_csv_file_is_refused_by_validate(tmp_path):
    make_model(tmp_path / "model")
    write_csv(tmp_path / "in.csv", prompts(5))
    job = write_job(tmp_path / "job.yaml", job_dict(input={"paths": ["in.csv"], "format": "jsonl"}))
    for command in ("validate", "run"):
        r = cli(command, job, "--engine", FAKE)
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert ("input.paths: in.csv is not JSONL: none of its first 6 lines is a JSON object "
                "(line 1: malformed JSON: Expecting value (column 1))") in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))
    # one good line among bad ones is JSONL with error rows, as before
    (tmp_path / "in.jsonl").write_text('not json\n{"id": "a", "prompt": "x", "topic": 1}\n')
    write_job(job, job_dict())
    assert cli("validate", job, "--engine", FAKE).exit_code == 0
