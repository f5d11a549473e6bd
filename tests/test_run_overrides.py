"""``batchgen run --set FIELD=VALUE``, ``--limit N`` and ``--dry-run`` (issue 56, item 7): overrides are
checked like the job file and saved as the job that ran; a limited run writes its own output dir; a dry
run prints the plan and writes nothing."""

from __future__ import annotations

import yaml
from jobkit import cli, read_rows, run, setup_job

from batchgen.job.outputs.saved import SAVED_YAML


def test_set_changes_the_run_and_the_saved_job(tmp_path):
    job = setup_job(tmp_path, rows=4)
    r = run(job, "--set", "sampling.max_tokens=3", "--set", "sampling.n=1")
    assert r.exit_code == 0, r.output
    rows = read_rows(tmp_path / "out")
    assert len(rows) == 4 and all(len(row["token_ids"]) <= 3 for row in rows)
    saved = (tmp_path / "out" / SAVED_YAML).read_text()
    assert saved.startswith("# job.yaml with --set sampling.max_tokens=3 --set sampling.n=1")
    assert yaml.safe_load(saved)["sampling"] == {"n": 1, "temperature": 0.8, "seed": 7, "max_tokens": 3}
    again = run(job, "--set", "sampling.max_tokens=3", "--set", "sampling.n=1")
    assert again.exit_code == 0 and "has nothing to do" in again.stdout
    plain = run(job)  # the file's own values are another configuration
    assert plain.exit_code == 1
    assert "sampling.max_tokens: 3 -> 6" in plain.stderr and "sampling.n: 1 -> 2" in plain.stderr


def test_a_bad_set_names_the_field_and_the_closest_one(tmp_path):
    job = setup_job(tmp_path, rows=4, model="model")  # ``model: PATH``, short for model.path
    r = run(job, "--set", "sampling.max_token=3", "--set", "modle.dtype=float32", "--set", "sampling.n.x=1",
            "--set", "nothing")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.splitlines() == [
        "batchgen: error: --set sampling.max_token: unknown field (did you mean 'max_tokens'?)",
        "batchgen: error: --set modle.dtype: unknown field 'modle' (did you mean 'model'?)",
        "batchgen: error: --set sampling.n.x: sampling.n is a value, not a section with fields",
        "batchgen: error: --set nothing: expected FIELD=VALUE with a dotted field, e.g. sampling.max_tokens=16"]
    bad_value = run(job, "--set", "sampling.top_p=5", "--set", "model.dtype=float8")
    assert bad_value.exit_code == 1
    assert "sampling.top_p: " in bad_value.stderr and "model.dtype: input should be" in bad_value.stderr
    ok = run(job, "--set", "model.dtype=float32", "--set", "sampling.stop=[x, y]", "--set", "sampling.seed=null")
    assert ok.exit_code == 0, ok.output
    saved = yaml.safe_load((tmp_path / "out" / SAVED_YAML).read_text())
    assert saved["model"] == {"path": "model", "dtype": "float32"}
    assert saved["sampling"]["stop"] == ["x", "y"] and saved["sampling"]["seed"] is None


def test_limit_runs_the_first_rows_into_a_dir_of_its_own(tmp_path):
    job = setup_job(tmp_path, rows=30, output={"dir": "out", "format": "jsonl", "merge_to": "all.jsonl"})
    r = run(job, "--limit", "5")
    assert r.exit_code == 0, r.output
    trial = tmp_path / "out.limit-5"
    assert f"--limit 5: the first 5 rows of shard 0/1 only, written to {trial}" in r.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "all.jsonl").exists()
    merged = [yaml.safe_load(line)["id"] for line in (tmp_path / "all.limit-5.jsonl").read_text().splitlines()]
    assert merged == [f"q{i:04d}" for i in range(5) for _ in range(2)]  # two samples each
    again = run(job, "--limit", "5")
    assert again.exit_code == 0 and "has nothing to do: all 5 rows found are done" in again.stdout
    assert run(job).exit_code == 0  # the real run starts from nothing
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == 60


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    job = setup_job(tmp_path, rows=30)
    r = run(job, "--dry-run", "--set", "sampling.max_tokens=16")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == f"dry run: nothing is generated or written; shard 0/1 of {job}"
    assert f"  output       {tmp_path / 'out'}" in lines
    assert any(line.startswith("  rows         ") and "30 rows in the input, 0 done before" in line for line in lines)
    assert "  outputs      2 samples a row, up to 16 tokens each; at most 960 tokens in all" in lines
    assert not (tmp_path / "out").exists()
    limited = run(job, "--dry-run", "--limit", "3")
    assert limited.exit_code == 0
    assert "  rows         3 rows in the input, 0 done before, 3 to do" in limited.stdout.splitlines()
    assert not (tmp_path / "out.limit-3").exists()


def test_dry_run_counts_tokens_with_the_tokenizer_and_sizes_the_kv_cache(tmp_path, tiny_model_dirs):
    job = setup_job(tmp_path, rows=5, model={"path": str(tiny_model_dirs["llama"]), "max_num_seqs": 4},
                    input={"paths": ["in.jsonl"], "id_column": "id", "prompt_column": "id", "carry_columns": []})
    (tmp_path / "in.jsonl").write_text("".join(f'{{"id": "q{i}", "prompt": "p"}}\n' for i in range(4)) +
                                       '{"id": "q9", "prompt": "p"}\n{"prompt": "no id"}\n')
    r = cli("run", job, "--dry-run")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "(the first 5 rows, counted with the model's tokenizer)" in out
    assert "row errors   1 of the first 6 rows would be error rows; the first: in.jsonl" in out
    assert "field 'id': missing id" in out
    assert "  KV cache     " in out and "a full step (4 sequences of up to" in out
    assert not (tmp_path / "out").exists()


def _with_bad_rows(tmp_path, **job):
    """A job of 10 rows, 2 of them with an empty prompt (error rows)."""
    path = setup_job(tmp_path, rows=0, **job)
    (tmp_path / "in.jsonl").write_text("".join(
        f'{{"id": "q{i}", "prompt": "{"" if i in (3, 7) else f"question {i}"}", "topic": 1}}\n' for i in range(10)))
    return path


def test_max_error_rate_fails_a_run_with_too_many_error_rows(tmp_path):
    job = _with_bad_rows(tmp_path)
    r = run(job, "--max-error-rate", "0.1")
    assert r.exit_code == 65, r.output
    assert r.stderr.splitlines() == [
        "batchgen: error: 2 of the 10 rows of shard 0/1 are errors (20.0%), more than the 10% allowed "
        "(--max-error-rate or output.max_error_rate); the rows are saved, each with its error column"]
    assert len({row["id"] for row in read_rows(tmp_path / "out")}) == 10
    assert run(job, "--max-error-rate", "0.1").exit_code == 65  # nothing to do, still too many errors
    assert run(job, "--max-error-rate", "0.2").exit_code == 0  # at most the share allowed
    assert run(job).exit_code == 0  # opt-in: no threshold, no failure
    assert run(job, "--max-error-rate", "1.5").exit_code == 2


def test_output_max_error_rate_in_the_job_file(tmp_path):
    job = _with_bad_rows(tmp_path, output={"max_error_rate": 0.05})
    r = run(job)
    assert r.exit_code == 65 and "more than the 5% allowed" in r.stderr
    assert run(job, "--max-error-rate", "0.5").exit_code == 0  # the command line wins
    bad = run(_with_bad_rows(tmp_path / "bad", output={"max_error_rate": 2}))
    assert bad.exit_code == 1 and "output.max_error_rate: input should be less than or equal to 1" in bad.stderr
