"""What a run says (issue 56, items 4 and 5): summaries in the words of the task (no samples or output
tokens for score and embed jobs), plurals, YAML's null in messages, a live display that fits an 80-column
terminal, requests running never above max_num_seqs, an ETA that counts down while no row finishes, and
the scoring guide's prefix-cache statement checked against the engine."""

from __future__ import annotations

import io

from jobkit import REPO, cli, job_dict, run, setup_job, write_job
from rich.console import Console

from batchgen.job.run.progress import LiveReporter, Plan, Snapshot, eta, status_line, summary
from batchgen.job.shard import Shard


def test_a_score_summary_counts_prompt_tokens_and_no_samples():
    snap = Snapshot(rows=2, samples=2, prompt_tokens=80, parts=1, elapsed=2.0, preemptions=0,
                    prefix_cache_hits=0, prefix_cache_queries=80)
    text = summary(Plan(Shard(), task="score"), snap, "complete")
    assert "  rows         2 this run (0 errors), 1 part written; 0 done before" in text.splitlines()
    assert "  tokens       80 prompt (task score makes no output tokens)" in text.splitlines()
    assert "  wall time    2s; 40.0 prompt tok/s" in text.splitlines()
    assert "sample" not in text and "output tok/s" not in text
    assert "40.0 prompt tok/s" in status_line(Plan(Shard(), total=4, task="embed"), snap)


def test_the_summary_says_one_part_and_one_error():
    snap = Snapshot(rows=3, samples=1, errors=1, parts=1, output_tokens=5, elapsed=1.0, preemptions=1)
    text = summary(Plan(Shard()), snap, "complete")
    assert "3 this run (1 error), 1 sample, 1 part written" in text and "1 preemption," in text


def test_requests_running_are_never_more_than_the_engine_runs():
    snap = Snapshot(rows=1, output_tokens=3, in_flight=4, running=2, elapsed=1.0)
    line = status_line(Plan(Shard(), total=10), snap)
    assert "running 2 | queued 2" in line and "in flight" not in line


def test_the_live_display_fits_an_80_column_terminal():
    buf = io.StringIO()
    reporter = LiveReporter(buf, console=Console(file=buf, width=80, color_system=None, force_terminal=False))
    reporter.plan = Plan(Shard(3, 16), done_before=1_234_567, total=9_876_543, exact=False)
    snap = Snapshot(rows=123_456, errors=12_345, output_tokens=9_999_999, generated_tokens=10_500_000,
                    in_flight=512, running=256, elapsed=98_765.0, kv_cache_usage=0.97, preemptions=123_456)
    reporter.console.print(reporter._render(snap))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines), lines
    assert "rows 1,358,023/~9,876,543 (13.7%)" in lines[0] and "running 256 | queued 256" in lines[1]


def test_the_eta_counts_down_while_no_row_finishes():
    """Rows written so far made 10 tokens each; the 4 in flight run long. With no row finishing the
    engine makes 10 tokens a second: the ETA must come down, not jump up as the rows in flight grow."""
    plan = Plan(Shard(), total=120)
    etas = [eta(plan, Snapshot(rows=100, output_tokens=1000, generated_tokens=1000 + 10 * t, in_flight=4,
                               elapsed=100.0 + t)) for t in range(0, 60, 5)]
    assert all(later <= earlier for earlier, later in zip(etas, etas[1:], strict=False)), etas


def test_messages_say_null_where_the_job_file_does(tmp_path):
    job = setup_job(tmp_path, rows=3, sampling={"logprobs": -1})
    r = run(job)
    assert r.exit_code == 1 and "sampling.logprobs: must be an integer >= 0 or null (got -1)" in r.stderr
    job = setup_job(tmp_path, rows=3)
    assert run(job).exit_code == 0
    chat = setup_job(tmp_path, input={"prompt_column": None, "messages_column": "prompt"})
    r = run(chat)
    assert r.exit_code == 1 and "input.messages_column: null -> 'prompt'" in r.stderr, r.stderr
    assert "None" not in r.stderr


def test_the_guide_says_a_shared_prompt_is_computed_once(tiny_model_dirs):
    """docs/scoring-embeddings.md: completions of one prompt given together compute it once; the others wait a
    step and take it from the cache, and so does a later call."""
    from batchgen import LLM

    guide = " ".join((REPO / "docs" / "scoring-embeddings.md").read_text(encoding="utf-8").split())
    assert "the others start one step later and find it in the cache" in guide
    prompt, completions = list(range(5, 42)), [[50, 51], [60, 61], [70, 71]]  # 37 tokens: 2 full blocks of 16
    llm = LLM(str(tiny_model_dirs["llama"]), kv_cache_memory="64MiB", swap_space="64MiB")
    together = llm.score_completions([prompt] * 3, completions, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == 2 * 32
    llm.score_completions([prompt], completions[:1], use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == 3 * 32
    alone = LLM(str(tiny_model_dirs["llama"]), kv_cache_memory="64MiB", swap_space="64MiB", enable_prefix_caching=False)
    assert [s.logprob for s in alone.score_completions([prompt] * 3, completions, use_tqdm=False)] == [
        s.logprob for s in together]


def test_a_score_job_summary_in_its_own_words(tmp_path, tiny_model_dirs):
    setup_job(tmp_path, rows=0)
    job = job_dict(task="score", model={"path": str(tiny_model_dirs["llama"])},
                   input={"completion_column": "answer", "carry_columns": []}, output={"dir": "out"})
    del job["sampling"], job["output"]["fields"]
    path = write_job(tmp_path / "score.yaml", job)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "The capital of France is", "answer": " Paris"}\n')
    r = cli("run", path)
    assert r.exit_code == 0, r.output
    assert "1 this run (0 errors), 1 part written" in r.stdout and "samples" not in r.stdout
    assert "(task score makes no output tokens)" in r.stdout and "prompt tok/s" in r.stdout
