"""Input id indexes: an unchanged input file's ids come from its index (no row of it read again),
give the same rows, ids and errors as reading the file, and are dropped as soon as the file or a
file before it changes; parts carry their ids packed (no JSON list parsed on a rerun)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobkit import cli, outputs_by_key, prompts, run, setup_job, write_jsonl
from test_job_scale import collide

from batchgen.job import ids as ids_module
from batchgen.job.ids import DoneIds
from batchgen.job.inputs import InputReader
from batchgen.job.inputs import id_index as index_module
from batchgen.job.inputs import parquet as parquet_module
from batchgen.job.inputs import reader as reader_module
from batchgen.job.inputs import seen as seen_module
from batchgen.job.inputs.id_index import INDEX_DIR, IndexDir
from batchgen.job.outputs import formats as formats_module
from batchgen.job.shard import Shard
from batchgen.job.spec import InputSpec
from batchgen.storage import location


def write_inputs(root: Path, fmt: str = "parquet", seed: int = 35) -> None:
    """Three files with ids repeated within a file, across files and across batches, missing, empty
    and integer ids, rows without a prompt, and for JSONL malformed and blank lines."""
    rng = random.Random(seed)
    ids = [rng.choice([f"k{rng.randrange(60)}", None, "", f"u{i}"]) for i in range(300)]
    texts = [None if i % 17 == 0 else f"p{i}" for i in range(300)]
    files = {"a": (ids[:200], texts[:200]), "b": (ids[200:], texts[200:]), "c": ([7, 8, None, 7, 9], ["x"] * 5)}
    for name, (file_ids, file_texts) in files.items():
        if fmt == "parquet":
            pq.write_table(pa.table({"id": file_ids, "prompt": file_texts}), root / f"{name}.parquet")
            continue
        lines = [json.dumps({"id": i, "prompt": t}) for i, t in zip(file_ids, file_texts, strict=True)]
        if name == "b":
            lines[5], lines[9] = "{not json", ""
        write_jsonl(root / f"{name}.jsonl", lines)


def reader(root: Path, indexed: bool) -> InputReader:
    fmt = "parquet" if (root / "a.parquet").exists() else "jsonl"
    return InputReader(InputSpec(paths=[f"{n}.{fmt}" for n in "abc"], id_column="id", prompt_column="prompt"), root,
                       index_dir=IndexDir(location(root / "out" / INDEX_DIR), "id") if indexed else None)


def read(root: Path, indexed: bool, shard: Shard | None = None, done: DoneIds | None = None) -> tuple[list, list]:
    rows = [(row.id, row.error, row.prompt, row.where) for row in reader(root, indexed).rows(shard, done or DoneIds())]
    return rows, status_of(root, indexed)


def status_of(root: Path, indexed: bool) -> list:
    """What ``status`` and ``merge`` read: every row's output id, owner and duplicate message."""
    return [(row_id, owner, b.duplicates.get(at)) for b in reader(root, indexed).id_batches()
            for at, (row_id, owner) in enumerate(zip(b.ids.to_pylist(), b.owners.to_pylist(), strict=True))]


def index_files(root: Path) -> list[Path]:
    return sorted((root / "out" / INDEX_DIR).glob("*.arrow"))


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(parquet_module, "COLUMN_BATCH_ROWS", 16)
    monkeypatch.setattr(seen_module, "SPILL_IDS", 20)
    monkeypatch.setattr(reader_module, "BATCH", 32)


def no_reading(monkeypatch) -> None:
    """Reading the rows of an input file fails (its first lines for the checks aside): what is asked
    must come from the indexes."""
    def fail(self, f, *args, **kwargs):
        raise AssertionError(f"{f.name} was read")

    monkeypatch.setattr(InputReader, "_id_batches", fail)


