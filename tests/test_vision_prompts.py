"""Image prompts into token ids and image inputs (PromptEncoder with a vision-language model's preprocessor), and
the prefix cache with images: the same text with another image never shares a block, one image asked many
questions shares its blocks."""

from __future__ import annotations

import base64
import io

import pytest
from vision_kit import build_llava, image

from batchgen import LLM, SamplingParams
from batchgen.engine.prompts import EncodedPrompt, PromptEncoder
from batchgen.models.loader import load_tokenizer
from batchgen.models.vision.processing import load_preprocessor

IMAGE_TOKENS = 16  # the tiny LLaVA's: 32x32 crops of 8x8 patches


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def encoder(llava_dir):
    from transformers import AutoConfig

    tokenizer = load_tokenizer(llava_dir)
    return PromptEncoder(tokenizer, len(tokenizer), load_preprocessor(llava_dir, AutoConfig.from_pretrained(llava_dir),
                                                                      tokenizer))


def data_url(img) -> str:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_placeholders_expand_and_go_first_when_the_text_has_none(encoder):
    image_id = encoder.images.image_token_id
    text_ids = encoder.tokenizer("the quick brown fox")["input_ids"]
    plain, inline = encoder.encode_batch([
        {"prompt": "the quick brown fox", "multi_modal_data": {"image": image(1)}},
        {"prompt": "the <image> quick <image>", "multi_modal_data": {"image": [image(1), image(2)]}},
    ])
    assert plain.token_ids == [image_id] * IMAGE_TOKENS + text_ids
    assert [(i.start, i.length) for i in plain.multi_modal.images] == [(0, IMAGE_TOKENS)]
    first, second = inline.multi_modal.images
    assert inline.token_ids[first.start:first.end] == [image_id] * IMAGE_TOKENS
    assert inline.token_ids.count(image_id) == 2 * IMAGE_TOKENS and second.start > first.end
    assert first.content_hash == plain.multi_modal.images[0].content_hash != second.content_hash


