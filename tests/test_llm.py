"""batchgen.LLM on tiny random models of every architecture, against transformers."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import ARCHITECTURES

from batchgen import LLM, SamplingParams

PROMPT_LENS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 90, 120, 200]
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


_hf_cache: dict[str, tuple] = {}


def hf_reference(model_dir, arch: str):
    """transformers' model and its greedy continuations of the standard prompts (cached per arch)."""
    if arch not in _hf_cache:
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompts = make_prompts(hf.config.vocab_size)
        refs = []
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
        _hf_cache[arch] = (hf, prompts, refs)
    return _hf_cache[arch]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(tiny_model_dirs, arch, prefix_caching):
    _, prompts, refs = hf_reference(tiny_model_dirs[arch], arch)
    llm = LLM(tiny_model_dirs[arch], dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=prefix_caching,
              max_num_batched_tokens=256)
    # The shared first half makes later prompts hit the prefix cache when it is on.
    outputs = llm.generate(prompts + prompts[-4:], GREEDY, use_tqdm=False)
    assert tokens(outputs) == refs + refs[-4:]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    hits = llm.stats()["prefix_cache_hits"]
    assert (hits > 0) == prefix_caching


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_matches_transformers_under_preemption(tiny_model_dirs, mode):
    _, prompts, refs = hf_reference(tiny_model_dirs["llama"], "llama")
    # 24 blocks of 16 tokens: the longest request (200 + 24 tokens) fits alone, the batch does not.
    block_bytes = 2 * 2 * 2 * 16 * 64 * 4
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=24 * block_bytes, swap_space="8MiB",
              preemption_mode=mode)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outputs) == refs
    assert llm.stats()[f"{mode}_preemptions"] > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_logits_match_transformers(tiny_model_dirs, arch):
    from batchgen.engine.sequence import Sequence

    hf, prompts, _ = hf_reference(tiny_model_dirs[arch], arch)
    llm = LLM(tiny_model_dirs[arch], dtype="float32", kv_cache_memory="8MiB")
    runner = llm.engine.runner
    prompt = prompts[-1]
    seq = Sequence(0, prompt)
    seq.block_table = list(range(-(-len(prompt) // 16)))[::-1]  # any distinct blocks, reversed
    split = 77  # a prefill chunk, then the rest on top of the cached context

    class Chunk:
        def __init__(self, start, n):
            self.seq, self.start, self.num_new_tokens = seq, start, n

    with torch.inference_mode():
        logits = []
        for chunk in (Chunk(0, split), Chunk(split, len(prompt) - split)):
            ids, pos, meta, _ = runner.prepare([chunk])
            logits.append(runner.model.compute_logits(runner.model(ids, pos, meta)))
        ours = torch.cat(logits)
        theirs = hf(torch.tensor([prompt])).logits[0]
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, rel


def _seeded_requests(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=12 + i % 5,
                           ignore_eos=True) for i in range(n)]


def test_seeded_sampling_is_independent_of_batching(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    prompts = make_prompts(400, [5, 40, 17, 90, 33, 2, 64, 12])
    params = _seeded_requests(len(prompts))
    together = tokens(LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False))
    one_by_one = []
    llm = LLM(path, dtype="float32")
    for p, sp in zip(prompts, params, strict=True):
        one_by_one += tokens(llm.generate([p], sp, use_tqdm=False))
    assert one_by_one == together
    # Fewer sequences per step, other requests mixed in, prompts in another order, preemption.
    small = LLM(path, dtype="float32", max_num_seqs=4, kv_cache_memory=8 * 2 * 2 * 2 * 16 * 64 * 4,
                preemption_mode="recompute")
    noise = make_prompts(400, [30, 60, 9], seed=5)
    mixed = small.generate(noise + prompts[::-1], _seeded_requests(3) + params[::-1], use_tqdm=False)
    assert tokens(mixed[3:])[::-1] == together
    assert small.stats()["num_preemptions"] > 0
    assert len(set(map(tuple, together))) == len(together)  # the seeds do make different samples


def test_n_samples_share_the_prompt(tiny_model_dirs):
    _, prompts, refs = hf_reference(tiny_model_dirs["llama"], "llama")
    llm = LLM(tiny_model_dirs["llama"], dtype="float32")
    greedy = llm.generate(prompts[-3:], SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                          use_tqdm=False)
    for out, ref in zip(greedy, refs[-3:], strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == ref for c in out.outputs)
    sampled = llm.generate([prompts[-1]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16,
                                                         ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1


def test_decode_tells_the_kernel_which_samples_share_a_prompt(tiny_model_dirs, monkeypatch):
    """The attention op reads a request's shared prompt blocks once when told which decodes are its samples
    (seq_groups; the kernel's own tests check the result); without multi-sample requests it is told nothing."""
    from batchgen.layers import attention

    seen = []
    decode = attention.ops.paged_attention_decode

    def spy(*args, seq_groups=None, **kwargs):
        seen.append(None if seq_groups is None else seq_groups.tolist())
        return decode(*args, seq_groups=seq_groups, **kwargs)

    monkeypatch.setattr(attention.ops, "paged_attention_decode", spy)
    llm = LLM(tiny_model_dirs["llama"], dtype="float32")
    prompts = make_prompts(400, [40, 70])
    llm.generate(prompts, [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True),
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert [0, 0, 0, 1] in seen
    seen.clear()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert seen and all(groups is None for groups in seen)


def test_max_tokens_stop_ids_and_min_tokens(tiny_model_dirs):
    _, prompts, refs = hf_reference(tiny_model_dirs["llama"], "llama")
    llm = LLM(tiny_model_dirs["llama"], dtype="float32")
    prompt, ref = prompts[9], refs[9]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[:5] and out.outputs[0].finish_reason == "length"

    stop_id = ref[10]
    first = ref.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_id],
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=first + 3,
                                                stop_token_ids=[stop_id], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[: first + 3]
    assert len(out.token_ids) >= first + 3


def test_stop_strings(tiny_model_dirs):
    _, prompts, refs = hf_reference(tiny_model_dirs["llama"], "llama")
    llm = LLM(tiny_model_dirs["llama"], dtype="float32")
    prompt, ref = prompts[12], refs[12]
    full = llm.tokenizer.decode(ref)
    stop = next(full[i : i + 3] for i in range(len(full) // 2, len(full) - 3) if full[i : i + 3].strip())
    cut = full.find(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop, "never-there"], ignore_eos=True,
                                include_stop_str_in_output=include)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (full[: cut + len(stop)] if include else full[:cut])
        assert out.token_ids == ref[: len(out.token_ids)]


def test_logprobs_match_transformers(tiny_model_dirs):
    hf, prompts, refs = hf_reference(tiny_model_dirs["qwen3"], "qwen3")
    llm = LLM(tiny_model_dirs["qwen3"], dtype="float32")
    prompt, ref = prompts[7], refs[7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref and len(out.logprobs) == MAX_NEW
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1]
    expected = logits.log_softmax(-1)
    for step, top in enumerate(out.logprobs):
        assert ref[step] in top and 3 <= len(top) <= 4
        for token, lp in top.items():
            assert abs(lp - expected[step, token].item()) < 1e-4
    assert abs(out.cumulative_logprob - expected.gather(1, torch.tensor(ref)[:, None]).sum().item()) < 1e-3


def test_chat_and_text_prompts(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": "hello world"}], params, use_tqdm=False)[0]
    assert chat.prompt.startswith("<|im_start|>user\nhello world<|im_end|>")
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    text = llm.generate(chat.prompt, params, use_tqdm=False)[0]
    assert text.outputs[0].token_ids == chat.outputs[0].token_ids
    assert text.outputs[0].text == llm.tokenizer.decode(text.outputs[0].token_ids, skip_special_tokens=True)


def test_a_prompt_that_can_never_fit_is_reported_not_fatal(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long_out, short_out = llm.generate([[5] * 100, [5] * 10], params, use_tqdm=False)
    assert long_out.error and "100" in long_out.error and "64" in long_out.error
    assert short_out.error is None and len(short_out.outputs[0].token_ids) == 4


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    cfg = tf.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100)
    tf.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel has head_dim 32; batchgen.s attention kernels take 64"):
        LLM(str(tmp_path))  # GPT-2 itself would run on the transformers backend
    with pytest.raises(ValueError, match="model_impl: batchgen has no native implementation of GPT2LMHeadModel"):
        LLM(str(tmp_path), model_impl="native")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "missing"))


def test_incremental_api_and_abort(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(400, [10, 20, 30])):
        llm.add_request(f"r{i}", prompt, params)
    with pytest.raises(ValueError, match="already"):
        llm.add_request("r0", [5, 6], params)
    finished = llm.step()
    llm.abort_request("r1")
    while llm.has_unfinished_requests():
        finished += llm.step()
    assert sorted(o.request_id for o in finished) == ["r0", "r2"]
    stats = llm.engine.scheduler.stats()
    assert stats.used_device_blocks == 0 and stats.num_running == stats.num_waiting == 0
