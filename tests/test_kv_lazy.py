"""The KV cache and the swap space cost nothing until used: a host cache is a fresh anonymous mapping
that reads as zeros where never written and takes memory as its blocks are first written, and the
block manager reuses written blocks before it touches new ones."""

from __future__ import annotations

import itertools
import sys

import psutil
import pytest
import torch

from batchgen import LLM, SamplingParams, ops
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sequence import Sequence

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings, RSS")
MAX_GROWTH_MIB = 512  # what a 4 GiB cache may add to RSS before much of it is written


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_a_fresh_cache_reads_as_zeros_and_attention_over_unwritten_blocks_is_finite():
    num_blocks, heads, block_size, head_dim = 64, 2, 16, 64
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, heads, block_size, head_dim, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(block_size, heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    slots = torch.arange(5 * block_size, 6 * block_size)  # block 5 only
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[5], key.transpose(0, 1)) and torch.equal(value_cache[5], value.transpose(0, 1))
    others = [b for b in range(num_blocks) if b != 5]
    assert not key_cache[others].any() and not value_cache[others].any()
    # A sequence over never-written blocks (whose last one is written) attends to zeros: finite, no NaN.
    query = torch.randn(1, 4, head_dim, generator=gen).bfloat16()
    table = torch.tensor([[60, 61, 62, 5]], dtype=torch.int32)
    out = ops.paged_attention_decode(query, key_cache, value_cache, table, torch.tensor([64], dtype=torch.int32),
                                     head_dim**-0.5)
    assert torch.isfinite(out.float()).all()


@linux_only
def test_a_4_gib_cache_takes_memory_only_as_its_blocks_are_written():
    heads, block_size, head_dim, dtype = 8, 16, 128, torch.bfloat16
    block_bytes = heads * block_size * head_dim * dtype.itemsize  # 32 KiB, key or value
    num_blocks = (2 << 30) // block_bytes  # 2 GiB each, 4 GiB the pair
    before = rss_mib()
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, heads, block_size, head_dim, dtype, "cpu")
    assert key_cache.nbytes + value_cache.nbytes == 4 << 30
    grown = rss_mib() - before
    assert grown < MAX_GROWTH_MIB, f"an untouched 4 GiB cache added {grown:.0f} MiB of RSS"
    used = torch.tensor([0, 1, 7, num_blocks // 2, num_blocks - 1])  # a few blocks far apart
    key_cache[used] = 1
    value_cache[used] = 2
    grown = rss_mib() - before
    assert grown < MAX_GROWTH_MIB, f"5 written blocks of a 4 GiB cache added {grown:.0f} MiB of RSS"
    for cache in (key_cache, value_cache):  # blocks beside written ones, and far from any, read as zeros
        assert not cache[[2, 6, 8, num_blocks // 4, num_blocks - 2]].any()


@linux_only
def test_an_engine_with_the_default_4_gib_cache_and_swap_space_grows_rss_by_what_it_uses(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    small = LLM(path, dtype="float32", kv_cache_memory="8MiB", swap_space=0)
    expected = [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)]
    del small
    before = rss_mib()
    llm = LLM(path, dtype="float32")  # kv_cache_memory and swap_space 4 GiB each
    runner = llm.engine.runner
    assert sum(k.nbytes + v.nbytes for k, v in runner.device_caches) == 4 << 30
    assert sum(k.nbytes + v.nbytes for k, v in runner.cpu_caches) == 4 << 30
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    grown = rss_mib() - before
    assert grown < MAX_GROWTH_MIB, f"an engine with 8 GiB of KV cache and swap space added {grown:.0f} MiB of RSS"
    assert [o.outputs[0].token_ids for o in outputs] == expected  # as with a small cache
    key_cache, value_cache = runner.device_caches[0]
    assert not key_cache[-16:].any() and not value_cache[-16:].any()  # never handed out


_seq_ids = itertools.count()


def _run_one_after_another(bm: BlockManager, lengths: list[int]) -> set[int]:
    """Allocates, fills and frees a sequence of each length in turn; returns every block id handed out."""
    seen: set[int] = set()
    for n in lengths:
        i = next(_seq_ids)
        seq = Sequence(i, [1000 * i + t for t in range(n)])  # distinct tokens: no prefix-cache hits
        bm.allocate(seq)
        bm.prepare_write(seq, 0, n)
        bm.mark_computed(seq, 0, n)
        seen.update(seq.block_table)
        bm.free(seq)
    return seen


def test_without_prefix_caching_a_run_reuses_the_blocks_it_has_written():
    bm = BlockManager(1000, 0, 4, enable_prefix_caching=False)
    seen = _run_one_after_another(bm, [9, 30, 5, 17, 30, 2, 25] * 10)
    assert seen == set(range(8))  # 30 tokens: 8 blocks at most at a time, the lowest ids


def test_with_prefix_caching_freed_partial_blocks_are_reused_before_new_ones():
    bm = BlockManager(1000, 0, 4, enable_prefix_caching=True)
    assert _run_one_after_another(bm, [9]) == {0, 1, 2}  # 0 and 1 full (cached), 2 partial (freed)
    # Each 6-token sequence's first block stays cached; its partial second is the next one's first.
    assert _run_one_after_another(bm, [6] * 5) == {2, 3, 4, 5, 6, 7}
