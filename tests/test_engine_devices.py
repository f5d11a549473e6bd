"""The engine's features on each device (kernel_cases.DEVICES), each against transformers run on the same device
in float32: sampling's filters and logprobs, penalties and logits processors, seeded samples, samples sharing a
prompt's blocks, beam search, prompt logprobs, scoring, embeddings, structured outputs, swap and recompute
preemption, prefix caching, an fp8 KV cache and images in (LLaVA, Qwen2-VL). On a CPU they run in every CI run,
which keeps the tests themselves honest; on a GPU `scripts/gpu_check.sh` runs them (`gpu` mark) through the CUDA
kernels, the decode graphs and every copy between host and device that the CPU never makes."""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass

import pytest
import torch
import transformers as tf
from kernel_cases import DEVICES
from lora_kit import hf_greedy
from model_zoo import build_zoo_model
from test_beam_search import assert_same_beams, hf_beams
from test_kv_fp8 import agreement
from test_llm import make_prompts, tokens
from test_vision_models import prompts as image_prompts
from vision_kit import build_llava, build_qwen2_vl
from vision_kit import hf_greedy as hf_image_greedy

from batchgen import LLM, BeamSearchParams, SamplingParams, ops
from batchgen import StructuredOutputsParams as Constraint
from batchgen.pooling_params import ScoringParams

MAX_NEW = 16
TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@dataclass
class Case:
    device: str
    path: str
    hf: tf.PreTrainedModel
    prompts: list[list[int]]
    greedy: list[list[int]]  # transformers' greedy continuations of prompts, MAX_NEW tokens each

    def llm(self, **options) -> LLM:
        return LLM(self.path, dtype="float32", device=self.device, **{"gpu_memory_utilization": 0.3, **options})

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """log_softmax of transformers' logits at every position of `ids`, on the CPU."""
        with torch.no_grad():
            return self.hf(torch.tensor([ids], device=self.device)).logits[0].float().log_softmax(-1).cpu()


@pytest.fixture(autouse=True)
def _release_engines():
    """On CUDA an engine's KV cache takes gpu_memory_utilization of the device: the next test's engine needs the
    last one collected."""
    yield
    gc.collect()


@pytest.fixture(scope="module", params=DEVICES)
def case(request, tiny_model_dirs) -> Case:
    path = tiny_model_dirs["llama"]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(request.param).eval()
    prompts = make_prompts(hf.config.vocab_size, [3, 17, 40, 90])
    yield Case(request.param, path, hf, prompts, hf_greedy(hf, prompts, MAX_NEW))
    del hf
    if request.param == "cuda":
        torch.cuda.empty_cache()


def test_filters_that_keep_one_token_follow_greedy_and_logprobs_match(case):
    """Greedy, top-k 1, a tiny top-p and min-p 1 in one batch: the sampler's filtered draws all land on the most
    likely token; the top-3 logprobs of every step are transformers'."""
    llm = case.llm()
    filters = [dict(temperature=0, logprobs=3), dict(temperature=1.0, top_k=1, seed=1),
               dict(temperature=0.7, top_p=1e-6, seed=2), dict(temperature=1.3, min_p=1.0, seed=3)]
    params = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **f) for f in filters for _ in case.prompts]
    outputs = llm.generate(case.prompts * len(filters), params, use_tqdm=False)
    assert tokens(outputs) == case.greedy * len(filters)
    for prompt, ref, out in zip(case.prompts, case.greedy, outputs, strict=False):
        expected = case.logprobs(prompt + ref)[len(prompt) - 1:-1]
        completion = out.outputs[0]
        assert len(completion.logprobs) == MAX_NEW
        for step, top in enumerate(completion.logprobs):
            assert set(top) == set(expected[step].topk(3).indices.tolist()) | {ref[step]}
            assert max(abs(lp - expected[step, t].item()) for t, lp in top.items()) < TOL
        cumulative = expected.gather(1, torch.tensor(ref)[:, None]).sum().item()
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-3)


