"""batchgen on a local Ray cluster: `batchgen ray` equals an unsharded run, a worker killed
mid-run is retried and resumes (each (id, sample) once), and the Ray Data stage gives the text
`LLM.generate` gives."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pyarrow as pa
import pytest
from jobkit import TESTS_DIR, batchgen_cmd, cli, outputs_by_key, run, setup_job, subprocess_env

from batchgen.ray.data import _Generator
from batchgen.storage.mounts import node_local_warning

# Per test, not for the module: the test of a missing Ray must run where Ray is missing too.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

CHATS = ["the quick brown fox", "paged attention keeps the kv cache", "a batch of prompts becomes",
         "hello world, this is batchgen"]  # greedy outputs of the tiny model that differ from each other
KNOBS = {"output": {"rows_per_part": 5}, "max_in_flight": 8, "model": {"path": "model", "max_num_seqs": 8}}


def ray_cmd(job, *args: str) -> list[str]:
    return batchgen_cmd("ray", job, "--workers", "2", *args)


@needs_ray
def test_two_workers_equal_one_unsharded_run(tmp_path):
    ref = setup_job(tmp_path / "ref", rows=120, **KNOBS)
    assert run(ref).exit_code == 0
    job = setup_job(tmp_path / "ray", rows=120, **KNOBS)
    proc = subprocess.run(ray_cmd(job), env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert outputs_by_key(tmp_path / "ray" / "out") == outputs_by_key(tmp_path / "ref" / "out")
    assert {p.name.split("-of-")[0] for p in (tmp_path / "ray" / "out").glob("part-*")} == {"part-00000", "part-00001"}
    assert "batchgen: 2 Ray workers complete" in proc.stdout
    assert re.search(r"shard 0/2 +complete on .*rows", proc.stdout) and re.search(r"shard 1/2 +complete", proc.stdout)
    assert re.search(r"2 Ray workers: 0 rows done before, ~?120 rows in input", proc.stdout), proc.stdout
    again = subprocess.run(ray_cmd(job), env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    # the header and the summary agree on the rows done before (the header said 0)
    assert re.search(r"2 Ray workers: 120 rows done before, ~?120 rows in input", again.stdout), again.stdout
    assert "0 this run (0 errors), 0 samples, 0 parts written; 120 done before" in again.stdout, again.stdout
    for out in (proc, again):  # Ray's own start-up lines stay out of the run's output
        assert "Token authentication" not in out.stdout + out.stderr, out.stderr


@needs_ray
def test_a_killed_worker_is_retried_and_resumes(tmp_path):
    ref = setup_job(tmp_path / "ref", rows=300, **KNOBS)
    assert run(ref).exit_code == 0
    root = tmp_path / "ray"
    job = setup_job(root, rows=300, **KNOBS)
    out = root / "out"
    driver = subprocess.Popen(ray_cmd(job), env=subprocess_env(FAKE_LLM_STEP_SLEEP="0.01"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = out / ".locks" / "shard-00000-of-00002.lock"
    deadline = time.monotonic() + 120
    while len(list(out.glob("part-00000-of-00002-*"))) < 2:
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "shard 0 wrote no parts"
        time.sleep(0.01)
    pid = int(re.match(r"pid (\d+)", lock.read_text())[1])
    os.kill(pid, signal.SIGKILL)  # the worker process, as a lost node or a spot reclaim would
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr
    assert "shard 0/2: attempt 2" in stdout and "1 retry" in stdout
    assert outputs_by_key(out) == outputs_by_key(tmp_path / "ref" / "out")  # asserts each (id, sample) once


@needs_ray
def test_a_worker_killed_with_a_bucket_output_is_retried_and_resumes_from_the_bucket(tmp_path, bucket):
    """No shared filesystem: parts and leases in S3; the retried attempt waits out the killed
    attempt's lease, then resumes from the bucket's parts."""
    from bucketkit import bucket_outputs, upload

    from batchgen.storage import location

    ref = setup_job(tmp_path / "ref", rows=300, **KNOBS)
    assert run(ref).exit_code == 0
    root = tmp_path / "ray"
    setup_job(root, rows=300, **KNOBS)
    upload(f"{bucket}/in.jsonl", root / "in.jsonl")
    job = setup_job(root, rows=300, **{**KNOBS, "input": {"paths": [f"{bucket}/in.jsonl"]},
                                       "output": {**KNOBS["output"], "dir": f"{bucket}/out"},
                                       "storage": {"lease_seconds": 2}})
    out = location(f"{bucket}/out")
    driver = subprocess.Popen(ray_cmd(job, "--address", "local"), env=subprocess_env(FAKE_LLM_STEP_SLEEP="0.01"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while sum(p.name.startswith("part-00000-of-00002-") for p in out.list_files()) < 2:
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "shard 0 wrote no parts"
        time.sleep(0.05)
    lease = [p for p in (out / ".locks").list_files() if p.name.startswith("shard-00000-of-00002.lock.lease.")][-1]
    pid = int(re.search(r"pid (\d+)", lease.read_text())[1])
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr
    assert "shard 0/2: attempt 2" in stdout and "1 retry" in stdout
    assert "looks local to this machine" not in stderr  # a bucket is shared by every node
    assert bucket_outputs(str(out)) == outputs_by_key(tmp_path / "ref" / "out")


def test_ray_missing_is_one_line_with_the_install_command(tmp_path, monkeypatch):
    job = setup_job(tmp_path, rows=2)
    monkeypatch.setitem(sys.modules, "ray", None)
    result = cli("ray", job, "--workers", "2")
    assert result.exit_code == 1
    assert ("Ray is not installed; install it with: pip install 'ray[data]>=2.40' (in a clone of batchgen: "
            "pip install -e '.[ray]')") in result.output


def test_node_local_output_dirs_are_told_apart(tmp_path):
    mounts = tmp_path / "mounts"
    (tmp_path / "shared").mkdir()
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {(tmp_path / 'shared').resolve()} nfs4 rw 0 0\n")
    assert "looks local to this machine" in node_local_warning(tmp_path / "local" / "out", str(mounts))
    assert node_local_warning(tmp_path / "shared" / "out", str(mounts)) is None
    job = setup_job(tmp_path / "job", rows=2)
    result = cli("validate", job, "--ray", "--engine", "fake_llm:FakeLLM")
    assert result.exit_code == 0  # a warning, not a problem
    here = node_local_warning(tmp_path / "job" / "out")  # whatever /tmp is on, validate says the same
    assert ("looks local to this machine" in result.output) == (here is not None)


@needs_ray
def test_ray_data_stage_gives_the_text_of_llm_generate(tiny_model_dirs, monkeypatch):
    """The same text as LLM.generate whichever of two actors, and whichever of Ray's batches, a row
    lands in; chat rows each equal their own prompt's output."""
    import ray

    import batchgen.ray
    from batchgen import LLM, SamplingParams

    model = str(tiny_model_dirs["llama"])
    prompts = [f"tell me about number {i}" for i in range(24)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8)
    options = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 128}
    # Two actors, each told apart by its process id (the probe's column); the workers import the probe
    # from this file. Ray Data waits for both before it hands out batches, so each one gets some.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(batchgen.ray.data, "_Generator", PidProbe)
    context = ray.data.DataContext.get_current()
    monkeypatch.setattr(context, "wait_for_min_actors_s", 300)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        ds = ray.data.from_items([{"key": i, "prompt": p} for i, p in enumerate(prompts)] + [{"key": 99, "prompt": ""}])
        rows = batchgen.ray.generate(ds, model, params, concurrency=2, batch_size=2, max_concurrent_batches=2,
                                     **options).take_all()
        chats = ray.data.from_items([{"key": i, "messages": [{"role": "user", "content": p}]}
                                     for i, p in enumerate(CHATS)])
        chat_rows = batchgen.ray.generate(chats, model, {"n": 2, "temperature": 0, "max_tokens": 4},
                                          prompt_column=None, messages_column="messages", **options).take_all()
    finally:
        ray.shutdown()
    assert len({r["actor_pid"] for r in rows}) == 2, "one actor generated every row"
    llm = LLM(model, **options)
    expected = [o.outputs[0] for o in llm.generate(prompts, params)]
    by_key = {r["key"]: r for r in rows}
    assert [by_key[i]["text"] for i in range(len(prompts))] == [c.text for c in expected]
    assert [by_key[i]["num_output_tokens"] for i in range(len(prompts))] == [len(c.token_ids) for c in expected]
    assert all(by_key[i]["error"] is None for i in range(len(prompts)))
    assert by_key[99]["text"] is None and by_key[99]["error"] == "prompt is empty"
    greedy = llm.chat([[{"role": "user", "content": p}] for p in CHATS],
                      SamplingParams(n=2, temperature=0, max_tokens=4))
    chat_by_key = {r["key"]: list(r["text"]) for r in chat_rows}
    assert chat_by_key == {i: [c.text for c in o.outputs] for i, o in enumerate(greedy)}
    assert len({tuple(texts) for texts in chat_by_key.values()}) > 1  # the prompts' outputs tell them apart


class PidProbe(_Generator):
    """batchgen.ray.generate's actor, adding the process id of the actor that made each row."""

    async def __call__(self, batch: pa.Table) -> Any:
        async for out in super().__call__(batch):
            yield out.append_column("actor_pid", pa.array([os.getpid()] * out.num_rows, pa.int64()))
