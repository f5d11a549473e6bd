"""LLM.score_completions: the log-likelihood of given completions, against transformers, the prompt shared
through the prefix cache, mixed with generation in one engine, the same numbers whatever shares the step."""

from __future__ import annotations

import math

import pytest
from scoring_kit import ModelShelf, make_prompts, reference

from batchgen import LLM, SamplingParams
from batchgen.pooling_params import ScoringParams

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelShelf(tmp_path_factory.mktemp("scoring_models"))


def small(model_dir: str, **options) -> LLM:
    return LLM(model_dir, dtype="float32", **{"kv_cache_memory": "16MiB", "max_num_batched_tokens": 40,
                                              "max_num_seqs": 8, **options})


def rows(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts, each with several completions of 1-70 tokens."""
    prompts = make_prompts(vocab, [5, 40, 90], seed=3)
    completions = make_prompts(vocab, [1, 9, 33, 70], seed=4)
    return [p for p in prompts for _ in completions], completions * len(prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_scores_match_transformers(models, arch):
    model_dir = models(arch)
    llm = small(model_dir)
    prompts, completions = rows(llm.engine.vocab_size)
    scores = llm.score_completions(prompts, completions, ScoringParams(token_logprobs=True, logprobs=2),
                                   use_tqdm=False)
    logprobs = reference(model_dir)
    for prompt, completion, score in zip(prompts, completions, scores, strict=True):
        ref = logprobs(prompt + completion)
        expected = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(completion)]
        assert score.error is None and score.prompt_token_ids == prompt and score.completion_token_ids == completion
        assert score.num_tokens == len(completion) and len(score.token_logprobs) == len(completion)
        assert max(abs(a - b) for a, b in zip(score.token_logprobs, expected, strict=True)) < TOL
        assert abs(score.logprob - sum(expected)) < TOL * len(completion)
        assert score.mean_logprob == pytest.approx(score.logprob / len(completion), abs=1e-12)
        assert score.perplexity == pytest.approx(math.exp(-score.mean_logprob))
        for i, entry in enumerate(score.top_logprobs):
            top = set(ref[len(prompt) + i - 1].topk(2).indices.tolist())
            assert set(entry) == top | {completion[i]}
    # Each prompt's full blocks were computed once and shared by its other completions.
    assert llm.stats()["prefix_cache_hits"] > 0


@pytest.mark.slow
def test_smollm2_scores_text_and_chat(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64, max_num_seqs=8)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answers = ["The capital of France is Paris.", "The capital of France is Berlin.", "Bananas."]
    scores = llm.score_completions(chat, answers, ScoringParams(token_logprobs=True), use_tqdm=False)
    tok = llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    logprobs = reference(str(smollm2_dir))
    for answer, score in zip(answers, scores, strict=True):
        completion = tok.encode(answer, add_special_tokens=False)
        assert score.prompt_token_ids == prompt and score.completion_token_ids == completion
        ref = logprobs(prompt + completion)
        expected = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(completion)]
        assert max(abs(a - b) for a, b in zip(score.token_logprobs, expected, strict=True)) < TOL
    assert scores[0].mean_logprob > scores[1].mean_logprob > scores[2].mean_logprob  # Paris, then Berlin
    text = llm.score_completions("The capital of France is", " Paris", use_tqdm=False)[0]
    assert text.num_tokens == 1 and text.token_logprobs is None and text.logprob < 0


def test_scores_do_not_depend_on_the_cache_chunks_or_neighbours(models):
    model_dir = models("llama")
    alone = small(model_dir, max_num_batched_tokens=512, enable_prefix_caching=False)
    prompts, completions = rows(alone.engine.vocab_size)
    params = ScoringParams(token_logprobs=True, logprobs=3)
    expected = [alone.score_completions(p, c, params, use_tqdm=False)[0]
                for p, c in zip(prompts, completions, strict=True)]
    mixed = small(model_dir, max_num_batched_tokens=23)
    gens = make_prompts(mixed.engine.vocab_size, [7, 60, 120], seed=9)
    for i, prompt in enumerate(gens):  # generation and prompt logprobs in the same steps
        mixed.add_request(f"gen-{i}", prompt, SamplingParams(temperature=0.5, seed=i, max_tokens=20,
                                                             prompt_logprobs=1 if i else None))
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        mixed.add_request(f"score-{i}", prompt, params, completion=completion)
    done = {}
    while mixed.has_unfinished_requests():
        done.update((out.request_id, out) for out in mixed.step())
    got = [done[f"score-{i}"] for i in range(len(prompts))]
    for a, b in zip(got, expected, strict=True):
        assert (a.logprob, a.token_logprobs, a.top_logprobs) == (b.logprob, b.token_logprobs, b.top_logprobs)
    assert mixed.stats()["prefix_cache_hits"] > 0
    assert all(len(done[f"gen-{i}"].outputs[0].token_ids) == 20 for i in range(3))


def test_scoring_errors(models):
    llm = small(models("llama"))
    with pytest.raises(ValueError, match="completions: 3 given for 2 prompts"):
        llm.score_completions([[5, 6], [7, 8]], [[1], [2], [3]], use_tqdm=False)
    with pytest.raises(ValueError, match="completion: expected a non-empty list"):
        llm.score_completions([5, 6], [[]], use_tqdm=False)
    with pytest.raises(ValueError, match="completion: a scoring request"):
        llm.add_request("x", [5, 6], SamplingParams(), completion=[3])
    with pytest.raises(ValueError, match="ScoringParams.logprobs"):
        ScoringParams(logprobs=-1)
    # A prompt longer than the model allows is that row's error, not an exception.
    short = small(models("llama"), max_model_len=64)
    out = short.score_completions([[5] * 60, [5] * 10], [[6] * 10, [6] * 10], use_tqdm=False)
    assert "max_model_len" in out[0].error and out[0].logprob is None and out[1].error is None


def test_bench_scoring_quick_pass(models, tmp_path):
    """scripts/bench_scoring.py --quick end to end on a tiny model: both engines run and agree."""
    import importlib.util
    import json
    import sys

    from jobkit import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_scoring", REPO / "scripts" / "bench_scoring.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--quick", "--model", models("llama"), "--dtype", "float32", "--json",
                          str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert report["score"]["rows"] == 8 and report["embed"]["rows"] == 8
    assert report["score"]["prefix_cache_hit_tokens"] > 0  # each prompt's 4 completions share it
