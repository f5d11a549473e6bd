"""LoRA adapters in job files and OpenAI batch files: a per-row adapter column equal to the Python API row for
row, SIGKILL/resume and shards bit-identical to an uninterrupted run, unknown adapters as row errors, body.model
selecting the adapter, the config hash covering adapters' contents, validate's one-line problems, and the
engine's host-memory cap (max_cpu_loras)."""

from __future__ import annotations

import json
import shutil

import pytest
from jobkit import check_kill_resume_and_shards, cli, read, write_job, write_jsonl, write_parquet

from batchgen import LLM, LoRARequest, SamplingParams
from batchgen.config import ConfigError
from batchgen.job.shard import row_seed
from batchgen.job.spec import load_job

pytest.importorskip("peft")
from lora_kit import make_adapter  # noqa: E402  (after the skip: it imports peft)

ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256, "max_num_batched_tokens": 64,
          "max_num_seqs": 8}
NAMES = ["sql", "chat", "math"]
SEED = 7


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory):
    """Three adapters on the tiny Llama (ranks 4, 8 and 32; attention only and all linears)."""
    root = tmp_path_factory.mktemp("job_adapters")
    specs = [(8, ["q_proj", "v_proj"]), (4, "all-linear"), (32, ["o_proj", "down_proj"])]
    return {name: make_adapter(tiny_model_dirs["llama"], root / name, rank, targets, seed=i)
            for i, (name, (rank, targets)) in enumerate(zip(NAMES, specs, strict=True))}


def rows_of(vocab: int) -> dict[str, list]:
    """18 rows: each prompt under every adapter and the base model (null and empty cells), then one row naming
    an adapter the job does not have."""
    import torch

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 23, 41)]
    data: dict[str, list] = {"id": [], "prompt": [], "adapter": []}
    for i, prompt in enumerate(prompts):
        for adapter in [*NAMES, None, "", ]:
            data["id"].append(f"p{i}-{adapter or 'base'}-{len(data['id'])}")
            data["prompt"].append(prompt)
            data["adapter"].append(adapter)
    data["id"].append("unknown")
    data["prompt"].append(prompts[0])
    data["adapter"].append("nope")
    return data


def lora_job(root, model, adapters, data, **sections):
    root.mkdir(parents=True, exist_ok=True)
    write_parquet(root / "in.parquet", data)
    job = {"model": {"path": str(model), "lora_modules": {k: str(v) for k, v in adapters.items()}, **ENGINE},
           "input": {"paths": ["in.parquet"], "id_column": "id", "prompt_column": "prompt", "lora_column": "adapter"},
           "sampling": {"temperature": 0.9, "seed": SEED, "max_tokens": 8, "ignore_eos": True},
           "output": {"dir": "out", "rows_per_part": 3, "fields": ["token_ids"]}, "max_in_flight": 4,
           "progress_interval": 3600}
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value}
    return write_job(root / "job.yaml", job)


@pytest.fixture(scope="module")
def expected(tiny_model_dirs, adapters, tmp_path_factory):
    """An uninterrupted run's rows by id, checked against LLM.generate(lora_request=...) row for row."""
    model = tiny_model_dirs["llama"]
    llm = LLM(model, enable_lora=True, max_loras=3, max_lora_rank=32, **ENGINE)
    data = rows_of(llm.engine.vocab_size)
    job = lora_job(tmp_path_factory.mktemp("whole"), model, adapters, data)
    result = cli("run", job)
    assert result.exit_code == 0, result.output
    schema, rows = read(job.parent / "out")
    assert "lora" in schema.names
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    known = [i for i, a in enumerate(data["adapter"]) if a != "nope"]
    params = [SamplingParams(temperature=0.9, seed=row_seed(SEED, data["id"][i]), max_tokens=8, ignore_eos=True)
              for i in known]
    api = llm.generate([data["prompt"][i] for i in known], params, use_tqdm=False,
                       lora_request=[requests.get(data["adapter"][i]) for i in known])
    for i, out in zip(known, api, strict=True):
        row = rows[data["id"][i]]
        assert row["error"] is None and row["token_ids"] == out.outputs[0].token_ids
        assert row["lora"] == (data["adapter"][i] or None)
    by_adapter = {rows[data["id"][i]]["lora"]: rows[data["id"][i]]["token_ids"] for i in range(5)}
    assert len({tuple(t) for t in by_adapter.values()}) == 4  # one prompt: each adapter and the base differ
    return model, data, rows


