"""Where a model comes from: a local dir, a Hugging Face Hub id (a cache in the Hub's own layout,
offline) or a bucket (moto's S3 server on 127.0.0.1), copied once per node into batchgen's cache."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import build_tiny_model
from jobkit import FAKE, batchgen_cmd, cli, job_dict, outputs_by_key, prompts, subprocess_env, write_job, write_jsonl

from batchgen.job.spec import load_job
from batchgen.models.resolve import ModelNotFound, locate_model, model_source, resolve_model
from batchgen.storage import location
from batchgen.storage.model_cache import ModelCache

REPO_ID = "tiny-org/tiny-model"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


# ------------------------------------------------------------------------------------- helpers


def make_hub_cache(hf_home: Path, repo_id: str, files: dict[str, bytes], commit: str, ref: str | None = "main") -> Path:
    """A model in the Hub cache's own layout: blobs by hash, a snapshot of symlinks, a ref."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def dir_files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def fake_model(name: str = "fake", **config: object) -> dict[str, bytes]:
    """The files of a model the fake engine loads (it reads config.json only)."""
    return {"config.json": json.dumps({"name": name, **config}).encode(), "weights.bin": os.urandom(1 << 20)}


def upload(s3_server, url: str, files: dict[str, bytes]) -> str:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = s3_server.client()
    for rel, data in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=data)
    return url


def stamp(path: Path) -> tuple[int, int]:
    """A file's inode and modification time: both change if it is written again."""
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def fake_job(root: Path, model: str, out: str = "out", rows: int = 4, **model_options: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "in.jsonl").exists():
        write_jsonl(root / "in.jsonl", prompts(rows))
    return write_job(root / f"{out}.yaml", job_dict(model={"path": model, **model_options}, output={"dir": out}))


