"""The decoder layers in one C++ call (ops.DecoderStack) against the Python layers they stand in for."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_llm import make_prompts

from batchgen import LLM, SamplingParams, ops
from batchgen.layers.attention import KVScales

pytestmark = pytest.mark.skipif(not ops.has_gemm_bf16(), reason="the stack runs on batchgen's bf16 GEMM (x86-64)")


class CountingStack:
    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.stack.forward(*args, **kwargs)


def run(llm: LLM, stack) -> list:
    """Samples (n=3, sharing their prompt's blocks) and greedy rows, long prompts in chunks of 64 tokens: steps
    mix decodes, first chunks and chunks with context."""
    model = llm.engine.runner.model
    saved, model.decoder_stack = model.decoder_stack, stack
    try:
        prompts = make_prompts(400, [5, 17, 40, 70, 130, 200])
        params = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=10, ignore_eos=True, logprobs=2)
                  if i % 2 else SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)
                  for i in range(len(prompts))]
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        model.decoder_stack = saved


def assert_same_outputs(ours: list, theirs: list) -> None:
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert x.logprobs == y.logprobs and x.cumulative_logprob == y.cumulative_logprob


# a bias on the qkv projection; q/k norms; the widened GEMMs
@pytest.mark.parametrize(("arch", "kernels"), [("llama", "own"), ("qwen2", "own"), ("qwen3", "own"),
                                               ("llama", "avx512"), ("llama", "avx2"), ("qwen2", "avx2")],
                         indirect=["kernels"])
def test_the_stack_gives_the_python_layers_results_bit_for_bit(tiny_model_dirs, arch, kernels):
    llm = LLM(tiny_model_dirs[arch], dtype="bfloat16", kv_cache_memory="32MiB", max_num_batched_tokens=64,
              max_num_seqs=16, enable_prefix_caching=False)
    stack = llm.engine.runner.model.decoder_stack
    assert stack is not None and stack.num_layers == 2
    assert all(layer.mlp.packed_gate_up.uses_panels for layer in llm.engine.runner.model.layers)
    counting = CountingStack(stack)
    ours, theirs = run(llm, counting), run(llm, None)
    assert counting.calls > 0
    seconds = stack.op_seconds()  # what scripts/bench.py reads for its breakdown
    assert set(seconds) == {"norms", "qkv", "rotary", "cache_write", "decode_attention", "prefill_attention", "o",
                            "gate_up", "down", "lora"}
    assert seconds.pop("lora") == 0 and all(t > 0 for t in seconds.values())  # no adapters here
    assert_same_outputs(ours, theirs)


def test_no_stack_for_weights_outside_the_gemm_panels(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="32MiB")
    assert llm.engine.runner.model.decoder_stack is None
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_stack_arguments_are_checked():
    for count in (0, 8):  # 7, or 9 with the q and k norms
        with pytest.raises(ValueError, match="needs 7 tensors"):
            ops.DecoderStack([[torch.empty(0)] * count], [None], 4, 2, 64, 128, 256, 1e-6, 0.125)
    with pytest.raises(ValueError, match="bad shape"):
        ops.DecoderStack([[torch.empty(0)] * 7], [None], 4, 3, 64, 128, 256, 1e-6, 0.125)
    with pytest.raises(ValueError, match="no layers"):
        ops.DecoderStack([], [], 4, 2, 64, 128, 256, 1e-6, 0.125)


def test_lora_slots_are_checked():
    stack = ops.DecoderStack([[torch.empty(0)] * 7], [None], 4, 2, 64, 128, 256, 1e-6, 0.125)
    piece = (0, torch.zeros(2, 8, 128), torch.zeros(2, 8, 128), torch.zeros(2, dtype=torch.int32))  # o: 256 -> 128
    with pytest.raises(ValueError, match="1 layers but 2 entries"):
        stack.set_lora([[[], [], [], []]] * 2)
    with pytest.raises(ValueError, match=r"layer 0 o piece .* with a \[slots, rank, 256\]"):
        stack.set_lora([[[], [piece], [], []]])
    good = (0, torch.zeros(2, 8, 256), torch.zeros(2, 8, 64), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="o's pieces cover 64 of its 128 columns"):
        stack.set_lora([[[], [good], [], []]])
    stack.set_lora([[[], [good, (64, *good[1:])], [], []]])  # two pieces of 64 columns: accepted


def test_the_stack_takes_a_sliding_window_as_the_python_layers_do(tiny_model_dirs):
    """A Mistral whose layers attend within a window builds its stack with it (DecoderStack(..., sliding_window=W)):
    bit for bit what the Python layers give with the same window."""
    window = 50  # shorter than most prompts, on no block or tile boundary
    llm = LLM(tiny_model_dirs["mistral"], dtype="bfloat16", kv_cache_memory="32MiB", max_num_batched_tokens=64,
              max_num_seqs=16, enable_prefix_caching=False)
    model = llm.engine.runner.model
    unwindowed = run(llm, model.decoder_stack)
    model.cfg.sliding_windows = (window,) * model.cfg.num_layers  # as a config with sliding_window: 50 gives
    for attn in model.attention_layers():
        attn.variant = dataclasses.replace(attn.variant, sliding_window=window)
    model._build_decoder_stack()
    stack = model.decoder_stack
    assert stack is not None
    ours, theirs = run(llm, stack), run(llm, None)
    assert_same_outputs(ours, theirs)
    assert any(x.logprobs != y.logprobs for a, b in zip(ours, unwindowed, strict=True)
               for x, y in zip(a.outputs, b.outputs, strict=True)), "the window changed nothing"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_stack_takes_an_fp8_cache_as_the_python_layers_do(tiny_model_dirs, kv_cache_dtype):
    """With an fp8 KV cache the stack writes and reads it with each layer's scales (`forward(..., key_scales,
    value_scales)`): bit for bit what the Python layers give, with scales that differ by layer and kv head."""
    llm = LLM(tiny_model_dirs["llama"], dtype="bfloat16", kv_cache_memory="32MiB", max_num_batched_tokens=64,
              max_num_seqs=16, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    gen = torch.Generator().manual_seed(0)
    for attn in model.attention_layers():  # as a checkpoint's scales per kv head would set them
        heads = attn.kv_scales.k.numel()
        attn.kv_scales = KVScales(torch.rand(heads, generator=gen) + 0.5, torch.rand(heads, generator=gen) + 0.5)
    counting = CountingStack(model.decoder_stack)
    ours, theirs = run(llm, counting), run(llm, None)
    assert counting.calls > 0
    assert_same_outputs(ours, theirs)
