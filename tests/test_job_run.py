"""`batchgen run` end to end on the fake engine (in-process CLI): outputs, resume, shards, lock,
new rows, config changes, bad input, engine failures, status, slurm."""

from __future__ import annotations

import json
import re
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jobkit import (
    FAKE,
    REPO,
    cli,
    job_dict,
    make_model,
    outputs_by_key,
    prompts,
    read_rows,
    run,
    setup_job,
    write_job,
    write_jsonl,
    write_parquet,
)

from batchgen.job.errors import EXIT_ENGINE, EXIT_LOCKED
from batchgen.job.run.lock import ShardLock
from batchgen.job.shard import Shard
from batchgen.storage.locks import FileLock

JOB_FILE_GUIDE = (REPO / "docs" / "job-file.md").read_text(encoding="utf-8")


def test_run_writes_every_id_and_sample_once(tmp_path):
    job = setup_job(tmp_path, rows=30)
    r = run(job)
    assert r.exit_code == 0, r.output
    assert "shard 0/1 complete" in r.stdout and "30 this run (0 errors), 60 samples" in r.stdout
    out = outputs_by_key(tmp_path / "out")
    assert set(out) == {(f"q{i:04d}", s) for i in range(30) for s in range(2)}
    rows = read_rows(tmp_path / "out")
    assert {r["topic"] for r in rows} == {0, 1, 2}
    assert all(r["num_output_tokens"] == len(r["token_ids"]) and r["num_prompt_tokens"] > 0 for r in rows)
    assert all(r["finish_reason"] in ("stop", "length") and r["error"] is None for r in rows)
    # the saved job and the metadata tell what produced the parts
    saved = json.loads((tmp_path / "out" / "_job.json").read_text())
    part = sorted((tmp_path / "out").glob("part-*.parquet"))[0]
    assert pq.read_schema(part).metadata[b"batchgen.config_hash"] == saved["config_hash"].encode()
    # a rerun finds everything done and never loads the model
    r = run(job)
    assert r.exit_code == 0 and "nothing to do: all 30 rows found are done" in r.stdout


def test_seeded_runs_are_reproducible_and_greedy_too(tmp_path):
    texts = []
    for k in range(2):
        job = setup_job(tmp_path / f"r{k}", rows=12, output={"rows_per_part": 1 + 4 * k},
                        max_in_flight=3 + 10 * k)
        assert run(job).exit_code == 0
        texts.append(outputs_by_key(tmp_path / f"r{k}" / "out"))
    assert texts[0] == texts[1]  # batch composition and part size do not matter
    job = setup_job(tmp_path / "g", rows=5, sampling={"temperature": 0, "seed": None, "n": 1})
    assert run(job).exit_code == 0


def test_three_shards_equal_one_unsharded_run(tmp_path):
    whole = setup_job(tmp_path / "whole", rows=45)
    assert run(whole).exit_code == 0
    sharded = setup_job(tmp_path / "sharded", rows=45)
    for i in range(3):
        r = run(sharded, "--shard", f"{i}/3")
        assert r.exit_code == 0, r.output
        assert f"shard {i}/3 complete" in r.stdout
    names = {p.name.split("-of-")[0] for p in (tmp_path / "sharded" / "out").glob("part-*.parquet")}
    assert names == {"part-00000", "part-00001", "part-00002"}
    assert outputs_by_key(tmp_path / "sharded" / "out") == outputs_by_key(tmp_path / "whole" / "out")


def test_slurm_array_variables_pick_the_shard(tmp_path, monkeypatch):
    job = setup_job(tmp_path, rows=20)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    r = run(job)
    assert r.exit_code == 0 and "shard 1/2 complete" in r.stdout
    assert {i for i, _ in outputs_by_key(tmp_path / "out")} == {
        f"q{i:04d}" for i in range(20) if Shard(1, 2).owns(f"q{i:04d}")}


