"""model_impl: the transformers backend against transformers' own generate on tiny models of many
architectures, native against the backend, and the kinds of model neither can run refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
from conftest import ARCHITECTURES, build_tiny_model
from model_zoo import ZOO, build_zoo_model

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError, EngineConfig
from batchgen.engine.preflight import plan_model
from batchgen.job.spec import ModelSpec, spec_problems
from batchgen.models.architectures import attention_geometry, pick_impl

PROMPT_LENS = [3, 28, 60, 17, 90]  # 28 and 60 cross a block edge while decoding
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# Every engine variation the issue names, in two runs per architecture. The KV budgets hold the longest
# request alone but not the batch, so both runs preempt.
ENGINE_RUNS = {
    "prefix-cache,block-8,chunked,swap": dict(enable_prefix_caching=True, block_size=8, max_num_batched_tokens=32,
                                              max_num_seqs=8, preemption_mode="swap", blocks=14),
    "no-prefix-cache,block-32,recompute": dict(enable_prefix_caching=False, block_size=32, preemption_mode="recompute",
                                               blocks=4),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            build = build_tiny_model if arch in ARCHITECTURES else build_zoo_model
            built[arch] = str(build(root / arch, arch))
        return built[arch]

    return get


def prompts_of(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return prompts + prompts[-2:]  # again: prefix cache hits when it is on


_references: dict[str, list[list[int]]] = {}


def reference(model_dir: str, arch: str) -> list[list[int]]:
    """transformers' greedy continuations (eager attention, float32), cached per architecture."""
    if arch not in _references:
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        refs = []
        for prompt in prompts_of(hf.config.vocab_size):
            x = torch.tensor([prompt])
            out = hf.eval().generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                                     min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(prompt):].tolist())
        _references[arch] = refs
    return _references[arch]


def run(model_dir: str, model_impl: str, blocks: int | None = None, **options) -> tuple[list[list[int]], dict]:
    if blocks is not None:
        geometry = attention_geometry(tf.AutoConfig.from_pretrained(model_dir))
        block_bytes = (2 * geometry.num_layers * geometry.num_kv_heads * options["block_size"] * geometry.head_dim
                       * 4)
        options.update(kv_cache_memory=blocks * block_bytes, swap_space="8MiB")
    llm = LLM(model_dir, dtype="float32", model_impl=model_impl, **options)
    vocab = tf.AutoConfig.from_pretrained(model_dir).vocab_size
    outputs = llm.generate(prompts_of(vocab), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.stats()


@pytest.mark.parametrize("engine_run", ENGINE_RUNS)
@pytest.mark.parametrize("arch", ZOO)
def test_transformers_backend_matches_transformers_generate(zoo, arch, engine_run):
    options = dict(ENGINE_RUNS[engine_run])
    tokens, stats = run(zoo(arch), "transformers", **options)
    assert tokens == reference(zoo(arch), arch)
    assert stats[f"{options['preemption_mode']}_preemptions"] > 0
    assert (stats["prefix_cache_hits"] > 0) == options["enable_prefix_caching"]


@pytest.mark.parametrize("engine_run", ENGINE_RUNS)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "mistral_window"])
def test_native_families_match_transformers_generate(zoo, arch, engine_run):
    """With the backend test above: native == transformers backend == transformers' generate."""
    options = dict(ENGINE_RUNS[engine_run])
    tokens, stats = run(zoo(arch), "native", **options)
    assert tokens == reference(zoo(arch), arch)
    assert stats[f"{options['preemption_mode']}_preemptions"] > 0


def test_the_llama_seam_through_the_backend(zoo):
    options = ENGINE_RUNS["prefix-cache,block-8,chunked,swap"]
    assert run(zoo("qwen3"), "transformers", **options)[0] == run(zoo("qwen3"), "native", **options)[0]


