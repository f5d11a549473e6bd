"""The README's and the docs/ guides' commands, run as written in a fresh directory.

Blocks marked `<!-- readme-test: KIND [ARG] -->` are taken from README.md and docs/*.md as they
are: the first job's files and commands, the job-file reference, the recipes (cron, a Slurm array
run here task by task, a resume after SIGTERM, pandas), the Python API, OpenAI batch files,
structured outputs, beam search and buckets. Every fenced block of every page carries a marker: one
of the kinds a test here runs, `job-example` (a job file checked by tests/test_docs.py), or
`skip REASON`, so no example goes unchecked by accident. HOME is a temp dir whose
`~/.cache/batchgen/models/SmolLM2-135M-Instruct` is a tiny random Llama with a chat template, so
the README's own model path works offline; `batchgen` is this venv's command.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jobkit import REPO, cli, outputs_by_key, read_rows

from batchgen.cli import GUIDES
from batchgen.job import errors
from batchgen.job.run.lock import ShardLock
from batchgen.job.shard import Shard
from batchgen.job.spec import InputSpec, JobSpec, ModelSpec, OutputSpec, parse_yaml, spec_problems

README = (REPO / "README.md").read_text(encoding="utf-8")
PAGES = {path.relative_to(REPO).as_posix(): path.read_text(encoding="utf-8")
         for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
ALL = "\n".join(PAGES.values())
BLOCK = re.compile(r"<!-- readme-test: (?P<kind>[\w-]+)(?: (?P<arg>\S+))? -->\n```\w*\n(?P<body>.*?)```", re.S)
FIRST_IDS = {"q1", "q2", "q3", "q4"}


def blocks(kind: str, arg: str | None = None) -> list[str]:
    found = [m["body"] for m in BLOCK.finditer(ALL) if m["kind"] == kind and (arg is None or m["arg"] == arg)]
    assert found, f"no page has a block marked readme-test: {kind} {arg or ''}"
    return found


def block(kind: str, arg: str | None = None) -> str:
    (body,) = blocks(kind, arg)
    return body


def commands(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def make_home(root: Path, model_dir: Path) -> Path:
    """A HOME with the README's model path and the first job's files in ~/first-job."""
    home = root / "home"
    model = home / ".cache" / "batchgen" / "models" / "SmolLM2-135M-Instruct"
    model.parent.mkdir(parents=True)
    model.symlink_to(model_dir, target_is_directory=True)
    job_dir = home / "first-job"
    job_dir.mkdir()
    for m in BLOCK.finditer(ALL):
        if m["kind"] == "file":
            (job_dir / m["arg"]).parent.mkdir(parents=True, exist_ok=True)  # tasks/capitals.yaml
            (job_dir / m["arg"]).write_text(m["body"], encoding="utf-8")
    return home


@pytest.fixture
def home(tmp_path, tiny_model_dirs) -> Path:
    return make_home(tmp_path, tiny_model_dirs["llama"])


def env(home: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("BATCHGEN_ENGINE", "PYTHONPATH")}
    out.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return out


def bash(script: str, home: Path, cwd: Path | None = None, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail\n{script}"], cwd=cwd or home / "first-job",
                          env={**env(home), **extra}, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dirs) -> dict:
    """The first job's output from one uninterrupted, unsharded run."""
    home = make_home(tmp_path_factory.mktemp("reference"), tiny_model_dirs["llama"])
    proc = bash("batchgen run job.yaml", home)
    assert proc.returncode == 0, proc.stderr
    return outputs_by_key(home / "first-job" / "out" / "first")


