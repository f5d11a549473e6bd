"""`batchgen run` end to end on the real engine with a tiny random LLaVA (tests/vision_kit.py): images as Parquet
bytes and as chat image parts give the same text as ``LLM.generate`` / ``LLM.chat`` on the same images, and a
broken image is its row's error while the others are written."""

from __future__ import annotations

import io

import pyarrow as pa
import pytest
from jobkit import cli, read, write_job, write_jsonl, write_parquet
from vision_kit import build_llava, image

from batchgen import LLM, SamplingParams

ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256}
MAX_TOKENS = 6


def png(im) -> bytes:
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(autouse=True)
def _real_engine(monkeypatch):
    monkeypatch.delenv("BATCHGEN_ENGINE", raising=False)


def test_caption_job_on_llava_matches_the_python_api(tmp_path, llava):
    pics = [image(i, (40 + 8 * i, 50)) for i in range(4)]
    write_parquet(tmp_path / "in.parquet", pa.table({
        "id": ["a", "b", "c", "d", "bad"], "prompt": ["a photo of"] * 4 + ["x"],
        "image": pa.array([png(p) for p in pics] + [b"not an image"], pa.binary())}))
    (tmp_path / "c.png").write_bytes(png(pics[2]))
    write_jsonl(tmp_path / "chat.jsonl", [{"id": "chat", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "c.png"}}, {"type": "text", "text": "what is this"}]}]}])
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    job = write_job(tmp_path / "job.yaml", {
        "model": {"path": str(llava), **ENGINE},
        "input": {"paths": ["in.parquet"], "id_column": "id", "prompt_column": "prompt", "images_column": "image"},
        "sampling": sampling, "output": {"dir": "out", "fields": ["text", "token_ids"]}, "progress_interval": 3600})
    chat_job = write_job(tmp_path / "chat.yaml", {
        "model": {"path": str(llava), **ENGINE},
        "input": {"paths": ["chat.jsonl"], "id_column": "id", "messages_column": "messages"},
        "sampling": sampling, "output": {"dir": "chat_out", "fields": ["text", "token_ids"]},
        "progress_interval": 3600})
    for j in (job, chat_job):
        result = cli("run", j)
        assert result.exit_code == 0, result.output
    rows = read(tmp_path / "out")[1]
    assert rows["bad"]["error"].startswith("in.parquet row 4: field 'image': image bytes (12 bytes): not an image")
    llm = LLM(llava, **ENGINE)
    params = SamplingParams(**sampling)
    want = llm.generate([{"prompt": "a photo of", "multi_modal_data": {"image": [p]}} for p in pics], params,
                        use_tqdm=False)
    assert [rows[k]["token_ids"] for k in "abcd"] == [o.outputs[0].token_ids for o in want]
    chat = llm.chat([{"role": "user", "content": [{"type": "image", "image": pics[2]},
                                                  {"type": "text", "text": "what is this"}]}], params, use_tqdm=False)
    assert read(tmp_path / "chat_out")[1]["chat"]["token_ids"] == chat[0].outputs[0].token_ids
