"""Scheduler behaviour, one policy at a time, driven through the fake runner and engine."""

from __future__ import annotations

import pytest
from fake_runner import FakeEngine, assert_pools_whole

from batchgen.engine import Scheduler, SchedulerConfig, Sequence, SequenceGroup, SequenceStatus
from batchgen.sampling_params import SamplingParams


def engine(**kw) -> FakeEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_device_blocks", 64)
    kw.setdefault("watermark", 0.0)
    return FakeEngine(SchedulerConfig(**kw))


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def kinds(out) -> list[tuple[str, int]]:
    return [(s.seq.extra.get("name", s.group.request_id), s.num_new_tokens) for s in out.scheduled]


def test_prefill_then_decode_then_finish():
    eng = engine()
    g = eng.add(prompt(10), max_tokens=3)
    out = eng.step()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.samples) == (0, 10, True)
    assert len(g.seqs[0].block_table) == 3 and out.num_batched_tokens == 10
    out = eng.step()
    assert [(x.start, x.num_new_tokens) for x in out.scheduled] == [(10, 1)]
    eng.run()
    assert g.seqs[0].finish_reason == "length" and len(g.seqs[0].output_token_ids) == 3
    eng.check_outputs()
    assert_pools_whole(eng.scheduler)


def test_continuous_batching_admits_new_requests_while_others_decode():
    eng = engine()
    eng.add(prompt(6), max_tokens=20)
    eng.step()
    eng.add(prompt(9, 100), max_tokens=5)
    out = eng.step()
    assert kinds(out) == [("r0", 1), ("r1", 9)]  # decodes first, then the new prefill