def test_adapter_column_rows_equal_the_api_and_unknown_names_are_row_errors(expected):
    _, data, rows = expected
    assert len(rows) == len(data["id"])
    bad = rows["unknown"]
    assert bad["token_ids"] is None and bad["lora"] == "nope"
    assert bad["error"] == ("in.parquet row 15: field 'adapter': unknown adapter 'nope' (model.lora_modules has: "
                            "sql, chat, math)")


def test_sigkill_resume_and_two_shards_equal_an_uninterrupted_run(expected, adapters, tmp_path):
    model, data, rows = expected
    check_kill_resume_and_shards(tmp_path, lambda root: lora_job(root, model, adapters, data), rows)


def test_job_wide_adapter_and_output_column(tiny_model_dirs, adapters, tmp_path, expected):
    model, data, rows = expected
    few = {k: v[:5] for k, v in data.items()}
    job = lora_job(tmp_path, model, adapters, few, input={"lora_column": None}, sampling={"lora": "chat"})
    result = cli("run", job)
    assert result.exit_code == 0, result.output
    _, got = read(tmp_path / "out")
    chat_row = next(r for r in rows.values() if r["lora"] == "chat")
    assert all(r["lora"] == "chat" for r in got.values())
    assert got[chat_row["id"]]["token_ids"] == chat_row["token_ids"]


def test_config_hash_covers_adapter_names_and_contents(tiny_model_dirs, adapters, tmp_path):
    model = tiny_model_dirs["llama"]
    copy = tmp_path / "sql-copy"
    shutil.copytree(adapters["sql"], copy)
    data = {"id": ["a"], "prompt": [[5, 6, 7]], "adapter": ["sql"]}
    job = lora_job(tmp_path / "j", model, {"sql": copy}, data)
    before = load_job(job).config_hash
    plain = lora_job(tmp_path / "plain", model, {}, data, input={"lora_column": None})
    assert "lora_modules" not in load_job(plain).config_fields()["model"]
    assert load_job(plain).config_hash != before
    renamed = lora_job(tmp_path / "renamed", model, {"other": copy}, data)
    assert load_job(renamed).config_hash != before
    moved = lora_job(tmp_path / "moved", model, {"sql": adapters["sql"]}, data)  # same bytes elsewhere
    assert load_job(moved).config_hash == before
    assert cli("run", job).exit_code == 0
    weights = copy / "adapter_model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    assert load_job(job).config_hash != before
    result = cli("run", job)
    assert result.exit_code != 0
    assert "model.lora_modules.sql:" in result.output and "holds the output of another job" in result.output


