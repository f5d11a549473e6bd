"""Rows on their way to the engine: read and prepared a chunk at a time (``RowFeeder``), in the
foreground or on a thread of their own, and prompts encoded a chunk at a time (``encode_batch``)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from jobkit import cli, outputs_by_key, write_job, write_jsonl

from batchgen import LLM
from batchgen.engine.prompts import EncodedPrompt
from batchgen.job.run import runner as runner_module
from batchgen.job.run.feeder import PreparedRow, RowFeeder


def _prepared(rows):
    return [PreparedRow(row) for row in rows]


def _rows_of(taken):
    return [p.row for p in taken]


@pytest.mark.parametrize("background", [False, True])
def test_every_row_comes_once_in_order_whatever_is_taken_at_a_time(background):
    feeder = RowFeeder(iter(range(1000)), _prepared, chunk=7, background=background)
    got: list[int] = []
    sizes = iter([1, 3, 50, 2, 128, 9] * 100)
    while not feeder.done:
        got += _rows_of(feeder.take(next(sizes)))
    assert got == list(range(1000))
    assert feeder.take(5) == []


def test_in_the_background_take_without_wait_returns_only_what_is_ready():
    release = threading.Event()
    threads: set[str] = set()

    def slow(rows):
        threads.add(threading.current_thread().name)
        release.wait(10)
        return _prepared(rows)

    feeder = RowFeeder(iter(range(10)), slow, chunk=4, background=True)
    assert feeder.take(10, wait=False) == []  # the first chunk is still being prepared
    release.set()
    got = _rows_of(feeder.take(10, wait=True))
    assert got[:4] == [0, 1, 2, 3]  # at least the chunk waited for
    while not feeder.done:
        got += _rows_of(feeder.take(10))
    assert got == list(range(10))
    assert threads == {"batchgen-rows"}


@pytest.mark.parametrize("background", [False, True])
def test_an_input_error_comes_after_the_rows_before_it(background):
    def rows():
        yield from range(10)
        raise OSError("the bucket went away")

    feeder = RowFeeder(rows(), _prepared, chunk=3, background=background)
    got = _rows_of(feeder.take(8))
    with pytest.raises(OSError, match="went away"):
        while True:
            got += _rows_of(feeder.take(8))
    assert got == list(range(10))
    assert feeder.done


def test_close_ends_a_thread_blocked_on_a_full_queue():
    feeder = RowFeeder(iter(range(10**6)), _prepared, chunk=1, background=True)
    assert _rows_of(feeder.take(1)) == [0]
    feeder.close()
    feeder._thread.join(5)
    assert not feeder._thread.is_alive()


def test_close_waits_for_the_chunk_being_prepared():
    """A daemon thread left inside native code (the tokenizer) when the interpreter exits can abort the process:
    close() returns once the thread has finished the chunk it was preparing."""
    preparing, finished = threading.Event(), threading.Event()

    def slow(rows):
        preparing.set()
        threading.Event().wait(0.3)
        finished.set()
        return _prepared(rows)

    feeder = RowFeeder(iter(range(10**6)), slow, chunk=4, background=True)
    assert preparing.wait(10)
    feeder.close()
    assert finished.is_set()
    assert not feeder._thread.is_alive()


# ------------------------------------------------------------------------------ encode_batch


def test_encode_batch_equals_encoding_each_prompt(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory="16MiB")
    chat = [{"role": "user", "content": "tell me about number 3"}]
    prompts = ["the quick brown fox", chat, [5, 6, 7], "", "hello world", [{"role": "user", "content": "hi"}]]
    encoded = llm.encode_batch(prompts)
    engine = llm.engine.prompts
    for prompt, got in zip(prompts, encoded, strict=True):
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            assert got is prompt  # token ids are checked when added, not here
        else:
            assert isinstance(got, EncodedPrompt)
            assert (got.text, got.token_ids) == engine.encode(prompt)
    assert encoded[1].text.startswith("<|im_start|>") and encoded[1].token_ids


def test_the_encoder_settles_the_tokenizers_truncation_before_any_thread_encodes(tiny_model_dirs):
    from transformers import AutoTokenizer

    from batchgen.engine.prompts import PromptEncoder

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tokenizer.backend_tokenizer.enable_truncation(8)
    tokenizer.backend_tokenizer.enable_padding(length=32)
    text = "the quick brown fox jumps over the lazy dog " * 4
    encoder = PromptEncoder(tokenizer, 400)
    assert tokenizer.backend_tokenizer.truncation is None and tokenizer.backend_tokenizer.padding is None
    assert encoder.encode_batch([text])[0].token_ids == tokenizer.encode(text)
    assert len(tokenizer.encode(text)) > 8


def test_encode_batch_returns_each_prompts_error(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory="16MiB", skip_tokenizer_init=True)
    text, chat, ids = llm.encode_batch(["a text", [{"role": "user", "content": "hi"}], [1, 2]])
    assert isinstance(text, ValueError) and "a text prompt needs a tokenizer" in str(text)
    assert isinstance(chat, ValueError) and "a chat prompt needs a tokenizer" in str(chat)
    assert ids == [1, 2]


# ------------------------------------------------------------------- the runner on the real engine


def _job(root, model_dir):
    records = [{"id": f"r{i:02d}", "messages": [{"role": "user", "content": f"tell me about number {i}"}]}
               for i in range(40)]
    records[7] = {"id": "r07", "messages": []}
    records[20] = {"id": "r20", "messages": [{"role": "user", "content": "the quick brown fox " * 200}]}
    write_jsonl(root / "in.jsonl", records)
    job = {
        "model": {"path": str(model_dir), "dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256,
                  "num_threads": 1},
        "input": {"paths": ["in.jsonl"], "id_column": "id", "messages_column": "messages"},
        "sampling": {"n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 6, "ignore_eos": True},
        "output": {"dir": "out", "rows_per_part": 8, "fields": ["text", "token_ids"]},
        "max_in_flight": 6,
        "progress_interval": 3600,
    }
    return write_job(root / "job.yaml", job)


@pytest.fixture
def torch_threads_restored():
    """The job's num_threads sets torch's threads for the process: as they were after the test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_cpu_engine_on_fewer_threads_than_cores_has_a_spare_core(tiny_model_dirs, torch_threads_restored):
    cores = len(os.sched_getaffinity(0))
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory="16MiB", num_threads=cores)
    assert not llm.spare_core
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory="16MiB", num_threads=1)
    assert llm.spare_core == (cores > 1)


