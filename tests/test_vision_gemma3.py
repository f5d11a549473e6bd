"""Gemma 3 with images, beyond the parity cases of test_vision_models.py: its prompts as its own processor
writes them, its image tokens seeing each other both ways (transformers' output changes without that), prefill
chunks that never end inside an image, a prefix-cache hit that ends inside one, and a token budget too small for
an image refused before any request."""

from __future__ import annotations

import pytest
import torch
from vision_kit import GEMMA3_SPECIALS, build_gemma3, hf_greedy, image, reference_images

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError
from batchgen.models.vision import gemma3
from batchgen.models.vision.inputs import ImageInput, MultiModalInputs

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers as tf

    return tf.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def two_images() -> dict:
    return {"prompt": "hello <start_of_image> world <start_of_image> jumps",
            "multi_modal_data": {"image": [image(2), image(3, (80, 60))]}}


def test_token_ids_and_pixels_are_the_processors(model_dir):
    from transformers import AutoTokenizer, Gemma3Processor

    llm = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB")
    names = dict(zip(("boi_token", "image_token", "eoi_token"), GEMMA3_SPECIALS, strict=True))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, extra_special_tokens=names)
    processor = Gemma3Processor(image_processor=llm.engine.prompts.images.image_processor, tokenizer=tokenizer,
                                image_seq_length=4)
    prompt = two_images()
    want = processor(text=[prompt["prompt"]], images=[prompt["multi_modal_data"]["image"]], return_tensors="pt")
    encoded = llm.encode_batch([prompt])[0]
    assert encoded.token_ids == want["input_ids"][0].tolist()
    assert torch.equal(torch.cat([i.pixel_values for i in encoded.multi_modal.images]), want["pixel_values"])
    # transformers' image tokens (its token_type_ids) are the runs batchgen's images cover
    runs = want["token_type_ids"][0].nonzero().flatten().tolist()
    assert runs == [p for i in encoded.multi_modal.images for p in range(i.start, i.end)]


def test_image_tokens_see_their_whole_image(model_dir, reference):
    """transformers' output with the image tokens' two-way attention (what batchgen matches) is not its causal
    one: the parity tests would catch a causal prefill."""
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB")
    encoded = llm.encode_batch([two_images()])[0]
    ids = torch.tensor([encoded.token_ids])
    kwargs = reference_images(reference, ids, encoded.multi_modal.images)
    with torch.no_grad():
        both_ways = reference(ids, **kwargs).logits
        kwargs.pop("token_type_ids")
        causal = reference(ids, **kwargs).logits
    assert (both_ways - causal).abs().max() > 0.1
    got = llm.generate([two_images()], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(reference, encoded, MAX_TOKENS)


def test_chunks_never_end_inside_an_image(model_dir, reference, monkeypatch):
    """Budgets of 4 to 9 tokens a step (an image is 4): every chunk that feeds image tokens feeds the rest of
    the image, some chunks end early before an image, and the output stays transformers'."""
    fed = []
    original = gemma3.with_key_limits

    def spy(meta, positions, rows):
        fed.extend((r.start, r.start + r.count, r.inputs) for r in rows)
        return original(meta, positions, rows)

    monkeypatch.setattr(gemma3, "with_key_limits", spy)
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB")
    encoded = llm.encode_batch([two_images()])[0]
    want = hf_greedy(reference, encoded, MAX_TOKENS)
    early = 0
    for budget in range(4, 10):
        fed.clear()
        chunked = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB", block_size=8, max_num_seqs=1,
                      max_num_batched_tokens=budget, enable_prefix_caching=False)
        assert chunked.generate([two_images()], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        assert fed, "no step fed image tokens"
        for start, end, inputs in fed:
            assert all(not image.start < end < image.end for image in inputs.images), (budget, start, end)
            early += end - start < budget and end < len(encoded.token_ids)
    assert early > 0


def test_prefix_hit_inside_an_image(model_dir, reference):
    """Blocks of 8: the second run finds the prompt's first blocks cached, the first image cut by a block's end,
    and prefills from inside it."""
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB", block_size=8, max_num_batched_tokens=16,
              max_num_seqs=4)
    prompt = {"prompt": "the quick <start_of_image> brown fox", "multi_modal_data": {"image": image(5)}}
    encoded = llm.encode_batch([prompt])[0]
    first = encoded.multi_modal.images[0]
    assert first.start < 8 < first.end or first.start < 16 < first.end  # a block boundary inside the image
    want = hf_greedy(reference, encoded, MAX_TOKENS)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    hits = llm.stats()["prefix_cache_hits"]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.stats()["prefix_cache_hits"] > hits


def test_chunk_end_and_key_limits():
    images = [ImageInput(torch.zeros(1), 5, 4, 1), ImageInput(torch.zeros(1), 12, 4, 2)]
    both_ways, causal = MultiModalInputs(images, bidirectional=True), MultiModalInputs(images)
    assert [both_ways.chunk_end(0, end) for end in (5, 6, 8, 9, 10, 13)] == [5, 5, 5, 9, 10, 12]
    assert both_ways.chunk_end(5, 8) == 5 and both_ways.chunk_end(7, 8) == 7  # the image waits for room
    assert both_ways.chunk_end(7, 9) == 9  # from inside an image (a prefix-cache hit) to its end
    assert causal.chunk_end(0, 8) == 8
    assert both_ways.key_limits(7, 14) == [(7, 9, 8), (12, 14, 15)] and causal.key_limits(7, 14) == []


def test_a_budget_smaller_than_an_image_is_refused(model_dir):
    with pytest.raises(ConfigError, match="max_num_batched_tokens: 3 is less than one image's 4 tokens"):
        LLM(model_dir, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=3, max_num_seqs=2)
