"""A rerun right after a kill, on a bucket: a lease whose holder was a process of this host that is gone is
taken over at once; one held from another host is waited out (said, with the time left) and taken over
unless renewed meanwhile, which ends the run with exit code 73. ``status`` tells these apart from "running"."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

from jobkit import cli, run
from test_buckets import bucket_job

from batchgen.job.errors import EXIT_LOCKED
from batchgen.storage import location

LOCKS = "out/.locks"
LOCK = "shard-00000-of-00001.lock"


def put_lease(bucket: str, holder: str, expires_in: float) -> int:
    """A live lease of shard 0/1 held by ``holder``, one generation above the newest; its generation."""
    locks = location(f"{bucket}/{LOCKS}")
    gens = [int(p.name.rsplit(".", 1)[1]) for p in locks.list_files() if p.name.startswith(f"{LOCK}.lease.")]
    gen = max(gens, default=0) + 1
    body = {"holder": holder, "expires": time.time() + expires_in, "released": False, "lease_seconds": expires_in,
            "token": f"test-{gen}"}
    assert (locks / f"{LOCK}.lease.{gen:010d}").publish_bytes(json.dumps(body).encode(), create_only=True)
    return gen


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def finished_job(tmp_path, bucket):
    job = bucket_job(tmp_path, bucket, rows=6)
    assert run(job).exit_code == 0
    return job


def test_a_gone_holder_of_this_host_is_stale_and_taken_over_at_once(tmp_path, bucket):
    job = finished_job(tmp_path, bucket)
    holder = f"pid {dead_pid()} on {socket.gethostname()}"
    put_lease(bucket, holder, 600)
    st = cli("status", f"{bucket}/out")
    assert f"stale (holder {holder} is not running)" in st.output, st.output
    assert json.loads(cli("status", f"{bucket}/out", "--json").output)["shards"][0]["state"].startswith("stale")
    started = time.monotonic()
    r = run(job)
    assert r.exit_code == 0, r.output
    assert f"took its lease over at once ({holder} is not running)" in r.output
    assert time.monotonic() - started < 60


def test_a_holder_elsewhere_is_waited_out_then_taken_over(tmp_path, bucket):
    job = finished_job(tmp_path, bucket)
    put_lease(bucket, "pid 4242 on another-node-57", 2.5)
    assert "lease expires in" in cli("status", f"{bucket}/out").output
    started = time.monotonic()
    r = run(job)
    assert r.exit_code == 0, r.output
    assert "pid 4242 on another-node-57; its lease expires in 2s unless renewed; waiting for it to expire" in r.output
    assert "nothing to do" in r.output and time.monotonic() - started >= 2.0


def test_a_holder_elsewhere_that_renews_meanwhile_ends_the_run_with_73(tmp_path, bucket):
    job = finished_job(tmp_path, bucket)
    holder = "pid 4242 on another-node-57"
    put_lease(bucket, holder, 2.0)
    renewal = threading.Timer(0.8, put_lease, (bucket, holder, 30.0))
    renewal.start()
    try:
        r = run(job)
    finally:
        renewal.join()
    assert r.exit_code == EXIT_LOCKED, r.output
    assert "renewed while this run waited: its holder is alive" in r.output and "Traceback" not in r.output
