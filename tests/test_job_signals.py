"""Real processes: SIGKILL at random moments, SIGTERM/SIGINT, a concurrent second run.

After any number of kills and a final run, every (id, sample) is in the output exactly once,
with the same text as an uninterrupted run (seeded sampling)."""

from __future__ import annotations

import random
import signal
import subprocess
import time

from jobkit import batchgen_cmd, kill_at_random_moments, outputs_by_key, run, setup_job, subprocess_env

from batchgen.job.errors import EXIT_INTERRUPTED, EXIT_LOCKED

KNOBS = {"output": {"rows_per_part": 5}, "max_in_flight": 8, "model": {"path": "model", "max_num_seqs": 8}}


def reference(tmp_path, rows: int) -> dict:
    job = setup_job(tmp_path / "ref", rows=rows, **KNOBS)
    assert run(job).exit_code == 0
    return outputs_by_key(tmp_path / "ref" / "out")


def wait_for_parts(out_dir, proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not list(out_dir.glob("part-*.parquet")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no part appeared"
        time.sleep(0.02)


def test_sigkill_at_random_moments_then_resume(tmp_path):
    rows = 500
    expected = reference(tmp_path, rows)
    job = setup_job(tmp_path / "run", rows=rows, **KNOBS)
    out = tmp_path / "run" / "out"
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.004")
    rng = random.Random(20240601)
    def check() -> None:
        done = outputs_by_key(out)  # asserts no (id, sample) twice, at every point
        assert all(expected[k] == v for k, v in done.items())

    def parts() -> int:
        return len(list(out.glob("part-*.parquet")))

    kills = kill_at_random_moments(job, env, parts, rng, rounds=12, anywhere=0.3, after_kill=check)
    assert kills >= 5
    final = subprocess.run(batchgen_cmd("run", job), env=subprocess_env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert outputs_by_key(out) == expected


def test_sigterm_saves_and_exits_75_and_a_concurrent_run_is_refused(tmp_path):
    rows = 300
    expected = reference(tmp_path, rows)
    job = setup_job(tmp_path / "run", rows=rows, **KNOBS)
    out = tmp_path / "run" / "out"
    # Slow enough steps (~15 s for the 300 rows) that the first run is still working when the second has started
    # up (at 10 ms a step it had finished all rows first on a quiet machine, and the second found nothing to do).
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.05")
    first = subprocess.Popen(batchgen_cmd("run", job), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for_parts(out, first)
        second = subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == EXIT_LOCKED
        assert "another batchgen run is already working on shard 0/1" in second.stderr
        assert f"pid {first.pid}" in second.stderr
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == EXIT_INTERRUPTED, stderr
    assert "SIGTERM received: admitting no more rows, finishing" in stdout
    assert "shard 0/1 interrupted" in stdout
    assert "interrupted by SIGTERM; finished rows are saved, run the same command again to resume" in stderr
    partial = outputs_by_key(out)
    assert 0 < len(partial) < len(expected)
    assert all(expected[k] == v for k, v in partial.items())
    assert run(job).exit_code == 0
    assert outputs_by_key(out) == expected


def test_sigint_with_no_grace_drops_in_flight(tmp_path):
    job = setup_job(tmp_path, rows=300, **KNOBS)
    proc = subprocess.Popen(batchgen_cmd("run", job, "--grace", "0"),
                            env=subprocess_env(FAKE_LLM_STEP_SLEEP="0.01"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_parts(tmp_path / "out", proc)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "dropping" in stdout and "the next run redoes them" in stdout
    assert "Traceback" not in stderr
    assert run(job).exit_code == 0
    assert len(outputs_by_key(tmp_path / "out")) == 600


def test_sbatch_script_passes_sigterm_on(tmp_path):
    """Slurm's --signal=B:TERM reaches only the batch shell; the script must hand it to batchgen."""
    from jobkit import cli

    job = setup_job(tmp_path, rows=300, **KNOBS)
    assert cli("slurm", job, "--array", "1").exit_code == 0
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.01", SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_JOB_ID="42",
                         REQUEUE_ON_INTERRUPT="0")
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_parts(tmp_path / "out", proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, (stdout, stderr)
    assert "batchgen shard 0/1 on" in stdout and f"batchgen exited with {EXIT_INTERRUPTED}" in stdout
    assert "SIGTERM received" in stdout