@pytest.mark.parametrize("fmt,colliding", [("parquet", False), ("parquet", True), ("jsonl", False), ("jsonl", True)])
def test_the_index_gives_the_rows_and_ids_reading_gives(tmp_path, monkeypatch, small_batches, fmt, colliding):
    write_inputs(tmp_path, fmt)
    if colliding:
        collide(monkeypatch, 3)
    plain = read(tmp_path, indexed=False)
    assert sum(1 for *_, duplicate in plain[1] if duplicate) > 20
    assert index_files(tmp_path) == []
    assert read(tmp_path, indexed=True) == plain  # read, and indexed as read
    assert len(index_files(tmp_path)) == 3
    with monkeypatch.context() as m:
        no_reading(m)
        done = DoneIds()
        every = [row_id for row_id, *_ in plain[0]]
        done.add_part(every, lambda: every)
        assert list(reader(tmp_path, indexed=True).rows(Shard(), done)) == []
        assert status_of(tmp_path, indexed=True) == plain[1]
    part = [row_id for row_id, *_ in plain[0][::3]]
    done = DoneIds()
    done.add_part(part, lambda: part)
    for shard in (Shard(), Shard(0, 3), Shard(2, 3)):
        assert read(tmp_path, indexed=True, shard=shard, done=done) == read(tmp_path, indexed=False, shard=shard,
                                                                            done=done)


def test_a_changed_file_is_read_again_and_later_files_see_the_earlier_ids(tmp_path, monkeypatch, small_batches):
    write_inputs(tmp_path)
    read(tmp_path, indexed=True)
    first_index = {p.name: p.stat().st_mtime_ns for p in index_files(tmp_path)}
    # c.parquet rewritten with an id of a.parquet: a repeat now, found with a.parquet's ids from its index
    a_id = next(i for i in pq.read_table(tmp_path / "a.parquet").column("id").to_pylist() if i)
    pq.write_table(pa.table({"id": ["new", a_id], "prompt": ["x", "y"]}), tmp_path / "c.parquet")
    os.utime(tmp_path / "c.parquet", ns=(1, 1))
    fresh = read(tmp_path, indexed=False)
    assert any(duplicate and repr(a_id) in duplicate for *_, duplicate in fresh[1])
    seen_files = []
    real_id_batches = InputReader._id_batches

    def counted(self, f, *args, **kwargs):
        seen_files.append(f.name)
        return real_id_batches(self, f, *args, **kwargs)

    monkeypatch.setattr(InputReader, "_id_batches", counted)
    assert status_of(tmp_path, indexed=True) == fresh[1]
    assert seen_files == ["c.parquet"]  # a and b from their indexes
    changed = {p.name: p.stat().st_mtime_ns for p in index_files(tmp_path)}
    assert sum(changed[n] != t for n, t in first_index.items()) == 1  # c's index written again
    assert read(tmp_path, indexed=True) == fresh
    # b.parquet rewritten: b and every file after it are read again
    pq.write_table(pa.table({"id": ["late", a_id], "prompt": ["z", "w"]}), tmp_path / "b.parquet")
    os.utime(tmp_path / "b.parquet", ns=(2, 2))
    seen_files.clear()
    assert status_of(tmp_path, indexed=True) == status_of(tmp_path, indexed=False)
    assert seen_files[:2] == ["b.parquet", "c.parquet"]
    assert read(tmp_path, indexed=True) == read(tmp_path, indexed=False)


def test_an_index_of_another_reading_or_hash_is_not_used(tmp_path, monkeypatch, small_batches):
    write_inputs(tmp_path)
    read(tmp_path, indexed=True)
    r = reader(tmp_path, indexed=True)
    keys = r.index_dir.keys_for(r.files)
    assert r.index_dir.read(r.files[0], keys, 0) is not None
    assert IndexDir(r.index_dir.root, "other").read(r.files[0], keys, 0) is None
    assert r.index_dir.read(r.files[1], keys[1:], 0) is None  # a file before it gone
    monkeypatch.setattr(index_module, "HASH_NAME", "another")
    assert r.index_dir.read(r.files[0], keys, 0) is None