def test_new_rows_and_files_are_the_only_work_of_a_rerun(tmp_path):
    job = setup_job(tmp_path, rows=20, input={"paths": ["in*.jsonl"]})
    assert run(job).exit_code == 0
    before = {p.name for p in (tmp_path / "out").glob("part-*.parquet")}
    write_jsonl(tmp_path / "in.jsonl", prompts(3, start=20), mode="a")
    write_jsonl(tmp_path / "in2.jsonl", prompts(4, start=23))
    r = run(job)
    assert r.exit_code == 0 and "7 this run" in r.stdout and "20 done before" in r.stdout
    new_parts = [p for p in (tmp_path / "out").glob("part-*.parquet") if p.name not in before]
    new_ids = {r["id"] for p in new_parts for r in pq.read_table(p).to_pylist()}
    assert new_ids == {f"q{i:04d}" for i in range(20, 27)}
    assert len(outputs_by_key(tmp_path / "out")) == 27 * 2


def test_second_run_of_a_shard_is_refused(tmp_path, monkeypatch):
    job = setup_job(tmp_path, rows=5)
    monkeypatch.setattr(FileLock, "retry_seconds", 0.0)
    with ShardLock(tmp_path / "out", Shard(0, 1)):
        r = run(job)
        assert r.exit_code == EXIT_LOCKED
        assert r.stderr.startswith("batchgen: error: another batchgen run is already working on shard 0/1")
        assert len(r.stderr.strip().splitlines()) == 1
        assert run(job, "--shard", "1/2").exit_code == 0  # other shards are not blocked
    assert run(job).exit_code == 0  # released: the lock never goes stale


def test_changed_config_is_refused_unless_forced(tmp_path):
    job = setup_job(tmp_path, rows=10)
    assert run(job).exit_code == 0
    write_jsonl(tmp_path / "in.jsonl", prompts(2, start=10), mode="a")
    changed = write_job(job, job_dict(sampling={"temperature": 0.3, "stop": ["."]}, output={"fields": ["text"]}))
    r = run(changed)
    assert r.exit_code == 1 and "another job configuration" in r.stderr and "--force" in r.stderr
    assert len(r.stderr.splitlines()) == 1  # what changed, named field by field
    assert ('(output.fields: ["finish_reason", "text", "token_counts", "token_ids"] -> ["text"]; '
            'sampling.stop: null -> ["."]; sampling.temperature: 0.8 -> 0.3; config ') in r.stderr, r.stderr
    r = run(changed, "--force")
    assert r.exit_code == 0 and "2 this run" in r.stdout
    assert len(outputs_by_key(tmp_path / "out")) == 12 * 2


def test_bad_rows_are_recorded_and_counted(tmp_path):
    make_model(tmp_path / "model", max_model_len=40)
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ok", "prompt": "short", "mt": 2},
        {"id": "long", "prompt": "x" * 100},
        {"id": "empty", "prompt": ""},
        '{"id": "broken"',
        {"id": "badmt", "prompt": "fine", "mt": -3},
        {"id": "strmt", "prompt": "fine", "mt": "many"},
    ])
    job = setup_job(tmp_path, rows=0, input={"carry_columns": []},
                    sampling={"overrides": {"max_tokens": "mt"}})
    r = run(job)
    assert r.exit_code == 0, r.output
    assert "6 this run (5 errors)" in r.stdout
    errors = {row["id"]: row["error"] for row in read_rows(tmp_path / "out") if row["error"]}
    assert errors["long"] == "in.jsonl line 2: prompt is 100 tokens, more than max_model_len 40"
    assert errors["empty"] == "in.jsonl line 3: field 'prompt': empty prompt"
    assert errors["in.jsonl:4"].startswith("in.jsonl line 4: malformed JSON")
    assert errors["badmt"].startswith("in.jsonl line 5: field 'mt' (sampling.max_tokens override): must be")
    assert errors["strmt"].startswith("in.jsonl line 6: field 'mt' (sampling.max_tokens override): ")
    ok = [row for row in read_rows(tmp_path / "out") if row["id"] == "ok"]
    assert len(ok) == 2 and all(row["num_output_tokens"] <= 2 for row in ok)
    assert run(job).exit_code == 0  # errors count as done: not retried
    assert len(read_rows(tmp_path / "out")) == 2 + 5