def test_auto_picks_native_where_there_is_one(zoo):
    assert plan_model(EngineConfig(zoo("gemma3"))).model_impl == "native"
    assert plan_model(EngineConfig(zoo("olmo2"))).model_impl == "transformers"
    # A native family's member it cannot run (Phi-3's long-context rope): the backend, or a clear error.
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
            "original_max_position_embeddings": 512}
    long_phi3 = tf.Phi3Config(architectures=["Phi3ForCausalLM"], hidden_size=256, num_attention_heads=4,
                              rope_parameters=rope)
    assert pick_impl("auto", long_phi3) == "transformers"
    with pytest.raises(ValueError, match="model_impl: batchgen's native Phi3ForCausalLM cannot run this model: "
                                         "its rope scaling 'longrope'"):
        pick_impl("native", long_phi3)


def refusal(tmp_path, config, **options) -> str:
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as caught:
        LLM(str(tmp_path), **options)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("kind", ["t5", "mamba", "headless", "alibi", "bloom"])
def test_models_neither_implementation_can_run_are_refused_with_the_reason(tmp_path, kind):
    config, arch, why = {
        "t5": (tf.T5Config(), "T5ForConditionalGeneration", "encoder-decoder"),
        "mamba": (tf.MambaConfig(), "MambaForCausalLM", "state"),
        "headless": (tf.Olmo2Config(), "Olmo2Model", "neither a causal language-model head"),
        "alibi": (tf.FalconConfig(alibi=True), "FalconForCausalLM", "ALiBi"),
        "bloom": (tf.BloomConfig(), "BloomForCausalLM", "ALiBi"),
    }[kind]
    config.architectures = [arch]
    message = refusal(tmp_path, config)
    assert message.startswith(f"model: architecture {arch} cannot run in batchgen") and why in message
    assert LLM.check_config(str(tmp_path))[0].message == message.removeprefix("model: ")


def test_native_for_an_architecture_without_one_is_a_config_error(tmp_path):
    config = tf.Olmo2Config(architectures=["Olmo2ForCausalLM"])
    message = refusal(tmp_path, config, model_impl="native")
    assert message.startswith("model_impl: batchgen has no native implementation of Olmo2ForCausalLM")


def test_model_impl_is_checked():
    with pytest.raises(ConfigError, match="model_impl: must be auto, native or transformers"):
        LLM("anything", model_impl="vllm")


def test_model_impl_in_a_job_file():
    spec = {"model": {"path": "m", "model_impl": "transformers"},
            "input": {"paths": ["p.jsonl"], "prompt_column": "prompt"}, "output": {"dir": "out"}}
    assert spec_problems(spec) == []
    assert ModelSpec(path="m", model_impl="transformers").engine_kwargs(Path("m"))["model_impl"] == "transformers"
    [problem] = spec_problems({**spec, "model": {"path": "m", "model_impl": "vllm"}})
    assert "model.model_impl" in str(problem)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings")
@pytest.mark.parametrize("arch", ["olmo2", "gpt_neox", "gpt_oss"])
def test_the_backend_lets_go_of_the_checkpoint_file(tmp_path, arch):
    """transformers loads tensors as views of the memory-mapped checkpoint: one left (embeddings, norms) kept the
    whole file mapped, every page the packing read in the process's memory (a 1.7 GB OLMo 2: 3.6 GB of RSS after
    load, 2.3 GB once let go). GPT-NeoX: its biases, kept by the packed linears; GPT-OSS: its experts' biases and
    the float32 copy of its attention sinks made at the first step."""
    import gc

    path = build_zoo_model(tmp_path / arch, arch)
    llm = LLM(str(path), dtype="float32", model_impl="transformers", kv_cache_memory="8MiB")
    gc.collect()
    checkpoint = str((path / "model.safetensors").resolve())
    assert not [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(checkpoint)]
    hf = llm.llm_engine.runner.model.hf  # an untied head, packed: its plain weight freed, not copied
    assert not hf.config.tie_word_embeddings and hf.get_output_embeddings().weight.device.type == "meta"
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
