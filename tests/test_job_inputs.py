"""Input formats: CSV and TSV (plain, gzipped, from a bucket), JSONL refused when it is not
JSONL, and Hugging Face datasets (a save_to_disk directory, a local data-file directory, the Hub
cache offline); each with ids, prompts, messages, carried columns, error rows, and resume and
shards exactly once on the fake engine."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from jobkit import (
    FAKE,
    REPO,
    batchgen_cmd,
    cli,
    job_dict,
    make_model,
    outputs_by_key,
    prompts,
    read_rows,
    run,
    setup_job,
    subprocess_env,
    write_job,
)

from batchgen.job.errors import EXIT_ENGINE
from batchgen.job.inputs import InputReader
from batchgen.job.inputs import csv as csv_input
from batchgen.job.inputs.hf_dataset import open_split
from batchgen.job.shard import Shard
from batchgen.job.spec import InputSpec, load_job, parse_job
from batchgen.storage import Location

try:
    import datasets
except ImportError:  # the optional extra batchgen[datasets]
    datasets = None
needs_datasets = pytest.mark.skipif(datasets is None, reason="needs the datasets library")


def write_csv(path: Path, rows: list[dict[str, Any]] | list[list[Any]], delimiter: str = ",",
              header: list[str] | None = None) -> Path:
    """Rows as CSV (quoted where needed, as the csv module writes); ``.gz`` names are gzipped."""
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=delimiter, lineterminator="\n")
    if rows and isinstance(rows[0], dict):
        header = header or list(rows[0])
        w.writerow(header)
        w.writerows([[r.get(c, "") for c in header] for r in rows])
    else:
        w.writerow(header or [])
        w.writerows(rows)
    data = buf.getvalue().encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def reader(root: Path, overrides: dict[str, str] | None = None, **spec: Any) -> InputReader:
    spec.setdefault("paths", ["in.csv"])
    if "messages_column" not in spec:
        spec.setdefault("prompt_column", "prompt")
    return InputReader(InputSpec(**spec), root, overrides)


def rows_by_id(r: InputReader) -> dict[str, Any]:
    return {row.id: row for row in r.rows()}


# ------------------------------------------------------------------------------------------ CSV


def test_csv_ids_prompts_carry_and_bad_rows(tmp_path):
    (tmp_path / "in.csv").write_bytes(
        b"id,prompt,score,ratio,flag,note,mt\n"
        b"007,hello,1,0.5,true,plain,4\n"
        b'008,"two\nlines, and a comma",2,1,false,"",\n'  # an empty override cell: the job's value
        b"009,,3,1.5,true,x,5\n"  # empty prompt
        b"010,caf\xe9,4,2.5,false,x,5\n"  # not UTF-8
        b"011,fine,5,3.5,true,x,5,extra\n"  # one field too many
        b"012,fine,NA,,true,x,6\n"  # pyarrow's null markers in typed columns
        b"013,fine,lots,3.5,true,x,6\n"  # not an int64 like the first rows
        b"007,again,7,3.5,true,x,6\n"  # duplicate id
    )
    r = reader(tmp_path, {"max_tokens": "mt"}, id_column="id", carry_columns=["score", "ratio", "flag", "note", "id"])
    assert r.check() == []
    # pyarrow's types of the first block; columns read for another use (the id) stay text
    assert [(f.name, str(f.type)) for f in r.carry_fields] == [
        ("score", "string"), ("ratio", "double"), ("flag", "bool"), ("note", "string"), ("id", "string")]
    rows = rows_by_id(r)
    assert rows["007"].prompt == "hello" and rows["007"].overrides == {"max_tokens": "4"}
    assert rows["007"].carry == {"score": "1", "ratio": 0.5, "flag": True, "note": "plain", "id": "007"}
    assert rows["007"].where == "in.csv row 0"
    assert rows["008"].prompt == "two\nlines, and a comma" and rows["008"].overrides == {}
    assert rows["008"].carry["ratio"] == 1.0 and rows["008"].carry["note"] == ""
    assert rows["009"].error == "in.csv row 2: field 'prompt': empty prompt"
    assert rows["010"].error == "in.csv row 3: field 'prompt': invalid UTF-8"
    assert rows["012"].error is None and rows["012"].carry["ratio"] is None and rows["012"].carry["score"] == "NA"
    assert rows["in.csv:6"].error == ("in.csv row 6: field 'id': duplicate id '007', first at in.csv row 0; "
                                      "only that row is generated")
    assert rows["in.csv:malformed-0"].error == (
        "in.csv malformed-0: malformed CSV line: 8 fields where the header has 7: '011,fine,5,3.5,true,x,5,extra'")
    assert rows["013"].error is None and rows["013"].carry["score"] == "lots"  # "lots" made score text
    assert r.total_rows() == (9, False)  # lines but the header; the quoted newline counts


def test_csv_carried_types_are_fixed_by_the_first_block(tmp_path):
    """pyarrow infers types block by block; the first block's hold for the whole input, and a later
    cell of another type is that row's error, not a failed job or a part of another schema."""
    n = 40_000  # > 1 MiB: several blocks
    rows = [{"id": f"r{i:06d}", "prompt": f"prompt number {i} " + "x" * 20, "score": i, "ratio": i / 2}
            for i in range(n)]
    rows[n - 5]["score"] = "many"
    rows[n - 4]["ratio"] = "half"
    rows[n - 3]["score"] = "2.5"
    write_csv(tmp_path / "in.csv", rows)
    assert (tmp_path / "in.csv").stat().st_size > 2 << 20
    r = reader(tmp_path, id_column="id", carry_columns=["score", "ratio"])
    assert [(f.name, str(f.type)) for f in r.carry_fields] == [("score", "int64"), ("ratio", "double")]
    errors = {row.id: row.error for row in r.rows() if row.error}
    assert errors == {
        f"r{n - 5:06d}": f"in.csv row {n - 5}: field 'score': expected int64 as in the first rows, got 'many'",
        f"r{n - 4:06d}": f"in.csv row {n - 4}: field 'ratio': expected float64 as in the first rows, got 'half'",
        f"r{n - 3:06d}": f"in.csv row {n - 3}: field 'score': expected int64 as in the first rows, got '2.5'",
    }


