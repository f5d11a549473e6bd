"""Local faults: the disk filling up mid-part and a read-only output dir are one line naming the path, a
non-zero exit and nothing half-written counted as done; a part that is not whole (truncated, torn, a
broken footer) is named by status, set aside by the next run and its rows generated again."""

from __future__ import annotations

import errno
import json
import os

import pyarrow.parquet as pq
import pytest
from jobkit import cli, outputs_by_key, run, setup_job

ROWS = 20
OUT = {"rows_per_part": 5}


def reference(tmp_path, **output) -> dict:
    job = setup_job(tmp_path / "ref", rows=ROWS, output={**OUT, **output})
    assert run(job).exit_code == 0
    return outputs_by_key(tmp_path / "ref" / "out")


def leftovers(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))


def test_the_disk_filling_up_mid_part_is_one_line_and_a_rerun_finishes(tmp_path, monkeypatch):
    expected = reference(tmp_path)
    job = setup_job(tmp_path / "job", rows=ROWS, output=OUT)
    write_table, calls = pq.write_table, []

    def full_disk(table, where, **kw):
        calls.append(where)
        if len(calls) == 3:  # the third part: half of it written, then the disk is full
            write_table(table, where, **kw)
            with open(where, "r+b") as f:
                f.truncate(os.path.getsize(where) // 2)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_table(table, where, **kw)

    monkeypatch.setattr(pq, "write_table", full_disk)
    r = run(job)
    assert r.exit_code == 1, r.output
    line = [x for x in r.output.splitlines() if x.startswith("batchgen: error:")]
    assert len(line) == 1 and "cannot write " + str(tmp_path / "job" / "out" / "part-00000-of-00001-000002.parquet") \
        in line[0] and "free space there" in line[0], r.output
    assert "Traceback" not in r.output
    out = tmp_path / "job" / "out"
    assert leftovers(out) == [] and not (out / "part-00000-of-00001-000002.parquet").exists()
    monkeypatch.setattr(pq, "write_table", write_table)
    assert run(job).exit_code == 0
    assert outputs_by_key(out) == expected


def test_a_read_only_output_dir_is_one_line(tmp_path, monkeypatch):
    expected = reference(tmp_path)
    job = setup_job(tmp_path / "job", rows=ROWS, output=OUT)

    def read_only(src, dst, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "link", read_only)
    r = run(job)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    line = [x for x in r.output.splitlines() if x.startswith("batchgen: error:")]
    assert len(line) == 1 and "Read-only file system; make the output dir writable and run again" in line[0]
    out = tmp_path / "job" / "out"
    assert leftovers(out) == [] and not list(out.glob("part-*"))
    monkeypatch.undo()
    assert run(job).exit_code == 0
    assert outputs_by_key(out) == expected


def truncate(path, keep: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_a_data_page_byte(path) -> None:
    """A flipped bit in the last byte of the first column's chunk, inside its data page, where the footer and the
    sizes still look whole: only the page's checksum (or its decompression) can tell."""
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    last = start + column.total_compressed_size - 1
    assert last > column.data_page_offset
    data = bytearray(path.read_bytes())
    data[last] ^= 0x10
    path.write_bytes(bytes(data))


def finished_then_damaged(tmp_path, fmt: str, damage):
    """(what the job writes, the job file, its output dir, the part damaged): a finished run whose second part
    `damage` then breaks."""
    expected = reference(tmp_path, format=fmt)
    job = setup_job(tmp_path / "job", rows=ROWS, output={**OUT, "format": fmt})
    assert run(job).exit_code == 0
    out = tmp_path / "job" / "out"
    broken = out / f"part-00000-of-00001-000001.{fmt}"
    damage(broken)
    return expected, job, out, broken


@pytest.mark.parametrize("fmt,damage", [("parquet", truncate), ("parquet", flip_last_byte), ("jsonl", truncate)])
def test_a_part_that_is_not_whole_is_named_set_aside_and_redone(tmp_path, fmt, damage):
    expected, job, out, broken = finished_then_damaged(tmp_path, fmt, damage)
    st = cli("status", out)
    assert st.exit_code == 0 and f"warning: {'cannot read part ' if fmt == 'parquet' else 'part '}{broken}" in st.output
    assert "the next run of its shard sets it aside" in st.output, st.output
    assert json.loads(cli("status", out, "--json").stdout)["corrupt_parts"]
    r = run(job)
    assert r.exit_code == 0, r.output
    assert f"set aside as {out / '.corrupt' / broken.name}, its rows are generated again" in r.output, r.output
    assert (out / ".corrupt" / broken.name).exists() and not broken.exists()
    assert outputs_by_key(out) == expected  # each (id, sample) once again
    assert "warning" not in cli("status", out).output


def flip_a_middle_byte(path) -> None:
    """A JSONL part whose size is unchanged: one character of a line's text changed."""
    data = bytearray(path.read_bytes())
    at = data.index(b'"text":"') + len(b'"text":"')
    data[at] = ord("Z") if data[at] != ord("Z") else ord("Y")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt,damage", [("parquet", flip_a_data_page_byte), ("jsonl", flip_a_middle_byte)])
def test_a_flipped_byte_is_found_by_verify_set_aside_and_redone(tmp_path, fmt, damage):
    """A byte changed inside the data, the footer and sizes intact: only reading the part whole can tell (page
    checksums, a JSONL part's sha256), which `status --verify` and `run --verify` do; plain status and resume read
    footers and indexes only, and say nothing."""
    expected, job, out, broken = finished_then_damaged(tmp_path, fmt, damage)
    assert "warning" not in cli("status", out).output
    st = cli("status", out, "--verify")
    assert st.exit_code == 0 and f"{broken}" in st.output and "warning" in st.output, st.output
    assert "the next run of its shard sets it aside" in st.output, st.output
    r = run(job, "--verify")
    assert r.exit_code == 0, r.output
    assert f"set aside as {out / '.corrupt' / broken.name}, its rows are generated again" in r.output, r.output
    assert outputs_by_key(out) == expected
    assert "warning" not in cli("status", out, "--verify").output
