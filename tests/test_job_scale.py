"""What a job keeps per row, held compactly: exact under hash collisions, read from the parts'
indexes instead of their rows, and exactly once after SIGKILLs at a million rows."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
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
from batchgen.job.inputs import InputReader
from batchgen.job.inputs import parquet as parquet_module
from batchgen.job.inputs import reader as reader_module
from batchgen.job.inputs import seen as seen_module
from batchgen.job.inputs.rows import InputFile
from batchgen.job.inputs.seen import FirstSeen, row_key
from batchgen.job.outputs import merge as merge_module
from batchgen.job.outputs import writer as writer_module
from batchgen.job.outputs.formats import META_IDS
from batchgen.job.outputs.writer import part_name
from batchgen.job.shard import Shard
from batchgen.job.spec import InputSpec

INSTANT = f"{REPO / 'scripts' / 'instant_engine.py'}:InstantLLM"


def colliding_hash(values: int):
    """A hash of ``values`` values: every id collides with many others."""
    def hash_ids(ids: pa.Array) -> np.ndarray:
        return np.array([len(i) % values for i in ids_module.as_bytes(ids).to_pylist()], dtype=np.int64)
    return hash_ids


def collide(monkeypatch, values: int) -> None:
    monkeypatch.setattr(ids_module, "hash_ids", colliding_hash(values))
    monkeypatch.setattr(reader_module, "hash_ids", colliding_hash(values))


@pytest.fixture
def collisions(monkeypatch):
    """Every id hashes to one of three values, FirstSeen spills every few ids, runs read back in blocks of 2."""
    collide(monkeypatch, 3)
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
    repeats = 0
    for start in range(0, len(ids), 10):
        batch = ids[start:start + 10]
        arr = ids_module.id_array(batch)
        got = seen.first_of(arr, ids_module.hash_ids(arr), row_key(0, np.arange(start, start + len(batch))))
        for index, (row_id, key) in enumerate(zip(batch, got.tolist(), strict=True), start):
            at = first.setdefault(row_id, index)
            assert key == (-1 if at == index else at)
            if key >= 0:
                repeats += 1
                assert seen.where(key) == f"a.jsonl line {at + 1}"
    assert repeats == 200 - 30 and seen._hashes.size > 0  # most repeats were of spilled ids
    seen.close()


def test_the_vectorised_hash_is_one_function_of_the_id():
    ids = ["", "a", "ab", "ba", "héllo", "r000000001", "a\udc80", "x" * 300, "r000000001"]
    arr = ids_module.id_array(ids)
    whole = ids_module.hash_ids(arr)
    one_by_one = [int(ids_module.hashes_of([i])[0]) for i in ids]
    assert whole.tolist() == one_by_one  # the same id, the same hash, alone or in a batch
    sliced = arr.slice(3, 4)
    assert ids_module.hash_ids(sliced).tolist() == one_by_one[3:7]  # an Arrow slice (offset) too
    assert ids_module.hash_ids(pa.array(ids[:6], pa.large_string())).tolist() == one_by_one[:6]
    assert whole[5] == whole[8] and len(set(whole.tolist())) == len(ids) - 1
    many = ids_module.hash_ids(pa.array([f"r{i:09d}" for i in range(200_000)]))
    assert len(np.unique(many)) == len(many)


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
    collide(monkeypatch, 2)
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


def row_by_row(monkeypatch) -> None:
    """The reader's record-by-record path for every Parquet batch (as JSONL is read)."""
    monkeypatch.setattr(reader_module, "column_ids", lambda *args: None)