def lines_of(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache, offline (batchgen reads these variables at each call)."""
    home = tmp_path / "hf"
    (home / "hub").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return home


@pytest.fixture
def model_cache_dir(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "batchgen-cache"
    monkeypatch.setenv("BATCHGEN_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama")


# ------------------------------------------------------------------------------ Hugging Face Hub


def test_hub_id_offline_from_the_cache(tmp_path, hf_home):
    files = fake_model()
    snapshot = make_hub_cache(hf_home, REPO_ID, files, COMMIT_A)
    source = model_source(REPO_ID, tmp_path)
    assert (source.kind, source.ref, source.name) == ("hub", REPO_ID, REPO_ID)
    path = resolve_model(source, log=lambda _: None)
    assert path == snapshot and dir_files(path) == files
    assert locate_model(source) == snapshot


def test_hub_revision_branch_and_commit(tmp_path, hf_home):
    make_hub_cache(hf_home, REPO_ID, fake_model("main-model"), COMMIT_A)
    make_hub_cache(hf_home, REPO_ID, fake_model("v2-model"), COMMIT_B, ref="v2")
    name = lambda p: json.loads((p / "config.json").read_text())["name"]  # noqa: E731
    assert name(resolve_model(model_source(REPO_ID, revision="v2"))) == "v2-model"
    assert name(resolve_model(model_source(REPO_ID, revision=COMMIT_A))) == "main-model"
    assert name(resolve_model(model_source(REPO_ID))) == "main-model"
    with pytest.raises(ModelNotFound) as e:
        resolve_model(model_source(REPO_ID, revision="nope"))
    assert "\n" not in str(e.value) and f"hf download {REPO_ID} --revision nope" in str(e.value)

    # In a job file: model.revision picks the snapshot, and the config hash follows the id and revision.
    job = fake_job(tmp_path, REPO_ID, out="out", revision="v2")
    assert cli("run", job, "--engine", FAKE).exit_code == 0
    assert {t for t, _ in outputs_by_key(tmp_path / "out").values()}  # rows were written
    spec = load_job(job)
    assert spec.model_path == REPO_ID and spec.model_name == REPO_ID
    other = load_job(fake_job(tmp_path, REPO_ID, out="other"))
    assert spec.config_hash != other.config_hash


def test_hub_config_hash_does_not_depend_on_the_cache(tmp_path, hf_home, monkeypatch):
    make_hub_cache(hf_home, REPO_ID, fake_model(), COMMIT_A)
    job = fake_job(tmp_path, REPO_ID)
    before = load_job(job).config_hash
    moved = tmp_path / "moved-hf"
    hf_home.rename(moved)
    monkeypatch.setenv("HF_HOME", str(moved))
    assert load_job(job).config_hash == before


def test_local_dir_wins_over_a_hub_id(tmp_path, hf_home):
    make_hub_cache(hf_home, REPO_ID, fake_model("from-hub"), COMMIT_A)
    local = tmp_path / REPO_ID
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"name": "local"}))
    source = model_source(REPO_ID, tmp_path)
    assert source.kind == "local" and Path(source.ref) == local
    assert resolve_model(source) == local
    # A bare name is a local path unless the Hub cache has it.
    assert model_source("no-such-model", tmp_path).kind == "local"
    make_hub_cache(hf_home, "gpt9", fake_model(), COMMIT_A)
    assert model_source("gpt9", tmp_path).kind == "hub"


def test_hub_id_not_in_the_cache_is_one_line(tmp_path, hf_home):
    job = fake_job(tmp_path, "nobody/nothing")
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 1 and "Traceback" not in r.output
    problem = lines_of(r)[0]
    assert problem.startswith("model.path: nobody/nothing: no local directory of that name, and the Hugging Face "
                              f"id was not found in the cache ({hf_home / 'hub'}) and HF_HUB_OFFLINE is set; "
                              "fetch it with `hf download nobody/nothing`"), problem
    assert lines_of(r)[1:] == [f"1 problem in {job}"]

    env = subprocess_env(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    proc = subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [f"batchgen: error: {problem}"]


def test_hub_unreachable_is_one_line(tmp_path):
    """Online without the model in the cache: the Hub is asked, and an unreachable one is one line."""
    job = fake_job(tmp_path, "nobody/nothing")
    closed = f"http://127.0.0.1:{_free_port()}"
    env = subprocess_env(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=closed, HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    proc = subprocess.run(batchgen_cmd("validate", job), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("model.path: nobody/nothing: no local directory of that name, not in the Hugging Face "
                            "cache") and "the Hub cannot be reached" in first, proc.stderr


def test_revision_on_a_local_dir_is_refused(tmp_path):
    job = fake_job(tmp_path, "model", revision="v1")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 1
    assert lines_of(r)[0].startswith("model.revision: applies to a Hugging Face Hub id only")


def test_run_batch_passes_a_hub_id_through(tmp_path, hf_home):
    make_hub_cache(hf_home, REPO_ID, fake_model(), COMMIT_A)
    request = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
               "body": {"model": REPO_ID, "prompt": "hello", "max_tokens": 3}}
    write_jsonl(tmp_path / "req.jsonl", [request])
    r = cli("run-batch", "-i", tmp_path / "req.jsonl", "-o", tmp_path / "res.jsonl", "--model", REPO_ID,
            "--check-model", "--engine", FAKE)
    assert r.exit_code == 0, r.output
    line = json.loads((tmp_path / "res.jsonl").read_text().splitlines()[0])
    assert line["error"] is None and line["response"]["body"]["model"] == REPO_ID


def test_hub_download_progress_is_plain_lines():
    """Not on a terminal, huggingface_hub's bars become log lines: one per file, one per 512 MiB."""
    from batchgen.models.resolve import _log_bar

    log: list[str] = []
    bar_class = _log_bar("model x/y", log.append)
    with bar_class(total=2, desc="Fetching 2 files") as files:
        files.update(1)
        files.update(1)
    with bar_class(total=1 << 30, desc="Downloading bytes", unit="B", unit_scale=True) as data:
        for _ in range(8):
            data.update(128 << 20)
    assert log == ["model x/y: 1 of 2 files", "model x/y: 2 of 2 files",
                   "model x/y: 512.0 MiB of 1.0 GiB", "model x/y: 1.0 GiB of 1.0 GiB"]


# ----------------------------------------------------------------------------------- buckets


def test_bucket_model_copied_once_then_used(bucket, s3_server, model_cache_dir, tmp_path):
    files = {**fake_model(), "tokenizer/vocab.txt": b"a\nb\n"}
    url = upload(s3_server, f"{bucket}/models/fake", files)
    bucket_name = bucket.removeprefix("s3://")
    for marker in ("models/fake/", "models/fake/tokenizer/"):  # folder markers, as the S3 console makes them
        s3_server.client().put_object(Bucket=bucket_name, Key=marker, Body=b"")
    log: list[str] = []
    path = resolve_model(model_source(url), log=log.append)
    assert path.is_relative_to(model_cache_dir / "models") and path.name == "fake"
    assert dir_files(path) == files
    assert any("copying 3 files" in line for line in log), log
    stamps = {rel: stamp(path / rel) for rel in files}

    log.clear()
    assert resolve_model(model_source(url), log=log.append) == path
    assert log == [f"model {url}: using the copy in {path}"]
    assert {rel: stamp(path / rel) for rel in files} == stamps
    assert locate_model(model_source(url)) == path


def test_bucket_model_in_a_job_uses_the_storage_section(bucket, s3_server, model_cache_dir, tmp_path, monkeypatch):
    url = upload(s3_server, f"{bucket}/models/fake", fake_model("from-bucket"))
    job = write_job(tmp_path / "job.yaml", {**job_dict(model={"path": url}),
                                            "storage": {"endpoint_url": s3_server.endpoint}})
    write_jsonl(tmp_path / "in.jsonl", prompts(4))
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # only the job file's storage section says where the store is

    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 0, r.output
    assert f"warning: model.path: {url} is not in the local cache yet" in r.output

    r = cli("run", job, "--engine", FAKE)
    assert r.exit_code == 0, r.output
    assert len(outputs_by_key(tmp_path / "out")) == 4 * 2
    spec = load_job(job)
    assert spec.model_path == url and spec.model_name == "fake"
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "elsewhere"))
    assert load_job(job).config_hash == spec.config_hash  # the URL is hashed, not where it is copied to
    monkeypatch.setenv("BATCHGEN_CACHE", str(model_cache_dir))
    assert cli("validate", job, "--engine", FAKE).output.strip() == "ok"  # copied now: checked as a local dir


