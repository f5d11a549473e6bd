"""Jobs with images (issue 55) on a fake vision-language engine (tests/fake_vlm.py): images as Parquet
bytes, paths relative to the input file, data URLs, bucket URLs, a Hugging Face dataset's Image feature,
chat messages with image parts; a broken image is its row's error and the job goes on; a text-only model
is refused before any row; a run SIGKILLed mid-way resumes with each row once."""

from __future__ import annotations

import base64
import io
import json
import signal
import subprocess
import time

import fake_vlm
import pyarrow as pa
import pytest
from jobkit import (
    batchgen_cmd,
    cli,
    job_dict,
    make_model,
    parts,
    read,
    subprocess_env,
    write_job,
    write_jsonl,
    write_parquet,
)
from PIL import Image

VLM = "fake_vlm:FakeVLM"
COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]


def png(i: int, size: tuple[int, int] = (12, 9), mode: str = "RGB") -> bytes:
    """A small image of its own colour (``i``), encoded as PNG."""
    out = io.BytesIO()
    Image.new(mode, size, COLORS[i % len(COLORS)] + ((255,) if mode == "RGBA" else ())).save(out, "PNG")
    return out.getvalue()


def tag(i: int, size: tuple[int, int] = (12, 9)) -> str:
    """The text the fake engine makes of image ``i``."""
    return f"<image:{fake_vlm.digest(Image.open(io.BytesIO(png(i, size))).convert('RGB'))}>"


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_job(root, input_: dict, vision: bool = True, **overrides) -> object:
    """A job file over ``root``'s files with a fake model dir (a vision-language one's config unless not ``vision``)."""
    make_model(root / "model", **({"vision_config": {"model_type": "fake"}} if vision else {}))
    spec = job_dict(input={"paths": ["in.jsonl"], "id_column": "id", "prompt_column": "prompt",
                           "carry_columns": [], **input_},
                    sampling={"n": 1, "temperature": 0.0, "max_tokens": 4}, **overrides)
    return write_job(root / "job.yaml", spec)


def run_vlm(job, *args):
    fake_vlm.RECORDED.clear()
    result = cli("run", job, "--engine", VLM, *args)
    assert result.exit_code == 0, result.output
    return read(job.parent / "out")[1]


@pytest.fixture(autouse=True)
def _quiet_records():
    fake_vlm.RECORDED.clear()
    yield
    fake_vlm.RECORDED.clear()


# ------------------------------------------------------------------------------------------ sources


def test_parquet_bytes_become_prompt_and_images(tmp_path):
    """A Parquet binary column, one image a row: shape {"prompt", "multi_modal_data": {"image": [PIL]}}."""
    write_parquet(tmp_path / "in.parquet", pa.table({
        "id": [f"r{i}" for i in range(6)], "prompt": [f"describe {i}" for i in range(6)],
        "image": pa.array([png(i) for i in range(6)], pa.binary())}))
    job = image_job(tmp_path, {"paths": ["in.parquet"], "images_column": "image"})
    rows = run_vlm(job)
    assert sorted(rows) == [f"r{i}" for i in range(6)] and all(r["error"] is None for r in rows.values())
    got = {rec["text"]: rec for rec in fake_vlm.RECORDED}
    for i in range(6):
        rec = got[f"describe {i}"]
        assert rec["shape"] == "prompt" and rec["images"] == [tag(i)] and rec["sizes"] == [[12, 9]]


