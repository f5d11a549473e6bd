"""Jobs on a bucket that fails in flight (tests/s3_faults.py between the run and moto's S3 server): each
fault kind alone, then a mix at 12% of requests. Transient faults never end a run; a create-only PUT whose
answer was lost is recognised as the run's own part; every (id, sample) is written once, with the text of
a local run."""

from __future__ import annotations

import random
import subprocess
import time

import pytest
from bucketkit import bucket_outputs
from jobkit import batchgen_cmd, kill_at_random_moments, subprocess_env
from s3_faults import FaultProxy
from test_buckets import bucket_job, local_reference

from batchgen.storage import location
from batchgen.storage.options import StorageOptions
from batchgen.storage.stores import Retries, is_transient

ROWS = 30
# Quick retries for the tests; a lease long enough that a renewal retried a few times stays valid.
STORAGE = {"lease_seconds": 20, "retries": 10, "retry_wait": 0.05, "retry_max_wait": 0.5}


def run_through(proxy: FaultProxy, job) -> subprocess.CompletedProcess:
    env = subprocess_env(AWS_ENDPOINT_URL=proxy.endpoint)
    return subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kind", ["slowdown", "error500", "lost", "cut", "slow"])
def test_each_fault_kind_alone_is_retried_and_nothing_is_lost_or_doubled(tmp_path, bucket, s3_server, kind):
    expected = local_reference(tmp_path, ROWS)
    job = bucket_job(tmp_path / "b", bucket, rows=ROWS, storage=STORAGE)
    rate = 0.05 if kind == "slow" else 0.15
    with FaultProxy(s3_server.endpoint, rate=rate, kinds=(kind,), seed=57, delay=0.3) as proxy:
        r = run_through(proxy, job)
        assert r.returncode == 0, r.stderr
        assert proxy.faults[kind] >= 2, (proxy.faults, proxy.requests)
    assert bucket_outputs(f"{bucket}/out") == expected


def test_a_part_put_whose_answer_was_lost_is_the_runs_own_not_a_conflict(tmp_path, bucket, s3_server):
    expected = local_reference(tmp_path, ROWS)
    job = bucket_job(tmp_path / "b", bucket, rows=ROWS, storage=STORAGE)
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.add("lost", method="PUT", key=r"/out/part-", create_only=True, times=3)
        proxy.add("lost", method="PUT", key=r"\.lease\.", create_only=True, times=2)
        r = run_through(proxy, job)
        assert r.returncode == 0, r.stderr
        assert proxy.faults["lost"] == 5 and proxy.statuses[412] >= 5  # each retry met its own first attempt
    assert bucket_outputs(f"{bucket}/out") == expected


def test_a_mix_of_faults_at_12_percent_of_requests(tmp_path, bucket, s3_server):
    expected = local_reference(tmp_path, ROWS)
    job = bucket_job(tmp_path / "b", bucket, rows=ROWS, storage=STORAGE)
    with FaultProxy(s3_server.endpoint, rate=0.12, seed=2026, delay=0.2) as proxy:
        r = run_through(proxy, job)
        assert r.returncode == 0, r.stderr
        again = run_through(proxy, job)  # a rerun reads the parts through the faults too: nothing to do
        assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr, again.stderr
        assert len(proxy.faults) >= 4, proxy.faults
    assert bucket_outputs(f"{bucket}/out") == expected


def test_sigkill_rounds_on_top_of_a_12_percent_mix(tmp_path, bucket, s3_server):
    """Killed at random moments while the store fails in flight; each rerun takes the killed run's lease over
    at once (same host) and no transient fault ends one: every (id, sample) once, the text of a local run."""
    rows = 200
    expected = local_reference(tmp_path, rows)
    job = bucket_job(tmp_path / "b", bucket, rows=rows, storage=STORAGE)
    out = location(f"{bucket}/out")

    def parts() -> int:
        return sum(1 for p in out.list_files() if p.name.startswith("part-"))

    def check() -> None:
        done = bucket_outputs(str(out))  # no (id, sample) twice at any point
        assert all(expected[k] == v for k, v in done.items())

    with FaultProxy(s3_server.endpoint, rate=0.12, seed=5757, delay=0.2) as proxy:
        env = subprocess_env(AWS_ENDPOINT_URL=proxy.endpoint, FAKE_LLM_STEP_SLEEP="0.004")
        kills = kill_at_random_moments(job, env, parts, random.Random(57), rounds=5, anywhere=0.3, after_kill=check)
        final = run_through(proxy, job)
        assert final.returncode == 0, final.stderr
        assert len(proxy.faults) >= 4, proxy.faults
    assert kills >= 2
    assert bucket_outputs(str(out)) == expected