def test_repetition_penalty_and_logits_processors_follow_transformers(case):
    """The rows that edit a float32 copy of their logits: a repetition penalty against transformers' own, and a
    logits processor banning each prompt's first greedy token against `bad_words_ids`."""
    llm = case.llm()

    def ban(token: int):
        def processor(_, logits):
            logits[token] = float("-inf")
            return logits
        return processor

    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3)
              for _ in case.prompts]
    params += [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logits_processors=[ban(ref[0])])
               for ref in case.greedy]
    outputs = tokens(llm.generate(case.prompts * 2, params, use_tqdm=False))
    assert outputs[:len(case.prompts)] == hf_greedy(case.hf, case.prompts, MAX_NEW, repetition_penalty=1.3)
    for i, (prompt, ref) in enumerate(zip(case.prompts, case.greedy, strict=True)):
        (banned,) = hf_greedy(case.hf, [prompt], MAX_NEW, bad_words_ids=[[ref[0]]])
        assert outputs[len(case.prompts) + i] == banned and ref[0] not in banned
    assert outputs[:len(case.prompts)] != case.greedy  # the penalty changed something: the check can fail


def test_seeded_samples_repeat_and_shared_prompts_decode_as_alone(case):
    """n seeded samples of a prompt share its blocks (copy-on-write of the last one): the same tokens on a second
    run, different from each other; at top-k 1 every sample is the greedy continuation."""
    llm = case.llm()
    seeded = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True)
    first, again = (llm.generate(case.prompts, seeded, use_tqdm=False) for _ in range(2))
    samples = [[c.token_ids for c in o.outputs] for o in first]
    assert samples == [[c.token_ids for c in o.outputs] for o in again]
    assert all(len({tuple(s) for s in per_prompt}) > 1 for per_prompt in samples)
    shared = SamplingParams(n=4, temperature=1.0, top_k=1, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(case.prompts, shared, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[ref] * 4 for ref in case.greedy]


def test_beam_search_matches_transformers(case):
    tokenizer = tf.AutoTokenizer.from_pretrained(case.path)
    llm = case.llm()
    stops = [tokenizer.eos_token_id, *case.greedy[0][:2]]  # frequent tokens end some beams early
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.8, stop_token_ids=stops[1:])
    outputs = llm.generate(case.prompts, params, use_tqdm=False)
    ended_early = 0
    for prompt, out in zip(case.prompts, outputs, strict=True):
        assert out.error is None
        got = [(c.token_ids, c.score) for c in out.outputs]
        assert_same_beams(got, hf_beams(case.hf, tokenizer, prompt, 3, 12, 0.8, False, stops), prompt)
        ended_early += sum(len(c.token_ids) < 12 for c in out.outputs)
    assert ended_early > 0
    assert llm.stats()["kv_cache_usage"] == 0


def test_prompt_logprobs_and_scores_match_transformers(case):
    llm = case.llm()
    outputs = llm.generate(case.prompts, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(case.prompts, outputs, strict=True):
        expected = case.logprobs(prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            assert set(entry) == set(expected[i - 1].topk(2).indices.tolist()) | {prompt[i]}
            assert max(abs(v - expected[i - 1, t].item()) for t, v in entry.items()) < TOL
    scores = llm.score_completions(case.prompts, case.greedy, ScoringParams(token_logprobs=True), use_tqdm=False)
    for prompt, completion, score in zip(case.prompts, case.greedy, scores, strict=True):
        expected = case.logprobs(prompt + completion)[len(prompt) - 1:-1].gather(1, torch.tensor(completion)[:, None])
        assert score.error is None
        assert max(abs(a - b) for a, b in zip(score.token_logprobs, expected[:, 0].tolist(), strict=True)) < TOL


def test_embeddings_match_transformers_hidden_states(case):
    llm = case.llm()
    for pooling in ("last", "mean"):
        outputs = llm.embed(case.prompts, pooling=pooling, normalize=False, use_tqdm=False)
        for prompt, out in zip(case.prompts, outputs, strict=True):
            with torch.no_grad():
                states = case.hf.model(torch.tensor([prompt], device=case.device)).last_hidden_state[0].float().cpu()
            expected = states[-1] if pooling == "last" else states.mean(0)
            ours = torch.tensor(out.outputs.embedding)
            assert (ours - expected).abs().max() < TOL * max(1.0, expected.abs().max().item()), pooling


def test_structured_outputs_hold_beside_free_rows(case):
    """Choice and regex constraints mask their own rows on the device; unconstrained rows in the same steps are
    transformers' greedy continuations."""
    llm = case.llm()
    choices, regex = ["yes", "no", "not sure"], r"[a-z]{2,6}-\d{1,3}"
    constrained = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=Constraint(choice=choices)),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=24, structured_outputs=Constraint(regex=regex))]
    params = [c for c in constrained for _ in case.prompts] + [GREEDY] * len(case.prompts)
    outputs = llm.generate(case.prompts * 3, params, use_tqdm=False)
    n = len(case.prompts)
    assert all(o.outputs[0].text in choices and o.outputs[0].valid for o in outputs[:n])
    assert all(re.fullmatch(regex, o.outputs[0].text) and o.outputs[0].valid for o in outputs[n:2 * n])
    assert tokens(outputs[2 * n:]) == case.greedy


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_come_back_unchanged(case, mode):
    """24 blocks of 8 tokens for 12 sequences of up to 106 tokens: preempted, swapped or recomputed, and back."""
    llm = case.llm(block_size=8, num_gpu_blocks_override=24, max_num_seqs=12, preemption_mode=mode,
                   swap_space="4MiB", enable_prefix_caching=False)
    assert llm.llm_engine.scheduler.config.num_device_blocks == 24
    outputs = llm.generate(case.prompts * 3, GREEDY, use_tqdm=False)
    assert tokens(outputs) == case.greedy * 3
    stats = llm.stats()
    assert stats[f"{mode}_preemptions"] > 0 and stats["kv_cache_usage"] == 0


