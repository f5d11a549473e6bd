"""Ray under chaos: `batchgen ray` writing to a bucket that fails in flight (tests/s3_faults.py, 10% of
requests), its workers SIGKILLed at random moments; Ray retries them, each retry takes the killed
worker's lease over at once (same host), and every (id, sample) is written once with the text of a
local run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

from bucketkit import bucket_outputs, upload
from jobkit import outputs_by_key, run, setup_job, subprocess_env
from s3_faults import FaultProxy
from test_ray import KNOBS, needs_ray, ray_cmd

from batchgen.storage import location

KILLS = 3


def live_holders(out) -> set[int]:
    """The pids holding a shard's newest lease now."""
    newest: dict[str, object] = {}
    for p in sorted((out / ".locks").list_files(), key=lambda p: p.name):
        if ".lease." not in p.name:
            continue
        newest[p.name.split(".lease.")[0]] = p
    pids = set()
    for p in newest.values():
        try:
            lease = json.loads(p.read_bytes())
        except (OSError, ValueError):
            continue
        if not lease.get("released") and lease.get("expires", 0) > time.time():
            pids.add(int(lease["holder"].split()[1]))
    return pids


@needs_ray
def test_workers_killed_at_random_behind_a_faulty_store_still_write_every_row_once(tmp_path, bucket, s3_server):
    ref = setup_job(tmp_path / "ref", rows=300, **KNOBS)
    assert run(ref).exit_code == 0
    root = tmp_path / "ray"
    setup_job(root, rows=300, **KNOBS)
    upload(f"{bucket}/in.jsonl", root / "in.jsonl")
    storage = {"lease_seconds": 20, "retries": 10, "retry_wait": 0.05, "retry_max_wait": 0.5}
    job = setup_job(root, rows=300, **{**KNOBS, "input": {"paths": [f"{bucket}/in.jsonl"]},
                                       "output": {**KNOBS["output"], "dir": f"{bucket}/out"}, "storage": storage})
    out, rng, killed = location(f"{bucket}/out"), random.Random(57), set()
    with FaultProxy(s3_server.endpoint, rate=0.10, seed=57, delay=0.1) as proxy:
        env = subprocess_env(AWS_ENDPOINT_URL=proxy.endpoint, FAKE_LLM_STEP_SLEEP="0.01")
        driver = subprocess.Popen(ray_cmd(job, "--max-retries", "6"), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            while len(killed) < KILLS and driver.poll() is None and time.monotonic() < deadline:
                fresh = live_holders(out) - killed
                if fresh:
                    time.sleep(rng.uniform(0.2, 1.0))
                    pid = rng.choice(sorted(fresh))
                    try:
                        os.kill(pid, signal.SIGKILL)  # a lost node or a spot reclaim
                        killed.add(pid)
                    except ProcessLookupError:  # it finished meanwhile
                        pass
                time.sleep(0.05)
            stdout, stderr = driver.communicate(timeout=300)
        finally:
            if driver.poll() is None:
                driver.kill()
    assert driver.returncode == 0, stderr
    assert killed and "retr" in stdout, stdout
    assert bucket_outputs(str(out)) == outputs_by_key(tmp_path / "ref" / "out")  # each (id, sample) once
