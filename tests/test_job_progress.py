"""Progress: plain lines at an interval in logs, a rich live display on terminals, the summary."""

from __future__ import annotations

import dataclasses
import io
import time

from rich.console import Console

from batchgen.job.run.progress import (
    LiveReporter,
    PlainReporter,
    Plan,
    Snapshot,
    eta,
    make_reporter,
    status_line,
    summary,
)
from batchgen.job.shard import Shard

SNAP = Snapshot(rows=50, samples=100, errors=2, prompt_tokens=1000, output_tokens=400, in_flight=8,
                parts=5, elapsed=20.0, kv_cache_usage=0.42, preemptions=3, prefix_cache_hits=25,
                prefix_cache_queries=100)


def test_plain_lines_come_every_interval():
    buf = io.StringIO()
    rep = PlainReporter(buf, interval=0.05)
    rep.start(Plan(Shard(1, 4), done_before=50, total=200, exact=False))
    for _ in range(8):
        rep.update(SNAP)
        time.sleep(0.02)
    lines = buf.getvalue().splitlines()
    assert "shard 1/4: 50 rows done before, ~200 rows in input" in lines[0]
    assert 2 <= len(lines) - 1 <= 5
    line = lines[1]
    for part in ("rows 100/~200 (50.0%)", "errors 2", "20.0 out tok/s", "kv 42%", "preemptions 3",
                 "in flight 8", "elapsed 20s", "eta 42s"):  # 100 rows left of 8.3 tokens, at 20 tok/s
        assert part in line, (part, line)


def test_summary_has_the_figures():
    text = summary(Plan(Shard(), done_before=7), SNAP, "complete")
    for part in ("shard 0/1 complete", "50 this run (2 errors), 100 samples, 5 parts written; 7 done before",
                 "1,000 prompt, 400 output", "wall time    20s", "20.0 output tok/s", "70.0 tok/s in all",
                 "3 preemptions", "prefix cache hit rate 25.0%"):
        assert part in text, (part, text)


def test_live_display_on_a_terminal():
    buf = io.StringIO()
    rep = LiveReporter(buf, console=Console(file=buf, force_terminal=True, width=120))
    rep.start(Plan(Shard(), total=100))
    rep.update(SNAP, force=True)
    rep.message("hello from the run")
    rep.finish(SNAP, "complete")
    out = buf.getvalue()
    assert "rows 50/100 (50.0%)" in out and "KV cache 42%" in out and "ETA 21s" in out
    assert "hello from the run" in out and "prefix cache hit rate 25.0%" in out


def test_reporter_choice_follows_the_terminal():
    assert isinstance(make_reporter(5, io.StringIO()), PlainReporter)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(make_reporter(5, Tty()), LiveReporter)


def test_run_logs_plain_progress_lines(tmp_path, monkeypatch):
    from jobkit import run, setup_job

    monkeypatch.setenv("FAKE_LLM_STEP_SLEEP", "0.01")
    job = setup_job(tmp_path, rows=40, progress_interval=0.001, max_in_flight=4)
    r = run(job)
    assert r.exit_code == 0
    progress = [line for line in r.stdout.splitlines() if "rows " in line and " | " in line]
    assert progress and "out tok/s" in progress[-1]


def test_tokens_count_as_they_are_made_and_the_eta_follows_them():
    """40 requests in flight, one row written after 20 s: the rate is what the engine made, not
    the written row's tokens, and the ETA is what the unwritten rows still need at that rate."""
    plan = Plan(Shard(), total=41)
    snap = Snapshot(rows=1, samples=1, output_tokens=100, generated_tokens=2400, in_flight=40, elapsed=20.0)
    line = status_line(plan, snap)
    assert "120.0 out tok/s" in line, line
    assert "eta 14s" in line, line  # 40 rows x 100 tokens, 2,300 of them made: 1,700 at 120 tok/s
    # before any row is written there is no estimate of a row's tokens; once all are, nothing is left
    assert eta(plan, Snapshot(generated_tokens=500, in_flight=40, elapsed=5.0)) is None
    assert eta(Plan(Shard(), total=1), Snapshot(rows=1, output_tokens=9, elapsed=1.0)) == 0.0
    # an engine that does not count (no stats): the written rows' tokens, as before
    assert "5.0 out tok/s" in status_line(plan, Snapshot(rows=1, output_tokens=100, elapsed=20.0))


def test_the_run_reports_tokens_of_rows_still_in_flight(tmp_path, monkeypatch):
    from jobkit import run, setup_job

    from batchgen.job.run import runner

    seen: list[Snapshot] = []
    monkeypatch.setattr(runner, "make_reporter", lambda interval: Recorder(seen))
    monkeypatch.setenv("FAKE_LLM_STEP_SLEEP", "0.05")  # a request of k tokens takes k steps
    job = setup_job(tmp_path, rows=12, max_in_flight=12, sampling={"max_tokens": 8, "n": 1})
    assert run(job).exit_code == 0
    early = [s for s in seen if s.generated_tokens and s.generated_tokens > s.output_tokens]
    assert early, "no progress update while rows were in flight"
    assert all(s.generated_tokens >= s.output_tokens for s in seen if s.generated_tokens is not None)


class Recorder(PlainReporter):
    """Keeps a copy of every snapshot the run reports."""

    def __init__(self, seen: list[Snapshot]):
        super().__init__(io.StringIO(), interval=0)
        self.seen = seen

    def update(self, snap: Snapshot, force: bool = False) -> None:
        self.seen.append(dataclasses.replace(snap))


def test_the_engine_start_is_told_step_by_step(tmp_path, tiny_model_dirs):
    """A slow start shows what it waits for: loading weights, the KV cache (on CPU a ceiling: reserved,
    not allocated), compiling a grammar, each one line in the log before the rows' progress."""
    from jobkit import cli, setup_job

    job = setup_job(tmp_path, rows=3, model={"path": str(tiny_model_dirs["llama"]), "dtype": "float32",
                                             "kv_cache_memory": "16MiB", "swap_space": "4MiB"},
                    sampling={"structured_outputs": {"regex": "[ab]{1,3}"}, "n": 1}, input={"carry_columns": []})
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()

    def first(text: str) -> int:
        found = [i for i, line in enumerate(lines) if text in line]
        assert found, (text, r.stdout)
        return found[0]

    steps = [first(f"] {step}") for step in ("loading weights from", "KV cache: reserving up to 16 MiB (",
                                               "engine ready in", "compiling a grammar for structured outputs (regex)")]
    assert steps == sorted(steps) and steps[-1] < first("shard 0/1 complete")
    assert sum("compiling a grammar" in line for line in lines) == 1


def test_engine_steps_reach_a_live_display_and_stop_with_the_run():
    import logging

    from batchgen.job.run.progress import engine_steps

    buf = io.StringIO()
    rep = LiveReporter(buf, console=Console(file=buf, force_terminal=True, width=120))
    with engine_steps(rep):
        logging.getLogger("batchgen.engine.llm_engine").info("loading weights from %s", "/models/x")
    logging.getLogger("batchgen.engine.llm_engine").info("after the run")
    assert "loading weights from /models/x" in buf.getvalue() and "after the run" not in buf.getvalue()