def test_chat_messages_and_parquet_input(tmp_path):
    msgs = pa.array([[{"role": "user", "content": f"hi {i}"}] for i in range(6)],
                    type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    write_parquet(tmp_path / "chats.parquet", pa.table({"uid": list(range(6)), "msgs": msgs,
                                                         "tags": [["a", "b"]] * 6}))
    job = setup_job(tmp_path, rows=0, input={"paths": ["chats.parquet"], "id_column": "uid",
                                              "prompt_column": None, "messages_column": "msgs",
                                              "carry_columns": ["tags", "msgs"]})
    r = run(job)
    assert r.exit_code == 0, r.output
    rows = read_rows(tmp_path / "out")
    assert sorted({row["id"] for row in rows}) == [str(i) for i in range(6)]
    assert rows[0]["tags"] == ["a", "b"] and rows[0]["msgs"][0]["role"] == "user"
    assert rows[0]["num_prompt_tokens"] > len("hi 0")  # rendered with the chat template


def test_model_without_chat_template_is_a_job_error(tmp_path):
    make_model(tmp_path / "model", chat_template=False)
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "msgs": [{"role": "user", "content": "hi"}]}])
    job = setup_job(tmp_path, rows=0, input={"prompt_column": None, "messages_column": "msgs",
                                              "carry_columns": []})
    r = run(job)
    assert r.exit_code == 1
    assert r.stderr.strip() == ("batchgen: error: model model has no chat template, so input.messages_column "
                                "cannot be rendered; use input.prompt_column instead")


@pytest.mark.parametrize("case", ["no-config", "missing-input", "missing-column", "bad-yaml", "bad-engine",
                                  "missing-job"])
def test_user_mistakes_are_one_line_without_traceback(tmp_path, case):
    job = setup_job(tmp_path, rows=3)
    args: list[str] = []
    if case == "no-config":
        (tmp_path / "model" / "config.json").unlink()
        expected = "batchgen: error: cannot load model"
    elif case == "missing-input":
        (tmp_path / "in.jsonl").unlink()
        expected = "batchgen: error: input.paths[0]: no input file matches"
    elif case == "missing-column":
        write_job(job, job_dict(input={"prompt_column": "question"}))
        expected = "batchgen: error: input.prompt_column: column 'question' not found in in.jsonl"
    elif case == "bad-yaml":
        job.write_text("model: {path: model\n")
        expected = "batchgen: error: invalid YAML at line 2"
    elif case == "bad-engine":
        args = ["--engine", "no_such_module:LLM"]
        expected = "batchgen: error: cannot load engine factory 'no_such_module:LLM'"
    else:
        job = tmp_path / "nope.yaml"
        expected = "batchgen: error: job file not found"
    r = cli("run", job, *(args or ["--engine", FAKE]))
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert r.stdout == ""


def test_engine_failure_keeps_finished_rows_and_rerun_completes(tmp_path, monkeypatch):
    job = setup_job(tmp_path, rows=40, output={"rows_per_part": 4}, max_in_flight=4)
    monkeypatch.setenv("FAKE_LLM_FAIL_AFTER", "25")
    r = run(job)
    assert r.exit_code == EXIT_ENGINE
    assert "fake engine failure" in r.stderr and "run the same command again to resume" in r.stderr
    partial = outputs_by_key(tmp_path / "out")
    assert 0 < len(partial) < 80
    monkeypatch.delenv("FAKE_LLM_FAIL_AFTER")
    assert run(job).exit_code == 0
    ref = setup_job(tmp_path / "ref", rows=40)
    assert run(ref).exit_code == 0
    assert outputs_by_key(tmp_path / "out") == outputs_by_key(tmp_path / "ref" / "out")


