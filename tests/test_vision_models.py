"""Vision-language models on the paged engine: float32 greedy outputs token-identical to transformers'
`generate` on tiny random LLaVA (over a Llama decoder, and over OLMo 2 on the transformers backend), Qwen2-VL,
Qwen2.5-VL, Idefics3, SmolVLM, Mistral 3 and Gemma 3 models, and LLaVA-NeXT and Aya Vision on the generic path
(transformers' own model API, the language model on the transformers backend), with one and several images a
prompt (as vLLM's prompt dicts, inline placeholders, chat image parts), chunked prefill cutting through image
tokens (Gemma 3's ending before them), the prefix cache on and off, preemption by swap and by recompute, and n
samples sharing the prompt's blocks."""

from __future__ import annotations

import pytest
import torch
from vision_kit import (
    build_aya_vision,
    build_gemma3,
    build_idefics3,
    build_llava,
    build_llava_next,
    build_mistral3,
    build_qwen2_vl,
    hf_greedy,
    image,
)

from batchgen import LLM, SamplingParams
from batchgen.models.vision.backend import BackendDecoder
from batchgen.models.vision.generic import GenericVisionModel

FAMILIES = {"llava": build_llava, "qwen2_vl": build_qwen2_vl,
            "qwen2_5_vl": lambda path: build_qwen2_vl(path, version="2.5"), "idefics3": build_idefics3,
            "smolvlm": lambda path: build_idefics3(path, family="smolvlm"), "mistral3": build_mistral3,
            "gemma3": build_gemma3,
            # OLMo 2 has no native decoder: LLaVA's language model on the transformers backend
            "llava_olmo2": lambda path: build_llava(path, decoder="olmo2"),
            # the generic path: transformers' get_image_features and processor, the decoder on the backend
            "llava_next": build_llava_next, "aya_vision": build_aya_vision}
GENERIC = ("llava_next", "aya_vision")
MAX_TOKENS = 10
BLOCK_BYTES = 2 * 2 * 2 * 8 * 64 * 4  # K and V, 2 layers, 2 KV heads, blocks of 8, head_dim 64, float32
SETUPS = {
    "plain": dict(enable_prefix_caching=False),
    # chunks of 10 tokens cut every image's tokens (Gemma 3's end before one); blocks of 8 split them over blocks
    "chunked": dict(block_size=8, max_num_batched_tokens=10, max_num_seqs=4),
    # a KV cache that holds the longest request alone (see test_greedy_matches_transformers)
    "swap": dict(block_size=8, swap_space="8MiB", preemption_mode="swap"),
    "recompute": dict(block_size=8, preemption_mode="recompute"),
}


def prompts(placeholder: str) -> list:
    """One image before the text (the text has no placeholder), two images inline, two chat image parts."""
    return [
        {"prompt": "the quick brown fox", "multi_modal_data": {"image": image(1)}},
        {"prompt": f"hello {placeholder} world {placeholder} jumps",
         "multi_modal_data": {"image": [image(2), image(3, (80, 60))]}},
        [{"role": "user", "content": [{"type": "image", "image": image(4, (60, 90))},
                                      {"type": "text", "text": "a batch of"},
                                      {"type": "image", "image": image(1)}]}],
    ]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """family -> (model dir, the prompts, transformers' greedy tokens of each, the longest prompt's tokens)."""
    import transformers as tf

    out = {}
    for family, build in FAMILIES.items():
        path = build(tmp_path_factory.mktemp(family))
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
        family_prompts = prompts(llm.engine.prompts.images.placeholder)
        encoded = llm.encode_batch(family_prompts)
        reference = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        out[family] = (path, family_prompts, [hf_greedy(reference, e, MAX_TOKENS) for e in encoded],
                       max(len(e.token_ids) for e in encoded))
    return out


# The setups on the paths where they differ: LLaVA (images in one run each), Qwen2-VL (M-RoPE), Idefics3 (tiles),
# Mistral 3 (an image in one run a row), Gemma 3 (image tokens attending to each other both ways: chunks end
# before an image rather than inside it);
# Qwen2.5-VL differs from Qwen2-VL, and SmolVLM from Idefics3, in their vision modules alone; Idefics3's tiles are
# placed as LLaVA's runs are, and run unchunked (their long prompts make many 10-token steps).
CASES = [("llava", "plain"), ("llava", "chunked"), ("llava", "swap"), ("qwen2_vl", "plain"),
         ("qwen2_vl", "chunked"), ("qwen2_vl", "recompute"), ("qwen2_5_vl", "plain"), ("qwen2_5_vl", "swap"),
         ("idefics3", "plain"), ("smolvlm", "plain"), ("mistral3", "chunked"), ("llava_olmo2", "chunked"),
         ("gemma3", "plain"), ("gemma3", "chunked"), ("gemma3", "swap"), ("gemma3", "recompute"),
         # LLaVA-NeXT: an image's crops and newlines in one run; Aya Vision: a run a tile, between tile tags
         ("llava_next", "plain"), ("llava_next", "chunked"), ("aya_vision", "chunked"), ("aya_vision", "swap"),
         ("aya_vision", "recompute")]