def test_tsv_gz_messages_column(tmp_path):
    good = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\tthere"}]
    write_csv(tmp_path / "chats.tsv.gz", [
        ["a", json.dumps(good), "x"],
        ["b", "[{\"role\": \"user\"", "y"],
        ["c", json.dumps({"role": "user"}), "z"],
        ["d", "", "w"],
    ], delimiter="\t", header=["uid", "msgs", "tag"])
    r = reader(tmp_path, paths=["chats.tsv.gz"], id_column="uid", messages_column="msgs", carry_columns=["tag"])
    assert r.files[0].format == "tsv" and r.check() == []
    rows = rows_by_id(r)
    assert rows["a"].error is None and rows["a"].prompt == good and rows["a"].carry == {"tag": "x"}
    assert rows["b"].error.startswith("chats.tsv.gz row 1: field 'msgs': malformed JSON: ")
    assert rows["c"].error == ("chats.tsv.gz row 2: field 'msgs': expected a non-empty list of {role, content} "
                               "messages, got an object")
    assert rows["d"].error == "chats.tsv.gz row 3: field 'msgs': missing or null"
    assert r.total_rows() == (None, False)  # not counted inside a gzip stream


def test_csv_format_forced_and_derived_ids(tmp_path):
    write_csv(tmp_path / "prompts.txt", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    r = reader(tmp_path, paths=["prompts.txt"], format="csv")
    assert [row.id for row in r.rows()] == ["prompts.txt:0", "prompts.txt:1", "prompts.txt:2"]
    assert [k.id for k in r.ids()] == ["prompts.txt:0", "prompts.txt:1", "prompts.txt:2"]
    (tmp_path / "empty.csv").write_bytes(b"")
    (tmp_path / "header.csv").write_bytes(b"prompt\n")
    r = reader(tmp_path, paths=["empty.csv", "header.csv"])
    assert r.check() == [] and list(r.rows()) == []


def test_csv_missing_column_is_refused_by_validate(tmp_path):
    make_model(tmp_path / "model")
    write_csv(tmp_path / "in.csv", [{"id": "a", "prompt": "x"}])
    job = write_job(tmp_path / "job.yaml", job_dict(input={"paths": ["in.csv"], "prompt_column": "question"},
                                                    sampling={"overrides": {"max_tokens": "mt"}}))
    r = cli("validate", job, "--engine", FAKE)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert sorted(r.stderr.splitlines()[:-1]) == [  # a header names every column: none is optional
        "input.carry_columns[0]: column 'topic' not found in in.csv (columns: id, prompt)",
        "input.prompt_column: column 'question' not found in in.csv (columns: id, prompt)",
        "sampling.overrides.max_tokens: column 'mt' not found in in.csv (columns: id, prompt)",
    ]


def test_jsonl_format_on_a_csv_file_is_refused_by_validate(tmp_path):
    make_model(tmp_path / "model")
    write_csv(tmp_path / "in.csv", prompts(5))
    job = write_job(tmp_path / "job.yaml", job_dict(input={"paths": ["in.csv"], "format": "jsonl"}))
    for command in ("validate", "run"):
        r = cli(command, job, "--engine", FAKE)
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert ("input.paths: in.csv is not JSONL: none of its first 6 lines is a JSON object "
                "(line 1: malformed JSON: Expecting value (column 1))") in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))
    # one good line among bad ones is JSONL with error rows, as before
    (tmp_path / "in.jsonl").write_text('not json\n{"id": "a", "prompt": "x", "topic": 1}\n')
    write_job(job, job_dict())
    assert cli("validate", job, "--engine", FAKE).exit_code == 0


