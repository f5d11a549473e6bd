"""Decode steps through CUDA graphs (engine/cuda_graphs.py) give the tokens of eager steps.

On a CPU the graphs' static buffers, their padding and the runner's choice of steps are run with
`replay_eagerly` (the forward called on the static buffers at each replay), so everything but the capture
itself is checked on every CI run; on a GPU (`gpu` mark) real graphs are captured and compared with
`enforce_eager=True`.
"""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.cuda_graphs import DecodeGraphs, graph_buckets, replay_eagerly
from batchgen.layers.attention import AttentionMetadata


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(256)[-3:] == [224, 240, 256]
    for max_num_seqs in (1, 3, 17, 100):
        buckets = graph_buckets(max_num_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs


def prompts_and_params():
    """Requests whose lengths and budgets differ, so the decode batch shrinks through odd sizes (stale
    padding rows behind it) and block tables of several widths meet in one step."""
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(11)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(11)]
    return prompts, params


def with_emulated_graphs(llm: LLM) -> DecodeGraphs:
    engine = llm.engine
    max_blocks = -(-engine.max_model_len // engine.config.block_size)
    graphs = DecodeGraphs(engine.runner.model, engine.device, engine.config.max_num_seqs, max_blocks,
                          capture=replay_eagerly)
    engine.runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("max_num_seqs", [16, 5])
def test_graph_buffers_give_the_eager_tokens(tiny_model_dirs, max_num_seqs):
    options = dict(model=str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory=64 << 20, seed=0,
                   max_num_seqs=max_num_seqs, skip_tokenizer_init=True)
    prompts, params = prompts_and_params()
    eager = LLM(**options)
    assert eager.engine.runner.graphs is None  # never on a CPU
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(**options)
    graphs = with_emulated_graphs(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.replays > 10 and len(graphs._replays) > 1  # decode steps went through several buckets


def test_padding_rows_write_no_cache_slot(tiny_model_dirs):
    """A step of 3 decodes runs the 4-row bucket: the padding row's slot mapping is -1, so the cache is
    written at exactly the 3 real rows' slots."""
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory=64 << 20,
              max_num_seqs=4, skip_tokenizer_init=True)
    graphs = with_emulated_graphs(llm)
    graphs.slot_mapping.fill_(5)  # as if a larger step had left real slots there
    key_cache = llm.engine.runner.device_caches[0][0]
    before = key_cache.clone()
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([16, 33, 50]), num_decode_tokens=3,
        decode_block_tables=torch.tensor([[1], [2], [3]], dtype=torch.int32),
        decode_seq_lens=torch.tensor([1, 2, 3], dtype=torch.int32), decode_seq_groups=None,
        prefill_block_tables=None, prefill_seq_lens=None, prefill_query_start_loc=None)
    hidden = graphs.forward(torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2]), meta)
    assert hidden.shape[0] == 3 and graphs.bucket(3) == 4
    assert graphs.slot_mapping[3].item() == -1
    by_slot = (key_cache != before).permute(0, 2, 1, 3).reshape(-1, key_cache.shape[1] * key_cache.shape[3])
    assert by_slot.any(dim=1).nonzero().flatten().tolist() == [16, 33, 50]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_tokens(tiny_model_dirs, dtype):
    options = dict(model=str(tiny_model_dirs["llama"]), dtype=dtype, device="cuda", seed=0, max_num_seqs=16,
                   skip_tokenizer_init=True, gpu_memory_utilization=0.3)
    prompts, params = prompts_and_params()
    eager = LLM(**options, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    llm = LLM(**options)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.runner.graphs.replays > 10
