"""vLLM's offline surface as client code calls it (lm-eval's vllm backend, distilabel, curator): engine
arguments with None for "default" and knobs that do not apply, prompt dicts, `prompts=`/`sampling_params=`
keywords, `get_tokenizer()`; the same tokens as the plain call."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory=64 << 20)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_vllm_engine_arguments_are_accepted_and_change_nothing(tiny_model_dirs, llm, caplog):
    """None means the default; parallelism, logging and loading knobs are dropped with one warning naming them."""
    with caplog.at_level(logging.WARNING, logger="batchgen.llm"):
        client = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory=64 << 20,
                     tensor_parallel_size=1, trust_remote_code=True, tokenizer_mode="auto", max_num_seqs=None,
                     quantization=None, seed=None, enable_lora=None, max_lora_rank=None, disable_log_stats=True,
                     enforce_eager=True, kv_cache_dtype="auto", load_format="auto", tokenizer=None,
                     swap_space=1 << 20)
    (warning,) = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert all(name in warning for name in ("tensor_parallel_size", "trust_remote_code", "tokenizer_mode",
                                            "disable_log_stats"))
    prompts = ["The sea is", "One plus one is"]
    assert texts(client.generate(prompts=prompts, sampling_params=GREEDY, use_tqdm=False)) == \
        texts(llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("options, field, message", [
    ({"max_num_seq": 4}, "max_num_seq", "did you mean 'max_num_seqs'"),
    ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype", "must be auto, fp8, fp8_e4m3 or fp8_e5m2"),
    ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override", "must be >= 2"),
    ({"load_format": "dummy"}, "load_format", "supports only 'auto' or 'safetensors'"),
    ({"tokenizer": "some/other-tokenizer"}, "tokenizer", "own tokenizer"),
])
def test_arguments_that_would_change_the_output_are_refused(tiny_model_dirs, options, field, message):
    with pytest.raises(ConfigError) as e:
        LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", **options)
    (problem,) = e.value.problems
    assert problem.option == field and message in problem.message
    assert LLM.check_config(str(tiny_model_dirs["llama"]), **options) == [problem]


def test_prompt_dicts_and_token_prompts_are_prompts_not_a_conversation(llm):
    """A list of vLLM prompt dicts is many prompts (it used to be read as one chat conversation)."""
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    assert llm.llm_engine.model_config.max_model_len == 1024  # the tiny model's max_position_embeddings
    ids = tokenizer.encode("One plus one is")
    want = texts(llm.generate(["The sea is", "One plus one is"], GREEDY, use_tqdm=False))
    got = texts(llm.generate([{"prompt": "The sea is"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False))
    assert got == want
    assert texts(llm.generate({"prompt": "The sea is"}, GREEDY, use_tqdm=False)) == want[:1]
    (conversation,) = llm.generate([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert conversation.prompt_token_ids and conversation.outputs[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "Describe", "multi_modal_data": {"image": [object()]}}, GREEDY, use_tqdm=False)


def test_prompt_logprobs_as_lm_eval_reads_them(llm):
    """lm-eval's loglikelihood call: the actual token and the top-ranked one at each position, each a Logprob
    with its logprob, its 1-based rank among the vocabulary and (when detokenizing) its text."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The sea is blue and the sky is")
    scoring = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": ids}], scoring, use_tqdm=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for token, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
        assert token in entry and 1 <= len(entry) <= 2
        best = max(entry, key=lambda t: entry[t].logprob)
        assert entry[best].rank == 1 and entry[token].rank >= 1
        assert (entry[token].rank == 1) == (token == best)
        assert entry[token].decoded_token is None  # detokenize=False, as vLLM
        assert float(entry[token]) == entry[token].logprob <= 0
    (named,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, prompt_logprobs=0, max_tokens=1),
                            use_tqdm=False)
    for token, entry, scored in zip(ids[1:], named.prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True):
        assert list(entry) == [token] and entry[token].decoded_token == tokenizer.decode([token])
        assert (entry[token].logprob, entry[token].rank) == (scored[token].logprob, scored[token].rank)


