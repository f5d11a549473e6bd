"""A fake model runner and engine loop for scheduler tests.

FakeKV plays the runner: it keeps a token per cache slot (device and CPU pools), applies swaps
and copies in the runner's order, checks that every scheduled sequence reads back its own
tokens at the same logical positions, and that no step writes a block another sequence holds
or that two sequences write. FakeEngine plays LLMEngine: it appends a deterministic token per
sample (a function of request, sample index and position, so any lost or duplicated work
shows in the outputs), forks the n samples after the prompt and stops at max_tokens. For a beam
search request it moves the beams once all are computed: random parents (some named several
times, some not at all) and deterministic tokens, through Scheduler.next_beams.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass

from batchgen.engine import (
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from batchgen.sampling_params import SamplingParams

VOCAB = 50_000


def token_for(seed: int, sample_index: int, position: int) -> int:
    return hash((seed, sample_index, position)) % VOCAB


def expected_output(seed: int, sample_index: int, prompt_len: int, num_tokens: int) -> list[int]:
    return [token_for(seed, sample_index, p) for p in range(prompt_len, prompt_len + num_tokens)]


class FakeKV:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.bs = scheduler.config.block_size
        self.device: dict[int, list[int | None]] = {}
        self.cpu: dict[int, list[int | None]] = {}

    def _block(self, pool: dict, block_id: int) -> list[int | None]:
        return pool.setdefault(block_id, [None] * self.bs)

    def execute(self, out: SchedulerOutput) -> None:
        bm, bs = self.scheduler.block_manager, self.bs
        for dev, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self._block(self.device, dev))
        for cpu, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self._block(self.cpu, cpu))
        for src, dst in out.blocks_to_copy:
            assert bm.ref_count(src) >= 1 and bm.ref_count(dst) == 1, (src, dst)
            self.device[dst] = list(self._block(self.device, src))
        writer: dict[int, int] = {}
        for s in out.scheduled:
            seq, table = s.seq, s.seq.block_table
            assert seq.status is SequenceStatus.RUNNING
            assert s.start == seq.num_computed_tokens and s.num_new_tokens >= 1
            assert len(table) * bs >= s.end, "block table does not cover the fed positions"
            self.check_context(seq, s.start)
            for p in range(s.start, s.end):
                block_id = table[p // bs]
                assert bm.ref_count(block_id) == 1, f"seq {seq.seq_id} writes shared block {block_id}"
                assert writer.setdefault(block_id, seq.seq_id) == seq.seq_id, f"two writers of {block_id}"
                self._block(self.device, block_id)[p % bs] = seq.token_ids[p]

    def check_context(self, seq: Sequence, num_tokens: int, pool: dict | None = None) -> None:
        """The cache holds seq's first num_tokens tokens at their logical positions."""
        bs, pool = self.bs, self.device if pool is None else pool
        for i in range(-(-num_tokens // bs)):
            n = min(bs, num_tokens - i * bs)
            got = self._block(pool, seq.block_table[i])[:n]
            assert got == seq.token_ids[i * bs:i * bs + n], f"seq {seq.seq_id} block {i}: cache {got}"


def check_invariants(scheduler: Scheduler, kv: FakeKV | None = None) -> None:
    """Reference counts equal block-table references, nothing both free and used, counters
    agree with a recount, queues in arrival order, swapped sequences' contents intact."""
    cfg, bm, bs = scheduler.config, scheduler.block_manager, scheduler.config.block_size
    device_refs: Counter[int] = Counter()
    cpu_refs: Counter[int] = Counter()
    filled: dict[int, int] = {}
    status_of_queue = [(scheduler.running, SequenceStatus.RUNNING),
                       (scheduler.swapped, SequenceStatus.SWAPPED),
                       (scheduler.waiting, SequenceStatus.WAITING)]
    seen: set[str] = set()
    for queue, status in status_of_queue:
        arrivals = [g.arrival for g in queue]
        assert arrivals == sorted(arrivals), f"{status} queue out of arrival order"
        for group in queue:
            assert group.request_id not in seen and not group.is_finished()
            seen.add(group.request_id)
            for seq in group.seqs:
                if seq.is_finished():
                    assert not seq.block_table
                    continue
                assert seq.status is status
                assert 0 <= seq.num_computed_tokens <= len(seq)
                if status is SequenceStatus.WAITING:
                    assert not seq.block_table and seq.num_computed_tokens == 0
                    continue
                assert len(seq.block_table) * bs >= seq.num_computed_tokens
                (device_refs if status is SequenceStatus.RUNNING else cpu_refs).update(seq.block_table)
                if status is SequenceStatus.RUNNING:
                    for i, block_id in enumerate(seq.block_table):
                        n = max(0, min(bs, seq.num_computed_tokens - i * bs))
                        filled[block_id] = max(filled.get(block_id, 0), n)
                elif kv is not None:
                    kv.check_context(seq, seq.num_computed_tokens, kv.cpu)
    running_seqs = sum(g.max_num_running_seqs() for g in scheduler.running)
    assert running_seqs <= cfg.max_num_seqs
    pools = ((False, device_refs, cfg.num_device_blocks), (True, cpu_refs, cfg.num_cpu_blocks))
    for on_cpu, refs, total in pools:
        free = bm.free_block_ids(on_cpu)
        assert len(free) == len(set(free)), "a block is free twice"
        assert not set(free) & set(refs), "a block is both free and used"
        assert len(free) + len(refs) == total, "a block is neither free nor used (leak)"
        for block_id in range(total):
            assert bm.ref_count(block_id, on_cpu) == refs.get(block_id, 0), f"refcount of block {block_id}"
    stats = bm.stats()
    assert stats.used_device_blocks == len(device_refs) and stats.used_cpu_blocks == len(cpu_refs)
    assert stats.filled_slots == sum(filled.values()), "filled-slot counter disagrees with a recount"
    assert stats.peak_used_device_blocks >= stats.used_device_blocks


def assert_pools_whole(scheduler: Scheduler) -> None:
    s = scheduler.stats()
    assert not scheduler.has_unfinished()
    assert s.used_device_blocks == 0 and s.free_device_blocks == s.num_device_blocks
    assert s.used_cpu_blocks == 0 and s.filled_slots == 0


@dataclass
class Request:
    group: SequenceGroup
    seed: int
    max_tokens: int


class FakeEngine:
    def __init__(self, config: SchedulerConfig, check: bool = True):
        self.scheduler = Scheduler(config)
        self.kv = FakeKV(self.scheduler)
        self.check = check
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, SequenceGroup] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    def add(self, prompt: list[int], n: int = 1, max_tokens: int = 16, request_id: str | None = None,
            seed: int | None = None, beam_width: int = 0, lora_id: int = 0) -> SequenceGroup:
        k = next(self._ids)
        request_id = request_id or f"r{k}"
        params = SamplingParams(n=n, max_tokens=max_tokens)
        group = SequenceGroup(request_id, k, params, [Sequence(k, prompt, lora_id=lora_id)], beam_width=beam_width)
        self.requests[request_id] = Request(group, k if seed is None else seed, max_tokens)
        self.scheduler.add(group)
        return group

    def step(self) -> SchedulerOutput:
        sched = self.scheduler
        out = sched.schedule()
        for group in out.ignored:
            self.finished[group.request_id] = group
        self.kv.execute(out)
        sched.on_step_done(out)
        beam_groups = {}
        for s in out.scheduled:
            if not s.samples or s.seq.is_finished():
                continue
            if s.group.beam_width:
                beam_groups[s.group.request_id] = s.group
                continue
            req, seqs = self.requests[s.group.request_id], [s.seq]
            if req.group.sampling_params.n > 1 and not s.group.forked:
                seqs += sched.fork(s.group, s.seq, req.group.sampling_params.n - 1)
            for seq in seqs:
                seq.append_token(token_for(req.seed, seq.sample_index, len(seq)))
                limit = sched.config.max_model_len
                if seq.num_output_tokens >= req.max_tokens or (limit is not None and len(seq) >= limit):
                    sched.finish_seq(seq, "length")
            if s.group.is_finished():
                self.finished[s.group.request_id] = s.group
        for group in beam_groups.values():
            self._move_beams(group)
        self.num_steps += 1
        if self.check:
            check_invariants(sched, self.kv)
        return out

    def _move_beams(self, group: SequenceGroup) -> None:
        """Once every live beam is computed (after a recompute they may be prefilled in different
        steps): new beams from random parents, then the length limits."""
        sched, req, live = self.scheduler, self.requests[group.request_id], group.unfinished_seqs()
        if any(seq.num_uncomputed_tokens for seq in live):
            return
        rng = random.Random(hash((req.seed, live[0].num_output_tokens)))
        parents = [rng.choice(live) for _ in range(rng.randint(1, group.beam_width))]
        position = len(live[0])
        beams = sched.next_beams(group, [(p, token_for(req.seed, rank, position)) for rank, p in enumerate(parents)])
        limit = sched.config.max_model_len
        if beams[0].num_output_tokens >= req.max_tokens or (limit is not None and len(beams[0]) >= limit):
            for seq in beams:
                sched.finish_seq(seq, "length")
        if group.is_finished():
            self.finished[group.request_id] = group

    def run(self, max_steps: int = 100_000, on_step=None) -> dict[str, SequenceGroup]:
        while self.scheduler.has_unfinished():
            assert self.num_steps < max_steps, "the scheduler did not finish the workload"
            out = self.step()
            assert not out.is_empty or out.ignored, "a step that did nothing while work was left"
            if on_step is not None:
                on_step(out)
        return self.finished

    def check_outputs(self) -> None:
        """Every request finished; each sample's tokens are exactly the deterministic ones."""
        for request_id, req in self.requests.items():
            group = self.finished[request_id]
            if group.error is not None:
                continue
            if group.beam_width:
                assert 1 <= len(group.seqs) <= group.beam_width
                assert all(seq.finish_reason == "length" for seq in group.seqs)
                assert [seq.sample_index for seq in group.seqs] == list(range(len(group.seqs)))
                continue
            n = req.group.sampling_params.n
            assert sorted(s.sample_index for s in group.seqs) == list(range(n))
            for seq in group.seqs:
                assert seq.finish_reason == "length", (request_id, seq.finish_reason)
                want = expected_output(req.seed, seq.sample_index, seq.num_prompt_tokens, req.max_tokens)
                assert seq.output_token_ids == want[: len(seq.output_token_ids)]
                limit = self.scheduler.config.max_model_len
                at_limit = limit is not None and len(seq) >= limit
                assert len(seq.output_token_ids) == req.max_tokens or at_limit
