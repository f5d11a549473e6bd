"""SamplingParams.prompt_logprobs against transformers' own forward, through chunked prefill, the prefix
cache and preemption; the same numbers whatever shares the steps; memory bounded by a chunk of rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from scoring_kit import ModelShelf, reference
from scoring_kit import make_prompts as random_prompts

from batchgen import LLM, SamplingParams

TOL = 1e-4
K = 5
PROMPT_LENS = [1, 2, 17, 33, 100, 200]
# Native Llama (untied head), Qwen2 (q/k/v biases, tied head), Qwen3 (q/k norms), Gemma 2 (soft-capped
# final logits), and OLMo 2 through the transformers backend.
ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "olmo2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelShelf(tmp_path_factory.mktemp("logprob_models"))


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    prompts = random_prompts(vocab, lens, seed)
    # A prompt sharing its first 120 tokens with the last one: a prefix-cache hit when the cache is on.
    return prompts + [prompts[-1][:120] + random_prompts(vocab, [40], seed + 1000)[0]]


def assert_matches(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int = K) -> float:
    """vLLM's shape, values within TOL of transformers' and the same top-k sets; returns the largest error."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    worst = 0.0
    for i in range(1, len(prompt)):
        entry, expected = prompt_logprobs[i], ref[i - 1]
        top = set(expected.topk(k).indices.tolist()) if k else set()
        assert set(entry) == top | {prompt[i]}, f"position {i}"
        for token, value in entry.items():
            worst = max(worst, abs(value - expected[token].item()))
    assert worst < TOL, worst
    return worst


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("chunk", [16, 37, 256])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers(models, arch, chunk, prefix_caching):
    model_dir = models(arch)
    logprobs = reference(model_dir)
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=chunk, max_num_seqs=8,
              enable_prefix_caching=prefix_caching, model_impl="auto")
    prompts = make_prompts(llm.engine.vocab_size)
    # Generating first puts every prompt's full blocks in the prefix cache (when it is on).
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    hits = llm.stats()["prefix_cache_hits"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out.prompt_logprobs, prompt, logprobs(prompt))
    # Every prompt position's hidden state is wanted: the cache skipped none of them (it was bypassed).
    assert llm.stats()["prefix_cache_hits"] == hits
    assert (hits > 0) == prefix_caching


def test_prompt_logprobs_do_not_change_the_generated_tokens(models):
    llm = LLM(models("qwen2"), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32, max_num_seqs=8)
    prompts = make_prompts(llm.engine.vocab_size)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, n=2, logprobs=2)
    plain = llm.generate(prompts, params, use_tqdm=False)
    params.prompt_logprobs = 0
    with_prompt = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, with_prompt, strict=True):
        assert a.prompt_logprobs is None and len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert all(len(entry) == 1 for entry in b.prompt_logprobs[1:])  # 0: the prompt's own token alone
        assert [(c.token_ids, c.logprobs) for c in a.outputs] == [(c.token_ids, c.logprobs) for c in b.outputs]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(),
    dict(enable_prefix_caching=False),
], ids=["prefix-cache", "no-prefix-cache"])
def test_smollm2_prompt_logprobs_match_transformers(smollm2_dir, options):
    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=48, max_num_seqs=8,
              **options)
    text = ("Paged attention keeps the key and value cache in fixed-size blocks, so that sequences of very "
            "different lengths share one pool of memory without fragmenting it. ") * 3
    prompts = [llm.tokenizer.encode(text), llm.tokenizer.encode(text[:150] + " and then it stops.")]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K), use_tqdm=False)
    logprobs = reference(str(smollm2_dir))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out.prompt_logprobs, prompt, logprobs(prompt))


def _run_mixed(llm: LLM, target: list[int], others: list[list[int]], order: str, max_tokens: int = 30):
    """Adds the target request (prompt logprobs) among generation and other prompt-logprob requests; its output."""
    target_params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    requests = [("target", target, target_params)]
    for i, prompt in enumerate(others):
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens + i % 7, ignore_eos=True,
                                prompt_logprobs=2 if i % 3 == 0 else None)
        requests.append((f"other-{i}", prompt, params))
    if order == "target-last":
        requests = requests[1:] + requests[:1]
    for request_id, prompt, params in requests:
        llm.add_request(request_id, prompt, params)
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == "target":
                return out
    raise AssertionError("the target request did not finish")