def test_paths_data_urls_lists_and_a_broken_image(tmp_path):
    """Paths relative to the input file, file:// and data URLs, several images a row; a missing, a corrupt and
    an oversize image are each their row's error naming the row, the field and the image; the rest is written."""
    data = tmp_path / "data"
    (data / "pics").mkdir(parents=True)
    for i in range(3):
        (data / "pics" / f"{i}.png").write_bytes(png(i))
    noise = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(noise, "PNG")
    (data / "pics" / "broken.png").write_bytes(noise.getvalue()[:len(noise.getvalue()) // 2])
    (data / "pics" / "big.png").write_bytes(png(1, size=(400, 300)))
    write_jsonl(data / "in.jsonl", [
        {"id": "one", "prompt": "a", "images": "pics/0.png"},
        {"id": "two", "prompt": "b", "images": ["pics/1.png", data_url(png(2))]},
        {"id": "url", "prompt": "c", "images": [f"file://{data}/pics/2.png"]},
        {"id": "none", "prompt": "d", "images": []},
        {"id": "missing", "prompt": "e", "images": ["pics/0.png", "pics/nope.png"]},
        {"id": "broken", "prompt": "f", "images": "pics/broken.png"},
        {"id": "big", "prompt": "g", "images": "pics/big.png"},
        {"id": "null", "prompt": "h", "images": None},
        {"id": "last", "prompt": "i", "images": "pics/1.png"},
    ])
    job = image_job(tmp_path, {"paths": ["data/in.jsonl"], "images_column": "images",
                               "max_image_pixels": 100_000})
    rows = run_vlm(job)
    assert len(rows) == 9
    assert {k for k, r in rows.items() if r["error"] is None} == {"one", "two", "url", "none", "last"}
    errors = {k: r["error"] for k, r in rows.items() if r["error"]}
    assert errors["missing"].startswith("data/in.jsonl line 5: field 'images' [1]: image 'pics/nope.png': not found")
    assert errors["broken"].startswith("data/in.jsonl line 6: field 'images': image 'pics/broken.png': ")
    assert "truncated or corrupt" in errors["broken"]
    assert errors["big"] == ("data/in.jsonl line 7: field 'images': image 'pics/big.png': 400x300 pixels, more than "
                             "the 100,000 an image may have (a decompression bomb, or a scan to shrink first)")
    assert errors["null"].startswith("data/in.jsonl line 8: field 'images': missing or null")
    by_text = {rec.get("text", rec.get("prompt")): rec for rec in fake_vlm.RECORDED}
    assert by_text["a"]["images"] == [tag(0)]
    assert by_text["b"]["images"] == [tag(1), tag(2)]
    assert by_text["c"]["images"] == [tag(2)]
    assert by_text["d"] == {"shape": "text", "prompt": "d"}  # no images: the prompt as it is


def test_chat_image_parts_placeholders_and_first_user_message(tmp_path):
    """messages_column: image_url parts load; bare {"type": "image"} placeholders take images_column's images in
    order; without placeholders they go first in the first user message; a mismatch is the row's error."""
    (tmp_path / "p0.png").write_bytes(png(0))
    sys_msg = {"role": "system", "content": "be brief"}
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "parts", "images": [], "messages": [{"role": "user", "content": [
            {"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": "p0.png"}},
            {"type": "image_url", "image_url": {"url": data_url(png(1))}}]}]},
        {"id": "holes", "images": [data_url(png(2)), "p0.png"], "messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]},
        {"id": "front", "images": ["p0.png"], "messages": [sys_msg, {"role": "user", "content": "what is it"}]},
        {"id": "textparts", "images": [], "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]},
        {"id": "short", "images": ["p0.png"], "messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "image"}]}]},
        {"id": "badpart", "images": [], "messages": [{"role": "user", "content": [{"type": "video"}]}]},
    ])
    job = image_job(tmp_path, {"prompt_column": None, "messages_column": "messages", "images_column": "images"})
    rows = run_vlm(job)
    assert {k for k, r in rows.items() if r["error"] is None} == {"parts", "holes", "front", "textparts"}
    assert rows["short"]["error"] == ("in.jsonl line 5: field 'messages': message [0].content[1]: image "
                                      "placeholder 2, but field 'images' has 1 image")
    assert rows["badpart"]["error"] == ("in.jsonl line 6: field 'messages': message [0].content[0].type: expected "
                                        "text, image_url or image, got 'video'")
    contents = sorted(rec["messages"][-1]["content"] for rec in fake_vlm.RECORDED)
    assert contents == sorted([f"compare{tag(0)}{tag(1)}", f"{tag(2)}and{tag(0)}", f"{tag(0)}what is it", "x\ny"])
    front = next(rec for rec in fake_vlm.RECORDED if rec["messages"][0] == sys_msg)
    assert front["messages"][1]["content"] == f"{tag(0)}what is it"


def test_hf_dataset_with_an_image_feature(tmp_path):
    datasets = pytest.importorskip("datasets")
    pics = [Image.open(io.BytesIO(png(i, mode="RGBA" if i == 1 else "RGB"))) for i in range(4)]
    ds = datasets.Dataset.from_dict({"question": [f"q{i}" for i in range(4)], "image": pics},
                                    features=datasets.Features({"question": datasets.Value("string"),
                                                                "image": datasets.Image()}))
    ds.save_to_disk(str(tmp_path / "saved"))
    job = image_job(tmp_path, {"paths": None, "id_column": None, "dataset": {"path": "saved"},
                               "prompt_column": "question", "images_column": "image"})
    rows = run_vlm(job)
    assert sorted(rows) == [f"train:{i}" for i in range(4)] and all(r["error"] is None for r in rows.values())
    got = {rec["text"]: rec["images"] for rec in fake_vlm.RECORDED}
    assert got["q0"] == [tag(0)] and got["q2"] == [tag(2)]
    white = Image.new("RGB", (12, 9), COLORS[1])  # an opaque RGBA image: its colour, on white unchanged
    assert got["q1"] == [f"<image:{fake_vlm.digest(white)}>"]


def test_bucket_urls_and_a_parquet_file_in_the_bucket(tmp_path, bucket):
    """Images named by s3:// URLs, and by paths relative to an input file that is itself in the bucket."""
    from bucketkit import upload

    for i in range(3):
        upload(f"{bucket}/pics/{i}.png", png(i))
    write_parquet(tmp_path / "in.parquet", pa.table({
        "id": ["abs", "rel", "gone"], "prompt": ["p", "q", "r"],
        "image": [f"{bucket}/pics/0.png", "../pics/2.png", f"{bucket}/pics/nope.png"]}))
    upload(f"{bucket}/inputs/in.parquet", tmp_path / "in.parquet")
    job = image_job(tmp_path, {"paths": [f"{bucket}/inputs/in.parquet"], "images_column": "image"})
    rows = run_vlm(job)
    assert rows["abs"]["error"] is None and rows["rel"]["error"] is None
    assert rows["gone"]["error"].startswith(f"{bucket}/inputs/in.parquet row 2: field 'image': "
                                            f"image '{bucket}/pics/nope.png': not found")
    got = {rec["text"]: rec["images"] for rec in fake_vlm.RECORDED}
    assert got == {"p": [tag(0)], "q": [tag(2)]}


def test_openai_batch_image_parts(tmp_path):
    """/v1/chat/completions bodies with image_url parts (a data URL, a path beside the file), as vLLM's run-batch."""
    (tmp_path / "cat.png").write_bytes(png(3))
    make_model(tmp_path / "model")

    def request(cid: str, url: str) -> dict:
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "caption"}, {"type": "image_url", "image_url": {"url": url}}]}]}}

    write_jsonl(tmp_path / "req.jsonl", [request("d", data_url(png(4))), request("p", "cat.png"),
                                         request("x", "nothere.png")])
    result = cli("run-batch", "-i", tmp_path / "req.jsonl", "-o", tmp_path / "out.jsonl", "--model",
                 tmp_path / "model", "--engine", VLM)
    assert result.exit_code == 0, result.output
    lines = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert lines["d"]["error"] is None and lines["p"]["error"] is None
    assert lines["x"]["error"]["message"].startswith("req.jsonl line 3: field 'body.messages': message [0].content[1]: "
                                                     "image 'nothere.png': not found")
    got = sorted(rec["messages"][0]["content"] for rec in fake_vlm.RECORDED)
    assert got == sorted([f"caption{tag(4)}", f"caption{tag(3)}"])


