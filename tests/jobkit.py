"""Helpers for the job-layer tests: model dirs, input files, job files, running the CLI."""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml
from typer.testing import CliRunner

from batchgen.cli import app, spread_lora_modules

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
FAKE = "fake_llm:FakeLLM"


def make_model(path: Path, **config: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def prompts(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"q{i:04d}", "prompt": f"question number {i}", "topic": i % 3}
            for i in range(start, start + n)]


def write_jsonl(path: Path, records: list[Any], mode: str = "w") -> Path:
    with open(path, mode, encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_parquet(path: Path, data: dict[str, Any] | pa.Table, row_group_size: int | None = None) -> Path:
    table = data if isinstance(data, pa.Table) else pa.table(data)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def job_dict(**overrides: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "model": {"path": "model"},
        "input": {"paths": ["in.jsonl"], "id_column": "id", "prompt_column": "prompt",
                  "carry_columns": ["topic"]},
        "sampling": {"n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 6},
        "output": {"dir": "out", "rows_per_part": 10,
                   "fields": ["text", "token_ids", "finish_reason", "token_counts"]},
        "progress_interval": 3600,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    return job


def setup_job(root: Path, rows: int = 30, name: str = "job.yaml", **overrides: Any) -> Path:
    """A model dir, an ``in.jsonl`` of ``rows`` prompts and a job file, all in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model").exists():
        make_model(root / "model")
    if rows and not (root / "in.jsonl").exists():
        write_jsonl(root / "in.jsonl", prompts(rows))
    return write_job(root / name, job_dict(**overrides))


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def run(job: Path, *args: str) -> Any:
    return cli("run", str(job), "--engine", FAKE, *args)


def read_rows(out_dir: Path) -> list[dict[str, Any]]:
    if not list(out_dir.glob("part-*.parquet")):
        return []
    return ds.dataset(out_dir, format="parquet").to_table().to_pylist()


def outputs_by_key(out_dir: Path) -> dict[tuple[str, int], Any]:
    """(id, sample_index) -> (text, error); asserts every key appears exactly once."""
    return keyed(read_rows(out_dir))


def keyed(rows: list[dict[str, Any]]) -> dict[tuple[str, int], Any]:
    """Output rows as (id, sample_index) -> (text, error), asserting every key appears once."""
    counts = Counter((r["id"], r["sample_index"]) for r in rows)
    dups = [k for k, c in counts.items() if c > 1]
    assert not dups, f"duplicated (id, sample): {dups[:5]}"
    return {(r["id"], r["sample_index"]): (r.get("text"), r["error"]) for r in rows}


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS_DIR)])
    env["BATCHGEN_ENGINE"] = FAKE
    env.update(extra)
    return env


def batchgen_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchgen", *map(str, args)]


def cli_child(argv: list[str], env: dict[str, str], stderr_path: str) -> None:
    """``batchgen *argv`` as the body of a forked process (multiprocessing's forkserver, with batchgen
    preloaded): the environment ``env``, stdout discarded, stderr to ``stderr_path``. A shard runner
    without an interpreter's start-up and imports (~2 s of CPU each), still a process to SIGKILL."""
    import atexit

    os.environ.clear()
    os.environ.update(env)
    for fd, path, flags in ((1, os.devnull, os.O_WRONLY), (2, stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        target = os.open(path, flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    try:
        app(args=spread_lora_modules(list(argv)))
    finally:  # what the interpreter does at exit (a forked child leaves by os._exit)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def kill_at_random_moments(job: Path, env: dict[str, str], parts: Callable[[], int], rng: Any, rounds: int,
                           anywhere: float, after_kill: Callable[[], None], cmd: list[str] | None = None,
                           linger: float = 0.25) -> int:
    """Start `batchgen run job` (or `cmd`) up to `rounds` times and SIGKILL it: with probability `anywhere`
    after a random delay (start-up included), else once it has written a part (`parts()` counts
    them) and up to `linger` seconds after (0 for a prefill-only job, which a quiet machine finishes
    within a quarter of a second of its first part); `after_kill()` checks the output after each
    kill. The number of kills; stops early when a run finishes (it must exit 0)."""
    import subprocess
    import time

    kills = 0
    for _ in range(rounds):
        before = parts()
        proc = subprocess.Popen(cmd or batchgen_cmd("run", job), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        if rng.random() < anywhere:
            time.sleep(rng.uniform(0.05, 1.0))
        else:  # mid-run: once this run has written a part (the machine may be slow to start us)
            deadline = time.monotonic() + 60
            while parts() == before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, linger))
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read().decode()
            break
        proc.kill()
        proc.wait()
        kills += 1
        after_kill()
    return kills


def engine_env() -> dict[str, str]:
    """A subprocess's environment for runs on the real engine (no fake engine injected)."""
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_ENGINE"}
    env["PYTHONPATH"] = str(REPO)
    return env


def read(out_dir) -> tuple[pa.Schema, dict[str, dict]]:
    """The output's schema and its rows by id, asserting each id is there once."""
    table = ds.dataset(out_dir, format="parquet").to_table()
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return table.schema, {r["id"]: r for r in rows}


def parts(out_dir) -> int:
    return len(list(out_dir.glob("part-*.parquet")))


def check_kill_resume_and_shards(tmp_path, make_job, expected: dict[str, dict]) -> None:
    """SIGKILL at random moments, then resume: each row once and equal to `expected` (an uninterrupted
    run); then the same job in two shards."""
    job = make_job(tmp_path / "killed")
    out_dir = job.parent / "out"
    seen: list[int] = []

    def after_kill() -> None:
        if parts(out_dir):
            seen.append(len(read(out_dir)[1]))

    kills = kill_at_random_moments(job, engine_env(), lambda: parts(out_dir), random.Random(1), rounds=3, anywhere=0.2,
                                   after_kill=after_kill, linger=0.0)
    assert kills >= 1 and any(n < len(expected) for n in seen), (kills, seen)  # a run was cut mid-way
    assert cli("run", job).exit_code == 0
    assert read(out_dir)[1] == expected
    sharded = make_job(tmp_path / "sharded")
    for shard in ("0/2", "1/2"):
        r = cli("run", sharded, "--shard", shard)
        assert r.exit_code == 0, r.output
    assert read(sharded.parent / "out")[1] == expected
