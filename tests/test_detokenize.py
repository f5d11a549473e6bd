"""SamplingParams.detokenize (vLLM's: token ids without the text) and who decodes a job's text (texts.TextPlan):
the engine in its loop, the part writer on its thread, or no one."""

from __future__ import annotations

import pytest
import yaml

from batchgen import LLM, SamplingParams
from batchgen.job.outputs.texts import TextPlan, decode_texts
from batchgen.job.spec import parse_job


def test_stop_strings_need_the_text():
    with pytest.raises(ValueError, match=r"SamplingParams\.detokenize: stop strings"):
        SamplingParams(stop=["\n"], detokenize=False)
    assert SamplingParams(stop_token_ids=[2], detokenize=False).detokenize is False


def test_the_engine_leaves_the_text_empty_and_the_tokens_as_they_are(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory="16MiB")
    prompts = ["a number of words", "other words, more of them"]
    decoded, raw = (llm.generate(prompts, SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=8,
                                                         ignore_eos=True, detokenize=flag), use_tqdm=False)
                    for flag in (True, False))
    for with_text, without in zip(decoded, raw, strict=True):
        for a, b in zip(with_text.outputs, without.outputs, strict=True):
            assert a.token_ids == b.token_ids and len(a.token_ids) == 8
            assert a.text and b.text == ""
            rows = [{"text": None, "token_ids": b.token_ids, "error": None}]
            decode_texts(llm.tokenizer, True, rows)  # the writer's decode gives the engine's text
            assert rows[0]["text"] == a.text


def _spec(tmp_path, sampling: dict | None = None, fields: list[str] | None = None, fmt: str = "jsonl"):
    job = {"model": {"path": "m"}, "input": {"paths": ["in.jsonl"], "prompt_column": "prompt"},
           "sampling": {"max_tokens": 4, **(sampling or {})},
           "output": {"dir": "out", "format": fmt, **({"fields": fields} if fields else {})}}
    return parse_job(yaml.safe_dump(job), tmp_path).spec


@pytest.mark.parametrize(("sampling", "fields", "spare", "want"), [
    ({}, ["text", "token_ids"], True, TextPlan(engine_decodes=False, writer_decodes=True)),
    ({}, ["text", "token_ids"], False, TextPlan()),  # no core for the writer: the engine decodes between steps
    ({}, ["token_ids"], False, TextPlan(engine_decodes=False)),  # no text column: no one decodes
    ({"stop": ["\n"]}, ["text"], True, TextPlan()),  # stop strings are found in the growing text
    ({"structured_outputs": {"regex": "[ab]+"}}, ["text"], True, TextPlan()),
    ({}, ["text", "parsed"], True, TextPlan()),  # parsed reads the text
    ({"beam_width": 2}, ["text"], True, TextPlan()),
    ({"detokenize": False}, ["text"], True, TextPlan()),  # the job asked for empty texts: kept as asked
    ({"overrides": {"stop": "stop_column"}}, ["text"], True, TextPlan()),  # a row may bring stop strings
    ({"overrides": {"max_tokens": "budget"}}, ["text"], True, TextPlan(engine_decodes=False, writer_decodes=True)),
])
def test_who_decodes_the_text(tmp_path, sampling, fields, spare, want):
    assert TextPlan.of(_spec(tmp_path, sampling, fields), True, _Engine(spare)) == want


def test_task_rows_and_openai_responses_keep_the_engines_text(tmp_path):
    assert TextPlan.of(_spec(tmp_path, fields=["text"]), False, _Engine(True)) == TextPlan()


def test_an_engine_without_a_tokenizer_decodes_its_own_text(tmp_path):
    """A job's own engine (BATCHGEN_ENGINE) may report a spare core and have no tokenizer for the writer."""
    spec = _spec(tmp_path, fields=["text"])
    assert TextPlan.of(spec, True, _Engine(True, tokenizer=None)) == TextPlan()
    assert TextPlan.of(spec, True, object()) == TextPlan()  # neither spare_core nor tokenizer


class _Engine:
    def __init__(self, spare_core: bool, tokenizer: object = "a tokenizer"):
        self.spare_core, self.tokenizer = spare_core, tokenizer


def test_the_writer_fills_only_texts_still_to_come():
    class Upper:
        @staticmethod
        def decode(ids, skip_special_tokens):
            assert skip_special_tokens is False
            return "".join(chr(65 + i) for i in ids)

    rows = [{"text": None, "token_ids": [0, 1], "error": None}, {"text": "kept", "token_ids": [2], "error": None},
            {"text": None, "token_ids": [], "error": None}, {"id": "x", "error": "failed"}]
    decode_texts(Upper(), False, rows)
    assert [r.get("text") for r in rows] == ["AB", "kept", "", None]
