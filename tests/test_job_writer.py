"""Parquet parts: atomic, named by shard and sequence, read back to find what is done."""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import __version__
from batchgen.job.errors import JobError
from batchgen.job.inputs import Row
from batchgen.job.outputs.formats import ParquetParts
from batchgen.job.outputs.writer import PartWriter, error_rows, list_parts, output_schema, recover, result_rows
from batchgen.job.shard import Shard
from batchgen.outputs import CompletionOutput, RequestOutput

META = {"batchgen.config_hash": "abc", "batchgen.model": "m", "batchgen.version": __version__,
        "batchgen.shard": "0/1"}


def finished(row_id: str, n: int = 2) -> tuple[Row, RequestOutput]:
    outs = [CompletionOutput(index=i, text=f"{row_id}-{i}", token_ids=[1, 2], finish_reason="stop")
            for i in range(n)]
    return Row(id=row_id, where="x", carry={"topic": 1}), RequestOutput("r", "p", [5, 6, 7], outs)


ONE = Shard(0, 1)


def writer(out, shard=ONE, rows_per_part=2, next_seq=0, fields=("text", "token_counts"), **kwargs) -> PartWriter:
    schema = output_schema(fields, [pa.field("topic", pa.int64())])
    return PartWriter(out, shard, schema, rows_per_part, next_seq, META, **kwargs)


def test_parts_are_written_whole_with_metadata(tmp_path):
    w = writer(tmp_path)
    for i in range(5):
        w.add(result_rows(*finished(f"id{i}")))
    w.add(error_rows(Row(id="bad", where="f line 1"), "f line 1: field 'prompt': empty prompt"))
    w.flush()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"part-00000-of-00001-{i:06d}.parquet" for i in range(3)]  # no temp files left
    meta = pq.read_schema(tmp_path / names[0]).metadata
    assert meta[b"batchgen.config_hash"] == b"abc" and meta[b"batchgen.version"] == __version__.encode()
    assert meta[b"batchgen.model"] == b"m"
    rows = pq.read_table(tmp_path / names[0]).to_pylist()
    assert [(r["id"], r["sample_index"], r["text"], r["num_prompt_tokens"]) for r in rows] == [
        ("id0", 0, "id0-0", 3), ("id0", 1, "id0-1", 3), ("id1", 0, "id1-0", 3), ("id1", 1, "id1-1", 3)]
    last = pq.read_table(tmp_path / names[2]).to_pylist()
    assert last[-1]["error"].endswith("empty prompt") and last[-1]["text"] is None


def test_recover_counts_only_complete_rows_and_cleans_temp_files(tmp_path):
    w = writer(tmp_path, rows_per_part=10)
    w.add(result_rows(*finished("a")))
    w.add(result_rows(*finished("b"))[:1])  # b lost a sample (cannot happen, but must not count)
    w.flush()
    (tmp_path / ".part-00000-of-00001-000001.tmp").write_bytes(b"half a part")
    rec = recover(tmp_path, Shard(), "abc")
    assert rec.done == {"a"} and rec.next_seq == 1 and rec.parts == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_recover_refuses_another_config_unless_forced(tmp_path):
    w = writer(tmp_path)
    w.add(result_rows(*finished("a")))
    w.flush()
    with pytest.raises(JobError, match="another job configuration.*--force"):
        recover(tmp_path, Shard(), "different")
    assert recover(tmp_path, Shard(), "different", force=True).done == {"a"}


def test_recover_reads_own_shard_and_other_shard_counts(tmp_path):
    ids = [f"r{i}" for i in range(60)]
    for old in range(2):  # a run with 2 shards wrote everything it owned
        w = writer(tmp_path, Shard(old, 2), rows_per_part=100)
        for i in ids:
            if Shard(old, 2).owns(i):
                w.add(result_rows(*finished(i)))
        w.flush()
    for new in range(3):  # re-sharded into 3: every id of the old parts is done for each new shard
        rec = recover(tmp_path, Shard(new, 3), "abc")
        assert rec.done == set(ids)
        assert rec.done_here == sum(Shard(new, 3).owns(i) for i in ids)
        assert rec.next_seq == 0
    w = writer(tmp_path, Shard(1, 2), next_seq=recover(tmp_path, Shard(1, 2), "abc").next_seq)
    w.add(result_rows(*finished("late")))
    w.flush()
    assert [p.seq for p in list_parts(tmp_path) if p.shard == Shard(1, 2)] == [0, 1]


def test_background_parts_equal_the_foreground_ones(tmp_path):
    """The runner's writer (background=True): the same parts, names and rows as written in the caller's thread,
    each whole once `wait` returns."""
    dirs = {mode: tmp_path / mode for mode in ("foreground", "background")}
    threads: dict[str, set[str]] = {mode: set() for mode in dirs}

    class Recording(ParquetParts):
        def write(self, *args):
            threads[mode].add(threading.current_thread().name.split("_")[0])
            super().write(*args)

    for mode, out in dirs.items():
        out.mkdir()
        w = writer(out, background=mode == "background", part_format=Recording())
        for i in range(7):
            w.add(result_rows(*finished(f"id{i}")))
        w.flush()
        w.wait()
        w.shutdown()
        assert w.parts_written == 4
    assert threads == {"foreground": {"MainThread"}, "background": {"batchgen-parts"}}
    parts = {mode: sorted(p.name for p in out.iterdir()) for mode, out in dirs.items()}
    assert parts["background"] == parts["foreground"] == [f"part-00000-of-00001-{i:06d}.parquet" for i in range(4)]
    for name in parts["background"]:
        rows = [pq.read_table(out / name).to_pylist() for out in dirs.values()]
        assert rows[0] == rows[1]


def test_a_failed_background_part_stops_the_writer(tmp_path):
    """What writing a part raised comes back from the next flush and from every wait after it, and nothing is
    written after it: its rows are in no part, so the next run does them (exactly once)."""
    calls = []

    def guard():
        calls.append(1)
        if len(calls) == 2:
            raise JobError("lost the shard lock")

    w = writer(tmp_path, rows_per_part=1, guard=guard, background=True)
    w.add(result_rows(*finished("a")))  # part 0, written
    w.add(result_rows(*finished("b")))  # part 1: the guard refuses
    with pytest.raises(JobError, match="lost the shard lock"):
        w.add(result_rows(*finished("c")))  # would be part 2: waits for part 1 first
    with pytest.raises(JobError, match="lost the shard lock"):
        w.wait()
    w.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00000-of-00001-000000.parquet"]
    assert recover(tmp_path, ONE, "abc").done == {"a"}
