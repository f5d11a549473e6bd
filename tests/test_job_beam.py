"""Beam search in job files: validation of what does not apply, one row per returned beam with its
cumulative logprob and score, resume after a kill, shards, per-row errors, OpenAI batch bodies."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from jobkit import FAKE, batchgen_cmd, cli, job_dict, read_rows, setup_job, write_job, write_jsonl
from test_job_real_engine import _env

from batchgen import LLM, BeamSearchParams
from batchgen.job.params import ParamsBuilder, RowParamsError
from batchgen.job.spec import SamplingSpec

BEAMS = {"beam_width": 3, "max_tokens": 8, "length_penalty": 0.5}


def _problems(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(("sampling", "message"), [
    ({"beam_width": 2, "temperature": 0.7}, "sampling.temperature: does not apply to beam search"),
    ({"beam_width": 2, "top_p": 0.9}, "sampling.top_p: does not apply to beam search"),
    ({"beam_width": 2, "n": 2}, "sampling.n: does not apply to beam search"),
    ({"beam_width": 2, "logprobs": 1}, "sampling.logprobs: does not apply to beam search"),
    ({"beam_width": 2, "overrides": {"temperature": "topic"}}, "sampling.overrides.temperature: does not apply"),
    ({"beam_width": 2, "max_tokens": None}, "sampling.max_tokens: a beam search needs max_tokens"),
    ({"length_penalty": 2.0}, "sampling.length_penalty: applies to beam search only"),
    ({"beam_width": 0}, "sampling.beam_width: input should be greater than 0"),
    ({"beam_width": 300}, "sampling.beam_width: 300 samples or beams of one request run together"),
])
def test_validate_refuses_what_a_beam_search_cannot_use(tmp_path, sampling, message):
    job = setup_job(tmp_path)
    base = job_dict()
    base["sampling"] = {"max_tokens": 6, **sampling}
    r = cli("validate", write_job(job, base), "--engine", FAKE)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert any(line.startswith(message) for line in _problems(r)), _problems(r)


def test_a_beam_job_validates_and_its_rows_get_beam_search_params(tmp_path):
    base = job_dict()
    base["sampling"] = {"seed": 3, "temperature": 0, **BEAMS, "overrides": {"max_tokens": "budget"}}
    r = cli("validate", write_job(setup_job(tmp_path), base), "--engine", FAKE)
    assert r.exit_code == 0, r.output
    builder = ParamsBuilder(SamplingSpec.model_validate(base["sampling"]))
    params = builder.for_row("q1", {"max_tokens": 5})
    assert params == BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.5)
    with pytest.raises(RowParamsError, match=r"field 'body.temperature': does not apply to beam search"):
        builder.for_row("q1", {"temperature": 0.9}, {"temperature": "body.temperature"})


def _beam_job(root, model_dir, rows: int = 16, **sampling):
    root.mkdir(parents=True, exist_ok=True)
    records = [{"id": f"r{i:02d}", "prompt": f"tell me about number {i}"} for i in range(rows)]
    records.append({"id": "too-long", "prompt": "the quick brown fox " * 100})
    write_jsonl(root / "in.jsonl", records)
    job = job_dict(
        model={"path": str(model_dir), "dtype": "float32", "kv_cache_memory": "32MiB", "max_model_len": 128},
        input={"carry_columns": []},
        max_in_flight=4,
    )
    job["output"] = {"dir": "out", "rows_per_part": 3}  # default fields, plus cumulative_logprob and score
    job["sampling"] = {**BEAMS, **sampling}
    return write_job(root / "job.yaml", job)


def _by_key(out_dir) -> dict[tuple[str, int], dict]:
    rows = read_rows(out_dir)
    keyed = {(r["id"], r["sample_index"]): r for r in rows}
    assert len(keyed) == len(rows), "a (row, beam) written twice"
    return keyed


def test_beam_job_rows_match_the_api_and_survive_a_kill_and_shards(tmp_path, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    whole = _beam_job(tmp_path / "whole", model)
    r = cli("run", whole)
    assert r.exit_code == 0, r.output
    rows = _by_key(tmp_path / "whole" / "out")
    assert rows[("too-long", 0)]["error"] and "max_model_len" in rows[("too-long", 0)]["error"]
    llm = LLM(model, dtype="float32")
    api = llm.beam_search([f"tell me about number {i}" for i in range(16)],
                          BeamSearchParams(**BEAMS), use_tqdm=False)
    for i, out in enumerate(api):
        for rank, beam in enumerate(out.sequences):
            row = rows[(f"r{i:02d}", rank)]
            assert row["error"] is None and row["num_samples"] == 3
            assert (row["text"], row["num_output_tokens"]) == (beam.text, len(beam.output_token_ids))
            assert row["cumulative_logprob"] == pytest.approx(beam.cum_logprob)
            assert row["score"] == pytest.approx(beam.score)
        scores = [rows[(f"r{i:02d}", rank)]["score"] for rank in range(3)]
        assert scores == sorted(scores, reverse=True)

    # SIGKILL once a part is written, then resume: each (row, beam) once, the same beams.
    killed = _beam_job(tmp_path / "killed", model)
    proc = subprocess.Popen(batchgen_cmd("run", killed), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list((tmp_path / "killed" / "out").glob("part-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert subprocess.run(batchgen_cmd("run", killed), env=_env(), capture_output=True).returncode == 0
    resumed = _by_key(tmp_path / "killed" / "out")
    assert {k: (v["text"], v["score"]) for k, v in resumed.items()} == {k: (v["text"], v["score"])
                                                                        for k, v in rows.items()}

    # Two shards add up to the whole.
    sharded = _beam_job(tmp_path / "sharded", model)
    for shard in ("0/2", "1/2"):
        r = cli("run", sharded, "--shard", shard)
        assert r.exit_code == 0, r.output
    assert {k: v["text"] for k, v in _by_key(tmp_path / "sharded" / "out").items()} == {
        k: v["text"] for k, v in rows.items()}