def test_two_concurrent_runs_copy_the_model_once(bucket, s3_server, model_cache_dir, tmp_path):
    """Both runs start while the node's lock on the copy is held (here by the test), so both must
    wait on it; when it is released, exactly one copies and the other uses its copy."""
    url = upload(s3_server, f"{bucket}/models/fake", fake_model())
    cache = ModelCache(location(url))
    cache.meta.mkdir(parents=True)
    fd = os.open(cache.lock_file, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"the test\n")
    procs, logs = [], []
    try:
        for name in ("a", "b"):
            job = fake_job(tmp_path, url, out=f"out-{name}")
            log = tmp_path / f"{name}.log"
            logs.append(log)
            with open(log, "w") as err:
                procs.append(subprocess.Popen(batchgen_cmd("run", job), env=subprocess_env(), stderr=err,
                                              stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        while not all("waiting for the test" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            assert all(p.poll() is None for p in procs), [log.read_text() for log in logs]
            time.sleep(0.05)
    finally:
        os.close(fd)  # releases the lock
    for p in procs:
        assert p.wait(120) == 0
    texts = [log.read_text() for log in logs]
    copied = [t for t in texts if f"model {url}: copying 2 files" in t]
    reused = [t for t in texts if f"model {url}: copied by another run" in t]
    assert len(copied) == 1 and len(reused) == 1, texts
    assert outputs_by_key(tmp_path / "out-a") == outputs_by_key(tmp_path / "out-b")


def test_interrupted_copy_resumes_without_fetching_complete_files(bucket, s3_server, model_cache_dir, tmp_path):
    files = {"config.json": b'{"name": "big"}', "tokenizer.json": b"{}" * 100,
             "model.safetensors": os.urandom(96 << 20)}
    url = upload(s3_server, f"{bucket}/models/big", files)
    code = ("import sys; from batchgen.models.resolve import model_source, resolve_model; "
            "resolve_model(model_source(sys.argv[1]))")
    proc = subprocess.Popen([sys.executable, "-c", code, url], env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    done = []
    for line in proc.stderr:
        if " done, " in line:
            done.append(line.rsplit(": ", 1)[1].split(" (")[0])
            if len(done) == 2:
                proc.send_signal(signal.SIGKILL)  # the small files are whole, the large one is still coming
                break
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL and sorted(done) == ["config.json", "tokenizer.json"]
    cache = ModelCache(location(url))
    manifest = json.loads(cache.manifest_file.read_text())["files"]
    assert sorted(manifest) == ["config.json", "tokenizer.json"]
    assert not (cache.dir / "model.safetensors").exists()
    stamps = {rel: stamp(cache.dir / rel) for rel in manifest}

    log: list[str] = []
    path = resolve_model(model_source(url), log=log.append)
    assert dir_files(path) == files
    assert any(line.endswith("copying 1 file (96.0 MiB) into " + f"{path}; 2 already here") for line in log), log
    assert [line for line in log if " done, " in line] == [f"model {url}: model.safetensors (96.0 MiB) done, "
                                                          "1 of 1 files"]
    assert {rel: stamp(path / rel) for rel in manifest} == stamps  # the same files, never written again
    assert not any(cache.partial_dir.glob("*"))


def test_changed_etag_refetches_and_removed_files_go(bucket, s3_server, model_cache_dir):
    files = fake_model("v1")
    files["old.txt"] = b"old"
    url = upload(s3_server, f"{bucket}/models/fake", files)
    path = resolve_model(model_source(url), log=lambda _: None)
    weights = stamp(path / "weights.bin")

    upload(s3_server, url, {"config.json": b'{"name": "v2"}'})  # same key, new content: a new ETag
    bucket_name, _, prefix = url.removeprefix("s3://").partition("/")
    s3_server.client().delete_object(Bucket=bucket_name, Key=f"{prefix}/old.txt")
    log: list[str] = []
    assert resolve_model(model_source(url), log=log.append) == path
    assert any("copying 1 file" in line for line in log), log
    assert json.loads((path / "config.json").read_text()) == {"name": "v2"}
    assert not (path / "old.txt").exists()
    assert stamp(path / "weights.bin") == weights


def test_missing_bucket_and_prefix_are_one_line(bucket, s3_server, model_cache_dir, tmp_path):
    for model, why in ((f"s3://no-such-bucket-{os.getpid()}/models/m", "no such bucket"),
                       (f"{bucket}/models/none", "no files there")):
        job = fake_job(tmp_path, model)
        r = cli("validate", job, "--engine", FAKE)
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert lines_of(r)[0].startswith("model.path: s3://") and why in lines_of(r)[0], r.output
        assert lines_of(r)[1:] == [f"1 problem in {job}"]
        r = cli("run", job, "--engine", FAKE)
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert lines_of(r) == [f"batchgen: error: {lines_of(cli('validate', job))[0]}"]


# ------------------------------------------------------------------------------- real engine


def test_real_engine_same_tokens_from_every_source(tiny_llama, hf_home, bucket, s3_server, model_cache_dir):
    from batchgen import LLM, SamplingParams

    make_hub_cache(hf_home, REPO_ID, dir_files(tiny_llama), COMMIT_A)
    url = upload(s3_server, f"{bucket}/models/tiny-llama", dir_files(tiny_llama))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts = ["the quick brown fox", "paged attention keeps the kv cache"]

    def run(model: str) -> tuple[list[list[int]], str]:
        llm = LLM(model, dtype="float32", kv_cache_memory="64MiB")
        outs = llm.generate(texts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.model_name

    local, _ = run(str(tiny_llama))
    assert all(len(t) == 12 for t in local)
    assert run(REPO_ID) == (local, REPO_ID)
    assert run(url) == (local, url)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
