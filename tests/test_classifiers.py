"""LLM.classify on `...ForSequenceClassification` checkpoints (classifiers, reward models) against
transformers' AutoModelForSequenceClassification, native and through the transformers backend."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from scoring_kit import ModelShelf, build_classifier, make_prompts

from batchgen import LLM, SamplingParams
from batchgen.models.transformers_backend import TransformersModel
from batchgen.pooling_params import PoolingParams

TOL = 1e-4
LABELS = ["negative", "neutral", "positive"]
LENS = [1, 3, 16, 17, 50, 120]


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    """arch -> a tiny random classifier built from the tiny causal model's config (num_labels 3, or 1 for
    "reward": a Llama reward model)."""
    root = tmp_path_factory.mktemp("classifiers")
    shelf = ModelShelf(root / "causal")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            base = shelf("llama" if arch == "reward" else arch)
            built[arch] = build_classifier(root / arch, base, ["reward"] if arch == "reward" else LABELS)
        return built[arch]

    return get


def small(model_dir: str, **options) -> LLM:
    return LLM(model_dir, dtype="float32", **{"kv_cache_memory": "16MiB", "max_num_batched_tokens": 256,
                                              "max_num_seqs": 8, **options})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "olmo2", "reward"])
def test_classifier_logits_match_transformers(classifiers, arch):
    model_dir = classifiers(arch)
    hf = tf.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    runs = []
    for chunk, prefix_caching in [(256, False), (16, True), (37, True)]:
        llm = small(model_dir, max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching)
        assert isinstance(llm.engine.runner.model, TransformersModel) == (arch == "olmo2")  # else native
        prompts = make_prompts(llm.engine.vocab_size, LENS, seed=3)
        prompts.append(prompts[-1][:100] + prompts[-2][:10])
        outs = llm.classify(prompts, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                expected = hf(torch.tensor([prompt])).logits[0]
            logits = torch.tensor(out.outputs.logits)
            assert (logits - expected).abs().max() < TOL * max(1.0, expected.abs().max().item())
            probs = torch.tensor(out.outputs.probs)
            if arch == "reward":  # one label: a score, and its sigmoid
                assert out.outputs.labels == ["reward"] and probs == pytest.approx(torch.sigmoid(logits))
            else:
                assert out.outputs.labels == LABELS and out.outputs.num_classes == 3
                assert probs == pytest.approx(torch.softmax(logits, 0), abs=1e-6)
                assert out.outputs.label == LABELS[int(expected.argmax())]
        runs.append([(o.outputs.logits, o.outputs.probs) for o in outs])
    assert runs[1] == runs[0] and runs[2] == runs[0]  # bit for bit at every chunk size, cache or not


def test_a_classifier_mixes_with_embeddings_and_does_not_generate(classifiers):
    model_dir = classifiers("qwen2")
    llm = small(model_dir, max_num_batched_tokens=23)
    prompts = make_prompts(llm.engine.vocab_size, [40, 7, 90], seed=4)
    alone_probs = [o.outputs.probs for o in small(model_dir).classify(prompts, use_tqdm=False)]
    alone_embeddings = [o.outputs.embedding for o in small(model_dir).embed(prompts, use_tqdm=False)]
    for i, prompt in enumerate(prompts):
        llm.add_request(f"c{i}", prompt, PoolingParams("classify"))
        llm.add_request(f"e{i}", prompt, PoolingParams("embed", pooling="last"))
    done = {}
    while llm.has_unfinished_requests():
        done.update((out.request_id, out) for out in llm.step())
    assert [done[f"c{i}"].outputs.probs for i in range(3)] == alone_probs
    assert [done[f"e{i}"].outputs.embedding for i in range(3)] == alone_embeddings
    raw = llm.classify(prompts, PoolingParams("classify", activation=False), use_tqdm=False)
    assert [o.outputs.probs for o in raw] == [o.outputs.logits for o in raw]
    message = "model: generation needs a language-model head, and this model has a classification head"
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="model: scoring needs a language-model head"):
        llm.score_completions(prompts[0], [5, 6], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params: classify takes PoolingParams"):
        llm.classify(prompts, PoolingParams("embed"), use_tqdm=False)


def test_classifiers_pass_the_config_checks(classifiers):
    assert LLM.check_config(classifiers("llama")) == []
    assert LLM.check_config(classifiers("olmo2")) == []
