"""Property-based tests: random programs of admissions, steps (appends, forks, preemptions,
swaps), early finishes and aborts on small pools; every invariant is checked after every step,
and at the end both pools must be whole again."""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeEngine, assert_pools_whole, check_invariants
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from batchgen.engine import SchedulerConfig, SequenceStatus

configs = st.builds(
    lambda bs, dev, cpu, seqs, extra, mode, caching, watermark: SchedulerConfig(
        block_size=bs, num_device_blocks=dev, num_cpu_blocks=cpu, max_num_seqs=seqs,
        max_num_batched_tokens=seqs + extra, preemption_mode=mode, enable_prefix_caching=caching,
        watermark=watermark, max_model_len=dev * bs // 2),
    bs=st.sampled_from([1, 2, 4]), dev=st.integers(4, 16), cpu=st.integers(0, 24), seqs=st.integers(2, 6),
    extra=st.integers(0, 24), mode=st.sampled_from(["swap", "recompute"]), caching=st.booleans(),
    watermark=st.sampled_from([0.0, 0.1, 0.3]),
)
SHARED = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3, 1, 1, 9, 2]  # common prefix material for cache hits


# (shared prefix length, tail, n, max_tokens, beam width): n > 1 samples, or a beam search
requests = st.lists(
    st.tuples(st.integers(0, len(SHARED)), st.lists(st.integers(0, 9), max_size=12),
              st.sampled_from([1, 1, 2, 3]), st.integers(1, 24), st.sampled_from([0, 0, 0, 2, 3])),
    min_size=1, max_size=6,
)


class EngineMachine(RuleBasedStateMachine):
    @initialize(config=configs, first=requests)
    def start(self, config: SchedulerConfig, first) -> None:
        self.engine = FakeEngine(config, check=False)
        self.aborted: set[str] = set()
        self.add_requests(first)

    @rule(batch=requests)
    def add_requests(self, batch):
        cfg = self.engine.scheduler.config
        for shared, tail, n, max_tokens, beam_width in batch:
            prompt = (SHARED[:shared] + tail)[: cfg.max_model_len // 2]
            self.engine.add(prompt or [1], n=1 if beam_width else n, max_tokens=max_tokens, beam_width=beam_width)

    @rule(count=st.integers(1, 4))
    def step(self, count):
        for _ in range(count):
            if self.engine.scheduler.has_unfinished():
                self.engine.step()
                check_invariants(self.engine.scheduler, self.engine.kv)

    @rule(data=st.data())
    def finish_a_sequence_early(self, data):
        """The engine finishes a sequence (a stop token), or a whole beam search (its end), whatever
        state its request is in."""
        sched = self.engine.scheduler
        groups = [*sched.running, *sched.swapped, *sched.waiting]
        seqs = [(s, g) for g in groups for s in g.unfinished_seqs()]
        if seqs:
            seq, group = data.draw(st.sampled_from(seqs))
            for s in group.unfinished_seqs() if group.beam_width else [seq]:
                sched.finish_seq(s, "stop")

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.engine.requests)
        if ids:
            request_id = data.draw(st.sampled_from(ids))
            if self.engine.scheduler.abort(request_id):
                self.aborted.add(request_id)

    @invariant()
    def consistent(self):
        if hasattr(self, "engine"):
            check_invariants(self.engine.scheduler, self.engine.kv)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        eng = self.engine
        steps = 0
        while eng.scheduler.has_unfinished():
            eng.step()
            check_invariants(eng.scheduler, eng.kv)
            steps += 1
            assert steps < 5000, "no progress"
        assert_pools_whole(eng.scheduler)
        stats = eng.scheduler.stats()
        event(f"swap preemptions: {min(stats.num_swap_preemptions, 3)}+")
        event(f"recompute preemptions: {min(stats.num_recompute_preemptions, 3)}+")
        event(f"prefix cache hits: {stats.prefix_cache_hit_tokens > 0}")
        event(f"copy-on-write: {stats.blocks_copied > 0}")
        event(f"beam searches: {any(r.group.beam_width for r in eng.requests.values())}")
        event(f"requests: {min(len(eng.requests) // 5 * 5, 20)}+")
        for request_id, req in eng.requests.items():
            group = req.group
            assert group.is_finished()
            if group.error is None and request_id not in self.aborted:
                for seq in group.seqs:
                    assert seq.status is SequenceStatus.FINISHED
                    if seq.finish_reason == "length":
                        limit = eng.scheduler.config.max_model_len
                        assert seq.num_output_tokens == req.max_tokens or len(seq) >= limit


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("seed", range(48))
def test_random_programs(seed):
    """Longer random runs than hypothesis takes, under memory pressure (sequences grow to half
    the pool), checked after every step; outputs exact."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    num_device_blocks = rng.randint(8, 32)
    max_num_seqs = rng.randint(3, 8)
    config = SchedulerConfig(
        block_size=bs, num_device_blocks=num_device_blocks, num_cpu_blocks=rng.choice([0, 8, 64]),
        max_num_seqs=max_num_seqs, max_num_batched_tokens=rng.randint(max_num_seqs, 48),
        preemption_mode=rng.choice(["swap", "recompute"]), enable_prefix_caching=rng.random() < 0.7,
        watermark=rng.choice([0.0, 0.05]), max_model_len=num_device_blocks * bs // 2,
    )
    eng = FakeEngine(config)
    for _ in range(rng.randint(10, 40)):
        length = rng.randint(1, config.max_model_len // 2)
        prompt = (SHARED[: rng.randint(0, len(SHARED))] + [rng.randrange(20) for _ in range(length)])[:length]
        n, beam_width = rng.choice([(1, 0), (1, 0), (2, 0), (3, 0), (1, 2), (1, 3)])
        eng.add(prompt, n=n, max_tokens=rng.randint(1, config.max_model_len), beam_width=beam_width)
    eng.run(max_steps=20_000)
    eng.check_outputs()
    assert_pools_whole(eng.scheduler)
    for group in eng.finished.values():
        if group.width * -(-config.max_model_len // bs) <= num_device_blocks:
            assert group.error is None  # it always fits alone, so it must have been served
        else:
            assert group.error is None or "out of KV-cache memory" in group.error
