"""What a job keeps per row, held compactly: exact under hash collisions, read from the parts'
indexes instead of their rows, and exactly once after SIGKILLs at a million rows."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from jobkit import (
    REPO,
    batchgen_cmd,
    cli,
    kill_at_random_moments,
    outputs_by_key,
    prompts,
    run,
    setup_job,
    subprocess_env,
    write_jsonl,
)

from batchgen.job import ids as ids_module
from batchgen.job.ids import DoneIds
from batchgen.job.inputs import seen as seen_module
from batchgen.job.inputs.rows import InputFile
from batchgen.job.inputs.seen import FirstSeen
from batchgen.job.outputs import writer as writer_module
from batchgen.job.outputs.formats import META_IDS

INSTANT = f"{REPO / 'scripts' / 'instant_engine.py'}:InstantLLM"


@pytest.fixture
def collisions(monkeypatch):
    """Every id hashes to one of three values, FirstSeen spills every few ids, runs read back in blocks of 2."""
    monkeypatch.setattr(ids_module, "id_hash", lambda row_id: len(row_id) % 3)
    monkeypatch.setattr(seen_module, "SPILL_IDS", 4)
    monkeypatch.setattr(ids_module, "RUN_CAP", 8)
    monkeypatch.setattr(ids_module, "FENCE", 2)  # equal hashes across blocks of the spilled runs


def test_done_ids_are_exact_under_collisions(collisions):
    parts = [[f"id{i}" for i in range(p, 40, 3)] for p in range(3)] + [["id5", "other"]]
    done = DoneIds()
    for part in parts:
        done.add_part(part, lambda part=part: part)
    everything = {row_id for part in parts for row_id in part}
    asked = sorted(everything | {f"id{i}" for i in range(40, 60)} | {"", "nope", "id"})
    assert done.contains_many(asked) == [a in everything for a in asked]
    assert sum(done.contains_many(asked)) == len(everything) == 41
    assert len(done) == len(everything) and done.twice == 1  # id5 in two parts
    assert done == everything and "id5" in done and "id999" not in done


def test_first_seen_is_exact_under_collisions_and_spills(collisions):
    files = [InputFile(None, "jsonl", "a.jsonl")]
    seen = FirstSeen(files)
    rng = random.Random(7)
    ids = [f"k{rng.randrange(30)}" for _ in range(200)]
    first: dict[str, int] = {}
    spilled_lookups = 0
    for start in range(0, len(ids), 10):
        batch = ids[start:start + 10]
        maybe = seen.spilled_maybe(ids_module.hashes_of(batch))
        spilled_lookups += sum(maybe)
        for index, (row_id, m) in enumerate(zip(batch, maybe, strict=True), start):
            out_id, error = seen.check(row_id, 0, index, "id", m)
            at = first.setdefault(row_id, index)
            if at == index:
                assert (out_id, error) == (row_id, None)
            else:
                assert out_id == f"a.jsonl:{index}" and f"first at a.jsonl line {at + 1}" in error
        seen.end_batch()
    assert spilled_lookups > 50  # the spilled runs were consulted, with colliding hashes
    seen.close()


def test_a_job_with_duplicates_is_the_same_under_collisions(tmp_path, monkeypatch):
    records = prompts(30) + [{"id": "q0003", "prompt": "again", "topic": 0}] + prompts(5, start=40)
    records += [{"id": "q0041", "prompt": "and again", "topic": 1}]
    jobs = {}
    for name in ("plain", "colliding"):
        root = tmp_path / name
        root.mkdir()
        write_jsonl(root / "in.jsonl", records)
        jobs[name] = setup_job(root, rows=0)
    assert run(jobs["plain"]).exit_code == 0
    expected = outputs_by_key(tmp_path / "plain" / "out")
    monkeypatch.setattr(ids_module, "id_hash", lambda row_id: len(row_id) % 2)
    monkeypatch.setattr(seen_module, "SPILL_IDS", 3)
    result = run(jobs["colliding"])
    assert result.exit_code == 0, result.output
    assert outputs_by_key(tmp_path / "colliding" / "out") == expected
    assert sum(1 for text, error in expected.values() if error and "duplicate id" in error) == 2
    assert run(jobs["colliding"]).exit_code == 0  # every row done: nothing is generated again
    assert outputs_by_key(tmp_path / "colliding" / "out") == expected


def test_recover_and_status_read_the_index_not_the_rows(tmp_path, monkeypatch):
    job = setup_job(tmp_path, rows=25)
    write_jsonl(tmp_path / "in.jsonl", [{"id": "bad", "topic": 1}], mode="a")  # no prompt: an error row
    assert run(job).exit_code == 0
    out = tmp_path / "out"
    indexed = [json.loads(pq.read_schema(p).metadata[META_IDS.encode()]) for p in out.glob("part-*.parquet")]
    assert sorted(row_id for ids in indexed for row_id in ids) == sorted([f"q{i:04d}" for i in range(25)] + ["bad"])

    def no_rows(path):
        raise AssertionError(f"read the rows of {path}")

    monkeypatch.setattr(writer_module, "read_part", no_rows)
    status = cli("status", out)
    assert status.exit_code == 0, status.output
    assert "26" in status.output and "done" in status.output
    rerun = run(job, "--retry-errors")  # rewrites the part with the error row, whose new index is used
    assert rerun.exit_code == 0, rerun.output
    assert "removed 1 error rows" in rerun.output
    assert run(job).exit_code == 0
    monkeypatch.undo()
    assert len(outputs_by_key(out)) == 26 * 2 - 1  # two samples each, one for the error row


def test_parts_written_before_the_index_are_read_whole(tmp_path):
    job = setup_job(tmp_path, rows=25)
    assert run(job).exit_code == 0
    out = tmp_path / "out"
    for part in out.glob("part-*.parquet"):  # as an older batchgen wrote them: no index
        table = pq.read_table(part)
        meta = {k: v for k, v in table.schema.metadata.items() if not k.startswith(b"batchgen.ids")}
        pq.write_table(table.replace_schema_metadata(meta), part)
    expected = outputs_by_key(out)
    write_jsonl(tmp_path / "in.jsonl", prompts(5, start=25), mode="a")
    result = run(job)
    assert result.exit_code == 0, result.output
    got = outputs_by_key(out)
    assert len(got) == 30 * 2 and all(got[k] == v for k, v in expected.items())
    assert "missing" in cli("status", out).output


def write_input(path: Path, start: int, rows: int) -> None:
    ids = pa.array([f"r{i:08d}" for i in range(start, start + rows)])
    pq.write_table(pa.table({"id": ids, "prompt": pc.binary_join_element_wise("p ", ids, "")}), path)


def output_ids(out: Path) -> pa.ChunkedArray:
    return ds.dataset(out, format="parquet").to_table(columns=["id"]).column("id")


@pytest.mark.slow
def test_a_million_rows_killed_and_resumed_then_an_increment_exactly_once(tmp_path):
    rows = 1_000_000
    (tmp_path / "in").mkdir()
    write_input(tmp_path / "in" / "a.parquet", 0, rows)
    job = setup_job(tmp_path, rows=0, input={"paths": ["in/*.parquet"], "id_column": "id", "prompt_column": "prompt",
                                                "carry_columns": []},
                    sampling={"n": 1, "temperature": 0, "max_tokens": 1}, output={"rows_per_part": 20_000},
                    max_in_flight=1024)
    out = tmp_path / "out"
    env = subprocess_env(BATCHGEN_ENGINE=INSTANT)

    def parts() -> int:
        return len(list(out.glob("part-*.parquet")))

    def no_id_twice() -> None:
        if parts():
            ids = output_ids(out)
            assert pc.count_distinct(ids).as_py() == len(ids)

    def finish(expected: int) -> None:
        final = subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True)
        assert final.returncode == 0, final.stderr
        ids = output_ids(out)
        assert len(ids) == pc.count_distinct(ids).as_py() == expected

    rng = random.Random(35)
    kills = kill_at_random_moments(job, env, parts, rng, rounds=2, anywhere=0.0, after_kill=no_id_twice)
    assert kills == 2 and 0 < parts() < rows // 20_000
    finish(rows)
    write_input(tmp_path / "in" / "b.parquet", rows, 1000)
    kill_at_random_moments(job, env, parts, rng, rounds=1, anywhere=1.0, after_kill=no_id_twice)
    finish(rows + 1000)