def csv_job(root: Path, n: int = 40, name: str = "in.csv", **input_spec: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_csv(root / name, prompts(n), delimiter="\t" if ".tsv" in name else ",")
    return setup_job(root, rows=0, input={"paths": [name], **input_spec})


def resume_and_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_job: Callable[[Path], Path],
                      n: int) -> dict[tuple[str, int], Any]:
    """A reference run; then shard 0/2 failing midway and rerun, shard 1/2, and a rerun with
    nothing to do: every (id, sample) once, the same outputs as the reference."""
    ref = make_job(tmp_path / "ref")
    r = run(ref)
    assert r.exit_code == 0, r.output
    expected = outputs_by_key(ref.parent / "out")
    assert len(expected) == 2 * n
    job = make_job(tmp_path / "sharded")
    spec = yaml.safe_load(job.read_text())
    spec["max_in_flight"], spec["output"]["rows_per_part"] = 4, 4  # a failure leaves some parts, not all
    write_job(job, spec)
    with monkeypatch.context() as m:
        m.setenv("FAKE_LLM_FAIL_AFTER", "12")
        r = run(job, "--shard", "0/2")
    assert r.exit_code == EXIT_ENGINE, r.output
    assert 0 < len(outputs_by_key(job.parent / "out")) < 2 * n
    for shard in ("0/2", "1/2"):
        r = run(job, "--shard", shard)
        assert r.exit_code == 0 and f"shard {shard} complete" in r.stdout, r.output
    assert outputs_by_key(job.parent / "out") == expected
    r = run(job, "--shard", "1/2")
    assert r.exit_code == 0 and "nothing to do" in r.stdout
    return expected


@pytest.mark.parametrize("name", ["in.csv", "in.tsv.gz"])
def test_csv_run_resume_and_shards_exactly_once(tmp_path, monkeypatch, name):
    out = resume_and_shards(tmp_path, monkeypatch, lambda root: csv_job(root, 40, name), 40)
    assert {i for i, _ in out} == {f"q{i:04d}" for i in range(40)}
    rows = read_rows(tmp_path / "ref" / "out")
    assert {row["topic"] for row in rows} == {0, 1, 2}  # int64, inferred by pyarrow
    assert pq.read_schema(sorted((tmp_path / "ref" / "out").glob("part-*"))[0]).field("topic").type == pa.int64()


def test_csv_run_bad_rows_become_error_rows_once(tmp_path):
    make_model(tmp_path / "model")
    (tmp_path / "in.csv").write_bytes(b'id,prompt,topic,mt,temp\na,fine,1,1,0.5\nb,,2,,\nc,"ok",3,4\n'
                                      b'd,fine,x,,\ne,fine,5,lots,\n')
    job = setup_job(tmp_path, rows=0, input={"paths": ["in.csv"]},
                    sampling={"overrides": {"max_tokens": "mt", "temperature": "temp"}})
    r = run(job)
    assert r.exit_code == 0, r.output
    assert "5 this run (3 errors)" in r.stdout
    rows = read_rows(tmp_path / "out")
    errors = {row["id"]: row["error"] for row in rows if row["error"]}
    assert errors == {"b": "in.csv row 1: field 'prompt': empty prompt",
                      "in.csv:malformed-0": "in.csv malformed-0: malformed CSV line: 4 fields where the header "
                                            "has 5: 'c,\"ok\",3,4'",
                      "e": "in.csv row 3: field 'mt' (sampling.max_tokens override): Input should be a valid "
                           "integer, unable to parse string as an integer (got 'lots')"}
    assert sorted({row["topic"] for row in rows if row["id"] in "ad"}) == ["1", "x"]  # "x" made it text
    # override cells are text made values by the sampling field; an empty cell is the job's value
    assert [row["num_output_tokens"] for row in rows if row["id"] == "a"] == [1, 1]
    assert max(row["num_output_tokens"] for row in rows if row["id"] == "d") > 1
    assert "nothing to do" in run(job).stdout


