"""BlockManager, one operation at a time."""

from __future__ import annotations

import pytest

from batchgen.engine import block_manager as bm_module
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sequence import Sequence

BS = 4


def make(num_device=16, num_cpu=8, caching=True) -> BlockManager:
    return BlockManager(num_device, num_cpu, BS, enable_prefix_caching=caching)


def seq(tokens, seq_id=[0]) -> Sequence:  # noqa: B006 - a counter
    seq_id[0] += 1
    return Sequence(seq_id[0], list(tokens))


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler and runner do for a prefill: write, then mark computed."""
    bm.prepare_write(s, s.num_computed_tokens, len(s))
    bm.mark_computed(s, s.num_computed_tokens, len(s))
    s.num_computed_tokens = len(s)


def test_allocate_takes_all_prompt_blocks_and_free_returns_them():
    bm = make()
    s = seq(range(10))
    assert bm.num_blocks_to_allocate([s]) == 3
    bm.allocate(s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_device_blocks == 13 and bm.stats().used_device_blocks == 3
    assert all(bm.ref_count(b) == 1 for b in s.block_table)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_device_blocks == 16


def test_append_slot_only_when_last_block_is_full():
    bm = make()
    s = seq(range(8))  # exactly two full blocks
    bm.allocate(s)
    compute_all(bm, s)
    s.append_token(100)
    assert bm.num_blocks_to_write([(s, 8, 9)]) == 1
    assert bm.prepare_write(s, 8, 9) == [] and len(s.block_table) == 3
    bm.mark_computed(s, 8, 9)
    s.num_computed_tokens = 9
    s.append_token(101)
    assert bm.num_blocks_to_write([(s, 9, 10)]) == 0
    bm.prepare_write(s, 9, 10)
    assert len(s.block_table) == 3


def test_fork_shares_every_block_and_copy_on_write_on_the_shared_partial_block():
    bm = make()
    parent = seq(range(6))
    bm.allocate(parent)
    compute_all(bm, parent)
    children = [parent.spawn(i) for i in (1, 2, 3)]
    for c in children:
        bm.fork(parent, c)
    assert all(bm.ref_count(b) == 4 for b in parent.block_table)
    assert bm.stats().used_device_blocks == 2
    for s in [parent, *children]:
        s.append_token(50 + s.sample_index)
    writes = [(s, 6, 7) for s in [parent, *children]]
    assert bm.num_blocks_to_write(writes) == 3  # the last writer keeps the original
    shared = parent.block_table[1]
    copies = [c for s in [parent, *children] for c in bm.prepare_write(s, 6, 7)]
    assert len(copies) == 3 and all(src == shared for src, _ in copies)
    last_blocks = {s.block_table[1] for s in [parent, *children]}
    assert len(last_blocks) == 4 and all(bm.ref_count(b) == 1 for b in last_blocks)
    first = parent.block_table[0]
    assert all(s.block_table[0] == first for s in children) and bm.ref_count(first) == 4
    assert bm.stats().blocks_copied == 3


def test_copy_on_write_when_another_group_still_holds_the_block():
    bm = make()
    a = seq(range(6))
    bm.allocate(a)
    compute_all(bm, a)
    b = a.spawn(1)
    bm.fork(a, b)
    a.append_token(7)
    assert bm.num_blocks_to_write([(a, 6, 7)]) == 1  # b holds it and does not write this step
    (src, dst), = bm.prepare_write(a, 6, 7)
    assert b.block_table[1] == src and a.block_table[1] == dst


def test_prefix_cache_reuses_longest_cached_prefix_and_sets_computed_tokens():
    bm = make()
    a = seq(range(12))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq([*range(8), 99, 98, 97, 96, 95])  # shares two full blocks with a
    assert bm.num_blocks_to_allocate([b]) == 2  # 4 blocks, 2 found in use
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert bm.ref_count(a.block_table[0]) == 2
    s = bm.stats()
    assert s.prefix_cache_query_tokens == 12 + 13 and s.prefix_cache_hit_tokens == 8


def test_prefix_cache_leaves_the_last_prompt_token_to_compute():
    bm = make()
    a = seq(range(8))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(range(8))  # identical, block aligned: only the first block may be reused
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]


def test_prefix_cache_off_reuses_nothing():
    bm = make(caching=False)
    a = seq(range(8))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(range(9))
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.free(a)
    assert bm.stats().cached_device_blocks == 0


def test_prefix_cache_verifies_token_ids_not_only_hashes(monkeypatch):
    monkeypatch.setattr(bm_module, "block_key", lambda parent, tokens: 42)  # every block collides
    bm = make()
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq([9, 9, 9, 9, 5])
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and b.block_table[0] != a.block_table[0]
    c = seq([1, 2, 3, 4, 6])
    bm.allocate(c)
    assert c.num_computed_tokens == 4


def test_freed_cached_blocks_stay_findable_until_never_cached_blocks_run_out():
    bm = make(num_device=6)
    a = seq(range(9))  # blocks: [0..3] [4..7] and a partial one
    bm.allocate(a)
    compute_all(bm, a)
    full = a.block_table[:2]
    bm.free(a)
    s = bm.stats()
    assert s.used_device_blocks == 0 and s.cached_device_blocks == 2 and s.free_device_blocks == 6
    filler = seq(range(100, 116))  # 4 blocks: exactly the never-cached ones
    bm.allocate(filler)
    assert not set(filler.block_table) & set(full)
    again = seq(range(9))
    assert bm.num_blocks_to_allocate([again]) == 3  # 1 new + 2 cached hits taken from the free pool
    bm.free(filler)
    bm.allocate(again)
    assert again.block_table[:2] == full and again.num_computed_tokens == 8


def test_eviction_takes_a_sequences_tail_before_its_head():
    bm = make(num_device=6)
    a = seq(range(9))
    bm.allocate(a)
    compute_all(bm, a)
    head, tail = a.block_table[:2]
    bm.free(a)  # last block first: the tail is the least recently freed
    other = seq(range(100, 120))  # 5 blocks: 4 never cached, then one eviction
    bm.allocate(other)
    assert tail in other.block_table and head not in other.block_table
    bm.free(other)
    again = seq(range(9))
    bm.allocate(again)
    assert again.num_computed_tokens == 4 and again.block_table[0] == head


def test_lru_evicts_least_recently_freed_first():
    bm = make(num_device=4)
    a, b = seq(range(0, 5)), seq(range(10, 15))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)  # a's first block cached, its partial block not
    bm.allocate(b)
    compute_all(bm, b)
    bm.free(b)
    assert bm.stats().cached_device_blocks == 2
    c = seq(range(20, 32))  # 3 blocks: the 2 never-cached ones, then the LRU cached one (a's)
    bm.allocate(c)
    bm.free(c)
    d = seq(range(10, 15))
    bm.allocate(d)
    assert d.num_computed_tokens == 4  # b's block survived
    a2 = seq(range(0, 5))
    bm.allocate(a2)
    assert a2.num_computed_tokens == 0  # a's was evicted


def test_swap_out_and_in_keeps_sharing_and_logical_positions():
    bm = make(num_device=16, num_cpu=8, caching=False)
    parent = seq(range(10))
    bm.allocate(parent)
    compute_all(bm, parent)
    samples = [parent] + [parent.spawn(i) for i in (1, 2, 3)]
    for c in samples[1:]:
        bm.fork(parent, c)
    device_table = list(parent.block_table)
    assert bm.num_blocks_to_swap(samples) == 3
    moved_out = bm.swap_out(samples)
    assert len(moved_out) == 3  # a block shared by 4 samples moves once
    assert bm.stats().used_cpu_blocks == 3 and bm.stats().used_device_blocks == 0
    assert all(s.block_table == parent.block_table for s in samples)
    assert all(bm.ref_count(c, on_cpu=True) == 4 for c in parent.block_table)
    assert [dict(moved_out)[d] for d in device_table] == parent.block_table  # block i -> cpu block i
    cpu_table = list(parent.block_table)
    moved_in = bm.swap_in(samples)
    assert len(moved_in) == 3 and bm.stats().used_cpu_blocks == 0
    assert all(s.block_table == parent.block_table for s in samples)
    assert all(bm.ref_count(b) == 4 for b in parent.block_table)
    assert [dict(moved_in)[c] for c in cpu_table] == parent.block_table
    assert bm.stats().filled_slots == 10 and bm.stats().blocks_swapped_out == 3


def test_swap_in_reuses_a_full_block_still_cached_on_the_device():
    bm = make()
    a = seq(range(10))
    bm.allocate(a)
    compute_all(bm, a)
    out = bm.swap_out([a])
    assert len(out) == 3 and bm.stats().cached_device_blocks == 2
    moved_in = bm.swap_in([a])
    assert len(moved_in) == 1  # only the partial block is copied back
    assert bm.stats().used_device_blocks == 3 and bm.stats().cached_device_blocks == 0


def test_slot_utilization_and_peak():
    bm = make()
    a = seq(range(9))
    bm.allocate(a)
    assert bm.stats().slot_utilization == 0.0
    compute_all(bm, a)
    s = bm.stats()
    assert s.filled_slots == 9 and s.allocated_slots == 12 and s.slot_utilization == pytest.approx(0.75)
    b = seq(range(100, 120))
    bm.allocate(b)
    bm.free(b)
    assert bm.stats().peak_used_device_blocks == 8


def test_allocating_from_an_empty_pool_raises():
    bm = make(num_device=2)
    bm.allocate(seq(range(8)))
    with pytest.raises(RuntimeError, match="no free device KV block"):
        bm.allocate(seq(range(100, 101)))