def test_a_rank_counts_the_tokens_scoring_higher(llm):
    """Sampled tokens' logprobs carry ranks too: with top 3, a random sample's own rank says where it stood."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, logprobs=3)
    (out,) = llm.generate(["The sea is"], params, use_tqdm=False)
    sample = out.outputs[0]
    for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
        assert sorted(lp.rank for t, lp in entry.items() if t != token or lp.rank <= 3)[:3] == [1, 2, 3]
        ordered = sorted(entry.values(), key=lambda lp: lp.rank)
        assert all(a.logprob >= b.logprob for a, b in zip(ordered, ordered[1:], strict=False))
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    chosen = [e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs, strict=True)]
    assert sample.cumulative_logprob == pytest.approx(sum(chosen))


def test_logits_processors_edit_their_own_row_only(llm):
    """vLLM's per-request Python processors, both forms: a processor that bans a token sees that sample's
    generated ids and its own row of logits; the other requests of the same call come out as they would alone."""
    tokenizer = llm.get_tokenizer()
    prompts = ["The sea is", "One plus one is", "The sky is"]
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    banned = plain[1].outputs[0].token_ids[0]
    seen: list[list[int]] = []

    def ban(generated_ids, logits):
        seen.append(list(generated_ids))
        logits[banned] = float("-inf")
        return logits

    def ban_with_prompt(prompt_ids, generated_ids, logits):
        assert list(prompt_ids) == tokenizer.encode("One plus one is")
        return ban(generated_ids, logits)

    for processor in (ban, ban_with_prompt):
        seen.clear()
        edited = SamplingParams(temperature=0, max_tokens=6, logits_processors=[processor])
        outs = llm.generate(prompts, [GREEDY, edited, GREEDY], use_tqdm=False)
        tokens = outs[1].outputs[0].token_ids
        assert banned not in tokens and tokens != plain[1].outputs[0].token_ids
        assert seen == [tokens[:i] for i in range(len(tokens))]  # one call per step, its own sample's ids
        assert texts([outs[0], outs[2]]) == texts([plain[0], plain[2]])


def test_a_logits_processor_that_changes_nothing_changes_nothing(llm):
    """The slow path gives the same tokens as the fast one when the processor leaves the logits as they are,
    greedy and seeded, with logprobs (the model's own, before processors, as before bans and penalties)."""
    for params in (SamplingParams(temperature=0, max_tokens=6, logprobs=1),
                   SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, logprobs=1)):
        plain = llm.generate(["The sea is"], params, use_tqdm=False)[0]
        params.logits_processors = [lambda ids, logits: logits]
        slow = llm.generate(["The sea is"], params, use_tqdm=False)[0]
        assert [c.token_ids for c in slow.outputs] == [c.token_ids for c in plain.outputs]
        assert [c.logprobs for c in slow.outputs] == [c.logprobs for c in plain.outputs]


def test_logits_processors_must_be_callables_of_two_or_three_arguments():
    with pytest.raises(ValueError, match="logits_processors: each must be a callable"):
        SamplingParams(logits_processors=["my_module:ban"])
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda logits: logits])


def test_spaces_between_special_tokens_with_special_tokens_kept(llm):
    """lm-eval's generate_until keeps special tokens and asks for no spaces between them; the tiny model's tokenizer
    is a fast one, which (as in vLLM) decodes in one call either way."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("<|im_start|>user")
    for spaced in (True, False):
        params = SamplingParams(temperature=0, max_tokens=6, skip_special_tokens=False, ignore_eos=True,
                                spaces_between_special_tokens=spaced)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=False)


def test_request_output_finished_and_metrics(llm):
    """distilabel and curator read `finished` and `metrics`: a small dataclass of times (vLLM's names)."""
    (out,) = llm.generate(["The sea is"], GREEDY, use_tqdm=False)
    assert out.finished is True
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time and m.num_preemptions == 0


def test_a_job_file_cannot_carry_logits_processors(tmp_path):
    """Python callables have no YAML form: a job file or a --set naming them is refused in one line saying where
    they go instead; spaces_between_special_tokens is a plain job setting."""
    from jobkit import cli, run, setup_job, write_job

    job = setup_job(tmp_path, rows=2)
    spec = yaml.safe_load(job.read_text())
    spec["sampling"] = {**spec.get("sampling", {}), "logits_processors": ["my_module:ban_token"],
                        "spaces_between_special_tokens": False}
    r = cli("validate", write_job(tmp_path / "bad.yaml", spec))
    assert r.exit_code == 1 and "Traceback" not in r.output
    (problem,) = [line for line in r.output.splitlines() if "logits_processors" in line]
    assert "sampling.logits_processors: Python callables cannot be given in a job file" in problem
    assert "LLM.generate" in problem and "spaces_between_special_tokens" not in r.output
    r = run(job, "--set", "sampling.logits_processors=[f]")
    assert r.exit_code == 1 and "--set sampling.logits_processors: Python callables cannot" in r.stderr


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_gpu_without_the_cuda_kernels_is_refused_before_the_weights(tiny_model_dirs, monkeypatch, device):
    """A GPU node whose batchgen._C was built without nvcc: one line at start-up, where the first step would fail
    every row."""
    from batchgen import _C

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_C, "has_cuda", lambda: False)
    (problem,) = LLM.check_config(str(tiny_model_dirs["llama"]), device=device)
    assert problem.option == "device" and "built without its CUDA kernels" in problem.message
    assert problem.message.startswith(f"{device} gives this machine's GPU") and "docs/gpu.md" in problem.message


def test_a_gpu_the_kernels_were_not_built_for_is_refused_before_the_weights(tiny_model_dirs, monkeypatch):
    """batchgen._C built for other architectures (no machine code or PTX for this GPU's): one line naming the
    architecture to build for, where the first step would fail every row."""
    from batchgen import _C
    from batchgen.engine import preflight

    def no_kernel_image(device):
        raise RuntimeError("reshape_and_cache: CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(_C, "has_cuda", lambda: True)
    monkeypatch.setattr(preflight, "_probe_cuda_kernels", no_kernel_image)
    (problem,) = LLM.check_config(str(tiny_model_dirs["llama"]), device="cuda")
    assert problem.option == "device" and "no kernel this GPU (sm_100) can run" in problem.message
    assert 'BATCHGEN_CUDA_ARCHS="100"' in problem.message and "no kernel image is available" in problem.message