def test_csv_from_a_bucket_is_streamed(tmp_path, s3_server, bucket, monkeypatch):
    name = bucket.removeprefix("s3://")
    client = s3_server.client()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz:
        gz.write(b"id,prompt,topic\n" + b"".join(f"q{i:04d},question number {i},{i % 3}\n".encode()
                                                 for i in range(30)))
    client.put_object(Bucket=name, Key="prompts/part-a.csv.gz", Body=buf.getvalue())
    ref = setup_job(tmp_path / "ref", rows=30)
    assert run(ref).exit_code == 0
    job = setup_job(tmp_path / "s3", rows=0, input={"paths": [f"{bucket}/prompts/*.csv.gz"]})
    r = run(job)
    assert r.exit_code == 0, r.output
    assert outputs_by_key(tmp_path / "s3" / "out") == outputs_by_key(tmp_path / "ref" / "out")
    # a large object: the first row comes after a block or two, not after the whole object
    big = b"id,prompt\n" + b"".join(f"b{i:07d},{'word ' * 30}{i}\n".encode() for i in range(100_000))
    client.put_object(Bucket=name, Key="big.csv", Body=big)
    read: list[int] = []
    open_read = Location.open_read

    def counted(self: Location):
        f = open_read(self)
        read.append(0)
        slot = len(read) - 1
        raw_read = f.read

        def read_counted(n: int = -1) -> bytes:
            data = raw_read(n)
            read[slot] += len(data)
            return data

        f.read = read_counted
        return f

    monkeypatch.setattr(Location, "open_read", counted)
    monkeypatch.setattr(csv_input, "BLOCK_BYTES", 1 << 16)  # pyarrow reads ~32 blocks ahead: 2 MiB, not 32
    r = reader(tmp_path, paths=[f"{bucket}/big.csv"], id_column="id")
    first = next(r.rows())
    assert first.id == "b0000000" and first.error is None
    assert read and max(read) < len(big) // 4, (read, len(big))


# ------------------------------------------------------------------------------------- datasets


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty Hugging Face home, offline, as ``datasets`` sees it in this process."""
    import huggingface_hub.constants

    home = tmp_path / "hf"
    env = {"HF_HOME": home, "HF_DATASETS_CACHE": home / "datasets", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    open_split.cache_clear()
    yield home
    open_split.cache_clear()


def prompt_table(n: int, start: int = 0) -> dict[str, list[Any]]:
    rows = prompts(n, start)
    return {k: [r[k] for r in rows] for k in rows[0]}


def cache_hub_dataset(home: Path, repo_id: str, splits: dict[str, dict[str, list[Any]]],
                      config: str = "default", sha: str = "5e1f" * 10) -> Path:
    """What ``load_dataset(repo_id)`` leaves in ``HF_DATASETS_CACHE`` once run online: the
    prepared Arrow files under ``<namespace>___<name>/<config>/<version>/<commit>/``, which is
    all that ``load_dataset`` reads offline. Built here by the same Parquet builder from local
    files (the Hub itself cannot be reached)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    src = home / "src" / config
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, table in splits.items():
        pq.write_table(pa.table(table), src / f"{split}.parquet")
        files[split] = [str(src / f"{split}.parquet")]
    build = home / "build"
    builder = Parquet(cache_dir=str(build), dataset_name=name, hash=sha, config_name=config, config_id=config,
                      data_files=files)
    builder.download_and_prepare()
    dest = home / "datasets" / f"{namespace}___{os.path.relpath(builder.cache_dir, build)}"
    shutil.copytree(builder.cache_dir, dest)
    shutil.rmtree(build)
    return dest


