"""A model directory without tokenizer files: a one-line error naming it, or, with
skip_tokenizer_init=True, token ids in and token ids out (as in vLLM)."""

from __future__ import annotations

import shutil

import pytest
from jobkit import cli, outputs_by_key, write_job, write_jsonl

from batchgen import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


@pytest.fixture(params=["weights-only", "tokenizer-config-only"])
def bare_model(request, tmp_path, tiny_model_dirs):
    """The tiny Llama without its tokenizer: config and weights, maybe a tokenizer_config.json."""
    src, dst = tiny_model_dirs["llama"], tmp_path / "bare"
    dst.mkdir()
    keep = ["config.json", "generation_config.json", "model.safetensors"]
    if request.param == "tokenizer-config-only":
        keep.append("tokenizer_config.json")
    for name in keep:
        shutil.copy(src / name, dst / name)
    return dst


def test_missing_tokenizer_is_a_one_line_error(bare_model):
    with pytest.raises(ValueError) as e:
        LLM(str(bare_model))
    message = str(e.value)
    assert message.startswith(f"model: model directory {str(bare_model)!r} has no tokenizer files (tokenizer.json")
    assert "skip_tokenizer_init=True" in message and "\n" not in message


def test_skip_tokenizer_init_gives_token_ids_in_and_out(bare_model, tiny_model_dirs):
    llm = LLM(str(bare_model), dtype="float32", skip_tokenizer_init=True)
    assert llm.tokenizer is None
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    full = LLM(str(tiny_model_dirs["llama"]), dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in full]
    assert all(o.outputs[0].text == "" and o.prompt is None for o in outs)
    with pytest.raises(ValueError, match="^prompt: a text prompt needs a tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="^stop: stop strings need a tokenizer"):
        llm.generate(PROMPTS, SamplingParams(stop=["x"]), use_tqdm=False)


def test_job_with_skip_tokenizer_init(tmp_path, bare_model):
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": "text"}])
    job = {
        "model": {"path": str(bare_model), "dtype": "float32", "kv_cache_memory": "16MiB"},
        "input": {"paths": ["in.jsonl"], "id_column": "id", "prompt_column": "prompt"},
        "sampling": {"temperature": 0, "max_tokens": 4, "ignore_eos": True},
        "output": {"dir": "out", "fields": ["token_ids"]},
        "progress_interval": 3600,
    }
    r = cli("validate", write_job(tmp_path / "job.yaml", job))
    assert r.exit_code == 1
    assert r.stderr.splitlines()[0].startswith(f"model.path: model directory {str(bare_model)!r} has no tokenizer")
    job["model"]["skip_tokenizer_init"] = True
    job["output"]["fields"] = ["text", "token_ids"]
    r = cli("validate", write_job(tmp_path / "job.yaml", job))
    assert r.exit_code == 1 and r.stderr.splitlines()[0].startswith(
        "output.fields: 'text' needs the model's tokenizer, which model.skip_tokenizer_init leaves out")
    job["output"]["fields"] = ["token_ids"]
    assert cli("validate", write_job(tmp_path / "job.yaml", job)).exit_code == 0
    r = cli("run", tmp_path / "job.yaml")
    assert r.exit_code == 0, r.output
    rows = outputs_by_key(tmp_path / "out")
    assert rows[("a", 0)][1] is None
    assert rows[("b", 0)][1].startswith("in.jsonl line 2: field 'prompt': a text prompt needs a tokenizer")