def test_validate_names_each_bad_adapter(tiny_model_dirs, adapters, tmp_path):
    dora = tmp_path / "dora"
    shutil.copytree(adapters["sql"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    from safetensors.torch import load_file, save_file

    wrong = tmp_path / "wrong"  # lora_A one column short: trained on another base
    shutil.copytree(adapters["sql"], wrong)
    tensors = load_file(wrong / "adapter_model.safetensors")
    name = next(k for k in tensors if "lora_A" in k)
    tensors[name] = tensors[name][:, 1:].contiguous()
    save_file(tensors, wrong / "adapter_model.safetensors")
    modules = {"good": adapters["sql"], "dora": dora, "missing": tmp_path / "nope", "wrong": wrong}
    job = lora_job(tmp_path / "j", tiny_model_dirs["llama"], modules, {"id": ["a"], "prompt": [[5]], "adapter": [None]},
                   sampling={"lora": "absent"}, input={"lora_column": None})
    result = cli("validate", job)
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if "model.lora_modules" in line or "sampling.lora" in line]
    assert any("model.lora_modules.dora:" in line and "DoRA" in line for line in lines), result.output
    assert any("model.lora_modules.missing:" in line and "no adapter directory" in line for line in lines)
    assert any("model.lora_modules.wrong:" in line and "do not fit" in line for line in lines), result.output
    assert any("sampling.lora:" in line and "'absent' is not in model.lora_modules" in line for line in lines)
    assert not any("model.lora_modules.good" in line for line in lines)


def request(custom_id: str, prompt: str, model: str | None) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    if model is not None:
        body["model"] = model
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def test_openai_body_model_selects_the_adapter(tiny_model_dirs, adapters, tmp_path):
    model = tiny_model_dirs["llama"]
    prompt = "tell me about the sea"
    reqs = [request("sql", prompt, "sql"), request("chat", prompt, "chat"), request("base", prompt, model.name),
            request("none", prompt, None), request("bad", prompt, "nope")]
    write_jsonl(tmp_path / "req.jsonl", reqs)
    result = cli("run-batch", "-i", tmp_path / "req.jsonl", "-o", tmp_path / "out.jsonl", "--model", model,
                 "--lora-modules", f"sql={adapters['sql']}", "--lora-modules", f"chat={adapters['chat']}",
                 *[str(x) for kv in ENGINE.items() for x in (f"--{kv[0].replace('_', '-')}", kv[1])])
    assert result.exit_code == 0, result.output
    lines = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert lines["bad"]["response"] is None
    assert lines["bad"]["error"]["code"] == "invalid_request"
    assert "field 'body.model': unknown adapter 'nope'" in lines["bad"]["error"]["message"]
    bodies = {k: v["response"]["body"] for k, v in lines.items() if k != "bad"}
    assert {k: b["model"] for k, b in bodies.items()} == {"sql": "sql", "chat": "chat", "base": model.name,
                                                          "none": model.name}
    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for name, lora in [("sql", LoRARequest("sql", 1, str(adapters["sql"]))),
                       ("chat", LoRARequest("chat", 2, str(adapters["chat"]))), ("base", None), ("none", None)]:
        want = llm.generate([prompt], greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        assert bodies[name]["choices"][0]["text"] == want
    assert bodies["sql"]["choices"][0]["text"] != bodies["base"]["choices"][0]["text"]


def test_lora_modules_flag_takes_vllm_spelling():
    from batchgen.cli import spread_lora_modules

    assert spread_lora_modules(["run-batch", "--lora-modules", "a=x", "b=y", "--model", "m"]) == [
        "run-batch", "--lora-modules", "a=x", "--lora-modules", "b=y", "--model", "m"]
    others = ["run", "job.yaml", "--shard", "0/2"]
    assert spread_lora_modules(others) == others


def test_host_memory_cap_drops_least_recently_used_never_one_in_a_slot(tiny_model_dirs, adapters):
    model = tiny_model_dirs["llama"]
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LLM(model, enable_lora=True, max_loras=2, max_cpu_loras=1, max_lora_rank=32, **ENGINE)
    capped = LLM(model, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=32, **ENGINE)
    free = LLM(model, enable_lora=True, max_loras=3, max_lora_rank=32, **ENGINE)
    manager = capped.engine.lora
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 13, 40], [7, 7, 8]]
    order = [0, 1, 2, 0, 2, 1, 0]
    for i in order:
        got = capped.generate(prompts, greedy, use_tqdm=False, lora_request=requests[i])
        want = free.generate(prompts, greedy, use_tqdm=False, lora_request=requests[i])
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert len(manager.adapters) <= 2
        assert all(lora_id in manager.adapters for lora_id in manager.in_slot if lora_id is not None)
    assert manager.num_reads > len(requests)  # dropped adapters were read again when asked
    mixed = capped.generate(prompts * 3, greedy, use_tqdm=False, lora_request=[requests[i % 3] for i in range(6)])
    alone = [free.generate([p], greedy, use_tqdm=False, lora_request=requests[i % 3])[0]
             for i, p in enumerate(prompts * 3)]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]