def test_prefix_cache_hits_change_no_token(case):
    llm = case.llm(block_size=8)
    longest, ref = case.prompts[-1], case.greedy[-1]
    assert tokens(llm.generate([longest], GREEDY, use_tqdm=False)) == [ref]
    hits = llm.stats()["prefix_cache_hits"]
    assert tokens(llm.generate([longest], GREEDY, use_tqdm=False)) == [ref]
    assert llm.stats()["prefix_cache_hits"] > hits


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_mostly_agrees_and_survives_swaps(case, kv_cache_dtype):
    """Greedy tokens up to each sequence's first difference from transformers (test_kv_fp8's measure and bar),
    and the same tokens when the cache is too small and sequences are swapped out and back."""
    llm = case.llm(kv_cache_dtype=kv_cache_dtype)
    assert llm.llm_engine.runner.device_caches[0][0].dtype in ops.FP8_CACHE_DTYPES
    roomy = tokens(llm.generate(case.prompts * 3, GREEDY, use_tqdm=False))
    assert agreement(roomy, case.greedy * 3) >= 0.25
    tight = case.llm(kv_cache_dtype=kv_cache_dtype, block_size=8, num_gpu_blocks_override=24, max_num_seqs=12,
                     swap_space="4MiB", enable_prefix_caching=False)
    assert tokens(tight.generate(case.prompts * 3, GREEDY, use_tqdm=False)) == roomy
    assert tight.stats()["swap_preemptions"] > 0


@pytest.mark.parametrize("build", [build_llava, build_qwen2_vl], ids=["llava", "qwen2_vl"])
@pytest.mark.parametrize("device", DEVICES)
def test_vision_language_models_match_transformers(tmp_path, device, build):
    """Images and text inline and in chat parts, the vision tower's embeddings placed on the device (Qwen2-VL's
    M-RoPE positions too), chunked prefills cutting through image tokens."""
    path = build(tmp_path)
    llm = LLM(path, dtype="float32", device=device, gpu_memory_utilization=0.3, block_size=8,
              max_num_batched_tokens=10, max_num_seqs=4)
    encoded = llm.encode_batch(image_prompts(llm.engine.prompts.images.placeholder))
    hf = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).to(device).eval()
    want = [hf_image_greedy(hf, e, 10) for e in encoded]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert tokens(llm.generate(encoded, greedy, use_tqdm=False)) == want


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_mixture_of_experts(device, tmp_path, arch):
    """A Qwen3-MoE and a GPT-OSS (attention sinks, on the CUDA kernels on a GPU) on the transformers backend: on a
    CPU their experts packed per expert (layers/experts.py), on a GPU transformers' own grouped experts; greedy
    tokens transformers' on the same device either way."""
    path = str(build_zoo_model(tmp_path / "moe", arch))
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    prompts = make_prompts(hf.config.vocab_size, [3, 17, 40, 90])
    want = hf_greedy(hf, prompts, MAX_NEW)
    llm = LLM(path, dtype="float32", device=device, gpu_memory_utilization=0.3)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    packed = llm.llm_engine.runner.model.hf.config._experts_implementation == "batchgen"
    assert packed == (device == "cpu")
