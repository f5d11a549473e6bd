"""Job file validation (`batchgen validate`), shard resolution, config hash, stable hashes."""

from __future__ import annotations

import pytest
from jobkit import FAKE, cli, job_dict, setup_job, write_job

from batchgen.job.errors import JobError
from batchgen.job.shard import Shard, resolve_shard, row_seed, shard_of
from batchgen.job.spec import load_job


def _problems(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_validate_ok(tmp_path):
    job = setup_job(tmp_path)
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "ok"


def test_validate_lists_every_problem_by_path(tmp_path):
    setup_job(tmp_path)
    job = job_dict(
        model={"path": "no-such-model", "block_size": 12},
        input={"prompt_column": "text"},
        sampling={"top_p": 1.5, "temperature": -1, "min_tokens": 50, "max_tokens": 10, "top_pp": 0.5},
        output={"rows_per_part": 0},
        shard="3/2",
        colour="blue",
    )
    r = cli("validate", write_job(tmp_path / "bad.yaml", job))
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    lines = _problems(r)
    expected = [
        "sampling.top_p: must be in (0, 1]",
        "sampling.temperature: must be >= 0",
        "sampling.min_tokens: must be <= max_tokens (10)",
        "sampling.top_pp: unknown field (did you mean 'top_p'?)",
        "output.rows_per_part: input should be greater than 0",
        "model.path: no model directory at",
        "model.block_size: ",
        "shard: index must be < count (2)",
        "colour: unknown field",
        "input.prompt_column: column 'text' not found in in.jsonl",
    ]
    for prefix in expected:
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    assert lines[-1] == f"{len(lines) - 1} problems in {tmp_path / 'bad.yaml'}"


def test_validate_input_problems(tmp_path):
    setup_job(tmp_path)
    job = job_dict(input={"paths": ["in.jsonl", "missing/*.jsonl", "notes.txt"]},
                   sampling={"overrides": {"max_tokens": "mt", "max_tokenz": "x"}})
    (tmp_path / "notes.txt").write_text("hi\n")
    r = cli("validate", write_job(tmp_path / "job2.yaml", job), "--engine", FAKE)
    lines = _problems(r)
    assert r.exit_code == 1
    assert any(line.startswith("input.paths[1]: no input file matches") for line in lines), lines
    assert any(line.startswith("input.paths[2]: cannot tell the format of 'notes.txt'; set input.format")
               for line in lines), lines
    hint = "sampling.overrides.max_tokenz: not a sampling field (did you mean 'max_tokens'?)"
    assert any(line.startswith(hint) for line in lines), lines


def test_validate_both_or_no_prompt_source_and_logprobs(tmp_path):
    setup_job(tmp_path)
    job = job_dict(input={"messages_column": "msgs"}, output={"fields": ["text", "logprobs", "bogus"]})
    r = cli("validate", write_job(tmp_path / "j.yaml", job))
    lines = _problems(r)
    assert any(line.startswith("input: set exactly one of prompt_column") for line in lines), lines
    assert any(line.startswith("output.fields[2]: input should be") for line in lines), lines
    job = job_dict(output={"fields": ["text", "logprobs"]})
    lines = _problems(cli("validate", write_job(tmp_path / "j.yaml", job)))
    assert any(line.startswith("output.fields: 'logprobs' needs sampling.logprobs") for line in lines), lines


@pytest.mark.parametrize("text, expected", [
    ("model: [unclosed\n", "invalid YAML at line"),
    ("", "the job file is empty"),
    ("- a\n- b\n", "the job file must be a mapping"),
])
def test_validate_bad_yaml(tmp_path, text, expected):
    (tmp_path / "job.yaml").write_text(text)
    r = cli("validate", tmp_path / "job.yaml")
    assert r.exit_code == 1
    assert _problems(r)[0].startswith(expected)
    assert "Traceback" not in r.output


def test_validate_missing_job_file(tmp_path):
    r = cli("validate", tmp_path / "nope.yaml")
    assert r.exit_code == 1
    assert _problems(r) == [f"batchgen: error: job file not found: {tmp_path / 'nope.yaml'}"]


def test_relative_paths_resolve_against_job_dir(tmp_path):
    sub = tmp_path / "jobs"
    sub.mkdir()
    job = write_job(sub / "job.yaml", job_dict(model="../m", output={"dir": "/abs/out"}))
    spec = load_job(job)
    assert spec.model_path == (sub / "../m")
    assert spec.spec.model.path == "../m"
    assert str(spec.output_dir) == "/abs/out"


def test_config_hash_covers_only_what_changes_outputs(tmp_path):
    base = load_job(write_job(tmp_path / "a.yaml", job_dict())).config_hash
    same = job_dict(model={"path": "model", "max_num_seqs": 8, "kv_cache_memory": "1GiB"},
                    input={"paths": ["in.jsonl", "more/*.jsonl"]}, output={"rows_per_part": 3},
                    shard="1/4", max_in_flight=5, progress_interval=1)
    assert load_job(write_job(tmp_path / "b.yaml", same)).config_hash == base
    for change in ({"sampling": {"temperature": 0.5}}, {"model": {"dtype": "float16"}},
                   {"input": {"carry_columns": []}}, {"output": {"fields": ["text"]}}):
        assert load_job(write_job(tmp_path / "c.yaml", job_dict(**change))).config_hash != base, change


def test_resolve_shard_precedence():
    env = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert resolve_shard(None, None, None, env) == Shard(2, 4)
    assert resolve_shard("0/2", None, None, env) == Shard(0, 2)  # --shard wins
    assert resolve_shard(None, 1, 3, env) == Shard(1, 3)  # job file before Slurm
    assert resolve_shard(None, None, 4, env) == Shard(2, 4)  # count from file, index from Slurm
    assert resolve_shard(None, None, None, {}) == Shard(0, 1)
    with pytest.raises(JobError, match="Slurm array has 4 tasks"):
        resolve_shard(None, None, 5, env)
    with pytest.raises(JobError, match="does not map to a shard"):
        resolve_shard(None, None, None, {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "4"})
    with pytest.raises(JobError, match="--shard must look like"):
        resolve_shard("2-4", None, None, {})
    with pytest.raises(JobError, match="need 0 <= index < count"):
        resolve_shard("4/4", None, None, {})


def test_stable_hashes_are_pinned():
    """Shard assignment and per-row seeds must never change: existing outputs depend on them."""
    assert [shard_of(f"row{i}", 7) for i in range(8)] == [shard_of(f"row{i}", 7) for i in range(8)]
    assert shard_of("row0", 1) == 0
    assert (shard_of("q0001", 3), shard_of("q0002", 3), shard_of("hello", 1000)) == PINNED_SHARDS
    assert row_seed(7, "q0001") == PINNED_SEED


PINNED_SHARDS = (0, 1, 723)
PINNED_SEED = 2376650936749506821


def test_prompt_logprobs_and_their_column_come_together(tmp_path):
    """Nothing computed and dropped, no column that nothing fills: each mismatch is one line."""
    from jobkit import job_dict

    from batchgen.job.spec import spec_problems

    explicit = ["text", "finish_reason"]
    for sampling, output, expected in (
            ({"prompt_logprobs": 2}, {"fields": explicit}, ["output.fields: add 'prompt_logprobs'"]),
            ({"overrides": {"prompt_logprobs": "pl"}}, {"fields": explicit}, ["output.fields: add 'prompt_logprobs'"]),
            ({}, {"fields": [*explicit, "prompt_logprobs"]}, ["output.fields: 'prompt_logprobs' needs sampling."]),
            ({"prompt_logprobs": 2}, {"fields": [*explicit, "prompt_logprobs"]}, []),
            ({"prompt_logprobs": 2, "beam_width": 2}, {"fields": [*explicit, "prompt_logprobs"]},
             ["sampling.prompt_logprobs: does not apply to beam search"]),
            ({"prompt_logprobs": 2}, {"format": "openai_batch", "fields": None},
             ["sampling.prompt_logprobs: the OpenAI batch shape has no place"])):
        job = job_dict(output=output)
        job["sampling"] = {"max_tokens": 4, **sampling}
        if output.get("fields") is None:
            del job["output"]["fields"], job["input"]["carry_columns"]
        found = [str(p) for p in spec_problems(job)]
        assert len(found) == len(expected), found
        assert all(f.startswith(e) for f, e in zip(found, expected, strict=True)), found
    # Without output.fields the column comes with sampling.prompt_logprobs.
    job = job_dict(sampling={"prompt_logprobs": 0})
    del job["output"]["fields"]
    assert "prompt_logprobs" in load_job(write_job(tmp_path / "j.yaml", job)).spec.output.fields
