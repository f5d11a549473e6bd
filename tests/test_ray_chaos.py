"""Ray under chaos: `batchgen ray` writing to a bucket that fails in flight (tests/s3_faults.py, 10% of
requests), its workers SIGKILLed at random moments; Ray retries them, each retry takes the killed
worker's lease over at once (same host), and every (id, sample) is written once with the text of a
local run. And the head node lost mid-run: the driver ends with exit 75 in bounded time, and after
the head's restart a rerun finishes the job, each (id, sample) once."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from bucketkit import bucket_outputs, upload
from jobkit import cli, outputs_by_key, run, setup_job, subprocess_env
from s3_faults import FaultProxy
from test_ray import KNOBS, needs_ray, ray_cmd

from batchgen.storage import location

KILLS = 3
RAY = str(Path(sys.executable).with_name("ray"))  # the venv's `ray` command


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(port: int, temp_dir, env: dict[str, str]) -> subprocess.Popen:
    """`ray start --head` on 127.0.0.1:port in its own session, once its port accepts connections."""
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
                             "--node-ip-address", "127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
                             "--temp-dir", str(temp_dir)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return head
        except OSError:
            time.sleep(0.2)


def kill_node(head: subprocess.Popen) -> None:
    """The head node lost at once: `ray start` and every process under it (GCS, raylet, the workers
    the raylet started) frozen, then SIGKILLed, as a machine that goes away."""
    procs = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
    head.wait()


@needs_ray
def test_a_lost_head_ends_the_driver_with_75_and_a_rerun_after_its_restart_finishes(tmp_path):
    """The head node (GCS, raylet and the workers on it) killed mid-run: the driver ends within Ray's
    reconnect limit with one line and exit 75, the parts written stay whole and single; once the head
    is started again, the same command finishes the job with the text of a local run."""
    ref = setup_job(tmp_path / "ref", rows=200, **KNOBS)
    assert run(ref).exit_code == 0
    root = tmp_path / "ray"
    job = setup_job(root, rows=200, **KNOBS)
    out, port = root / "out", free_port()
    # Token auth off (Ray 2.5x's `ray start` turns it on and keeps the token in ~/.ray); Ray's own
    # limit on a silent GCS 20 s (default 60), so the driver gives up after 10 s.
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.01", RAY_AUTH_MODE="disabled",
                         RAY_gcs_rpc_server_reconnect_timeout_s="20")
    cmd = ray_cmd(job, "--address", f"127.0.0.1:{port}")
    # Ray's socket paths must fit in 107 bytes: a short temp dir, not pytest's
    temp = tempfile.TemporaryDirectory(prefix="ray-", ignore_cleanup_errors=True)
    heads = [start_head(port, temp.name, env)]
    try:
        driver = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while len(list(out.glob("part-*"))) < 4:
            assert driver.poll() is None, driver.communicate()
            assert time.monotonic() < deadline, "no parts written"
            time.sleep(0.02)
        kill_node(heads[0])
        lost = time.monotonic()
        stdout, stderr = driver.communicate(timeout=60)
        waited = time.monotonic() - lost
        assert driver.returncode == 75, stderr
        assert "Traceback" not in stderr and 8 < waited < 25, (waited, stderr)
        assert stderr.splitlines()[-1].startswith("batchgen: error: lost the Ray cluster's head at 127.0.0.1:"), stderr
        assert "run the same command again" in stderr.splitlines()[-1]
        partial = outputs_by_key(out)  # each (id, sample) once, every part readable
        assert 0 < len(partial) < 400 and cli("status", out).exit_code == 0
        down = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 75 and down.stderr.splitlines()[-1] == (
            f"batchgen: error: cannot reach the Ray cluster's head at 127.0.0.1:{port} (Connection refused); "
            "start it (or wait for it to restart), then run the same command again"), down.stderr
        heads.append(start_head(port, temp.name, env))
        again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
    finally:
        for head in heads:
            if head.poll() is None:
                kill_node(head)
        temp.cleanup()
    assert outputs_by_key(out) == outputs_by_key(tmp_path / "ref" / "out")


def head_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of a head started with `--temp-dir temp_dir` (they name it), and theirs."""
    own = [p for p in psutil.process_iter() if _names(p, temp_dir)]
    return own + [c for p in own for c in _children(p)]


def _names(p: psutil.Process, text: str) -> bool:
    with contextlib.suppress(psutil.Error):
        return text in " ".join(p.cmdline())
    return False


def _children(p: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return p.children(recursive=True)
    return []


@needs_ray
def test_a_run_lives_through_a_gcs_restart_with_rocksdb_storage(tmp_path):
    """GCS fault tolerance without Redis (Ray's RAY_gcs_storage=rocksdb): the head's GCS killed
    mid-run and started again 3 s later from its storage, as a supervisor would; the driver waits
    for it, the workers go on, and the run ends 0 with the text of a local run."""
    ref = setup_job(tmp_path / "ref", rows=200, **KNOBS)
    assert run(ref).exit_code == 0
    root = tmp_path / "ray"
    job = setup_job(root, rows=200, **KNOBS)
    out, port = root / "out", free_port()
    temp = tempfile.TemporaryDirectory(prefix="ray-", ignore_cleanup_errors=True)
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.01", RAY_AUTH_MODE="disabled",
                         RAY_gcs_rpc_server_reconnect_timeout_s="20")
    head_env = {**env, "RAY_gcs_storage": "rocksdb", "RAY_gcs_storage_path": f"{temp.name}/gcs"}
    restarted = None
    try:
        started = subprocess.run([RAY, "start", "--head", "--port", str(port), "--num-cpus", "2",
                                  "--node-ip-address", "127.0.0.1", "--include-dashboard=false",
                                  "--disable-usage-stats", "--temp-dir", temp.name], env=head_env,
                                 start_new_session=True, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        driver = subprocess.Popen(ray_cmd(job, "--address", f"127.0.0.1:{port}"), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while len(list(out.glob("part-*"))) < 4:
            assert driver.poll() is None, driver.communicate()
            assert time.monotonic() < deadline, "no parts written"
            time.sleep(0.02)
        (gcs,) = [p for p in head_processes(temp.name) if p.name() == "gcs_server"]
        cmd, gcs_env, cwd = gcs.cmdline(), gcs.environ(), gcs.cwd()
        gcs.kill()
        parts_then = len(list(out.glob("part-*")))
        time.sleep(3)
        restarted = subprocess.Popen(cmd, env=gcs_env, cwd=cwd, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        for p in head_processes(temp.name):
            with contextlib.suppress(psutil.Error):
                p.kill()
        if restarted:
            restarted.wait()
        temp.cleanup()
    assert driver.returncode == 0, stderr
    assert parts_then < 40, "the run was over before the GCS went away"  # 40 parts in all
    assert outputs_by_key(out) == outputs_by_key(tmp_path / "ref" / "out")