@pytest.mark.parametrize(("family", "setup"), CASES)
def test_greedy_matches_transformers(vlm, family, setup):
    path, family_prompts, want, longest = vlm[family]
    options = {"kv_cache_memory": "16MiB", **SETUPS[setup]}
    if "preemption_mode" in options:  # room for the longest request alone: running them together preempts
        options["kv_cache_memory"] = -(-(longest + MAX_TOKENS) // 8) * BLOCK_BYTES
    llm = LLM(path, dtype="float32", **options)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(family_prompts, greedy, use_tqdm=False)]
    assert got == want
    model = llm.engine.runner.model
    assert isinstance(model, GenericVisionModel) == (family in GENERIC)
    if family in GENERIC:
        assert isinstance(model.language_model, BackendDecoder)
        runs = [i for e in llm.encode_batch(family_prompts) for i in e.multi_modal.images]
        # Aya Vision's tiles: an image in several runs, each its slice of the image's embeddings
        assert (len(runs) > len({id(i.pixel_values) for i in runs})) == (family == "aya_vision")
    if family == "llava_olmo2":  # the transformers backend's decoder, and the prefix cache reused through it
        assert isinstance(model.language_model, BackendDecoder)
        assert [o.outputs[0].token_ids for o in llm.generate(family_prompts, greedy, use_tqdm=False)] == want
        assert llm.stats()["prefix_cache_hits"] > 0
    stats = llm.stats()
    if setup in ("swap", "recompute"):
        assert stats[f"{setup}_preemptions"] > 0
    if setup == "chunked":
        # The same prompts again, 3 greedy samples each: their blocks, images included, come from the prefix
        # cache, and the samples fork after the prefill, sharing them.
        three = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        again = [[c.token_ids for c in o.outputs] for o in llm.generate(family_prompts, three, use_tqdm=False)]
        assert again == [[w] * 3 for w in want]
        assert llm.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]


def test_incremental_api_takes_encoded_image_prompts(vlm):
    """What the job reader does: encode_batch on its thread, then add_request with the encoded prompts."""
    path, family_prompts, want, _ = vlm["qwen2_vl"]
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    assert llm.supports_images  # what the job runner asks before it reads an images column
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, encoded in enumerate(llm.encode_batch(family_prompts)):
        assert encoded.multi_modal is not None
        llm.add_request(f"r{i}", encoded, greedy)
    llm.add_request("raw", family_prompts[2], greedy)  # not encoded ahead: add_request encodes it
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in llm.step())
    assert [done[f"r{i}"] for i in range(3)] == want
    assert done["raw"] == want[2]
    # Each image through the tower once: 5 in the three prompts; the raw one is prompt 2's twin, so it waits a
    # step and takes the K/V of its prompt, images included, from the prefix cache: its 2 are not encoded.
    stats = llm.stats()
    assert stats["images_encoded"] == 5 and stats["vision_seconds"] > 0 and stats["prefix_cache_hits"] > 0


def test_idefics3_token_ids_are_the_processors(vlm):
    """Idefics3's image splitting (tiles, row/column tags, the global view) as its own processor writes it."""
    from transformers import AutoTokenizer, Idefics3Processor

    path, family_prompts, _, _ = vlm["idefics3"]
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    processor = Idefics3Processor(image_processor=llm.engine.prompts.images.image_processor,
                                  tokenizer=AutoTokenizer.from_pretrained(path), image_seq_len=4)
    prompt = family_prompts[1]
    want = processor(text=[prompt["prompt"]], images=[prompt["multi_modal_data"]["image"]], return_tensors="pt")
    assert llm.encode_batch([prompt])[0].token_ids == want["input_ids"][0].tolist()


@pytest.mark.parametrize("family", GENERIC)
def test_generic_token_ids_are_the_processors(vlm, family):
    """The generic path's placeholder expansion, one image at a time, as the model's processor writes a prompt
    with two images (LLaVA-NeXT's crops and newlines, Aya Vision's tiles and tags)."""
    from transformers import AutoProcessor

    path, family_prompts, _, _ = vlm[family]
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    prompt = family_prompts[1]
    want = AutoProcessor.from_pretrained(path)(text=[prompt["prompt"]], images=[prompt["multi_modal_data"]["image"]],
                                               return_tensors="pt")
    assert llm.encode_batch([prompt])[0].token_ids == want["input_ids"][0].tolist()