def test_guide_job_and_run_batch_examples_run(tiny_model_dirs, adapters, tmp_path):
    """docs/lora.md's job file and run-batch command and the README's LoRA example as written, in a HOME
    where their model and adapter paths lead to the tiny Llama and two of the adapters."""
    import os
    import re
    import subprocess
    import sys

    from jobkit import REPO

    guide = (REPO / "docs" / "lora.md").read_text(encoding="utf-8")
    (job_text,) = re.findall(r"<!-- readme-test: lora-job -->\n```yaml\n(.*?)```", guide, re.S)
    (command,) = re.findall(r"<!-- readme-test: lora-run-batch -->\n```bash\n(.*?)```", guide, re.S)
    home = tmp_path / "home"
    model = home / ".cache" / "batchgen" / "models" / "SmolLM2-135M-Instruct"
    model.parent.mkdir(parents=True)
    model.symlink_to(tiny_model_dirs["llama"], target_is_directory=True)
    for name in ("sql", "chat"):
        (home / "adapters").mkdir(exist_ok=True)
        (home / "adapters" / f"{name}-lora").symlink_to(adapters[name], target_is_directory=True)
    work = home / "work"
    work.mkdir()
    (work / "job.yaml").write_text(job_text)
    write_jsonl(work / "tickets.jsonl", [{"id": "t1", "prompt": "list the tables", "adapter": "sql"},
                                         {"id": "t2", "prompt": "list the tables", "adapter": None},
                                         {"id": "t3", "prompt": "list the tables", "adapter": "sq1"}])
    write_jsonl(work / "requests.jsonl", [request("r1", "list the tables", "chat"),
                                          request("r2", "list the tables", "SmolLM2-135M-Instruct")])
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_ENGINE"}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    (snippet,) = re.findall(r"<!-- readme-test: python lora-readme -->\n```python\n(.*?)```", readme, re.S)
    (work / "readme.py").write_text(snippet)
    for script in ("batchgen run job.yaml", command, f"{sys.executable} readme.py"):
        proc = subprocess.run(["bash", "-c", f"set -euo pipefail\n{script}"], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _, rows = read(work / "out" / "tickets")
    assert [rows[i]["lora"] for i in ("t1", "t2", "t3")] == ["sql", None, "sq1"]
    assert rows["t1"]["text"] != rows["t2"]["text"]
    assert rows["t3"]["error"] == ("tickets.jsonl line 3: field 'adapter': unknown adapter 'sq1' "
                                   "(model.lora_modules has: sql, chat)")
    lines = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()]
    assert [x["response"]["body"]["model"] for x in lines] == ["chat", "SmolLM2-135M-Instruct"]


def test_adapter_in_a_bucket_is_copied_once_and_hashed_by_content(tiny_model_dirs, adapters, tmp_path, bucket,
                                                                   monkeypatch):
    from bucketkit import upload

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    url = f"{bucket}/adapters/sql"
    for file in adapters["sql"].iterdir():
        upload(f"{url}/{file.name}", file)
    model = tiny_model_dirs["llama"]
    data = {"id": ["a", "b"], "prompt": [[5, 6, 7], [9, 10]], "adapter": [None, None]}
    local = lora_job(tmp_path / "local", model, {"sql": adapters["sql"]}, data, input={"lora_column": None},
                     sampling={"lora": "sql"})
    remote = lora_job(tmp_path / "remote", model, {"sql": url}, data, input={"lora_column": None},
                      sampling={"lora": "sql"})
    checked = cli("validate", remote)
    assert checked.exit_code == 0 and "not copied to this node yet" in checked.output, checked.output
    for job in (local, remote):
        result = cli("run", job)
        assert result.exit_code == 0, result.output
    assert load_job(remote).config_hash == load_job(local).config_hash  # the same bytes: the same job
    assert read(tmp_path / "remote" / "out")[1] == read(tmp_path / "local" / "out")[1]
    assert (tmp_path / "cache" / "models").is_dir()
    assert "not copied" not in cli("validate", remote).output  # the run's copy is checked now


def test_validate_takes_transformers_backend_module_names(tmp_path):
    """GPT-NeoX runs on the transformers backend, where adapters name its own linears (query_key_value):
    validate checks the adapter's config and leaves the modules to the run's load."""
    from model_zoo import build_zoo_model

    model = build_zoo_model(tmp_path / "gpt_neox", "gpt_neox")
    adapter = make_adapter(model, tmp_path / "neox-lora", 8, None, seed=0)
    job = lora_job(tmp_path / "j", model, {"neox": adapter}, {"id": ["a"], "prompt": [[5]], "adapter": ["neox"]})
    result = cli("validate", job)
    assert result.exit_code == 0, result.output