@pytest.mark.parametrize("setting", ["chunked", "target-last", "swap", "recompute"])
def test_prompt_logprobs_do_not_depend_on_what_shares_the_step(models, setting):
    model_dir = models("llama")
    alone = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=512, max_num_seqs=8)
    vocab = alone.engine.vocab_size
    target = random_prompts(vocab, [300], seed=7)[0]
    expected = alone.generate([target], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3),
                              use_tqdm=False)[0].prompt_logprobs
    options = dict(max_num_batched_tokens=29, max_num_seqs=6)
    if setting in ("chunked", "target-last"):
        mixed = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB", **options)
        others = random_prompts(vocab, [5, 40, 90, 150, 33, 64, 17, 250], seed=8)
        got = _run_mixed(mixed, target, others, "target-first" if setting == "chunked" else "target-last")
    else:
        # 26 blocks of 16 tokens: three running 28-token prompts and the 300-token target (19 blocks) fit at
        # first; when the three grow past 32 tokens, the newest request, the target, is preempted mid-prefill.
        block_bytes = 2 * 2 * 2 * 16 * 64 * 4
        mixed = LLM(model_dir, dtype="float32", kv_cache_memory=26 * block_bytes, swap_space="8MiB",
                    preemption_mode=setting, **options)
        others = random_prompts(vocab, [28, 28, 28], seed=8)
        got = _run_mixed(mixed, target, others, "target-last", max_tokens=60)
        assert got.metrics.num_preemptions > 0
    assert got.prompt_logprobs == expected  # bit for bit


_MEMORY_PROBE = """
import json, re, sys
import torch
from batchgen import LLM, SamplingParams
from batchgen.engine import prompt_logprobs

def kib(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

model_dir, chunk = sys.argv[1], int(sys.argv[2])
llm = LLM(model_dir, dtype="float32", kv_cache_memory="512MiB", max_num_batched_tokens=chunk, max_num_seqs=8,
          enable_prefix_caching=False)
prompt = torch.randint(3, llm.engine.vocab_size, (8 * chunk,), generator=torch.Generator().manual_seed(5)).tolist()
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # KV blocks, activations
# and the head's buffers at their steady size: a prompt of two chunks, with prompt logprobs
llm.generate([prompt[:2 * chunk]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)
model, rows = llm.engine.runner.model, []
real = model.compute_logits
model.compute_logits = lambda hidden: rows.append(hidden.shape[0]) or real(hidden)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = kib("VmRSS")
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
ok = len(out.prompt_logprobs) == len(prompt) and all(e[t] <= 0 for e, t in zip(out.prompt_logprobs[1:], prompt[1:]))
print(json.dumps({"extra": (kib("VmHWM") - before) * 1024, "rows": rows, "vocab": llm.engine.vocab_size,
                  "ok": ok, "logit_rows": prompt_logprobs.LOGIT_ROWS}))
"""


def wide_vocab_model(path, smollm2_dir):
    """SmolLM2's tokenizer and vocabulary (49,152) on a one-layer model 64 wide: the logits of SmolLM2, the
    forward of almost nothing, so that the memory probe costs seconds, not minutes."""
    import transformers as tf
    from conftest import save_random_model

    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_dir)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
                            tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    return save_random_model(path, tf.LlamaForCausalLM, config, tokenizer, seed=3)


@pytest.mark.slow
def test_prompt_logprobs_of_a_long_prompt_keep_memory_bounded(smollm2_dir, tmp_path):
    """A prompt 8x max_num_batched_tokens long (4,096 tokens): its logits in one piece would be 4,096 x 49,152
    float32 = 805 MB (SmolLM2's vocabulary, on a model of one narrow layer). Bound asserted: the head is never
    given more than LOGIT_ROWS rows at once, and the peak RSS of a fresh process grows by less than two chunks'
    logits, 2 x max_num_batched_tokens x vocab x 4 bytes (192 MiB, a quarter of the whole prompt's), against the
    same process warmed up by that prompt without prompt logprobs (KV blocks, activations) and a prompt of
    two chunks with them (the head's buffers at their steady size). Measured on an AVX2 Zen 2: 32-63 MiB,
    the prompt's logprobs as Python objects and the C library's heap; without the second warm-up the
    heap's own growth was 3.5-134 MiB from run to run (scripts/PERF.md)."""
    chunk = 512
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    model_dir = wide_vocab_model(tmp_path / "wide", smollm2_dir)
    run = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(model_dir), str(chunk)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["ok"]
    assert max(probe["rows"]) <= probe["logit_rows"], probe["rows"]
    assert sum(probe["rows"]) == 8 * chunk  # every prompt position but the last, and the sampled row
    bound = 2 * chunk * probe["vocab"] * 4
    print(f"peak RSS growth {probe['extra'] / 2**20:.1f} MiB (bound {bound / 2**20:.1f} MiB)")
    assert probe["extra"] < bound, (probe["extra"], bound)