def test_the_columnar_path_gives_the_row_by_row_paths_rows(tmp_path, monkeypatch):
    """Duplicate ids (within a batch, across batches, across files, after a spill), missing and empty ids,
    integer ids, rows without a prompt, shards and done ids: the same rows, ids and errors both ways."""
    rng = random.Random(35)
    ids = [rng.choice([f"k{rng.randrange(60)}", None, "", f"u{i}"]) for i in range(300)]
    prompts_ = [None if i % 17 == 0 else f"p{i}" for i in range(300)]
    pq.write_table(pa.table({"id": ids[:200], "prompt": prompts_[:200]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ids[200:], "prompt": prompts_[200:]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"id": pa.array([7, 8, None, 7, 9]), "prompt": ["x"] * 5}), tmp_path / "c.parquet")
    monkeypatch.setattr(parquet_module, "COLUMN_BATCH_ROWS", 16)
    monkeypatch.setattr(seen_module, "SPILL_IDS", 20)
    columnar = 0
    real_column_ids = reader_module.column_ids

    def counted(*args):
        nonlocal columnar
        got = real_column_ids(*args)
        columnar += got is not None
        return got

    def read(shard: Shard, done: DoneIds) -> tuple[list[tuple[str, str | None, object]], list]:
        r = InputReader(InputSpec(paths=["a.parquet", "b.parquet", "c.parquet"], id_column="id",
                                  prompt_column="prompt"), tmp_path)
        rows = [(row.id, row.error, row.prompt) for row in r.rows(shard, done)]
        status = [(row_id, owner, b.duplicates.get(at)) for b in r.id_batches()
                  for at, (row_id, owner) in enumerate(zip(b.ids.to_pylist(), b.owners.to_pylist(), strict=True))]
        return rows, status

    everything, status = read(Shard(), DoneIds())
    assert sum(1 for _, error, _ in everything if error and "duplicate id" in error) > 20
    assert sum(1 for _, _, duplicate in status if duplicate) > 20
    assert any(error and "missing id" in error for _, error, _ in everything)
    assert any(error and "id is empty" in error for _, error, _ in everything)
    done = DoneIds()
    part = [row_id for row_id, _, _ in everything[::3]]  # some first rows, some repeats' own ids
    done.add_part(part, lambda: part)
    for shard in (Shard(), Shard(0, 3), Shard(2, 3)):
        for skip in (DoneIds(), done):
            with monkeypatch.context() as m:
                m.setattr(reader_module, "column_ids", counted)
                fast = read(shard, skip)
            with monkeypatch.context() as m:
                row_by_row(m)
                slow = read(shard, skip)
            assert fast == slow
    assert columnar > 20  # the columnar path ran


def test_status_and_a_rerun_read_no_row_whole_when_all_is_done(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    write_input(tmp_path / "in" / "a.parquet", 0, 3000)
    job = setup_job(tmp_path, rows=0, input={"paths": ["in/*.parquet"], "id_column": "id", "prompt_column": "prompt",
                                                "carry_columns": []},
                    sampling={"n": 1, "temperature": 0, "max_tokens": 1}, output={"rows_per_part": 1000})
    monkeypatch.setenv("BATCHGEN_ENGINE", INSTANT)
    assert run(job).exit_code == 0
    made = 0
    real_records_of = parquet_module.records_of

    def counted(*args, **kwargs):
        nonlocal made
        got = real_records_of(*args, **kwargs)
        made += len(got)
        return got

    monkeypatch.setattr(parquet_module, "records_of", counted)
    rerun = run(job)
    assert rerun.exit_code == 0, rerun.output
    status = cli("status", tmp_path / "out")
    assert status.exit_code == 0 and "3,000" in status.output, status.output
    assert made == 0
    write_input(tmp_path / "in" / "b.parquet", 3000, 10)
    assert run(job).exit_code == 0
    assert made == 10 and len(output_ids(tmp_path / "out")) == 3010


def test_merge_streams_input_order_with_extras_and_an_id_in_two_parts(tmp_path, monkeypatch):
    job = setup_job(tmp_path, rows=30, output={"dir": "out", "rows_per_part": 4, "format": "jsonl"})
    write_jsonl(tmp_path / "in.jsonl", list(reversed(prompts(30))))  # input order is not the parts' order
    assert run(job).exit_code == 0
    out = tmp_path / "out"
    lines: dict[str, list[str]] = {}  # id -> its lines, in part then line order
    for part in sorted(out.glob("part-*.jsonl")):
        for line in part.read_text().splitlines(keepends=True):
            lines.setdefault(json.loads(line)["id"], []).append(line)
    twice = next(iter(lines))  # also complete in a later part: the first part wins
    clone = out / part_name(Shard(), 999_999, ".jsonl")
    clone.write_text("".join(lines[twice]))
    meta = json.loads(next(out.glob(".part-*.meta")).read_text())
    meta.update({META_IDS: json.dumps([twice]), "batchgen.errors": "0", "batchgen.bytes": str(clone.stat().st_size)})
    (out / f".{clone.name}.meta").write_text(json.dumps(meta))
    dropped = ["q0017", "q0003"]  # rows no longer in the input: at the end, in part order
    kept = [r for r in reversed(prompts(30)) if r["id"] not in dropped]
    write_jsonl(tmp_path / "in.jsonl", kept)
    monkeypatch.setattr(merge_module, "CONFIRM_CACHE_IDS", 5)  # part lines read again after eviction
    result = cli("merge", out, "-o", tmp_path / "all.jsonl")
    assert result.exit_code == 0, result.output
    extra = [row_id for row_id in lines if row_id in dropped]
    assert extra == dropped
    expected = [line for row_id in [r["id"] for r in kept] + extra for line in lines[row_id]]
    assert (tmp_path / "all.jsonl").read_text() == "".join(expected)
