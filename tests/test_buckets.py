"""Jobs whose input and output live in S3, against a real S3 API (moto's server on 127.0.0.1).

The same promises as on a local disk: every (id, sample) exactly once through SIGKILLs and
reruns, the same seeded text as a local run, one run per shard (a lease instead of flock),
shards, status and merge on the bucket, and one line for each storage mistake.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bucketkit import bucket_outputs, bucket_rows, download, upload
from jobkit import (
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
from s3_server import S3Server

from batchgen.job.errors import EXIT_LOCKED
from batchgen.storage import location

LEASE = 1.5  # seconds: short, so that a killed run's lease expires within the test
KNOBS = {"output": {"rows_per_part": 5}, "max_in_flight": 8, "model": {"path": "model", "max_num_seqs": 8}}


def knobs(**overrides) -> dict:
    """KNOBS with ``overrides``, sections merged one level deep."""
    out = dict(KNOBS)
    for key, value in overrides.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def bucket_job(tmp_path, bucket, rows: int = 40, *, fmt: str = "jsonl", name: str = "job.yaml", **overrides):
    """A local model and job file; the prompts uploaded to the bucket, the output dir in it."""
    setup_job(tmp_path, rows=rows, name=name)
    if fmt == "parquet":
        table = pa.Table.from_pylist(prompts(rows))
        pq.write_table(table, tmp_path / "in.parquet", row_group_size=7)
        upload(f"{bucket}/prompts/in.parquet", tmp_path / "in.parquet")
    else:
        upload(f"{bucket}/prompts/in.jsonl", tmp_path / "in.jsonl")
    storage = {"lease_seconds": LEASE, **overrides.pop("storage", {})}
    spec = knobs(input={"paths": [f"{bucket}/prompts/*.{fmt}"]}, storage=storage, **overrides)
    spec["output"] = {**spec["output"], "dir": f"{bucket}/out"}
    return setup_job(tmp_path, rows=rows, name=name, **spec)


def local_reference(tmp_path, rows: int, **overrides) -> dict:
    job = setup_job(tmp_path / "ref", rows=rows, **knobs(**overrides))
    assert run(job).exit_code == 0
    return outputs_by_key(tmp_path / "ref" / "out")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_bucket_input_and_output_equal_a_local_run(tmp_path, bucket, fmt):
    expected = local_reference(tmp_path, 40)
    job = bucket_job(tmp_path / "b", bucket, fmt=fmt)
    r = run(job)
    assert r.exit_code == 0, r.output
    assert bucket_outputs(f"{bucket}/out") == expected
    names = {p.name for p in location(f"{bucket}/out").list_files()}
    assert {"_job.json", "_job.yaml"} <= names and not any(n.endswith(".tmp") for n in names)
    again = run(job)  # nothing to do, found from the bucket's parts
    assert again.exit_code == 0 and "nothing to do" in again.output
    assert bucket_outputs(f"{bucket}/out") == expected


@pytest.mark.parametrize("out_format", ["jsonl", "openai_batch"])
def test_jsonl_and_openai_batch_output_to_a_bucket_and_merge_to(tmp_path, bucket, out_format):
    output = {"format": out_format, "merge_to": f"{bucket}/merged.jsonl"}
    if out_format == "openai_batch":
        output["fields"] = None
    job = bucket_job(tmp_path, bucket, rows=12, output={k: v for k, v in output.items() if v is not None})
    if out_format == "openai_batch":  # its input: OpenAI batch requests
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "m", "prompt": f"question {i}", "max_tokens": 4}} for i in range(12)]
        write_jsonl(tmp_path / "req.jsonl", lines)
        upload(f"{bucket}/prompts/req.jsonl", tmp_path / "req.jsonl")
        import yaml

        spec = yaml.safe_load(job.read_text())
        spec["input"] = {"paths": [f"{bucket}/prompts/req.jsonl"], "format": "openai_batch"}
        spec["output"].pop("fields")
        job.write_text(yaml.safe_dump(spec))
    r = run(job)
    assert r.exit_code == 0, r.output
    merged = [json.loads(x) for x in download(f"{bucket}/merged.jsonl").decode().splitlines()]
    if out_format == "jsonl":
        assert [(m["id"], m["sample_index"]) for m in merged] == [(f"q{i:04d}", s) for i in range(12) for s in (0, 1)]
    else:
        assert [m["custom_id"] for m in merged] == [f"r{i}" for i in range(12)]
        assert all(m["response"]["status_code"] == 200 for m in merged)


def test_sigkill_at_random_moments_then_resume_on_a_bucket(tmp_path, bucket):
    rows = 300
    expected = local_reference(tmp_path, rows)
    job = bucket_job(tmp_path / "b", bucket, rows=rows)
    out = location(f"{bucket}/out")
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.004")
    rng = random.Random(20261203)

    def parts() -> int:
        return sum(1 for p in out.list_files() if p.name.startswith("part-"))

    def check() -> None:
        done = bucket_outputs(str(out))  # no (id, sample) twice at any point
        assert all(expected[k] == v for k, v in done.items())
        time.sleep(LEASE + 0.2)  # the killed run's lease expires; then the next run takes over

    kills = kill_at_random_moments(job, env, parts, rng, rounds=8, anywhere=0.3, after_kill=check)
    assert kills >= 4
    final = subprocess.run(batchgen_cmd("run", job), env=subprocess_env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert bucket_outputs(str(out)) == expected


def test_one_run_per_shard_and_a_killed_runs_lease_is_taken_over_at_once_on_its_host(tmp_path, bucket):
    rows = 3000  # ~40 s at this pace: still running when the second run starts
    expected = local_reference(tmp_path, rows)
    # Long enough that the run started right after the kill finds the lease still live, even on a busy machine
    # (at 20 s, with two test workers and builds beside it, the status call and the run's start took longer
    # than what was left of it: that run took over an expired lease, which says nothing).
    lease = 45.0
    job = bucket_job(tmp_path / "b", bucket, rows=rows, storage={"lease_seconds": lease})
    out = location(f"{bucket}/out")
    first = subprocess.Popen(batchgen_cmd("run", job), env=subprocess_env(FAKE_LLM_STEP_SLEEP="0.02"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith("part-") for p in out.list_files()):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        time.sleep(lease * 0.4)  # the first run has renewed its lease meanwhile (every third)
        second = subprocess.run(batchgen_cmd("run", job), env=subprocess_env(), capture_output=True, text=True)
        assert second.returncode == EXIT_LOCKED, second.stderr
        assert "another batchgen run is already working on shard 0/1" in second.stderr
        assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
        first.kill()
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
    holder = f"pid {first.pid} on {socket.gethostname()}"
    assert f"stale (holder {holder} is not running)" in cli("status", str(out)).output  # not "running"
    final = subprocess.run(batchgen_cmd("run", job), env=subprocess_env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr  # at once: the killed holder ran on this host
    assert f"took its lease over at once ({holder} is not running)" in final.stdout + final.stderr
    assert bucket_outputs(str(out)) == expected
    leases = [p.name for p in out.__truediv__(".locks").list_files()]
    assert len(leases) == 1 and ".lease." in leases[0]  # superseded generations are pruned


def test_three_shards_then_status_and_merge_on_the_bucket(tmp_path, bucket):
    expected = local_reference(tmp_path, 30)  # Parquet: the same rows
    job = bucket_job(tmp_path / "b", bucket, rows=30, output={"format": "jsonl"})
    for i in range(2):
        assert run(job, "--shard", f"{i}/3").exit_code == 0
    st = cli("status", f"{bucket}/out")
    assert st.exit_code == 0, st.output
    assert "incomplete" not in st.output and "not started" in st.output and "done" in st.output
    early = cli("merge", f"{bucket}/out", "-o", f"{bucket}/all.jsonl")
    assert early.exit_code == 1 and "not done yet" in early.output
    assert run(job, "--shard", "2/3").exit_code == 0
    st = cli("status", f"{bucket}/out")
    total = [line for line in st.output.splitlines() if line.startswith("total")][0]
    assert total.split()[-1] == "0", st.output  # nothing missing
    m = cli("merge", f"{bucket}/out", "-o", f"{bucket}/all.jsonl")
    assert m.exit_code == 0, m.output
    merged = [json.loads(x) for x in download(f"{bucket}/all.jsonl").decode().splitlines()]
    assert {(r["id"], r["sample_index"]): (r["text"], r["error"]) for r in merged} == expected
    assert [r["id"] for r in merged][::2] == [f"q{i:04d}" for i in range(30)]  # input order
    assert bucket_outputs(f"{bucket}/out") == expected


def test_run_batch_reads_and_writes_urls(tmp_path, bucket):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3}}
             for i in range(5)]
    upload(f"{bucket}/req.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    setup_job(tmp_path, rows=0)
    r = cli("run-batch", "-i", f"{bucket}/req.jsonl", "-o", f"{bucket}/res.jsonl", "--model", tmp_path / "model",
            "--engine", "fake_llm:FakeLLM")
    assert r.exit_code == 0, r.output
    out = [json.loads(x) for x in download(f"{bucket}/res.jsonl").decode().splitlines()]
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(5)]
    assert location(f"{bucket}/res.jsonl.parts").is_dir()


def test_the_store_itself_refuses_a_second_create_of_a_part(s3_server, bucket):
    """Exactly-once must not rest on our bookkeeping alone: the server refuses the second PUT."""
    name = bucket.removeprefix("s3://")
    client = s3_server.client()
    client.put_object(Bucket=name, Key="out/part-00000-of-00001-000000.parquet", Body=b"first", IfNoneMatch="*")
    with pytest.raises(client.exceptions.ClientError) as refused:
        client.put_object(Bucket=name, Key="out/part-00000-of-00001-000000.parquet", Body=b"2nd", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    part = location(f"{bucket}/out/part-00000-of-00001-000000.parquet")
    assert part.publish_bytes(b"third", create_only=True) is False
    assert part.read_bytes() == b"first"
    # A create-only PUT retried after its response was lost finds its own bytes there: created.
    assert part.publish_bytes(b"first", create_only=True) is True


def test_a_part_name_taken_by_another_writer_stops_the_run(tmp_path, bucket):
    """A second writer of the shard (one that lost its lease, on a store without conditional
    writes...) creates a part this run was about to write: the run stops instead of writing twice."""
    job = bucket_job(tmp_path, bucket, rows=80)
    out = location(f"{bucket}/out")
    proc = subprocess.Popen(batchgen_cmd("run", job), env=subprocess_env(FAKE_LLM_STEP_SLEEP="0.01"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "part-00000-of-00001-000000.parquet").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        assert (out / "part-00000-of-00001-000010.parquet").publish_bytes(b"another writer's part", create_only=True)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr
    assert "part-00000-of-00001-000010.parquet exists already: another run is writing this shard" in stderr
    assert "Traceback" not in stderr
    assert (out / "part-00000-of-00001-000010.parquet").read_bytes() == b"another writer's part"


def test_storage_mistakes_are_one_line(tmp_path, bucket, s3_server):
    job = bucket_job(tmp_path, bucket, rows=3)
    missing = job.read_text().replace(bucket + "/out", "s3://no-such-bucket-here/out")
    (tmp_path / "missing.yaml").write_text(missing)
    r = run(tmp_path / "missing.yaml")
    assert r.exit_code == 1 and "no-such-bucket-here: no such bucket" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    v = cli("validate", tmp_path / "missing.yaml", "--engine", "fake_llm:FakeLLM")  # validate finds it too
    assert v.exit_code == 1 and "output.dir: s3://no-such-bucket-here: no such bucket" in v.output, v.output
    no_input = job.read_text().replace(f"{bucket}/prompts/*.jsonl", f"{bucket}/nothing/*.jsonl")
    (tmp_path / "noinput.yaml").write_text(no_input)
    r = run(tmp_path / "noinput.yaml")
    assert r.exit_code == 1 and f"no input file matches '{bucket}/nothing/*.jsonl'" in r.output, r.output


def test_refused_credentials_are_one_line(tmp_path):
    guarded = S3Server().start(auth=True)
    try:
        job = setup_job(tmp_path, rows=3, input={"paths": ["s3://some-bucket/in.jsonl"]},
                        output={"dir": "s3://some-bucket/out"}, storage={"retries": 2})
        env = subprocess_env(**guarded.env())
        r = subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r.stderr
        assert "s3://some-bucket" in r.stderr and ("refused" in r.stderr or "denied" in r.stderr), r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        guarded.stop()


def test_a_refused_connection_says_so_at_once_and_fails_fast(tmp_path):
    """An endpoint where nothing listens (issue 56, item 2): each retry is a line as it happens, naming the
    endpoint, the attempt and the wait; a refused connection gets a few quick tries, not the throttling
    backoff (storage.retries 8 took 17-19 s of silence), then the one error line."""
    closed = S3Server()  # never started: its port refuses connections
    job = setup_job(tmp_path, rows=3, input={"paths": ["s3://some-bucket/in.jsonl"]},
                    output={"dir": "s3://some-bucket/out"}, storage={"retries": 8, "retry_wait": 1.0})
    proc = subprocess.Popen(batchgen_cmd("run", job), env=subprocess_env(**closed.env()), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines, stamps = [], []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        stamps.append(time.monotonic())
    assert proc.wait(timeout=300) == 1, lines
    endpoint = closed.env()["AWS_ENDPOINT_URL"]
    *retries, error = lines
    said = re.compile(rf"s3://some-bucket/\S+: cannot reach the storage endpoint \({re.escape(endpoint)}, connection "
                      r"refused\): retrying \(attempt ([23]) of 3, next in \d+\.\ds\)$")
    assert retries and all(said.match(line) for line in retries), lines
    assert [said.match(line)[1] for line in retries[:2]] == ["2", "3"]  # each call: attempts 2 and 3, then done
    assert error.startswith("batchgen: error: ") and "s3://some-bucket/in.jsonl: cannot reach the storage " \
        "endpoint" in error and error.endswith("(still failing after 3 attempts)"), error
    # two waits of at most 1 and 2 s (full jitter) between the first line and the last: generous on a busy box
    assert stamps[-1] - stamps[0] < 30


def test_bucket_outputs_are_not_node_local(bucket):
    from batchgen.storage.mounts import node_local_warning

    assert node_local_warning(location(f"{bucket}/out")) is None


def test_rows_helper_reads_back_what_was_written(tmp_path, bucket):
    """The test helper itself: bucket_rows sees every row of every part (guards the checks above)."""
    job = bucket_job(tmp_path, bucket, rows=7)
    assert run(job).exit_code == 0
    assert len(bucket_rows(f"{bucket}/out")) == 14
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_large_bucket_input_is_streamed_not_downloaded(tmp_path, bucket, fmt, monkeypatch):
    """A ~64 MB object is read as a stream: the first rows come before the rest is fetched (bytes
    counted where s3fs fetches ranges from the server)."""
    import s3fs

    from batchgen.job.inputs import InputReader
    from batchgen.job.spec import InputSpec

    rows, pad = 25_000, "x" * 2_500
    table = pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": [f"{i} {pad}" for i in range(rows)]})
    local = tmp_path / f"big.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, local, row_group_size=2_000, compression="none")
    else:
        with open(local, "w") as f:
            for r in table.to_pylist():
                f.write(json.dumps(r) + "\n")
    size = local.stat().st_size
    assert size > 60e6
    upload(f"{bucket}/big.{fmt}", local)
    local.unlink()
    del table
    reader = InputReader(InputSpec(paths=[f"{bucket}/big.{fmt}"], id_column="id", prompt_column="prompt"), tmp_path)
    fetched = []
    fetch = s3fs.core.S3File._fetch_range

    def counted(self, start, end):
        data = fetch(self, start, end)
        fetched.append(len(data))
        return data

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counted)
    rows_read = reader.rows()
    first = [next(rows_read) for _ in range(100)]
    assert 0 < sum(fetched) < size / 4, f"the first 100 rows fetched {sum(fetched) / 1e6:.0f} MB of {size / 1e6:.0f} MB"
    assert first[0].id == "r0" and first[0].prompt.startswith("0 x")
    assert 100 + sum(1 for _ in rows_read) == rows


def test_a_throttling_store_is_retried_and_nothing_is_lost(tmp_path, bucket, s3_server):
    """Every fourth request answered 503 SlowDown: the run retries with backoff and completes,
    each (id, sample) once, the same text as a local run."""
    from s3_server import FlakyProxy

    expected = local_reference(tmp_path, 30)
    job = bucket_job(tmp_path / "b", bucket, rows=30, storage={"lease_seconds": 20})  # > retries' backoff
    with FlakyProxy(s3_server.endpoint, every=4) as proxy:
        env = subprocess_env(AWS_ENDPOINT_URL=proxy.endpoint)
        r = subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert proxy.throttled >= 5, proxy.count  # the store did push back, repeatedly
    assert bucket_outputs(f"{bucket}/out") == expected


@pytest.mark.parametrize("out_format", ["parquet", "jsonl"])
def test_retry_errors_on_a_bucket(tmp_path, bucket, out_format):
    """--retry-errors rewrites the shard's parts in the bucket without their error rows, then
    generates those rows again: each (id, sample) still once."""
    from jobkit import make_model

    make_model(tmp_path / "model", max_model_len=40)
    lines = [{"id": f"ok{i}", "prompt": "short"} for i in range(5)] + [{"id": "long", "prompt": "x" * 100}]
    upload(f"{bucket}/prompts/in.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    job = setup_job(tmp_path, rows=0, input={"paths": [f"{bucket}/prompts/in.jsonl"], "carry_columns": []},
                    output={"dir": f"{bucket}/out", "rows_per_part": 2, "format": out_format})
    r = run(job)
    assert r.exit_code == 0 and "6 this run (1 error)" in r.stdout, r.output
    make_model(tmp_path / "model", max_model_len=400)  # the fix
    assert "nothing to do" in run(job).stdout
    r = run(job, "--retry-errors")
    assert r.exit_code == 0, r.output
    assert "removed 1 error rows of shard 0/1" in r.stdout and "1 this run (0 errors)" in r.stdout
    after = bucket_outputs(f"{bucket}/out")
    assert len(after) == 12 and all(error is None for _, error in after.values())
    assert "nothing to do" in run(job).stdout


def test_a_missing_cloud_library_is_one_line_naming_the_extra(monkeypatch):
    import sys

    from batchgen.storage import locations

    fsspec_registry = sys.modules["fsspec.registry"]
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    monkeypatch.setattr(fsspec_registry, "_registry", {})  # nor imported by an earlier test
    monkeypatch.setattr(fsspec_registry, "registry", {})
    monkeypatch.setattr(locations, "_stores", {})  # no client made before
    with pytest.raises(OSError) as e:
        location("s3://some-bucket/x.jsonl").exists()
    assert str(e.value) == ("s3:// paths need s3fs: pip install 's3fs>=2025.7' "
                            "(in a clone of batchgen: pip install -e '.[s3]')")


def test_an_unreachable_endpoint_is_told_whatever_its_port():
    """A port such as 54039 holds "403": the message must still say the endpoint is unreachable."""
    from batchgen.storage.stores import describe

    message = describe(OSError('Could not connect to the endpoint URL: "http://127.0.0.1:54039/b?list-type=2"'))
    assert message.startswith("cannot reach the storage endpoint")


def test_refused_connections_get_few_tries_and_each_retry_to_connect_is_told(caplog):
    """Retries in one place: a refused connection 3 tries in all with a line per retry; a dropped connection
    (transient, but the store was reached) the full storage.retries, quietly."""
    from batchgen.storage.stores import Retries

    retries = Retries(attempts=8, first_wait=0.001, max_wait=0.001)

    def failing(error: Exception):
        calls = []

        def call():
            calls.append(1)
            raise error
        return calls, call

    calls, call = failing(ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)"))
    with caplog.at_level(logging.WARNING, logger="batchgen.storage"), pytest.raises(ConnectionRefusedError):
        retries.run(call, "s3://b/k")
    assert len(calls) == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"s3://b/k: cannot reach the storage endpoint (connection refused): retrying (attempt {n} of 3, next in 0.0s)"
        for n in (2, 3)]
    caplog.clear()
    calls, call = failing(ConnectionResetError(104, "Connection reset by peer"))
    with caplog.at_level(logging.WARNING, logger="batchgen.storage"), pytest.raises(ConnectionResetError):
        retries.run(call, "s3://b/k")
    assert len(calls) == 8 and not caplog.records
