"""The engine's other tasks on image prompts: a PEFT LoRA on a vision-language model's language model (tiny random
LLaVA, Qwen2-VL, and LLaVA over OLMo 2 on the transformers backend) against PEFT on transformers, beam search
against transformers' beam search, and structured outputs against xgrammar over transformers' forward (tiny random
LLaVA), all in float32 with the images given."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf
from test_beam_search import assert_same_beams, hf_beams
from test_structured import reference_greedy
from vision_kit import build_llava, build_qwen2_vl, hf_greedy, image, reference_images

from batchgen import LLM, BeamSearchParams, LoRARequest, SamplingParams, StructuredOutputsParams

peft = pytest.importorskip("peft")
from lora_kit import make_adapter  # noqa: E402  (after the skip: it imports peft)

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
LANGUAGE_MODEL = r".*language_model.*\.(q_proj|v_proj|o_proj|down_proj)"  # PEFT's regex: the decoder alone


def image_prompts(placeholder: str) -> list:
    """One image before the text, two images inline."""
    return [{"prompt": "the quick brown fox", "multi_modal_data": {"image": image(1)}},
            {"prompt": f"hello {placeholder} world {placeholder} jumps",
             "multi_modal_data": {"image": [image(2), image(3, (80, 60))]}}]


def reference_inputs(model, encoded) -> tuple[list[int], dict]:
    """An encoded prompt's token ids and the image arguments transformers takes with them."""
    return encoded.token_ids, reference_images(model, torch.tensor([encoded.token_ids]), encoded.multi_modal.images)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The tiny LLaVA's dir, its transformers model and tokenizer, and the prompts encoded by batchgen."""
    path = build_llava(tmp_path_factory.mktemp("llava"))
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    prompts = image_prompts(llm.engine.prompts.images.placeholder)
    reference = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return path, llm, reference, tf.AutoTokenizer.from_pretrained(path), prompts, llm.encode_batch(prompts)


@pytest.mark.parametrize("build", [build_llava, build_qwen2_vl, lambda path: build_llava(path, decoder="olmo2")],
                         ids=["llava", "qwen2_vl", "llava_olmo2"])  # the last: the transformers backend's decoder
def test_lora_on_the_language_model_matches_peft(tmp_path, build):
    path = build(tmp_path / "model")
    adapter = make_adapter(path, tmp_path / "adapter", 8, LANGUAGE_MODEL, seed=1,
                           auto_class=tf.AutoModelForImageTextToText)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=8, block_size=8,
              max_num_batched_tokens=10, max_num_seqs=4)  # chunks cut through the image tokens
    prompts = image_prompts(llm.engine.prompts.images.placeholder)
    encoded = llm.encode_batch(prompts)
    base = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    base_refs = [hf_greedy(base, e, MAX_TOKENS) for e in encoded]
    tuned = peft.PeftModel.from_pretrained(base, adapter).eval()
    refs = [hf_greedy(tuned, e, MAX_TOKENS) for e in encoded]
    assert refs != base_refs  # the adapter changes the output: the check below can fail
    lora = LoRARequest("a", 1, str(adapter))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)] == refs
    # the base model's blocks of the same images are not the adapter's (the prefix cache keys both)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == base_refs


def test_lora_on_the_vision_tower_is_refused_in_one_line(tmp_path, llava):
    path, *_ = llava
    adapter = make_adapter(path, tmp_path / "adapter", 4, r".*vision_tower.*\.q_proj", seed=2,
                           auto_class=tf.AutoModelForImageTextToText)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'v' \(.*\): has weights for the vision tower or "
                                         r"projector \(base_model\.model\.model\.vision_tower\.[^\n]*\); batchgen "
                                         r"applies LoRA to the language model's decoder layers only$"):
        llm.generate(image_prompts("<image>")[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("v", 1, adapter))


def test_beam_search_on_images_matches_transformers(llava):
    _, llm, reference, tokenizer, prompts, encoded = llava
    width, max_new = 3, 8
    eos = [tokenizer.eos_token_id]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_new), use_tqdm=False)
    for out, e in zip(outs, encoded, strict=True):
        ids, images = reference_inputs(reference, e)
        assert out.error is None and out.prompt_token_ids == ids
        want = hf_beams(reference, tokenizer, ids, width, max_new, 1.0, False, eos, **images)
        assert_same_beams([(s.output_token_ids, s.score) for s in out.sequences], want, out.prompt)


REGEX = r"[a-z]{2,6}-\d{1,3}"


def test_structured_outputs_on_images_match_the_reference(llava):
    """The greedy tokens a regex allows, as xgrammar's matcher picks them over transformers' logits with the
    images; each output ends within max_tokens and matches. (A JSON schema takes the same path; its grammar
    compiles for half a minute here.)"""
    _, llm, reference, tokenizer, prompts, encoded = llava
    constraint = StructuredOutputsParams(regex=REGEX)
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint)
    for out, e in zip(llm.generate(prompts, params, use_tqdm=False), encoded, strict=True):
        ids, images = reference_inputs(reference, e)
        completion = out.outputs[0]
        assert completion.token_ids == reference_greedy(reference, tokenizer, ids, constraint, 24, **images)
        assert completion.valid and completion.finish_reason == "stop"
        assert re.fullmatch(REGEX, completion.text)