def test_long_prompt_is_prefilled_in_chunks_without_stalling_decodes():
    eng = engine(num_device_blocks=400, max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(3):
        eng.add(prompt(5, 1000 * i), max_tokens=100)
    eng.step()
    big = eng.add(prompt(1000, 50_000), max_tokens=2)
    chunks = []
    while not big.seqs[0].output_token_ids:
        out = eng.step()
        assert len(big.seqs[0].block_table) == 250  # all prompt blocks from admission on
        decodes = [s for s in out.scheduled if s.group is not big]
        assert len(decodes) == 3 and all(s.num_new_tokens == 1 for s in decodes)
        chunks += [s.num_new_tokens for s in out.scheduled if s.group is big]
        assert out.num_batched_tokens <= 64
    assert sum(chunks) == 1000 and max(chunks) == 61 and len(chunks) == 17
    eng.run()
    eng.check_outputs()


def test_admission_is_first_come_first_served():
    eng = engine(num_device_blocks=10, max_num_seqs=8, max_num_batched_tokens=100)
    eng.add(prompt(30), max_tokens=10)  # 8 blocks
    eng.add(prompt(12, 100), max_tokens=1)  # 3 blocks: does not fit next to the first
    eng.add(prompt(2, 200), max_tokens=1)  # would fit, but must not overtake
    out = eng.step()
    assert [s.group.request_id for s in out.scheduled] == ["r0"]
    eng.run()
    eng.check_outputs()


def test_max_num_seqs_counts_the_samples_a_request_will_fork():
    eng = engine(max_num_seqs=4, max_num_batched_tokens=64)
    eng.add(prompt(4), n=3, max_tokens=4)
    eng.add(prompt(4, 100), n=2, max_tokens=4)
    eng.add(prompt(4, 200), n=1, max_tokens=4)
    out = eng.step()
    assert {s.group.request_id for s in out.scheduled} == {"r0"}  # 3 + 2 > 4; r2 may not overtake r1
    assert len(eng.requests["r0"].group.seqs) == 3
    while eng.requests["r0"].group.unfinished_seqs():
        assert not eng.scheduler.stats().num_running_seqs > 4
        eng.step()
    out = eng.step()
    assert {s.group.request_id for s in out.scheduled} == {"r1", "r2"}
    eng.run()
    eng.check_outputs()


@pytest.mark.parametrize("length, error", [
    (5000, "prompt has 5000 tokens, more than max_model_len 4096"),
    (0, "prompt is empty"),
])
def test_impossible_prompts_are_ignored_with_a_clear_error(length, error):
    eng = engine(num_device_blocks=2000, max_model_len=4096)
    ok = eng.add(prompt(5), max_tokens=2)
    bad = eng.add(prompt(length, 7), max_tokens=2)
    out = eng.step()
    assert out.ignored == [bad] and bad.error == error
    assert bad.seqs[0].status is SequenceStatus.FINISHED and bad.seqs[0].finish_reason == "abort"
    assert [s.group for s in out.scheduled] == [ok]
    eng.run()
    assert ok.seqs[0].finish_reason == "length"


def test_prompt_larger_than_the_device_pool_is_ignored():
    eng = engine(num_device_blocks=8)
    bad = eng.add(prompt(40), max_tokens=2)
    out = eng.step()
    assert out.ignored == [bad] and "needs 10 KV-cache blocks" in bad.error and "(8)" in bad.error
    assert not eng.scheduler.has_unfinished()


def test_more_samples_than_max_num_seqs_is_ignored():
    eng = engine(max_num_seqs=4, max_num_batched_tokens=16)
    bad = eng.add(prompt(4), n=5)
    assert eng.step().ignored == [bad] and "5 samples or beams of one request" in bad.error
    assert "max_num_seqs >= 5" in bad.error


def _two_growing_requests(mode: str, num_cpu_blocks: int = 32) -> FakeEngine:
    eng = engine(num_device_blocks=8, num_cpu_blocks=num_cpu_blocks, preemption_mode=mode,
                 enable_prefix_caching=False)
    eng.add(prompt(8), max_tokens=12)  # grows to 5 blocks
    eng.add(prompt(8, 100), max_tokens=12)  # together they need 10 > 8
    return eng


def test_swap_preemption_swaps_out_the_newest_and_swaps_it_back():
    eng = _two_growing_requests("swap")
    old, new = eng.requests["r0"].group, eng.requests["r1"].group
    swapped_step = None
    while eng.scheduler.has_unfinished():
        out = eng.step()
        if out.blocks_to_swap_out and swapped_step is None:
            swapped_step = eng.num_steps
            assert out.preempted == [new] and new.seqs[0].status is SequenceStatus.SWAPPED
            assert [s.group for s in out.scheduled] == [old]
            assert len(out.blocks_to_swap_out) == len(new.seqs[0].block_table)
        if out.blocks_to_swap_in:
            assert new.seqs[0].status is SequenceStatus.RUNNING
    assert swapped_step is not None and new.num_preemptions == 1 and old.num_preemptions == 0
    s = eng.scheduler.stats()
    assert s.num_swap_preemptions == 1 and s.num_recompute_preemptions == 0 and s.blocks_swapped_in > 0
    eng.check_outputs()
    assert_pools_whole(eng.scheduler)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_victim_is_always_the_newest_running_request(mode):
    eng = engine(num_device_blocks=12, num_cpu_blocks=64, preemption_mode=mode, enable_prefix_caching=False)
    for i in range(3):
        eng.add(prompt(8, 100 * i), max_tokens=14)  # 3 x 2 blocks, growing to 3 x 6
    victims = []
    while eng.scheduler.has_unfinished():
        out = eng.step()
        for group in out.preempted:
            running = [g.arrival for g in eng.scheduler.running]
            assert all(group.arrival > a for a in running), "an older request was preempted"
            victims.append(group.request_id)
    assert victims and victims[0] == "r2"
    eng.check_outputs()


@pytest.mark.parametrize("mode, cpu", [("recompute", 32), ("swap", 0)])
def test_recompute_preemption_requeues_in_front_and_reprefills_prompt_and_outputs(mode, cpu):
    eng = _two_growing_requests(mode, cpu)
    new = eng.requests["r1"].group
    seq = new.seqs[0]
    eng.add(prompt(20, 500), max_tokens=1)  # waits: 5 blocks do not fit next to the two others
    seen_reprefill = False
    while eng.scheduler.has_unfinished():
        out = eng.step()
        if out.preempted:
            assert out.preempted == [new] and not out.blocks_to_swap_out
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
            assert not seq.block_table and seq.output_token_ids
            assert eng.scheduler.waiting[0] is new
        for s in out.scheduled:
            if s.seq is seq and s.start == 0 and new.num_preemptions:
                seen_reprefill = True
                assert s.samples and s.num_new_tokens > seq.num_prompt_tokens  # prompt and outputs
    assert seen_reprefill
    assert eng.scheduler.stats().num_recompute_preemptions >= 1
    eng.check_outputs()
    assert_pools_whole(eng.scheduler)


def test_forked_group_recompute_readmits_each_sample_and_prefix_cache_shares_the_prompt():
    eng = engine(num_device_blocks=40, preemption_mode="recompute", max_num_batched_tokens=256)
    eng.add(prompt(33), max_tokens=30)
    group = eng.add(prompt(32, 1000), n=4, max_tokens=30)
    while not group.num_preemptions:
        eng.step()
    seqs = group.unfinished_seqs()
    assert len(seqs) == 4 and all(s.status is SequenceStatus.WAITING for s in seqs)
    while seqs[0].status is SequenceStatus.WAITING:
        eng.step()
    # the prompt's 8 full blocks were found again: all samples share them
    assert all(s.block_table[:8] == seqs[0].block_table[:8] for s in seqs)
    assert all(s.num_computed_tokens >= 32 for s in seqs)
    eng.run()
    eng.check_outputs()
    assert_pools_whole(eng.scheduler)


def test_swapped_requests_come_back_before_new_admissions():
    eng = _two_growing_requests("swap")
    while not eng.scheduler.swapped:
        eng.step()
    late = eng.add(prompt(2, 900), max_tokens=1)
    while True:
        out = eng.step()
        if any(s.group is late for s in out.scheduled):
            break
        assert not out.blocks_to_swap_in
    assert not eng.scheduler.swapped and out.blocks_to_swap_in  # admitted in the swap-in step, after it
    eng.run()
    eng.check_outputs()


def test_a_request_that_cannot_fit_alone_fails_instead_of_preempting_forever():
    for mode in ("swap", "recompute"):
        eng = engine(num_device_blocks=6, num_cpu_blocks=50, preemption_mode=mode)
        group = eng.add(prompt(8), n=4, max_tokens=6)  # 4 samples x 4 blocks > 6 blocks
        ok = eng.add(prompt(3, 100), max_tokens=2)
        eng.run(max_steps=200)
        assert group.error is not None and "out of KV-cache memory" in group.error
        assert all(s.finish_reason == "abort" for s in group.seqs)
        assert ok.error is None and ok.seqs[0].finish_reason == "length"
        assert_pools_whole(eng.scheduler)


def test_watermark_keeps_blocks_free_at_admission_but_not_when_alone():
    eng = engine(num_device_blocks=10, watermark=0.3)  # 3 blocks kept free
    first = eng.add(prompt(30), max_tokens=1)  # 8 blocks: admitted alone although it eats the watermark
    second = eng.add(prompt(1, 100), max_tokens=1)  # 1 block: 2 are free, but 3 are kept
    out = eng.step()
    assert [s.group for s in out.scheduled] == [first]
    assert eng.scheduler.waiting[0] is second
    eng.run()
    assert first.error is None and second.error is None


def test_abort_in_each_state_frees_everything():
    eng = _two_growing_requests("swap")
    while not eng.scheduler.swapped:
        eng.step()
    eng.add(prompt(5, 300), max_tokens=3)
    eng.step()
    sched = eng.scheduler
    assert [g.request_id for g in sched.swapped] == ["r1"] and [g.request_id for g in sched.waiting] == ["r2"]
    assert sched.abort("r1")  # swapped
    assert sched.abort("r2")  # waiting
    assert sched.abort("r0")  # running
    assert not sched.abort("r0") and not sched.abort("nope")
    assert sched.stats().used_cpu_blocks == 0
    assert_pools_whole(sched)


def test_fork_children_share_all_blocks_and_get_sample_indices():
    eng = engine()
    group = eng.add(prompt(10), n=3, max_tokens=5)
    eng.step()
    parent, *children = group.seqs
    assert [s.sample_index for s in group.seqs] == [0, 1, 2] and group.forked
    assert all(c.block_table == parent.block_table for c in children)
    assert all(eng.scheduler.block_manager.ref_count(b) == 3 for b in parent.block_table)
    out = eng.step()  # everyone writes position 10, in the shared partial block: two copies
    assert len(out.blocks_to_copy) == 2
    assert len({s.block_table[2] for s in group.seqs}) == 3
    eng.run()
    eng.check_outputs()


def test_engine_protocol_errors_are_explicit():
    sched = Scheduler(SchedulerConfig(num_device_blocks=8, block_size=4))
    group = SequenceGroup("a", 0, SamplingParams(n=2), [Sequence(0, [1, 2, 3])])
    sched.add(group)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(SequenceGroup("a", 1, SamplingParams(), [Sequence(1, [1])]))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before on_step_done"):
        sched.schedule()
    with pytest.raises(RuntimeError, match="before on_step_done"):
        sched.fork(group, group.seqs[0], 1)
    with pytest.raises(RuntimeError, match="not the last schedule"):
        sched.on_step_done(type(out)())
    sched.on_step_done(out)
    with pytest.raises(ValueError, match="cannot fork 2"):
        sched.fork(group, group.seqs[0], 2)
    with pytest.raises(RuntimeError, match="got no new token"):
        sched.schedule()  # sampled, but the engine appended nothing


def test_stats_report_usage_and_prefix_hits():
    eng = engine(num_device_blocks=32)
    eng.add(prompt(16), max_tokens=2)
    eng.run()
    eng.add(prompt(16) + [7], max_tokens=2)
    eng.step()
    s = eng.scheduler.stats()
    assert s.prefix_cache_hit_tokens == 16 and s.prefix_cache_query_tokens == 16 + 17
    assert s.num_running == 1 and s.num_waiting == 0 and s.num_running_seqs == 1
    assert s.used_device_blocks == 5 and s.peak_used_device_blocks >= 5
    assert s.slot_utilization == pytest.approx(17 / 20)


def test_blocks_filled_by_generated_tokens_are_cached_too():
    eng = engine()
    first = eng.add(prompt(6), max_tokens=12)
    eng.run()
    text = first.seqs[0].token_ids  # 18 tokens: blocks 0..3 are full, 2 of them hold outputs
    follow_up = eng.add(text + [1, 2, 3], max_tokens=1)
    (s,) = eng.step().scheduled
    assert s.seq is follow_up.seqs[0] and (s.start, s.num_new_tokens) == (16, 5)
    assert eng.scheduler.stats().prefix_cache_hit_tokens == 16


@pytest.mark.parametrize("kw, field", [
    (dict(num_device_blocks=0), "num_device_blocks"),
    (dict(num_device_blocks=4, max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(num_device_blocks=4, preemption_mode="drop"), "preemption_mode"),
    (dict(num_device_blocks=4, watermark=1.0), "watermark"),
])
def test_config_is_validated(kw, field):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field}"):
        SchedulerConfig(**kw)


def test_an_image_whose_tokens_attend_both_ways_is_prefilled_in_one_chunk_and_is_not_starved():
    """Gemma 3's images: a chunk ends before an image it would cut; an image that does not fit the budget left
    after the decodes waits, and no request is admitted meanwhile, so the decodes run out and it gets room
    while new requests keep coming."""
    import torch

    from batchgen.models.vision.inputs import ImageInput, MultiModalInputs

    eng = engine(max_num_batched_tokens=8, max_num_seqs=6)
    for i in range(3):
        eng.add(prompt(3, 100 * i), max_tokens=6)
    eng.step()
    image = ImageInput(torch.zeros(1), 2, 6, 1)
    group = eng.add(prompt(12, 1000), max_tokens=2)
    group.seqs[0].multi_modal = MultiModalInputs([image], bidirectional=True)
    chunks, admitted_while_waiting = [], 0
    for step in range(30):
        eng.add(prompt(3, 5000 + 10 * step), max_tokens=6)  # a new text request every step
        waiting = group.seqs[0].num_computed_tokens == image.start
        out = eng.step()
        chunks += [(step, s.start, s.end) for s in out.scheduled if s.seq is group.seqs[0] and s.start < 12]
        waited = waiting and not any(s.seq is group.seqs[0] for s in out.scheduled)
        admitted_while_waiting += waited and any(s.start == 0 for s in out.scheduled)
    assert len(chunks) >= 2, f"the image never got room: {chunks}"
    assert chunks[0][1:] == (0, 2) and chunks[1][1] == 2 and chunks[1][2] >= 8  # before the image, then all of it
    assert chunks[1][0] < 10  # while the new requests keep coming
    assert all(not image.start < end < image.end for _, _, end in chunks)
    assert group.seqs[0].output_token_ids and admitted_while_waiting == 0


def test_prompts_sharing_a_prefix_admitted_together_compute_it_once():
    """Four choices of one question arrive together: the first computes the shared context, its twins wait one
    step and find it in the prefix cache; a prompt of its own is not held back, and outputs are the same."""
    eng = engine(num_device_blocks=64)
    context = prompt(12, 500)  # three full blocks of 4
    choices = [eng.add(context + [1 + i, 2], max_tokens=1) for i in range(4)]
    other = eng.add(prompt(9, 900), max_tokens=1)
    first = eng.step()
    assert kinds(first) == [("r0", 14), ("r4", 9)]  # the twins wait; the unrelated prompt passes them
    second = eng.step()
    twins = [(s.seq.extra.get("name", s.group.request_id), s.start, s.num_new_tokens) for s in second.scheduled
             if s.num_new_tokens > 1]
    assert twins == [("r1", 12, 2), ("r2", 12, 2), ("r3", 12, 2)]  # the context came from the cache
    eng.run()
    assert all(len(g.seqs[0].output_token_ids) == 1 for g in [*choices, other])
    assert eng.scheduler.stats().prefix_cache_hit_tokens == 3 * 12
    eng.check_outputs()
    assert_pools_whole(eng.scheduler)


def test_twins_compute_the_prefix_side_by_side_without_the_prefix_cache():
    eng = engine(num_device_blocks=64, enable_prefix_caching=False)
    for i in range(3):
        eng.add(prompt(12, 500) + [1 + i], max_tokens=1)
    assert kinds(eng.step()) == [("r0", 13), ("r1", 13), ("r2", 13)]