def test_a_rerun_reads_no_input_row_and_no_id_list(tmp_path, monkeypatch):
    job = setup_job(tmp_path, rows=0, output={"rows_per_part": 7})
    write_jsonl(tmp_path / "in.jsonl", prompts(30) + [{"id": "q0004", "prompt": "again"}, "{bad"])
    assert run(job).exit_code == 0
    expected = outputs_by_key(tmp_path / "out")
    assert len(index_files(tmp_path)) == 1
    with monkeypatch.context() as m:
        no_reading(m)
        m.setattr(formats_module.PartIndex, "ids", property(lambda self: pytest.fail("a part's id list was parsed")))
        rerun = run(job)
        assert rerun.exit_code == 0 and "nothing to do" in rerun.output, rerun.output
        status = cli("status", tmp_path / "out")
        assert status.exit_code == 0 and "1 input row repeats" in status.output, status.output
    assert outputs_by_key(tmp_path / "out") == expected
    write_jsonl(tmp_path / "in.jsonl", prompts(3, start=30), mode="a")  # the file changed: read again
    assert run(job).exit_code == 0
    got = outputs_by_key(tmp_path / "out")
    assert len(got) == len(expected) + 6 and all(got[k] == v for k, v in expected.items())


def test_packed_ids_are_the_listed_ids_with_their_hashes(tmp_path):
    ids = ["a", "héllo", "r000000001", "x" * 300]
    meta = formats_module.index_meta(ids, 1, 5)
    index = formats_module._index({**meta, formats_module.META_ROWS: "5"}, formats_module.META_ROWS, 5)
    assert index is not None and index.packed is not None and len(index) == 4
    assert index.array.to_pylist() == ids
    assert index.hashes.tolist() == reader_module.hash_ids(pa.array(ids)).tolist()
    stale = {**meta, formats_module.META_IDS: json.dumps(["b"])}  # a list edited since: the packed form is not used
    index = formats_module._index(stale, formats_module.META_ROWS, 5)
    assert index is not None and index.packed is None and index.array.to_pylist() == ["b"]
    assert np.array_equal(index.hashes, reader_module.hash_ids(pa.array(["b"])))


@pytest.mark.parametrize("dtype,values", [(np.int64, np.uint32), (np.int32, np.uint16)])
def test_run_filters_never_hide_a_match(monkeypatch, dtype, values):
    monkeypatch.setattr(ids_module, "FILTERED_RUN", 1)
    monkeypatch.setattr(ids_module, "RUN_CAP", 64)
    rng = np.random.default_rng(35)
    pool = rng.integers(-(1 << 62), 1 << 62, 300, dtype=np.int64)
    runs = ids_module.SortedRuns(dtype, values)
    added: dict[int, list[int]] = {}
    for value in range(40):
        batch = rng.choice(pool, 12)  # repeats within and across runs
        runs.add(batch, value)
        for h in batch.astype(dtype).tolist():
            added.setdefault(h, []).append(value)
    assert any(f is not None for f in runs.filters) and len(runs.runs) > 3
    query = np.concatenate([pool, rng.integers(-(1 << 62), 1 << 62, 300, dtype=np.int64)])
    got: dict[int, list[int]] = {}
    for at, found in runs.matches(query):
        for i, v in zip(at.tolist(), found.tolist(), strict=True):
            got.setdefault(i, []).append(v)
    expected = {i: added[h] for i, h in enumerate(query.astype(dtype).tolist()) if h in added}
    assert {i: sorted(v) for i, v in got.items()} == {i: sorted(v) for i, v in expected.items()}
    assert runs.contains(query).tolist() == [h in added for h in query.astype(dtype).tolist()]


def test_ids_done_twice_are_counted_with_filters(monkeypatch):
    monkeypatch.setattr(ids_module, "FILTERED_RUN", 1)
    monkeypatch.setattr(ids_module, "RUN_CAP", 16)
    rng = random.Random(35)
    parts = [[f"id{rng.randrange(120)}" for _ in range(6)] for _ in range(30)]
    parts = [list(dict.fromkeys(part)) for part in parts]  # each id once in a part
    done = DoneIds()
    for part in parts:
        done.add_part(part, lambda part=part: part)
    assert any(f is not None for f in done._hashes.filters) and len(done._hashes.runs) > 3
    total = sum(map(len, parts))
    assert done.twice == total - len({i for part in parts for i in part}) > 0