# ------------------------------------------------------------------------------------ the model, resume


def test_a_text_only_model_is_refused_before_any_row(tmp_path):
    """By validate, from a local model's config.json; by the run, from the loaded engine (a model fetched first)."""
    write_parquet(tmp_path / "in.parquet", pa.table({"id": ["a"], "prompt": ["p"],
                                                     "image": pa.array([png(0)], pa.binary())}))
    job = image_job(tmp_path, {"paths": ["in.parquet"], "images_column": "image"}, vision=False)
    for command in ("validate", "run"):
        result = cli(command, job, "--engine", VLM)
        assert result.exit_code == 1, result.output
        assert ("input.images_column: model model takes no images: its config.json has no vision_config (not a "
                "vision-language model)") in result.output
    job = image_job(tmp_path, {"paths": ["in.parquet"], "images_column": "image"})
    result = cli("run", job, "--engine", "fake_llm:FakeLLM")
    assert result.exit_code == 1
    assert "input.images_column: model model takes no images (not a vision-language model)" in result.output
    assert not list((tmp_path / "out").glob("part-*"))


def test_validate_knows_the_image_fields(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "p", "image": "x.png"}])
    job = image_job(tmp_path, {"image_column": "image", "max_image_size": "lots"})
    result = cli("validate", job, "--engine", VLM)
    assert result.exit_code == 1
    assert "input.image_column: unknown field (did you mean 'images_column'?)" in result.output
    assert "input.max_image_size: 'lots' is not a size (bytes, or with a unit: '64MiB', '2GB')" in result.output
    job = image_job(tmp_path, {"images_column": "picture"})
    result = cli("validate", job, "--engine", VLM)
    assert result.exit_code == 1
    assert "input.images_column: column 'picture' not found in in.jsonl (columns: id, image, prompt)" in result.output


