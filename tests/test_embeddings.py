"""LLM.embed: transformers' final hidden states pooled (last, mean, CLS), through chunked prefill, the prefix
cache and preemption, mixed with generation; a sentence-transformers pooling config followed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from scoring_kit import ModelShelf, make_prompts, transformers_forward

from batchgen import LLM, SamplingParams
from batchgen.pooling_params import PoolingParams

TOL = 1e-4
LENS = [1, 2, 16, 17, 45, 130]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelShelf(tmp_path_factory.mktemp("embedding_models"))


def hidden_states(model_dir: str):
    """prompt -> transformers' final hidden states [len, hidden] (AutoModel: the decoder with its final norm)."""
    return transformers_forward(model_dir, tf.AutoModel, lambda out: out.last_hidden_state[0].float())


def pooled(states: torch.Tensor, pooling: str) -> torch.Tensor:
    return {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]


def small(model_dir: str, **options) -> LLM:
    return LLM(model_dir, dtype="float32", **{"kv_cache_memory": "16MiB", "max_num_batched_tokens": 256,
                                              "max_num_seqs": 8, **options})


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "olmo2"])
def test_embeddings_match_transformers(models, arch):
    model_dir = models(arch)
    reference = hidden_states(model_dir)
    results: dict[tuple, list] = {}
    for chunk, prefix_caching in [(256, False), (16, True), (37, True)]:
        llm = small(model_dir, max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching)
        prompts = make_prompts(llm.engine.vocab_size, LENS, seed=1)
        prompts.append(prompts[-1][:100] + prompts[-2][:20])  # a cached prefix when the cache is on
        for pooling in ("last", "mean", "cls"):
            raw = llm.embed(prompts, pooling=pooling, normalize=False, use_tqdm=False)
            unit = llm.embed(prompts, pooling=pooling, use_tqdm=False)  # normalised by default
            for prompt, a, b in zip(prompts, raw, unit, strict=True):
                expected = pooled(reference(prompt), pooling)
                ours = torch.tensor(a.outputs.embedding)
                assert (ours - expected).abs().max() < TOL * max(1.0, expected.abs().max().item())
                assert F.cosine_similarity(torch.tensor(b.outputs.embedding), expected, dim=0) > 0.99999
                assert torch.tensor(b.outputs.embedding).norm() == pytest.approx(1.0, abs=1e-5)
            # The same vectors, bit for bit, at every chunk size, with the cache and without.
            results.setdefault(pooling, []).append([o.outputs.embedding for o in raw])
        if prefix_caching:
            assert llm.stats()["prefix_cache_hits"] > 0  # last-token pooling reused cached blocks
    for runs in results.values():
        assert all(run == runs[0] for run in runs)


@pytest.mark.slow
def test_smollm2_embeddings_match_transformers(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=32, max_num_seqs=8)
    texts = ["A paged KV cache keeps sequences in fixed-size blocks.", "Bonjour", "The sea, the sea. " * 8]
    reference = hidden_states(str(smollm2_dir))
    for pooling in ("last", "mean"):
        for text, out in zip(texts, llm.embed(texts, pooling=pooling, normalize=False, use_tqdm=False), strict=True):
            assert out.prompt_token_ids == llm.tokenizer.encode(text)
            expected = pooled(reference(out.prompt_token_ids), pooling)
            assert (torch.tensor(out.outputs.embedding) - expected).abs().max() < TOL * expected.abs().max()
            assert out.outputs.hidden_size == 576