def test_setup_commands_come_first():
    first = re.search(r"```\w*\n(.*?)```", README, re.S)[1]
    assert [line.split("#")[0].strip() for line in first.splitlines()] == [
        "bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_first_job(home, reference):
    proc = bash(block("run"), home)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "ok"
    assert "has nothing to do: all 4 rows found are done" in proc.stdout
    assert re.search(r"^total\s+1\s+4\s+0\s+0$", proc.stdout, re.M), proc.stdout
    out = outputs_by_key(home / "first-job" / "out" / "first")
    assert out == reference and {i for i, _ in out} == FIRST_IDS
    assert all(error is None and text for text, error in out.values())
    columns = set(read_rows(home / "first-job" / "out" / "first")[0])
    listed = re.search(r"Each output row is one \(id, sample\): (.*?)\. Add", README, re.S)[1]
    assert columns == set(re.findall(r"`(\w+)`", listed)), listed  # the README lists every column, and only those


def test_job_file_reference_is_complete_and_valid():
    text = block("job-reference")
    assert spec_problems(parse_yaml(text)) == []
    for section in (ModelSpec, InputSpec, OutputSpec, JobSpec):
        for name in section.model_fields:
            assert re.search(rf"^\s*#?\s*{name}:", text, re.M), f"{section.__name__}.{name} is not in the README"


def test_commands_and_exit_codes_are_all_listed():
    cli_doc = PAGES["docs/cli.md"]
    readme_row = next(line for line in PAGES["README.md"].splitlines() if line.startswith("| [The command line]"))
    assert len(GUIDES) >= 9  # every command registers its guide there
    for command in GUIDES:
        assert f"| `batchgen {command} " in cli_doc, command
        assert f"`{command}`" in readme_row, command
    for command in ("run", "run-batch", "merge", "ray", "validate"):
        command_help = cli(command, "--help").stdout
        for option in sorted(set(re.findall(r"(--[a-z][a-z-]+)", command_help)) - {"--help"}):
            assert option in ALL, f"{command} {option}"
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert codes == {int(c) for c in re.findall(r"^\| (\d+) \|", cli_doc, re.M)}


def test_cron_recipe(home, reference):
    (line,) = commands(block("crontab"))
    command = line.split(None, 5)[5]  # after minute, hour, day, month, weekday
    job_dir = home / "first-job"
    proc = bash(command, home, cwd=home)  # cron starts in HOME
    assert proc.returncode == 0, proc.stderr
    assert outputs_by_key(job_dir / "out" / "first") == reference
    with open(job_dir / "prompts.jsonl", "a") as f:
        f.write('{"id": "q5", "messages": [{"role": "user", "content": "Name a colour."}]}\n')
    with ShardLock(job_dir / "out" / "first", Shard()):  # the last run is still busy
        proc = bash(command, home, cwd=home)
    assert proc.returncode == 0, proc.stderr
    assert "another batchgen run is already working on shard 0/1" in (job_dir / "cron.log").read_text()
    assert "q5" not in {i for i, _ in outputs_by_key(job_dir / "out" / "first")}
    proc = bash(command, home, cwd=home)
    assert proc.returncode == 0, proc.stderr
    out = outputs_by_key(job_dir / "out" / "first")
    assert {i for i, _ in out} == FIRST_IDS | {"q5"} and all(error is None for _, error in out.values())


def test_slurm_recipe_run_here_task_by_task(home, reference):
    """`sbatch X` is the one line not run as written: each array task runs X here instead."""
    job_dir = home / "first-job"
    for line in commands(block("slurm")):
        if line.startswith("sbatch "):
            script = job_dir / shlex.split(line)[1]
            tasks = int(re.search(r"^#SBATCH --array=0-(\d+)$", script.read_text(), re.M)[1]) + 1
            for task in range(tasks):
                proc = bash(f"bash {script.name}", home, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_JOB_ID="7")
                assert proc.returncode == 0, proc.stderr
                assert f"batchgen shard {task}/{tasks} on" in proc.stdout
            continue
        proc = bash(line, home)
        assert proc.returncode == 0, proc.stderr
    assert tasks == 4
    assert all(re.search(rf"^{i}/4 .* done$", proc.stdout, re.M) for i in range(4)), proc.stdout
    assert outputs_by_key(job_dir / "out" / "first") == reference


def test_resume_after_preemption_recipe(home, reference):
    first, *rest = commands(block("preempted"))
    job_dir = home / "first-job"
    for _ in range(3):  # the tiny model can finish all rows before a busy machine delivers the signal
        proc = subprocess.Popen(shlex.split(first, comments=True), cwd=job_dir, env=env(home),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for line in proc.stdout:  # the engine is up and the run has begun
                if "rows done before" in line:
                    break
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGTERM)  # the second drops the requests in flight
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        if len(outputs_by_key(job_dir / "out" / "first")) < len(reference):
            break
        shutil.rmtree(job_dir / "out" / "first")
    assert proc.returncode == errors.EXIT_INTERRUPTED, (stdout, stderr)
    assert "run the same command again to resume" in stderr
    assert len(outputs_by_key(job_dir / "out" / "first")) < len(reference)
    after = bash("\n".join(rest), home)
    assert after.returncode == 0, after.stderr
    assert outputs_by_key(job_dir / "out" / "first") == reference
    assert re.search(r"^total\s+\d+\s+4\s+0\s+0$", after.stdout, re.M), after.stdout


def test_python_api_example(home):
    proc = bash(f"{shlex.quote(sys.executable)} - <<'PY'\n{block('python', 'api')}PY", home)
    assert proc.returncode == 0, proc.stderr
    first, samples = proc.stdout.splitlines()[-2:]
    assert first.strip() and len(eval(samples)) == 4  # one text per sample of the chat


def test_lora_guide_makes_the_adapters_its_examples_name(home):
    """docs/lora.md's adapters are made by its own snippet, where its examples look for them."""
    pytest.importorskip("peft")
    from batchgen.lora.checkpoint import read_config
    from batchgen.lora.request import LoRARequest

    proc = bash(f"{shlex.quote(sys.executable)} - <<'PY'\n{block('python', 'lora-make')}PY", home)
    assert proc.returncode == 0, proc.stderr
    for name in ("sql-lora", "chat-lora"):
        assert f"~/adapters/{name}" in PAGES["docs/lora.md"]
        read_config(LoRARequest(name, 1, str(home / "adapters" / name)))  # a PEFT adapter batchgen takes


def test_no_page_or_message_sends_a_clone_to_a_package_index():
    """batchgen is installed from its clone: an extra is `pip install -e '.[s3]'` there, never
    `pip install 'batchgen[s3]'`; `aws s3 cp` to another store needs --endpoint-url."""
    from batchgen.extras import install_hint

    sources = [*PAGES.values(), *(p.read_text(encoding="utf-8") for p in (REPO / "batchgen").rglob("*.py"))]
    assert not any("install 'batchgen[" in text for text in sources)
    assert install_hint("s3", "s3fs") == "pip install 's3fs>=2025.7' (in a clone of batchgen: pip install -e '.[s3]')"
    assert "aws s3 cp --endpoint-url" in PAGES["docs/buckets.md"]


def test_pandas_recipe(home):
    pytest.importorskip("pandas")
    script = f"batchgen run job.yaml >/dev/null\n{shlex.quote(sys.executable)} - <<'PY'\n{block('python', 'pandas')}PY"
    proc = bash(script, home)
    assert proc.returncode == 0, proc.stderr
    assert all(i in proc.stdout for i in FIRST_IDS)


def test_run_batch_example(home):
    """The OpenAI batch example, on the README's example request file: every line is a response
    the openai package reads, in the request file's order."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    work = home / "repo"
    (work / "configs").mkdir(parents=True)
    requests = (REPO / "configs" / "batch_requests.jsonl").read_text()
    (work / "configs" / "batch_requests.jsonl").write_text(requests)
    proc = bash(block("run-batch"), home, cwd=work)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (work / "out" / "batch" / "results.jsonl").read_text().splitlines()]
    wanted = [json.loads(x) for x in requests.splitlines()]
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in wanted]
    for line, req in zip(lines, wanted, strict=True):
        kind = ChatCompletion if req["url"] == "/v1/chat/completions" else Completion
        body = kind.model_validate(line["response"]["body"])
        assert len(body.choices) == req["body"].get("n", 1)
        assert body.model == "SmolLM2-135M-Instruct"  # the name given, not where a symlink leads


def test_beam_search_examples(home):
    proc = bash(f"{shlex.quote(sys.executable)} - <<'PY'\n{block('python', 'beam')}PY", home)
    assert proc.returncode == 0, proc.stderr
    scores = [float(line.split()[0]) for line in proc.stdout.splitlines()[-4:]]
    assert scores == sorted(scores, reverse=True)  # best first
    proc = bash(block("beam"), home)
    assert proc.returncode == 0, proc.stderr
    rows = read_rows(home / "first-job" / "out" / "beams")
    assert sorted((r["id"], r["sample_index"]) for r in rows) == [(i, k) for i in sorted(FIRST_IDS) for k in range(4)]
    for row_id in FIRST_IDS:
        beams = sorted((r for r in rows if r["id"] == row_id), key=lambda r: r["sample_index"])
        assert [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
        assert all(b["error"] is None and b["cumulative_logprob"] < 0 for b in beams)


def test_bucket_guide_examples(home, s3_server, bucket):
    """docs/buckets.md against the S3 test server (its bucket stands in for `s3://my-bucket`): the
    job runs from and to the bucket, a rerun has nothing to do, status reads the bucket, and the
    pandas snippet reads the output back."""
    from bucketkit import bucket_outputs, upload

    job_dir = home / "first-job"
    job_file = job_dir / "s3-job.yaml"
    job_file.write_text(job_file.read_text().replace("s3://my-bucket", bucket))
    upload(f"{bucket}/prompts/prompts.jsonl", job_dir / "prompts.jsonl")
    proc = bash(block("bucket").replace("s3://my-bucket", bucket), home, **s3_server.env())
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout
    assert re.search(r"^total\s+1\s+4\s+0\s+0$", proc.stdout, re.M), proc.stdout
    out = bucket_outputs(f"{bucket}/runs/first")
    assert {i for i, _ in out} == FIRST_IDS and all(error is None and text for text, error in out.values())
    snippet = block("python", "s3-read").replace("s3://my-bucket", bucket)
    proc = bash(f"{shlex.quote(sys.executable)} - <<'PY'\n{snippet}PY", home, **s3_server.env())
    assert proc.returncode == 0, proc.stderr
    assert all(i in proc.stdout for i in FIRST_IDS), proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_data_stage_example(home, s3_server, bucket):
    """docs/ray.md's Ray Data stage as written, against the S3 test server, with what this machine
    lacks substituted: the test bucket, the tiny model, no GPU and one actor on 2 cores."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from bucketkit import upload

    prompts = ["the quick brown fox", "a batch of prompts", "hello world", "paged attention"]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"prompt": prompts}), sink)
    upload(f"{bucket}/prompts/part-0.parquet", sink.getvalue().to_pybytes())
    model = home / ".cache" / "batchgen" / "models" / "SmolLM2-135M-Instruct"
    snippet = block("python", "ray-data")
    for old, new in (("s3://bucket", bucket), ("/models/SmolLM2-135M-Instruct", str(model)),
                     ("max_tokens=256", "max_tokens=8"), ("concurrency=4", "concurrency=1"),
                     ("num_gpus=1", "num_gpus=0")):
        assert old in snippet, old
        snippet = snippet.replace(old, new)
    proc = bash(f"{shlex.quote(sys.executable)} - <<'PY'\n{snippet}PY", home, **s3_server.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint, access_key=s3_server.env()["AWS_ACCESS_KEY_ID"],
                           secret_key=s3_server.env()["AWS_SECRET_ACCESS_KEY"], region="us-east-1")
    rows = pq.read_table(f"{bucket.removeprefix('s3://')}/generated/", filesystem=fs).to_pylist()
    assert sorted(r["prompt"] for r in rows) == sorted(prompts)
    assert all(r["error"] is None and r["text"] and r["finish_reason"] for r in rows), rows