def test_image_parts_for_a_text_only_model_are_row_errors(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "img", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                                                {"type": "text", "text": "x"}]}]},
        {"id": "txt", "messages": [{"role": "user", "content": "hello"}]}])
    job = image_job(tmp_path, {"prompt_column": None, "messages_column": "messages"})
    result = cli("run", job, "--engine", "fake_llm:FakeLLM")
    assert result.exit_code == 0, result.output
    rows = read(tmp_path / "out")[1]
    assert rows["txt"]["error"] is None
    assert rows["img"]["error"] == ("in.jsonl line 1: field 'messages': model model takes no images (not a "
                                    "vision-language model)")


def test_sigkill_mid_run_then_resume_each_row_once(tmp_path):
    n = 40
    (tmp_path / "pics").mkdir()
    for i in range(len(COLORS)):
        (tmp_path / "pics" / f"{i}.png").write_bytes(png(i))
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i:02d}", "prompt": f"caption {i}",
                                         "image": f"pics/{i % len(COLORS)}.png"} for i in range(n)])
    job = image_job(tmp_path, {"images_column": "image"}, max_in_flight=4,
                    output={"dir": "out", "rows_per_part": 4, "fields": ["text"]})
    env = subprocess_env(FAKE_LLM_STEP_SLEEP="0.02")
    env["BATCHGEN_ENGINE"] = VLM
    proc = subprocess.Popen(batchgen_cmd("run", job), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while parts(tmp_path / "out") < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = read(tmp_path / "out")[1]
    assert 0 < len(first) < n, len(first)
    done = subprocess.run(batchgen_cmd("run", job), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resumed = read(tmp_path / "out")[1]  # asserts each id once
    assert sorted(resumed) == [f"r{i:02d}" for i in range(n)]
    assert all(r["error"] is None for r in resumed.values())
    assert {k: resumed[k]["text"] for k in first} == {k: r["text"] for k, r in first.items()}
    # same image, same prompt text -> same output: the images reached the engine as the same pixels
    reference = image_job(tmp_path / "ref", {"images_column": "image"}, output={"dir": "out", "fields": ["text"]})
    write_jsonl(tmp_path / "ref" / "in.jsonl", [json.loads(x) for x in (tmp_path / "in.jsonl").read_text().split("\n")
                                                if x])
    (tmp_path / "ref" / "pics").symlink_to(tmp_path / "pics")
    assert {k: r["text"] for k, r in run_vlm(reference).items()} == {k: r["text"] for k, r in resumed.items()}


# ------------------------------------------------------------------------------------------ memory bounds


def test_the_feeder_bounds_decoded_images_ahead_and_taken():
    """Read ahead: prepared chunks wait while the images ahead are over ``ahead_bytes``; taken: no more than
    ``max_bytes`` (and at least the first row when there is no bound)."""
    import threading

    from batchgen.job.run.feeder import PreparedRow, RowFeeder

    prepared: list[int] = []
    lock = threading.Lock()

    def prepare(rows):
        with lock:
            prepared.extend(rows)
        return [PreparedRow(r, image_bytes=100) for r in rows]

    feeder = RowFeeder(iter(range(40)), prepare, chunk=2, background=True, ahead_bytes=450)
    deadline = time.monotonic() + 10
    while len(prepared) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(prepared) <= 6  # 4 rows (400 bytes) ahead, one more chunk prepared and held back
    first = feeder.take(10, max_bytes=250)
    assert [p.row for p in first] == [0, 1]
    assert [p.row for p in feeder.take(10, max_bytes=0)] == []
    assert [p.row for p in feeder.take(1, max_bytes=None)] == [2]
    got = [2]
    while not feeder.done:
        got += [p.row for p in feeder.take(3)]
    assert [0, 1, *got] == list(range(40))
    feeder.close()


def test_a_job_reading_images_reads_parquet_a_few_hundred_rows_at_a_time(tmp_path):
    """A batch's image bytes are all in memory at once: 256 rows, not the 65,536 a text job reads."""
    from batchgen.job.inputs import InputReader
    from batchgen.job.inputs.reader import IMAGE_BATCH_ROWS
    from batchgen.job.spec import InputSpec

    write_parquet(tmp_path / "in.parquet", pa.table({"id": [str(i) for i in range(1000)], "prompt": ["p"] * 1000,
                                                     "image": pa.array([b"x"] * 1000, pa.binary())}))
    spec = InputSpec(paths=["in.parquet"], id_column="id", prompt_column="prompt", images_column="image")
    reader = InputReader(spec, tmp_path)
    source = reader._source(reader.files[0])
    sizes = [len(b.columns) for b in source.column_batches(["id", "prompt", "image"])]
    assert max(sizes) == IMAGE_BATCH_ROWS and sum(sizes) == 1000
    assert [r.images for r in reader.rows()][:2] == [[b"x"], [b"x"]]


def test_a_dry_run_counts_the_images_without_reading_them(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "images": ["nowhere.png"], "messages": [{"role": "user", "content": "what is it"}]},
        {"id": "b", "images": [], "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "gone.png"}}, {"type": "text", "text": "and this"}]}]}])
    job = image_job(tmp_path, {"prompt_column": None, "messages_column": "messages", "images_column": "images"})
    result = cli("run", job, "--dry-run", "--engine", VLM)
    assert result.exit_code == 0, result.output
    assert "and 2 images in those rows, whose tokens (as many as the model gives an image) are not counted" in \
        result.output
    assert not (tmp_path / "out").exists()


def test_csv_cells_hold_a_path_or_a_json_list_of_paths(tmp_path):
    for i in range(2):
        (tmp_path / f"{i}.png").write_bytes(png(i))
    (tmp_path / "in.csv").write_text('id,prompt,image\none,a,0.png\ntwo,b,"[""0.png"", ""1.png""]"\n')
    job = image_job(tmp_path, {"paths": ["in.csv"], "images_column": "image"})
    rows = run_vlm(job)
    assert all(r["error"] is None for r in rows.values()) and sorted(rows) == ["one", "two"]
    assert {rec["text"]: rec["images"] for rec in fake_vlm.RECORDED} == {"a": [tag(0)], "b": [tag(0), tag(1)]}
