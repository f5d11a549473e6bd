"""Structured outputs in the engine: the constraint API, greedy outputs against an independent
xgrammar + transformers reference, seeded outputs through batching and preemption, the compile
cache, and (on SmolLM2) sampled outputs that parse and validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import transformers as tf
import xgrammar as xgr
from test_llm import make_prompts, tokens

from batchgen import LLM, SamplingParams, StructuredOutputsParams
from batchgen.layers.sampler import SamplingRow, sample

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                            "required": ["kind"]}, "maxItems": 2},
    },
    "required": ["name", "age", "colour", "pets"],
}
REGEX = r"[a-z]{2,6}-\d{1,3}"
CHOICES = ["yes", "no", "not sure"]
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
    "json_object": StructuredOutputsParams(json_object=True),
}


# --- the API -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({}, "structured_outputs: set exactly one of json, regex, choice, grammar, json_object (got none)"),
    ({"json": SCHEMA, "regex": "a"}, "set exactly one of json, regex, choice, grammar, json_object (got json, regex)"),
    ({"json": {"type": "nope"}}, 'structured_outputs.json: Unsupported type "nope"'),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex: Regex parsing error"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar: EBNF parser error"),
    ({"choice": []}, "structured_outputs.choice: must be a non-empty list"),
    ({"json_object": False}, "(got none)"),
])
def test_bad_constraints_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sampling_params_take_a_mapping_and_name_the_field():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match=r"^SamplingParams\.structured_outputs\.regex: Regex parsing error"):
        SamplingParams(structured_outputs={"regex": "(("})
    with pytest.raises(ValueError, match=r"^SamplingParams\.structured_outputs\.jsn: unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_a_schema_as_dict_or_text_is_one_constraint():
    text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert text.key == StructuredOutputsParams(json=SCHEMA).key


# --- the sampler's mask ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_masks_exactly_the_constrained_rows(dtype):
    """Against xgrammar's own kernel masking the logits first: the same tokens for constrained rows
    (greedy and seeded, with penalties and bans after the mask), unchanged tokens for the others."""
    vocab, rows_n = 1000, 40
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows_n, vocab, generator=gen) * 3).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows_n, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[::5] &= 0x00F0_0001  # some rows allow only a few tokens
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.9, top_k=50 if i % 4 else -1,
                             presence_penalty=0.5 if i % 7 == 0 else 0.0) for i in range(rows_n)]
    constrained = [i % 2 == 0 for i in range(rows_n)]

    def rows(with_masks: bool) -> list[SamplingRow]:
        return [SamplingRow.of(params[i], seed=10 + i, sample_index=0, prompt_token_ids=[1, 2],
                               output_token_ids=[3, i], banned_token_ids=[5] if i % 6 == 0 else [],
                               allowed=bitmask[i] if with_masks and constrained[i] else None) for i in range(rows_n)]

    ours = sample(logits, rows(True)).token_ids
    masked = logits.float().clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask, indices=[i for i in range(rows_n) if constrained[i]])
    reference = sample(masked, rows(False)).token_ids
    free = sample(logits, rows(False)).token_ids
    for i in range(rows_n):
        if constrained[i]:
            assert ours[i] == reference[i], i
            assert bitmask[i, ours[i] // 32] >> (ours[i] % 32) & 1, i
        else:
            assert ours[i] == free[i], i
    assert ours != free


# --- greedy against an independent reference -----------------------------------------------------

def reference_greedy(hf, tokenizer, prompt: list[int], constraint: StructuredOutputsParams,
                     max_tokens: int, **inputs) -> list[int]:
    """transformers' forward, xgrammar's own compiler, matcher and bitmask kernel, one token at a time; `inputs`:
    more arguments of each forward (a vision-language model's images)."""
    vocab_size = hf.config.get_text_config().vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    kind = constraint.kind
    if kind == "json":
        compiled = compiler.compile_json_schema(json.dumps(constraint.json))
    elif kind == "regex":
        compiled = compiler.compile_regex(constraint.regex)
    elif kind == "json_object":
        compiled = compiler.compile_json_schema('{"type": "object"}')
    else:
        ebnf = constraint.grammar or "root ::= " + " | ".join(f'"{c}"' for c in constraint.choice)
        compiled = compiler.compile_grammar(ebnf)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens and not matcher.is_terminated():
            logits = hf(torch.tensor([ids]), **inputs).logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            ids.append(token)
            out.append(token)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, tf.AutoTokenizer.from_pretrained(path)


def test_greedy_constrained_outputs_match_the_reference(tiny):
    path, hf, tokenizer = tiny
    prompts = make_prompts(hf.config.vocab_size, [3, 20, 41])
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    cases = [(p, c) for c in CONSTRAINTS for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=CONSTRAINTS[c]) for _, c in cases]
    # Unconstrained rows in the same steps must not be touched by the masks.
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([p for p, _ in cases] + prompts, params + [free] * len(prompts), use_tqdm=False)
    for (prompt, c), out in zip(cases, outputs, strict=False):
        ref = reference_greedy(hf, tokenizer, prompt, CONSTRAINTS[c], 24)
        completion = out.outputs[0]
        assert completion.token_ids == ref, c
        assert completion.valid == (completion.finish_reason == "stop"), c
        if completion.valid and c in ("json", "json_object"):
            assert isinstance(json.loads(completion.text), dict), c
        assert completion.finish_reason == ("stop" if len(ref) < 24 or ref[-1] == tokenizer.eos_token_id
                                            else "length"), c
    free_outputs = LLM(path, dtype="float32", kv_cache_memory="32MiB").generate(prompts, free, use_tqdm=False)
    assert tokens(outputs[len(cases):]) == tokens(free_outputs)
    assert all(o.outputs[0].valid is None for o in outputs[len(cases):])
    stopped = [o.outputs[0] for o in outputs[: len(cases)] if o.outputs[0].finish_reason == "stop"]
    assert stopped, "no constrained output ended within max_tokens: the test checks nothing about endings"