def test_status_shows_shards_and_missing_rows(tmp_path):
    job = setup_job(tmp_path, rows=30)
    assert run(job, "--shard", "0/2").exit_code == 0
    r = cli("status", tmp_path / "out")
    assert r.exit_code == 0, r.output
    lines = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line[:1].isdigit()}
    owned0 = sum(Shard(0, 2).owns(f"q{i:04d}") for i in range(30))
    assert lines["0/2"][1:] == [str(-(-owned0 // 10)), str(owned0), "0", "0", "done"]
    assert lines["1/2"][2:] == ["0", "0", str(30 - owned0), "not", "started"]
    assert cli("status", tmp_path / "nothing").exit_code == 1


def test_slurm_script(tmp_path):
    job = setup_job(tmp_path, rows=3)
    assert run(job).exit_code == 0 and not (tmp_path / "out" / "_logs").exists()  # as docs/job-file.md says:
    assert re.search(r"`_logs/`\s+\(the array tasks' logs\) once `batchgen slurm` has written", JOB_FILE_GUIDE)
    r = cli("slurm", job, "--array", "8", "--time", "02:00:00", "--gpus", "2", "--partition", "gpu",
            "--max-parallel", "4")
    assert r.exit_code == 0, r.output
    script = (tmp_path / "job.sbatch").read_text()
    for line in ["#SBATCH --array=0-7%4", "#SBATCH --time=02:00:00", "#SBATCH --gpus=2",
                 "#SBATCH --partition=gpu", "#SBATCH --requeue", "#SBATCH --signal=B:TERM@120",
                 f"#SBATCH --output={tmp_path / 'out' / '_logs'}/%x_%A_%a.out",
                 'SHARD="${SLURM_ARRAY_TASK_ID}/8"', "scontrol requeue"]:
        assert line in script, line
    assert "run \"$JOB\" --shard \"$SHARD\"" in script and str(job) in script
    assert (tmp_path / "out" / "_logs").is_dir()
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert cli("slurm", job, "--array", "0").exit_code == 1
    assert cli("slurm", job, "--array", "2", "--time", "soon").exit_code == 1


def test_output_dir_inside_the_input_glob_is_not_input(tmp_path):
    (tmp_path / "data").mkdir()
    write_parquet(tmp_path / "data" / "a.parquet", {"id": ["x", "y"], "prompt": ["p1", "p2"], "topic": [1, 2]})
    job = setup_job(tmp_path, rows=0, input={"paths": ["data/**/*.parquet"]}, output={"dir": "data/out"})
    assert run(job).exit_code == 0
    write_parquet(tmp_path / "data" / "b.parquet", {"id": ["z"], "prompt": ["p3"], "topic": [3]})
    r = run(job)
    assert r.exit_code == 0 and "1 this run" in r.stdout
    assert {k[0] for k in outputs_by_key(tmp_path / "data" / "out")} == {"x", "y", "z"}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_duplicate_ids_first_row_wins_and_reruns_do_nothing(tmp_path, fmt):
    first = [{"id": "a", "prompt": "first a"}, {"id": "b", "prompt": "first b"}, {"id": "a", "prompt": "again a"}]
    second = [{"id": "c", "prompt": "c"}, {"id": "b", "prompt": "again b"}]
    if fmt == "jsonl":
        write_jsonl(tmp_path / "in1.jsonl", first)
        write_jsonl(tmp_path / "in2.jsonl", second)
        where = ["in1.jsonl line 3", "in1.jsonl line 1", "in2.jsonl line 2", "in1.jsonl line 2"]
    else:
        for name, rows in (("in1", first), ("in2", second)):
            write_parquet(tmp_path / f"{name}.{fmt}", pa.Table.from_pylist(rows))
        where = ["in1.parquet row 2", "in1.parquet row 0", "in2.parquet row 1", "in1.parquet row 1"]
    job = setup_job(tmp_path, rows=0, input={"paths": [f"in*.{fmt}"], "carry_columns": []})
    r = run(job)
    assert r.exit_code == 0, r.output
    assert "5 this run (2 errors)" in r.stdout
    out = outputs_by_key(tmp_path / "out")  # each (id, sample) once
    ext, first_line = ("jsonl", 1) if fmt == "jsonl" else ("parquet", 0)  # JSONL ids count lines as messages do
    assert out[(f"in1.{ext}:{2 + first_line}", 0)][1] == (
        f"{where[0]}: field 'id': duplicate id 'a', first at {where[1]}; only that row is generated")
    assert out[(f"in2.{ext}:{1 + first_line}", 0)][1] == (
        f"{where[2]}: field 'id': duplicate id 'b', first at {where[3]}; only that row is generated")
    ref = setup_job(tmp_path / "ref", rows=0, input={"carry_columns": []})
    write_jsonl(tmp_path / "ref" / "in.jsonl", [first[0], first[1], second[0]])
    assert run(ref).exit_code == 0
    assert {k: v for k, v in out.items() if k[0] in "abc"} == outputs_by_key(tmp_path / "ref" / "out")
    r = run(job)
    assert r.exit_code == 0 and "nothing to do" in r.stdout
    r = cli("status", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "warning: 2 input rows repeat the id of an earlier row" in r.stdout
    assert f"  {where[0]}: field 'id': duplicate id 'a', first at {where[1]}" in r.stdout
    total = next(line.split() for line in r.stdout.splitlines() if line.startswith("total"))
    assert total[2:] == ["5", "2", "0"]  # rows done, errors, missing: nothing is left to do


def test_a_duplicate_appended_later_becomes_an_error_row_once(tmp_path):
    job = setup_job(tmp_path, rows=4, input={"carry_columns": []})
    assert run(job).exit_code == 0
    write_jsonl(tmp_path / "in.jsonl", [{"id": "q0001", "prompt": "late copy"}], mode="a")
    r = run(job)
    assert r.exit_code == 0 and "1 this run (1 error)" in r.stdout
    assert outputs_by_key(tmp_path / "out")[("in.jsonl:5", 0)][1].startswith(
        "in.jsonl line 5: field 'id': duplicate id 'q0001', first at in.jsonl line 2")
    assert "nothing to do" in run(job).stdout


def test_an_override_column_missing_from_some_lines_means_null_there(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "none", "prompt": "no mt here"},
        {"id": "three", "prompt": "mt is three", "mt": 1},
        {"id": "null", "prompt": "mt is null", "mt": None},
    ])
    job = setup_job(tmp_path, rows=0, input={"carry_columns": ["topic"]}, sampling={"overrides": {"max_tokens": "mt"}})
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [  # the carried column is on no line: a warning, not an error
        "warning: input.carry_columns[0]: column 'topic' is in none of the first 1000 lines of in.jsonl; "
        "rows without it take null there"]
    r = run(job)
    assert r.exit_code == 0, r.output
    rows = read_rows(tmp_path / "out")
    assert all(row["error"] is None and row["topic"] is None for row in rows)
    assert max(row["num_output_tokens"] for row in rows if row["id"] == "three") == 1
    assert max(row["num_output_tokens"] for row in rows if row["id"] != "three") > 1  # the job's 6


@pytest.mark.parametrize("model, sampling, problem", [
    ({"max_num_seqs": 64, "max_num_batched_tokens": 16}, {},
     "model.max_num_batched_tokens: must be >= max_num_seqs (64) so every running sequence can decode (got 16)"),
    ({"max_num_seqs": 2}, {"n": 4},
     "sampling.n: 4 samples or beams of one request run together and need max_num_seqs >= 4 (it is 2)"),
])
def test_engine_limits_are_refused_by_validate_and_before_any_row(tmp_path, model, sampling, problem):
    job = setup_job(tmp_path, rows=5, model={"path": "model", **model}, sampling=sampling)
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 1 and r.stderr.splitlines()[0] == problem, r.output
    r = run(job)
    assert r.exit_code == 1 and r.stderr.strip() == f"batchgen: error: {problem}"
    assert not (tmp_path / "out").exists()  # nothing was admitted, nothing to skip later


def test_retry_errors_generates_error_rows_again(tmp_path):
    make_model(tmp_path / "model", max_model_len=40)
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"ok{i}", "prompt": "short"} for i in range(5)] +
                [{"id": "long", "prompt": "x" * 100}, {"id": "empty", "prompt": ""}])
    job = setup_job(tmp_path, rows=0, input={"carry_columns": []}, output={"rows_per_part": 3})
    r = run(job)
    assert r.exit_code == 0 and "7 this run (2 errors)" in r.stdout
    make_model(tmp_path / "model", max_model_len=400)  # the fix; the job's configuration is the same
    assert "nothing to do" in run(job).stdout  # error rows count as done...
    before = outputs_by_key(tmp_path / "out")
    r = run(job, "--retry-errors")  # ...until asked to retry them
    assert r.exit_code == 0, r.output
    assert "removed 2 error rows of shard 0/1" in r.stdout and "2 this run (1 error)" in r.stdout
    after = outputs_by_key(tmp_path / "out")  # still each (id, sample) once
    assert after[("long", 0)][1] is None and after[("long", 1)][1] is None
    assert after[("empty", 0)][1] == "in.jsonl line 7: field 'prompt': empty prompt"
    assert {k: v for k, v in after.items() if k[0].startswith("ok")} == {
        k: v for k, v in before.items() if k[0].startswith("ok")}
    metas = {pq.read_schema(p).metadata[b"batchgen.config_hash"] for p in (tmp_path / "out").glob("part-*")}
    assert len(metas) == 1  # rewritten parts keep their metadata
    assert "nothing to do" in run(job).stdout