def test_sentence_transformers_config_is_followed(models, tmp_path):
    model_dir = tmp_path / "st"
    shutil.copytree(models("qwen3"), model_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 128, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
               "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    llm = small(str(model_dir))
    prompts = make_prompts(llm.engine.vocab_size, LENS, seed=2)
    own = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    assert own == [o.outputs.embedding for o in llm.embed(prompts, pooling="mean", normalize=True, use_tqdm=False)]
    # Matryoshka truncation: the first dimensions, normalised after truncating.
    short = llm.embed(prompts, PoolingParams(dimensions=32), use_tqdm=False)
    for full, cut in zip(own, short, strict=True):
        assert len(cut.outputs.embedding) == 32
        expected = F.normalize(torch.tensor(full)[:32], dim=0)  # normalising the unit vector again: the same
        assert torch.allclose(torch.tensor(cut.outputs.embedding), expected, atol=1e-6)
    # Without the Normalize module the vectors are not normalised; a pooling batchgen lacks must be named.
    modules.pop()
    (model_dir / "modules.json").write_text(json.dumps(modules))
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    llm = small(str(model_dir))
    with pytest.raises(ValueError, match=r"pooling: the model's own cannot be followed: its sentence-transformers "
                                         r"pooling \(pooling_mode_max_tokens\)"):
        llm.embed(prompts, use_tqdm=False)
    last = llm.embed(prompts, pooling="last", use_tqdm=False)
    assert any(abs(torch.tensor(o.outputs.embedding).norm() - 1) > 1e-3 for o in last)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_embeddings_mixed_with_generation_and_preempted(models, mode):
    model_dir = models("llama")
    alone = small(model_dir)
    vocab = alone.engine.vocab_size
    long_prompts = make_prompts(vocab, [300, 240], seed=3)
    gen_prompts = make_prompts(vocab, [28, 28, 28], seed=4)
    gen_params = SamplingParams(temperature=0.8, seed=5, max_tokens=60, ignore_eos=True)
    expected_vectors = [o.outputs.embedding for o in alone.embed(long_prompts, pooling="mean", use_tqdm=False)]
    expected_tokens = [o.outputs[0].token_ids for o in alone.generate(gen_prompts, gen_params, use_tqdm=False)]
    # 26 blocks: the generations grow and preempt the newest requests, the embeddings, mid-prefill.
    block_bytes = 2 * 2 * 2 * 16 * 64 * 4
    mixed = small(model_dir, kv_cache_memory=26 * block_bytes, swap_space="8MiB", preemption_mode=mode,
                  max_num_batched_tokens=29, max_num_seqs=6)
    for i, prompt in enumerate(gen_prompts):
        mixed.add_request(f"gen-{i}", prompt, gen_params)
    for i, prompt in enumerate(long_prompts):
        mixed.add_request(f"emb-{i}", prompt, PoolingParams(pooling="mean"))
    done = {}
    while mixed.has_unfinished_requests():
        done.update((out.request_id, out) for out in mixed.step())
    assert [done[f"emb-{i}"].outputs.embedding for i in range(2)] == expected_vectors
    assert [done[f"gen-{i}"].outputs[0].token_ids for i in range(3)] == expected_tokens
    assert max(done[f"emb-{i}"].metrics.num_preemptions for i in range(2)) > 0


def test_a_checkpoint_without_its_head_embeds_but_does_not_generate(models, tmp_path):
    hf = tf.AutoModel.from_pretrained(models("llama"), dtype=torch.float32)  # LlamaModel: no lm_head
    hf.save_pretrained(tmp_path)
    tf.AutoTokenizer.from_pretrained(models("llama")).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaModel"]
    llm = small(str(tmp_path))
    prompt = make_prompts(llm.engine.vocab_size, [20], seed=6)[0]
    expected = small(models("llama")).embed([prompt], use_tqdm=False)[0].outputs.embedding
    assert llm.embed([prompt], use_tqdm=False)[0].outputs.embedding == expected
    with pytest.raises(ValueError, match="model: generation needs a language-model head, and this model has no "
                                         "language-model head; it can embed"):
        llm.generate([prompt], use_tqdm=False)
    with pytest.raises(ValueError, match="task: classify needs a model with a classification head"):
        llm.classify([prompt], use_tqdm=False)


def test_pooling_params_are_checked():
    for kwargs, field in [(dict(task="rank"), "task"), (dict(pooling="max"), "pooling"),
                          (dict(dimensions=0), "dimensions"), (dict(task="classify", dimensions=8), "dimensions"),
                          (dict(normalize="yes"), "normalize")]:
        with pytest.raises(ValueError, match=rf"^PoolingParams\.{field}: "):
            PoolingParams(**kwargs)
