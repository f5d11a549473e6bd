"""Whole runs of the scheduler with the fake runner: workloads many times larger than the KV
pool, and the memory-efficiency numbers paged KV is for.

Slot utilisation is measured after every step over the device blocks in use at that moment
(filled slots / slots of those blocks, a filled slot being one whose K/V has been computed);
we assert both its average over all steps, weighted by the blocks in use (sum of filled slots /
sum of allocated slots), and its value at the step of peak usage.
"""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeEngine, assert_pools_whole

from batchgen.engine import SchedulerConfig

BLOCK = 16


def _shared_prefix_workload(eng: FakeEngine, rng: random.Random, num_requests: int) -> int:
    """Requests on three system prompts, ragged user parts, n in 1..4. Returns the tokens that
    their samples would hold at the end, unshared."""
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(64, 160))] for _ in range(3)]
    total = 0
    for _ in range(num_requests):
        prompt = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randint(10, 200))]
        n, max_tokens = rng.choice([1, 1, 1, 2, 4]), rng.randint(8, 96)
        eng.add(prompt, n=n, max_tokens=max_tokens)
        total += n * (len(prompt) + max_tokens)
    return total


@pytest.mark.parametrize("mode, num_cpu_blocks, caching", [
    ("swap", 64, True), ("swap", 64, False), ("recompute", 64, True), ("recompute", 0, False),
    ("swap", 12, True),  # a small CPU pool: swaps while it has room, recomputes after
])
def test_a_workload_many_times_the_pool_finishes_every_request(mode, num_cpu_blocks, caching):
    config = SchedulerConfig(num_device_blocks=160, num_cpu_blocks=num_cpu_blocks, max_num_seqs=48,
                             max_num_batched_tokens=512, preemption_mode=mode, enable_prefix_caching=caching,
                             max_model_len=1024)
    eng = FakeEngine(config)  # every invariant and the cache contents checked after every step
    demand = _shared_prefix_workload(eng, random.Random(3), 200)
    assert demand > 20 * config.num_device_blocks * BLOCK
    eng.run(max_steps=5000)
    assert len(eng.finished) == 200 and all(g.error is None for g in eng.finished.values())
    eng.check_outputs()  # each sample's tokens exactly once, as without any preemption
    assert_pools_whole(eng.scheduler)
    s = eng.scheduler.stats()
    if mode == "swap":
        assert s.num_swap_preemptions > 0 and s.blocks_swapped_in > 0
    if mode == "recompute" or num_cpu_blocks < 64:
        assert s.num_recompute_preemptions > 0
    else:
        assert s.num_recompute_preemptions == 0
    assert (s.prefix_cache_hit_tokens > 0) == caching
    assert s.blocks_copied > 0  # forked samples diverged inside a shared block


def test_slot_utilization_on_ragged_lengths():
    rng = random.Random(1)
    eng = FakeEngine(SchedulerConfig(num_device_blocks=1000, num_cpu_blocks=500), check=False)
    lengths = []
    for _ in range(600):
        prompt_len, max_tokens = rng.randint(20, 300), rng.randint(1, 80)
        eng.add([rng.randrange(50_000) for _ in range(prompt_len)], max_tokens=max_tokens)
        lengths.append(prompt_len + max_tokens)
    assert 190 <= sum(lengths) / len(lengths) <= 210
    filled = allocated = peak_used = 0
    at_peak = 0.0

    def measure(_out):
        nonlocal filled, allocated, peak_used, at_peak
        s = eng.scheduler.stats()
        filled, allocated = filled + s.filled_slots, allocated + s.allocated_slots
        if s.used_device_blocks >= peak_used:
            peak_used, at_peak = s.used_device_blocks, s.slot_utilization

    eng.run(on_step=measure)
    eng.check_outputs()
    average = filled / allocated
    print(f"slot utilisation: {average:.4f} averaged over steps, {at_peak:.4f} at peak ({peak_used} blocks)")
    assert average >= 0.95 and at_peak >= 0.95
    assert peak_used >= 950  # the pool was really used


def test_forked_samples_share_their_prompt_blocks():
    """32 prompts of ~400 tokens (sharing nothing), n=8 samples of 64 tokens each."""
    rng = random.Random(2)
    eng = FakeEngine(SchedulerConfig(num_device_blocks=8000, num_cpu_blocks=0), check=False)
    for _ in range(32):
        eng.add([rng.randrange(50_000) for _ in range(rng.randint(390, 410))], n=8, max_tokens=64)
    eng.run()
    eng.check_outputs()
    s = eng.scheduler.stats()
    unshared = 32 * 8 * -(-(400 + 64) // BLOCK)
    ratio = s.peak_used_device_blocks / unshared
    print(f"peak used blocks {s.peak_used_device_blocks} = {ratio:.3f} x the {unshared} unshared ones")
    assert ratio <= 0.30
    assert s.num_swap_preemptions == s.num_recompute_preemptions == 0  # the peak is real sharing
    assert s.prefix_cache_hit_tokens == 0  # ... by forking, not by the prefix cache


@pytest.mark.parametrize("caching", [True, False])
def test_the_one_pass_decode_schedules_what_the_group_loop_does(caching, monkeypatch):
    """Scheduler._decode_all, the one-pass step 1, against the group-by-group loop it stands in for: the same
    workload (forks, preemptions, copy-on-write) gives the same steps, blocks and copies with it as without it."""
    from batchgen.engine.scheduler import Scheduler

    def steps(one_pass: bool) -> tuple[list, int]:
        config = SchedulerConfig(num_device_blocks=160, num_cpu_blocks=64, max_num_seqs=48, max_num_batched_tokens=512,
                                 preemption_mode="swap", enable_prefix_caching=caching, max_model_len=1024)
        taken, fast = [], Scheduler._decode_all

        def counted(self, out):
            took = one_pass and fast(self, out)
            taken.append(took)
            return took

        monkeypatch.setattr(Scheduler, "_decode_all", counted)
        eng = FakeEngine(config)
        _shared_prefix_workload(eng, random.Random(5), 120)
        record, names = [], {}  # forked samples' ids come from a process-wide counter: named in order of appearance
        eng.run(max_steps=5000, on_step=lambda out: record.append(
            ([(names.setdefault(s.seq.seq_id, len(names)), s.start, s.num_new_tokens, s.samples,
               tuple(s.seq.block_table)) for s in out.scheduled],
             list(out.blocks_to_copy), list(out.blocks_to_swap_out), list(out.blocks_to_swap_in))))
        eng.check_outputs()
        return record, sum(taken)

    with_it, taken = steps(True)
    without_it, never = steps(False)
    assert taken > 100 and never == 0  # the one pass did decide most steps in the first run
    assert with_it == without_it