@pytest.mark.parametrize("where", ["file", "under-a-file", "bucket-object"])
def test_an_output_dir_that_is_a_file_is_refused_by_validate_and_run(tmp_path, where, request):
    (tmp_path / "taken").write_text("not a directory\n")
    out, shown = {"file": ("taken", tmp_path / "taken"), "under-a-file": ("taken/out", tmp_path / "taken")}.get(
        where, (None, None))
    if where == "bucket-object":
        from bucketkit import upload

        bucket = request.getfixturevalue("bucket")
        out = shown = upload(f"{bucket}/taken", b"not a prefix\n")
    job = setup_job(tmp_path, rows=3, output={"dir": str(out)})
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 1, r.output
    problem = r.stderr.splitlines()[0]
    assert problem.startswith(f"output.dir: {shown} is a file") and "must be a directory" in problem, r.output
    r = run(job)
    assert r.exit_code == 1 and r.stderr.splitlines() == [f"batchgen: error: {problem}"], r.output


def test_validate_warnings_are_printed_by_run_at_its_start(tmp_path):
    """A misspelt override column: validate warns, and so does every run, before it starts (a
    cron job's log shows it, a run with nothing to do too), without repeating it at the end."""
    job = setup_job(tmp_path, rows=4, sampling={"overrides": {"max_tokens": "max_tokns"}})
    warning = ("warning: sampling.overrides.max_tokens: column 'max_tokns' is in none of the first 1000 lines "
               "of in.jsonl; rows without it take null there")
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 0 and r.stderr.splitlines() == [warning], r.output
    for _ in range(2):  # the run, then a rerun with nothing to do
        r = run(job)
        assert r.exit_code == 0 and r.stderr.splitlines() == [warning], r.output
        assert "max_tokns" not in r.stdout