# --- seeded sampling: batching, n > 1, preemption ----------------------------------------------

BLOCK_BYTES = 2 * 2 * 2 * 16 * 64 * 4  # the tiny llama's K and V, 2 layers, 2 KV heads, 16 tokens, float32


def _seeded(constraint: str, i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, n=3, seed=40 + i, max_tokens=20, structured_outputs=CONSTRAINTS[constraint])


@pytest.mark.parametrize("variant", [
    {},
    {"kv_cache_memory": 14 * BLOCK_BYTES, "swap_space": "8MiB", "preemption_mode": "swap"},
    {"kv_cache_memory": 14 * BLOCK_BYTES, "preemption_mode": "recompute"},
    {"enable_prefix_caching": False, "max_num_batched_tokens": 32, "max_num_seqs": 8},
], ids=["together", "swap", "recompute", "chunked"])
def test_seeded_constrained_samples_do_not_depend_on_batching_or_preemption(tiny, variant):
    path, hf, tokenizer = tiny
    prompts = make_prompts(hf.config.vocab_size, [30, 45, 12, 60, 25, 50])
    kinds = ["json", "regex", "json_object", "choice", "grammar", "json"]
    params = [_seeded(k, i) for i, k in enumerate(kinds)]
    alone = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    expected = [alone.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params, strict=True)]
    llm = LLM(path, dtype="float32", **{"kv_cache_memory": "32MiB", **variant})
    got = llm.generate(prompts, params, use_tqdm=False)
    for e, g in zip(expected, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
        assert [c.valid for c in g.outputs] == [c.valid for c in e.outputs]
    if "preemption_mode" in variant:
        assert llm.stats()[f"{variant['preemption_mode']}_preemptions"] > 0
    samples = [c.token_ids for o in expected for c in o.outputs]
    assert len({tuple(s) for s in samples}) > len(prompts), "the n samples of a request should differ"


def test_each_distinct_constraint_compiles_once(tiny):
    path, hf, _ = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    prompts = make_prompts(hf.config.vocab_size, [5] * 12)
    as_dict = SamplingParams(max_tokens=2, structured_outputs={"json": SCHEMA})
    as_text = SamplingParams(max_tokens=2, structured_outputs={"json": json.dumps(SCHEMA)})
    llm.generate(prompts, [as_dict, as_text] * 6, use_tqdm=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, structured_outputs={"regex": "a+"}), use_tqdm=False)
    assert llm.stats()["grammar_compiles"] == 2


def test_the_compile_cache_keeps_the_constraints_used_last():
    from conftest import _tiny_tokenizer

    from batchgen.structured.backend import GrammarBackend

    tokenizer = _tiny_tokenizer()
    backend = GrammarBackend(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    for constraint in (a, b, a, c, a):  # c evicts b, the one used longest ago
        backend.compile(constraint)
    assert backend.num_compiles == 3
    backend.compile(b)
    assert backend.num_compiles == 4


def test_a_constraint_ends_the_sample_even_with_ignore_eos(tiny):
    path, hf, _ = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True, min_tokens=5,
                            structured_outputs={"choice": ["a", "b"]})
    out = llm.generate(make_prompts(hf.config.vocab_size, [9]), params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.valid and out.text in ("a", "b")


def test_a_stop_string_inside_a_constrained_output_ends_it_as_not_valid(tiny):
    path, hf, _ = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=12, stop=["b"], n=2,
                            structured_outputs={"regex": "a{0,3}b{1,3}"})
    for out in llm.generate(make_prompts(hf.config.vocab_size, [9, 14]), params, use_tqdm=False):
        for c in out.outputs:
            assert (c.finish_reason, c.stop_reason, c.valid) == ("stop", "b", False)
            assert set(c.text) <= {"a"} and len(c.text) <= 3


def test_a_constraint_needs_the_tokenizer(tiny):
    path, hf, _ = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        llm.engine.add_request("r", [5, 6], SamplingParams(structured_outputs={"regex": "a"}))


# --- the real model -------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_sampled_outputs_parse_and_validate(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="bfloat16", kv_cache_memory="512MiB")
    subjects = ["a cat owner", "a retired pilot", "a child", "a chef", "a gardener"] * 4
    chats = [[{"role": "user", "content": f"Describe {s} as a JSON record with name, age, colour and pets."}]
             for s in subjects]
    json_params = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=72, structured_outputs={"json": SCHEMA})
    outputs = llm.chat(chats, json_params, use_tqdm=False)
    samples = [c for o in outputs for c in o.outputs]
    assert len(samples) == 80
    stopped = [c for c in samples if c.finish_reason == "stop"]
    print(f"{len(stopped)} of 80 JSON samples ended within max_tokens")
    assert len(stopped) >= 40, f"only {len(stopped)} of 80 JSON samples ended within max_tokens"
    for c in stopped:
        assert c.valid
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert all(not c.valid for c in samples if c.finish_reason == "length")
    assert llm.stats()["grammar_compiles"] == 1

    short = [[{"role": "user", "content": f"Is {s} happy? Then give a code."}] for s in subjects[:10]]
    for constraint, check in [({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                              ({"choice": CHOICES}, lambda t: t in CHOICES)]:
        params = SamplingParams(temperature=1.0, n=4, seed=8, max_tokens=12, structured_outputs=constraint)
        done = [c for o in llm.chat(short, params, use_tqdm=False) for c in o.outputs if c.finish_reason == "stop"]
        assert len(done) >= 20, constraint
        assert all(check(c.text) and c.valid for c in done), constraint