def test_a_holder_cut_off_from_its_lease_longer_than_the_lease_stops_writing(tmp_path, bucket, s3_server):
    """Every renewal refused (500) from the first part on: past its lease the run stops before its next part,
    in one line, so no other run can take the shard over while it writes; a rerun finishes the job."""
    rows = 600
    expected = local_reference(tmp_path, rows)
    job = bucket_job(tmp_path / "b", bucket, rows=rows,
                     storage={"lease_seconds": 2, "retries": 2, "retry_wait": 0.05, "retry_max_wait": 0.1})
    out = location(f"{bucket}/out")
    with FaultProxy(s3_server.endpoint) as proxy:
        env = subprocess_env(AWS_ENDPOINT_URL=proxy.endpoint, FAKE_LLM_STEP_SLEEP="0.02")
        proc = subprocess.Popen(batchgen_cmd("run", job), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        try:
            deadline = time.monotonic() + 60
            while not any(p.name.startswith("part-") for p in out.list_files()):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.05)
            proxy.add("error500", method="PUT", key=r"\.lease\.", times=10_000)
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1 and "this run stops writing" in stderr and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    done = bucket_outputs(str(out))
    assert 0 < len(done) < len(expected) and all(expected[k] == v for k, v in done.items())
    final = subprocess.run(batchgen_cmd("run", job), env=subprocess_env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert bucket_outputs(str(out)) == expected


def test_a_permanent_refusal_is_not_retried(tmp_path, bucket, s3_server):
    """A missing bucket behind a throttling proxy: one line, at once, however many retries are allowed."""
    job = bucket_job(tmp_path, bucket, rows=3, storage={**STORAGE, "retries": 50, "retry_wait": 5})
    (tmp_path / "missing.yaml").write_text(job.read_text().replace(f"{bucket}/out", "s3://no-such-bucket-57/out"))
    with FaultProxy(s3_server.endpoint) as proxy:
        r = run_through(proxy, tmp_path / "missing.yaml")
    assert r.returncode == 1 and "no-such-bucket-57: no such bucket" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_what_is_transient():
    from botocore.exceptions import ClientError, ConnectionClosedError

    def client_error(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    def translated(cause: BaseException) -> OSError:  # as s3fs raises it
        err = OSError(5, str(cause))
        err.__cause__ = cause
        return err

    assert is_transient(translated(client_error(503, "SlowDown")))
    assert is_transient(client_error(500, "InternalError")) and is_transient(client_error(429, "TooManyRequests"))
    assert is_transient(ConnectionClosedError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert not is_transient(translated(client_error(403, "AccessDenied")))
    assert not is_transient(client_error(404, "NoSuchBucket")) and not is_transient(FileNotFoundError("x"))
    assert not is_transient(client_error(412, "PreconditionFailed")) and not is_transient(PermissionError())


def attempts_until_raised(retries: Retries, error: Exception) -> int:
    """How many times ``retries`` calls a function that always raises ``error``."""
    calls = []

    def failing() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        retries.run(failing)
    return len(calls)


def test_retries_are_bounded_and_back_off():
    retries = Retries.of(StorageOptions(retries=4, retry_wait=0.001, retry_max_wait=0.002))
    assert attempts_until_raised(retries, ConnectionResetError("reset by peer")) == 4
    assert attempts_until_raised(retries, PermissionError("403")) == 1
    assert all(0 <= Retries(8, 0.2, 20.0).wait(i) <= min(20.0, 0.2 * 2 ** i) for i in range(8))