@pytest.mark.parametrize("model, context, whose", [
    ({"max_model_len": 48}, None, "model.max_model_len"),
    ({}, 48, "the model's length"),
])
def test_max_tokens_beyond_the_context_is_a_warning_of_validate_and_run(tmp_path, model, context, whose):
    config = {"max_position_embeddings": context, "max_model_len": context} if context else {}
    make_model(tmp_path / "model", **config)  # the fake engine's length is its max_model_len
    job = setup_job(tmp_path, rows=3, model={"path": "model", **model}, sampling={"max_tokens": 100})
    warning = (f"warning: sampling.max_tokens: 100 does not fit in the context of 48 tokens ({whose}); prompt and "
               'output share it, so an output ends where it is full (finish_reason "length")')
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 0 and r.stderr.splitlines() == [warning], r.output
    r = run(job)
    assert r.exit_code == 0 and r.stderr.splitlines() == [warning], r.output
    assert "max_tokens" not in r.stdout  # the engine's own length agrees: said once
    fits = setup_job(tmp_path, rows=3, name="fits.yaml", model={"path": "model", **model}, sampling={"max_tokens": 47},
                     output={"dir": "out2"})
    assert cli("validate", fits, "--engine", FAKE).stderr == ""


def test_max_tokens_beyond_what_the_engine_allows_is_a_run_warning(tmp_path):
    """A model whose length validate cannot read (here: none in config.json): the run tells, from
    the engine's own length."""
    make_model(tmp_path / "model", max_model_len=48)
    job = setup_job(tmp_path, rows=3, sampling={"max_tokens": 100})
    r = run(job)
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert "warning: sampling.max_tokens: 100 does not fit in the context of 48 tokens" in r.stdout