def test_rows_prepared_in_the_background_give_the_same_outputs(tmp_path, tiny_model_dirs, monkeypatch,
                                                               torch_threads_restored):
    """With a core free of the engine, rows are read and encoded on the feeder's thread and the samples'
    text is decoded on the part writer's; the outputs, errors included, equal a run that does it all between
    steps."""
    monkeypatch.delenv("BATCHGEN_ENGINE", raising=False)
    threads: list[str] = []
    decoded: list[tuple[str, int]] = []  # (thread, texts filled)
    prepare, decode = runner_module.Runner._prepare, runner_module.decode_texts

    def recording(self, rows, builder, encode_batch):
        assert encode_batch is not None
        threads.append(threading.current_thread().name)
        return prepare(self, rows, builder, encode_batch)

    def recording_decode(tokenizer, skip_special_tokens, rows):
        todo = sum(r.get("text") is None and r.get("error") is None for r in rows)
        decode(tokenizer, skip_special_tokens, rows)
        decoded.append((threading.current_thread().name, todo))

    monkeypatch.setattr(runner_module.Runner, "_prepare", recording)
    monkeypatch.setattr(runner_module, "decode_texts", recording_decode)
    outputs = {}
    for spare in (False, True):
        monkeypatch.setattr(LLM, "spare_core", property(lambda self, spare=spare: spare))
        threads.clear()
        decoded.clear()
        root = tmp_path / str(spare)
        root.mkdir()
        r = cli("run", _job(root, tiny_model_dirs["llama"]))
        assert r.exit_code == 0, r.output
        assert set(threads) == {"batchgen-rows" if spare else threading.current_thread().name}
        assert {name for name, _ in decoded} == ({"batchgen-parts_0"} if spare else set())
        assert sum(n for _, n in decoded) == (2 * 38 if spare else 0)
        outputs[spare] = outputs_by_key(root / "out")
    assert outputs[True] == outputs[False]
    assert len(outputs[True]) == 2 * 38 + 2
    assert "max_model_len" in outputs[True][("r20", 0)][1]
    assert outputs[True][("r07", 0)][1]
    assert all(err is None and text for (row, _), (text, err) in outputs[True].items() if row not in ("r07", "r20"))
