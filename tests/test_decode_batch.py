"""The kept rows of steady decode steps (engine/decode_batch.py, engine/kept_rows.py): their arrays against a fresh
rebuild from the sequences at every step of long workloads (forks, swaps, recompute preemptions, copy-on-write,
prefix hits, early finishes), the steps they schedule against those the loops schedule without them, and an
engine's outputs token for token with and without them."""

from __future__ import annotations

import random

import numpy as np
import pytest
from fake_runner import FakeEngine
from test_scheduler_simulation import _shared_prefix_workload

from batchgen import LLM, SamplingParams
from batchgen.engine import SchedulerConfig, SequenceStatus
from batchgen.engine import scheduler as scheduler_module
from batchgen.engine.block_tables import padded_tables
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.scheduler import Scheduler


def _config(mode: str, caching: bool) -> SchedulerConfig:
    return SchedulerConfig(num_device_blocks=160, num_cpu_blocks=64, max_num_seqs=48, max_num_batched_tokens=512,
                           preemption_mode=mode, enable_prefix_caching=caching, max_model_len=1024)


def _check_kept_rows(scheduler: Scheduler, out) -> None:
    """A steady step's rows are every running sequence, in the loops' order, and its arrays are what the
    sequences give now (before on_step_done)."""
    step = out.decode
    batch = step.batch
    running = [seq for group in scheduler.running for seq in group.unfinished_seqs()]
    assert batch.seqs == running and batch.groups == [g for g in scheduler.running for _ in g.unfinished_seqs()]
    assert all(seq.status is SequenceStatus.RUNNING for seq in batch.seqs)
    lengths = np.array([len(seq.token_ids) for seq in batch.seqs])
    assert (batch.lengths == lengths).all() and (step.positions == lengths - 1).all()
    assert (step.positions == [seq.num_computed_tokens for seq in batch.seqs]).all()
    tables = [seq.block_table for seq in batch.seqs]
    lens = np.array([len(t) for t in tables])
    assert (batch.table_lens == lens).all()
    assert (batch.tables[:, :batch.width()] == padded_tables(tables, lens)).all()
    assert (batch.tables[:, batch.width():] == 0).all()
    assert (lens * scheduler.config.block_size > step.positions).all()  # every position has its block


@pytest.mark.parametrize("mode, caching", [("swap", True), ("recompute", True), ("swap", False)])
def test_kept_rows_are_a_fresh_rebuild_at_every_step(mode, caching, monkeypatch):
    """A workload many times the pool (forks, preemptions both ways, copy-on-write, prefix hits): at every steady
    step the kept arrays equal the sequences' own; and the steps (rows, positions, tables, copies, swaps) are those
    the scheduler makes with no rows ever kept."""
    def steps(kept: bool) -> tuple[list, int]:
        taken = []
        real_steady, real_schedule = Scheduler._decode_steady, Scheduler.schedule

        def steady(self, out):
            took = kept and real_steady(self, out)
            taken.append(took)
            return took

        def schedule(self):
            out = real_schedule(self)
            if out.decode is not None:
                _check_kept_rows(self, out)
            return out

        monkeypatch.setattr(Scheduler, "_decode_steady", steady)
        monkeypatch.setattr(Scheduler, "schedule", schedule)
        monkeypatch.setattr(scheduler_module, "keepable", scheduler_module.keepable if kept else lambda g, s: False)
        eng = FakeEngine(_config(mode, caching))
        _shared_prefix_workload(eng, random.Random(7), 120)
        record, names = [], {}
        eng.run(max_steps=5000, on_step=lambda out: record.append(
            ([(names.setdefault(s.seq.seq_id, len(names)), s.start, s.num_new_tokens, s.samples,
               tuple(s.seq.block_table)) for s in out.scheduled],
             list(out.blocks_to_copy), list(out.blocks_to_swap_out), list(out.blocks_to_swap_in))))
        eng.check_outputs()
        stats = eng.scheduler.stats()
        assert stats.num_swap_preemptions + stats.num_recompute_preemptions > 0
        return record, sum(taken)

    with_kept, taken = steps(True)
    without, never = steps(False)
    assert taken > 100 and never == 0
    assert with_kept == without


def test_a_row_without_its_token_drops_the_kept_rows():
    """A kept row that did not get exactly one token since the last step: the loops decide (here they raise, as
    for a sampled sequence without a token), never the arrays."""
    eng = FakeEngine(_config("swap", True))
    for _ in range(3):
        eng.add(list(range(1, 20)), max_tokens=40)
    while eng.scheduler._batch is None:
        eng.step()
    seq = eng.scheduler.running[1].seqs[0]
    seq.token_ids.pop()  # as if the engine had not appended its token
    with pytest.raises(RuntimeError, match="got no new token"):
        eng.scheduler.schedule()
    assert eng.scheduler._batch is None


def _llm(model_dir) -> LLM:
    # A small cache: requests are preempted (recompute) and come back, so the kept rows are dropped and rebuilt.
    return LLM(model_dir, dtype="float32", kv_cache_memory="1MiB", max_num_seqs=16, seed=11)


def _requests(rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(24):
        prompts.append([rng.randrange(10, 300) for _ in range(rng.randint(3, 40))])
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(8, 40)))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=30, n=2, logprobs=2))
        elif kind == 2:
            params.append(SamplingParams(temperature=1.0, top_p=0.9, max_tokens=35, stop_token_ids=[17, 42, 99]))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.7, min_tokens=6, max_tokens=25, seed=100 + i))
        elif kind == 4:
            params.append(SamplingParams(temperature=0, max_tokens=45, ignore_eos=True, repetition_penalty=1.2))
        else:
            params.append(SamplingParams(temperature=0.8, top_k=20, max_tokens=rng.randint(5, 50)))
    return prompts, params


def test_engine_outputs_are_the_same_with_and_without_kept_rows(tiny_model_dirs, monkeypatch):
    """Greedy and seeded samples, n > 1, stop tokens, min_tokens, logprobs, penalties, preemptions: token for
    token (and logprob for logprob) what the engine gives with no rows ever kept; the kept path is taken."""
    prompts, params = _requests(random.Random(3))
    kept_steps = []
    real = LLMEngine._kept_step

    def counted(self, *args):
        kept_steps.append(1)
        return real(self, *args)

    monkeypatch.setattr(LLMEngine, "_kept_step", counted)
    outputs = _llm(tiny_model_dirs["llama"]).generate(prompts, params, use_tqdm=False)
    assert len(kept_steps) > 20
    monkeypatch.setattr(scheduler_module, "keepable", lambda group, seq: False)  # no rows kept: the loops, as before
    kept_steps.clear()
    plain = _llm(tiny_model_dirs["llama"]).generate(prompts, params, use_tqdm=False)
    assert not kept_steps

    def digest(results):
        return [[(c.index, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                  c.logprobs and [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in c.logprobs])
                 for c in r.outputs] for r in results]

    assert digest(outputs) == digest(plain)
    assert any(c.finish_reason == "stop" for r in outputs for c in r.outputs)
