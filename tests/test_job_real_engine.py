"""`batchgen run` end to end on the real engine (a tiny random Llama with a chat template):
per-row errors, SIGKILL and resume with identical text, and shards that add up to the whole."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from jobkit import REPO, batchgen_cmd, cli, outputs_by_key, write_job, write_jsonl


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_ENGINE"}
    env["PYTHONPATH"] = str(REPO)
    return env


def _setup(root, model_dir, rows: int = 120, out: str = "out"):
    root.mkdir(parents=True, exist_ok=True)
    records = [{"id": f"r{i:03d}", "messages": [{"role": "user", "content": f"tell me about number {i}"}]}
               for i in range(rows)]
    records.append({"id": "too-long", "messages": [{"role": "user", "content": "the quick brown fox " * 200}]})
    records.append({"id": "empty", "messages": []})
    write_jsonl(root / "in.jsonl", records)
    job = {
        "model": {"path": str(model_dir), "dtype": "float32", "kv_cache_memory": "32MiB", "swap_space": "8MiB",
                  "max_model_len": 256},
        "input": {"paths": ["in.jsonl"], "id_column": "id", "messages_column": "messages"},
        "sampling": {"n": 2, "temperature": 0.8, "top_p": 0.95, "seed": 11, "max_tokens": 24, "ignore_eos": True},
        "output": {"dir": out, "rows_per_part": 2, "fields": ["text", "token_ids", "finish_reason", "token_counts"]},
        "max_in_flight": 8,  # rows stream through in waves, so a kill lands mid-run
        "progress_interval": 3600,
    }
    return write_job(root / "job.yaml", job)


def _run(job, *args, check=True):
    proc = subprocess.run(batchgen_cmd("run", job, *args), env=_env(), capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_real_engine_job_errors_resume_and_shards(tmp_path, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    whole = _setup(tmp_path / "whole", model)
    _run(whole)
    reference = outputs_by_key(tmp_path / "whole" / "out")
    assert len(reference) == 120 * 2 + 2
    assert "max_model_len" in reference[("too-long", 0)][1]
    assert reference[("empty", 0)][1]
    assert all(err is None and text for key, (text, err) in reference.items() if key[0].startswith("r"))

    # SIGKILL as soon as the first part lands, then resume: exactly once, the same text.
    killed = _setup(tmp_path / "killed", model)
    proc = subprocess.Popen(batchgen_cmd("run", killed), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    out_dir = tmp_path / "killed" / "out"
    deadline = time.time() + 300
    while time.time() < deadline and not list(out_dir.glob("part-*.parquet")) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(outputs_by_key(out_dir))
    _run(killed)
    assert outputs_by_key(out_dir) == reference
    assert partial < len(reference)

    # Three shards together equal the unsharded run.
    sharded = _setup(tmp_path / "sharded", model)
    for i in range(3):
        _run(sharded, "--shard", f"{i}/3")
    assert outputs_by_key(tmp_path / "sharded" / "out") == reference


def _small_job(root, model_dir, records, **changes):
    write_jsonl(root / "in.jsonl", records)
    job = {
        "model": {"path": str(model_dir), "dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256},
        "input": {"paths": ["in.jsonl"], "id_column": "id", "prompt_column": "prompt"},
        "sampling": {"temperature": 0, "max_tokens": 4, "ignore_eos": True},
        "output": {"dir": "out", "fields": ["text", "token_ids"]},
        "progress_interval": 3600,
    }
    for section, values in changes.items():
        job[section] = {**job[section], **values}
    return write_job(root / "job.yaml", job)


def test_a_token_id_outside_the_vocabulary_is_that_rows_error(tmp_path, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    job = _small_job(tmp_path, model, [
        {"id": "t", "prompt": [vocab]},
        {"id": "ids", "prompt": [5, 6, 7]},
        {"id": "text", "prompt": "the quick brown fox"},
        {"id": "negative", "prompt": [3, -2]},
    ])
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    out = outputs_by_key(tmp_path / "out")
    assert out[("t", 0)] == (None, f"in.jsonl line 1: field 'prompt': token id {vocab} at [0] is outside "
                                   f"the model's vocabulary (0..{vocab - 1})")
    assert out[("negative", 0)][1].startswith("in.jsonl line 4: field 'prompt': expected a string or a non-empty")
    assert out[("ids", 0)][1] is None and out[("text", 0)][1] is None
    r = cli("run", job)
    assert r.exit_code == 0 and "nothing to do" in r.stdout


def test_validate_asks_the_engine_about_the_model(tmp_path, tiny_model_dirs):
    """The engine's own checks against the model, each at its job-file field, before any run."""
    job = _small_job(tmp_path, tiny_model_dirs["llama"], [{"id": "a", "prompt": "hi"}],
                     model={"max_model_len": 5000, "kv_cache_memory": "40KiB", "device": "cpu"})
    r = cli("validate", job)
    assert r.exit_code == 1 and "Traceback" not in r.output
    problems = r.stderr.splitlines()
    assert "model.max_model_len: 5000 is more than the model supports (1024)" in problems
    assert any(p.startswith("model.kv_cache_memory: the KV cache budget leaves 1 blocks") for p in problems)
    r = cli("run", job)  # the same checks when the engine is built, before any row
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "max_model_len: 5000 is more than the model supports" in r.stderr
    assert not list((tmp_path / "out").glob("part-*"))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dirs["llama"], no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    job = _small_job(tmp_path, no_weights, [{"id": "a", "prompt": "hi"}])
    r = cli("validate", job)
    assert r.exit_code == 1
    assert r.stderr.splitlines()[0] == f"model.path: model directory {str(no_weights)!r} has no *.safetensors files"