def test_matches_transformers_processor(llava_dir, encoder):
    """The token ids are the model's own processor's (LlavaProcessor expands the text, batchgen the token ids)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir)
    processor.patch_size, processor.vision_feature_select_strategy = 8, "default"
    processor.num_additional_image_tokens = 1
    want = processor(text=["hello <image> world"], images=[image(5)], return_tensors="pt")
    got = encoder.encode_prompt({"prompt": "hello <image> world", "multi_modal_data": {"image": [image(5)]}})
    assert got.token_ids == want["input_ids"][0].tolist()
    assert got.multi_modal.images[0].pixel_values.equal(want["pixel_values"])


def test_images_are_made_rgb_and_loaded(encoder, tmp_path):
    """A grayscale or RGBA image is converted to RGB, a path or bytes loaded: the same pixels, the same inputs."""
    rgb = image(6)
    rgb.save(tmp_path / "six.png")
    want = encoder.encode_prompt({"prompt": "x", "multi_modal_data": {"image": rgb}})
    for value in (str(tmp_path / "six.png"), (tmp_path / "six.png").read_bytes(), rgb.convert("RGBA")):
        got = encoder.encode_prompt({"prompt": "x", "multi_modal_data": {"image": value}})
        assert got.multi_modal.images[0].content_hash == want.multi_modal.images[0].content_hash
    gray = encoder.encode_prompt({"prompt": "x", "multi_modal_data": {"image": rgb.convert("L")}})
    assert gray.multi_modal.images[0].pixel_values.shape == want.multi_modal.images[0].pixel_values.shape
    (missing,) = encoder.encode_batch([{"prompt": "x", "multi_modal_data": {"image": str(tmp_path / "gone.png")}}])
    assert isinstance(missing, ValueError) and "multi_modal_data.image[0]" in str(missing)


def test_chat_image_parts(encoder):
    """image_url parts are loaded (a data: URL here), image parts taken as they are: the same image, the same
    inputs; the chat template renders each part as the placeholder."""
    def chat(part):
        return [{"role": "user", "content": [part, {"type": "text", "text": "what is it"}]}]

    by_url, by_image = encoder.encode_batch([chat({"type": "image_url", "image_url": {"url": data_url(image(3))}}),
                                             chat({"type": "image", "image": image(3)})])
    assert isinstance(by_url, EncodedPrompt) and by_url.token_ids == by_image.token_ids
    assert by_url.multi_modal.images[0].content_hash == by_image.multi_modal.images[0].content_hash
    assert "<image>" in by_url.text


def test_a_tokenizer_without_chat_template_takes_the_processors(llava_dir, tmp_path):
    """llava-hf's models keep their chat template in the processor's chat_template.json."""
    import json
    import shutil

    from transformers import AutoConfig

    model = shutil.copytree(llava_dir, tmp_path / "llava")
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        if (model / name).exists():
            config = json.loads((model / name).read_text()) if name.endswith(".json") else None
            if config is None:
                (model / name).unlink()
            else:
                config.pop("chat_template", None)
                (model / name).write_text(json.dumps(config))
    tokenizer = load_tokenizer(model)
    assert not tokenizer.chat_template
    (model / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'][0]['type'] }}"}))
    encoder = PromptEncoder(tokenizer, len(tokenizer), load_preprocessor(model, AutoConfig.from_pretrained(model),
                                                                         tokenizer))
    assert encoder.chat_text([{"role": "user", "content": [{"type": "image"}]}]) == "image"


def test_bad_image_prompts_are_one_line_errors(encoder):
    mismatch, no_text, bad_key, fine = encoder.encode_batch([
        {"prompt": "<image> and <image>", "multi_modal_data": {"image": image(1)}},
        {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image(1)}},
        {"prompt": "x", "multi_modal_data": {"video": [1]}},
        {"prompt": "the fox"},
    ])
    assert isinstance(mismatch, ValueError) and "2 image placeholder(s)" in str(mismatch) and "1 image(s)" in str(
        mismatch)
    assert isinstance(no_text, ValueError) and "'prompt'" in str(no_text)
    assert isinstance(bad_key, ValueError) and "'image'" in str(bad_key)
    assert fine == EncodedPrompt("the fox", encoder.tokenizer("the fox")["input_ids"])
    with pytest.raises(ValueError, match="generation"):  # scoring and pooling take no images
        encoder.encode({"prompt": "x", "multi_modal_data": {"image": image(1)}})
    text_only = PromptEncoder(encoder.tokenizer, encoder.vocab_size)
    with pytest.raises(ValueError, match="multi_modal_data"):
        text_only.encode_prompt({"prompt": "x", "multi_modal_data": {"image": image(1)}})
    assert text_only.encode_prompt({"prompt_token_ids": [3, 4]}) == EncodedPrompt(None, [3, 4])


def test_prefix_cache_keys_blocks_by_image(llava_dir):
    """Image tokens fill the first two blocks of 8: another image with the same text shares nothing, the same
    image with another question shares both image blocks."""
    llm = LLM(llava_dir, dtype="float32", kv_cache_memory="16MiB", block_size=8)
    greedy = SamplingParams(max_tokens=2, temperature=0)

    def hits(img, question: str) -> int:
        before = llm.stats()["prefix_cache_hits"]
        llm.generate({"prompt": question, "multi_modal_data": {"image": img}}, greedy, use_tqdm=False)
        return llm.stats()["prefix_cache_hits"] - before

    question = "the quick brown fox jumps over the lazy dog"  # more than 8 tokens: a third full block
    assert hits(image(1), question) == 0
    assert hits(image(2), question) == 0
    assert hits(image(1), "a batch of prompts") == IMAGE_TOKENS
    assert hits(image(1).copy(), question) == IMAGE_TOKENS + 8  # the same pixels in another object: all it can


def test_a_language_model_neither_native_nor_on_the_backend_is_refused_before_loading(tmp_path):
    """LLaVA over a decoder of the transformers backend loads (tests/test_vision_models.py: OLMo 2); over a
    state-space one, neither runs it."""
    import transformers as tf

    tf.LlavaConfig(text_config={"model_type": "mamba"}, architectures=["LlavaForConditionalGeneration"]
                   ).save_pretrained(tmp_path)
    problems = [str(p) for p in LLM.check_config(tmp_path) if p.option == "model"]
    assert any("'mamba' has no native decoder" in p and "the transformers backend cannot run it: it has " in p
               and "which keep a state instead of a KV cache" in p for p in problems), problems


@pytest.mark.parametrize(("config", "why"), [
    ("PaliGemmaConfig", "attend to each other both ways (a bidirectional prefix)"),
    ("MllamaConfig", "enter through cross-attention layers of the language model"),
    ("Qwen3VLConfig", "positions are 3-D (M-RoPE), which batchgen runs natively for Qwen2-VL and Qwen2.5-VL only"),
    ("Florence2Config", "it is an encoder-decoder model"),
    ("LlavaOnevisionConfig", "family 'llava_onevision' is not one batchgen runs"),  # its processor needs torchvision
])
def test_vision_families_that_do_not_fit_are_refused_in_one_line(tmp_path, config, why):
    """The vision-language families whose images do not enter as embeddings at image tokens of a causal decoder with
    1-D positions (or that no test has checked): one line naming the architecture and why, before loading."""
    import transformers as tf

    hf_config = getattr(tf, config)()
    hf_config.architectures = [config.removesuffix("Config") + "ForConditionalGeneration"]
    hf_config.save_pretrained(tmp_path)
    problems = [str(p) for p in LLM.check_config(tmp_path) if p.option == "model"]
    assert len(problems) == 1, problems
    assert f"architecture {hf_config.architectures[0]} cannot run in batchgen: " in problems[0], problems
    assert why in problems[0] and "\n" not in problems[0], problems


def test_a_generic_family_over_a_language_model_the_backend_cannot_run_is_refused_before_loading(tmp_path):
    """The generic path's language model always runs on the transformers backend: a state-space one is refused."""
    import transformers as tf

    tf.LlavaNextConfig(text_config={"model_type": "mamba"}, architectures=["LlavaNextForConditionalGeneration"]
                       ).save_pretrained(tmp_path)
    problems = [str(p) for p in LLM.check_config(tmp_path) if p.option == "model"]
    assert any("'mamba' cannot run on the transformers backend: it has " in p and "LlavaNext" in p
               for p in problems), problems