def dataset_job(root: Path, dataset: dict[str, Any], **input_spec: Any) -> Path:
    return setup_job(root, rows=0, input={"paths": None, "dataset": dataset, **input_spec})


@needs_datasets
def test_dataset_saved_to_disk_resume_and_shards(tmp_path, monkeypatch, hf_home):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(prompt_table(5)),
                          "test": datasets.Dataset.from_dict(prompt_table(36, 100))}).save_to_disk(saved)

    def make(root: Path) -> Path:
        return dataset_job(root, {"path": "../saved", "split": "test"}, id_column=None)

    out = resume_and_shards(tmp_path, monkeypatch, make, 36)
    assert {i for i, _ in out} == {f"test:{i}" for i in range(36)}  # ids default to <split>:<row>
    rows = read_rows(tmp_path / "ref" / "out")
    assert {row["topic"] for row in rows} == {0, 1, 2}
    job = load_job(tmp_path / "ref" / "job.yaml")
    r = InputReader.for_job(job)
    assert r.total_rows() == (36, True)
    assert r.files[0].where(7) == "dataset ../saved split test row 7"
    # a saved single Dataset: its split must be the one asked for, when it records one
    datasets.Dataset.from_dict(prompt_table(3)).save_to_disk(tmp_path / "one")
    r = InputReader(InputSpec(dataset={"path": "one"}, id_column="id", prompt_column="prompt"), tmp_path)
    assert [row.id for row in r.rows()] == ["q0000", "q0001", "q0002"]


@needs_datasets
def test_dataset_from_the_hub_cache_offline_resume_and_shards(tmp_path, monkeypatch, hf_home):
    cache_hub_dataset(hf_home, "tester/prompts", {"train": prompt_table(34), "test": prompt_table(4, 50)})

    def make(root: Path) -> Path:
        return dataset_job(root, {"path": "tester/prompts", "split": "train"})

    out = resume_and_shards(tmp_path, monkeypatch, make, 34)
    assert {i for i, _ in out} == {f"q{i:04d}" for i in range(34)}
    job = load_job(tmp_path / "ref" / "job.yaml")
    assert InputReader.for_job(job).total_rows() == (34, True)


@needs_datasets
def test_dataset_hub_cache_in_a_subprocess_reads_the_environment(tmp_path):
    """The standard variables alone (HF_HOME, HF_HUB_OFFLINE) lead `batchgen run` to the cache."""
    home = tmp_path / "hf"
    cache_hub_dataset(home, "tester/chats", {"train": {
        "uid": ["a", "b"], "msgs": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]}})
    job = dataset_job(tmp_path, {"path": "tester/chats"}, id_column="uid", prompt_column=None,
                      messages_column="msgs", carry_columns=[])
    env = subprocess_env(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    env.pop("HF_DATASETS_CACHE", None)
    p = subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert {i for i, _ in outputs_by_key(tmp_path / "out")} == {"a", "b"}


@needs_datasets
def test_dataset_local_data_dir_configs_and_problems(tmp_path, hf_home):
    repo = tmp_path / "repo"  # a dataset repository checked out locally: data files only
    (repo / "data").mkdir(parents=True)
    pq.write_table(pa.table(prompt_table(6)), repo / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table(prompt_table(2, 10)), repo / "data" / "test-00000-of-00001.parquet")
    r = InputReader(InputSpec(dataset={"path": "repo", "split": "test"}, id_column="id", prompt_column="prompt",
                              carry_columns=["topic"]), tmp_path)
    assert r.check() == []
    assert [row.id for row in r.rows()] == ["q0010", "q0011"]
    assert [(f.name, str(f.type)) for f in r.carry_fields] == [("topic", "int64")]
    cache_hub_dataset(hf_home, "tester/multi", {"train": prompt_table(2)}, config="small")
    cache_hub_dataset(hf_home, "tester/multi", {"train": prompt_table(3)}, config="large")
    r = InputReader(InputSpec(dataset={"path": "tester/multi", "name": "large"}, id_column="id",
                              prompt_column="prompt"), tmp_path)
    assert len(list(r.rows())) == 3

    make_model(tmp_path / "model")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(prompt_table(2))}).save_to_disk(tmp_path / "saved")
    cases = {
        "missing dir": ({"path": "./nowhere"}, "input.dataset.path: no dataset directory at "),
        "unknown id": ({"path": "tester/unknown"}, "input.dataset.path: cannot load dataset 'tester/unknown': "),
        "unknown config": ({"path": "tester/multi", "name": "huge"},
                           "input.dataset.name: cannot load dataset 'tester/multi': "),
        "no config chosen": ({"path": "tester/multi"}, "input.dataset.name: cannot load dataset 'tester/multi': "),
        "unknown split": ({"path": "repo", "split": "dev"},
                          "input.dataset.split: no split 'dev' in dataset "),
        "unknown saved split": ({"path": "saved", "split": "dev"},
                                "input.dataset.split: no split 'dev' in "),
        "config of a saved dir": ({"path": "saved", "name": "x"}, "input.dataset.name: "),
        "missing column": ({"path": "saved"}, "input.prompt_column: column 'question' not found in dataset saved"),
    }
    for case, (dataset, expected) in cases.items():
        spec = {"prompt_column": "question"} if case == "missing column" else {}
        job = write_job(tmp_path / "job.yaml", job_dict(input={"paths": None, "dataset": dataset, **spec}))
        r = cli("validate", job, "--engine", FAKE)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 1 and "Traceback" not in r.output, (case, r.output)
        assert len(lines) == 2 and lines[0].startswith(expected), (case, lines)
    for given, expected in (({"paths": ["in.jsonl"], "dataset": {"path": "saved"}}, "input: set one of paths"),
                            ({"paths": None, "dataset": {"path": "saved", "split": "train[:1]"}},
                             "input.dataset.split: a split's name such as train or test, not 'train[:1]'"),
                            ({"paths": None}, "input: set one of paths"),
                            ({"paths": None, "dataset": {"path": "saved"}, "format": "csv"}, "input: format applies")):
        r = cli("validate", write_job(tmp_path / "job.yaml", job_dict(input=given)), "--engine", FAKE)
        assert r.exit_code == 1 and expected in r.stderr, (given, r.stderr)


