"""A model directory without tokenizer files: a one-line error naming it, or, with
skip_tokenizer_init=True, token ids in and token ids out (as in vLLM)."""

from __future__ import annotations

import shutil

import pytest

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