MARKER = re.compile(r"^<!-- readme-test: (?P<kind>[\w-]+)(?: (?P<rest>.*?))? -->$")
RUN_HERE = {("setup", None), ("run", None), ("job-reference", None), ("crontab", None), ("slurm", None),
            ("preempted", None), ("python", "pandas"), ("python", "api"), ("run-batch", None),
            ("structured", None), ("python", "beam"), ("beam", None), ("bucket", None), ("python", "s3-read"),
            # docs/scoring-embeddings.md, run by tests/test_scoring_docs.py
            ("python", "prompt-logprobs"), ("python", "score"), ("python", "embed"), ("python", "classify"),
            ("python", "mixed"), ("task-data", "answers.jsonl"), ("task-data", "texts.jsonl"),
            ("task-data", "embed_requests.jsonl"), ("task-job", "score"), ("task-job", "embed"),
            ("task-job", "classify"), ("run-batch-embeddings", None), ("python", "ray-data"),
            ("python", "lora"),  # docs/lora.md, run by tests/test_lora.py and tests/test_lora_jobs.py
            ("lora-job", None), ("lora-run-batch", None), ("python", "lora-readme"), ("python", "lora-make"),
            ("python", "int8"),  # docs/int8.md, run by tests/test_int8_engine.py
            ("python", "int8-checkpoint"),  # docs/int8.md, run by tests/test_int8_checkpoint.py
            ("python", "gpt-oss"),  # docs/models.md, run by tests/test_moe.py
            ("eval", None), ("python", "lm-eval"),  # docs/evaluation.md, run by tests/test_lm_eval.py
            ("python", "vision"), ("python", "vision-chat"),  # docs/vision.md, run by tests/test_vision_api_docs.py
            ("vision-job", "caption"), ("vision-job", "questions"), ("vision-data", "questions.jsonl"),
            ("vision-data", "requests.jsonl"), ("vision-run-batch", None)}  # and by tests/test_vision_job_docs.py


def test_every_fenced_block_is_run_checked_or_excluded_by_name():
    """A fenced block without a marker, or with one that no test runs, fails here; so does a
    marker that does not sit right above a fence (a block that would be dropped silently)."""
    seen = set()
    for name, text in PAGES.items():
        lines = text.split("\n")
        inside = False
        for i, line in enumerate(lines):
            marker = MARKER.match(line)
            if marker and not inside:
                fence_next = i + 1 < len(lines) and lines[i + 1].startswith("```")
                assert fence_next, f"{name}:{i + 1}: marker not above a fence"
            if not line.startswith("```"):
                continue
            if not inside:
                above = MARKER.match(lines[i - 1]) if i else None
                assert above, f"{name}:{i + 1}: a fenced block without a readme-test marker"
                kind, rest = above["kind"], above["rest"]
                if kind == "skip":
                    assert rest, f"{name}:{i + 1}: skip needs a reason"
                elif kind not in ("file", "job-example"):
                    assert (kind, rest) in RUN_HERE, f"{name}:{i + 1}: no test runs readme-test: {kind} {rest or ''}"
                    seen.add((kind, rest))
            inside = not inside
    assert seen == RUN_HERE  # and every kind a test runs is on some page