def test_missing_datasets_library_is_one_line(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    open_split.cache_clear()
    make_model(tmp_path / "model")
    job = write_job(tmp_path / "job.yaml", job_dict(input={"paths": None, "dataset": {"path": "tester/x"}}))
    r = run(job)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.strip() == ("batchgen: error: input.dataset: needs the datasets library: "
                                "pip install 'datasets>=3' (in a clone of batchgen: pip install -e '.[datasets]')")


def test_config_hash_holds_the_dataset_identity(tmp_path):
    def hash_of(**dataset: Any) -> str:
        job = write_job(tmp_path / "job.yaml", job_dict(input={"paths": None, "dataset": dataset}, model=PINNED_MODEL))
        return load_job(job).config_hash

    base = hash_of(path="org/name")
    assert hash_of(path="org/name", split="train") == base  # the default, written out
    for change in ({"path": "org/other"}, {"name": "cfg"}, {"split": "test"}, {"revision": "v2"}):
        assert hash_of(**{"path": "org/name", **change}) != base, change
    # a job reading files keeps the hash it had before input.dataset existed
    assert load_job(write_job(tmp_path / "f.yaml", job_dict(model=PINNED_MODEL))).config_hash == PINNED_FILES_HASH
    # derived dataset ids hold no path, so the job file's place is not in the hash
    (tmp_path / "elsewhere").mkdir()
    job = job_dict(input={"paths": None, "dataset": {"path": "org/name"}, "id_column": None}, model=PINNED_MODEL)
    assert (load_job(write_job(tmp_path / "a.yaml", job)).config_hash
            == load_job(write_job(tmp_path / "elsewhere" / "a.yaml", job)).config_hash)


PINNED_MODEL = {"path": "/pinned/model"}
PINNED_FILES_HASH = "cbcc5fbd31e58cc0"  # what the job's hash was before input.dataset and CSV existed


def test_shards_partition_dataset_ids():
    ids = [f"train:{i}" for i in range(300)]
    owners = [sum(Shard(k, 3).owns(i) for k in range(3)) for i in ids]
    assert owners == [1] * 300


def test_docs_job_files_are_complete():
    """Every job file in docs/input-formats.md passes the job file's schema as it is."""
    text = (REPO / "docs" / "input-formats.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    assert len(blocks) >= 6
    for block in blocks:
        job = parse_job(block, REPO)
        assert job.spec.output.dir and (job.spec.input.paths or job.spec.input.dataset)
