"""Scheduler: continuous batching over the paged KV cache.

Each step, in this order:
1. running requests, oldest first: every sequence with one token left to compute decodes; if
   its blocks cannot be had, the newest running request is preempted (swapped to the CPU pool
   when the mode is "swap" and it has room, else dropped for recompute) until they can. A
   request that cannot continue even with nothing else running is finished with an error.
2. swapped requests come back, oldest first, before anything new is admitted (none in a step
   that preempted).
3. running sequences that are prefilling get chunks of the remaining token budget, oldest
   first, so a huge prompt is spread over steps and never stalls decoding. A chunk never ends
   inside an image whose tokens attend to each other both ways (Gemma 3's): it ends before the
   image, or the image waits for a step whose budget holds it.
4. waiting requests are admitted first come first served while blocks (less a watermark),
   sequence slots and token budget allow; each gets all its blocks at admission and a first
   chunk at once (unless that chunk would be an image that does not fit, as in 3). None is
   admitted in a step where an image waits for room: the running requests' decodes, which take
   the budget before it, then run out. A prompt whose first block a prompt admitted in the same
   step computes (and the prefix cache does not hold yet) waits for the next step, where the
   cache gives it what they share; those behind it may pass it.

Requests are kept in arrival order in every queue, so the newest is always the victim and the
oldest always progresses: no preemption loop can starve it.

The engine's loop: schedule() -> runner executes the output -> on_step_done(output) -> the
engine appends each sampled token (ScheduledSeq.samples), forks the n samples after a prompt's
prefill (fork), and finishes sequences (finish_seq), including at max_model_len: the scheduler
never stops a sequence itself except with an error. abort() and finish_seq() belong between steps.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from batchgen.engine.adapter_slots import AdapterSlots
from batchgen.engine.block_manager import BlockManager, BlockStats
from batchgen.engine.config import SchedulerConfig, samples_problem
from batchgen.engine.decode_batch import DecodeBatch, DecodeStep, keepable
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus

_FINISHED = SequenceStatus.FINISHED


@dataclass(slots=True, init=False)  # one per sequence and step: slots, and an __init__ that is one call
class ScheduledSeq:
    """Feed seq.token_ids[start:start + num_new_tokens] at positions start.. this step."""

    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int
    start: int  # == seq.num_computed_tokens when scheduled
    # The last token is fed: this step's logits give the sequence's next token (never for a
    # prefill-only group, whose step ends its request instead). Fixed when scheduled, so it stays
    # true after the engine appends that token. Worked out here unless the caller knows it.
    samples: bool

    def __init__(self, seq: Sequence, group: SequenceGroup, num_new_tokens: int, start: int,
                 samples: bool | None = None) -> None:
        self.seq, self.group, self.num_new_tokens, self.start = seq, group, num_new_tokens, start
        self.samples = (start + num_new_tokens == len(seq.token_ids) and not group.prefill_only
                        if samples is None else samples)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu id, device id)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device id, cpu id)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device ids
    ignored: list[SequenceGroup] = field(default_factory=list)  # given up on: group.error says why
    preempted: list[SequenceGroup] = field(default_factory=list)
    adapters_to_load: list[tuple[int, int]] = field(default_factory=list)  # (slot, lora id) before the step
    lora_slots: dict[int, int] = field(default_factory=dict)  # lora id -> device slot, of the scheduled rows
    # A steady decode step (engine/decode_batch.py): every row feeds one token that samples, and its inputs are in
    # the kept arrays; `scheduled` is built from it when first read. None in any other step.
    decode: DecodeStep | None = None
    _scheduled: list[ScheduledSeq] | None = field(default=None, repr=False)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Decodes first, then prefill chunks."""
        if self._scheduled is None:
            self._scheduled = [] if self.decode is None else _decode_rows(self.decode)
        return self._scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        moves = self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy
        return not (self.scheduled or moves)


@dataclass(kw_only=True)
class SchedulerStats(BlockStats):
    num_running: int  # requests
    num_waiting: int
    num_swapped: int
    num_running_seqs: int
    num_swap_preemptions: int
    num_recompute_preemptions: int


def _by_arrival(group: SequenceGroup) -> int:
    return group.arrival


def _decode_rows(step: DecodeStep) -> list[ScheduledSeq]:
    batch = step.batch
    return [ScheduledSeq(seq, group, 1, start, True)
            for seq, group, start in zip(batch.seqs, batch.groups, step.positions.tolist(), strict=True)]


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(
            config.num_device_blocks, config.num_cpu_blocks, config.block_size, config.enable_prefix_caching
        )
        self.adapters = AdapterSlots(config.max_loras) if config.max_loras else None
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # arrival order
        self.swapped: list[SequenceGroup] = []  # arrival order
        self._groups: dict[str, SequenceGroup] = {}
        self._group_of: dict[int, SequenceGroup] = {}  # seq id -> its group
        self._rejected: list[SequenceGroup] = []  # reported by the next schedule()
        self._pending: SchedulerOutput | None = None
        self._prefilling = False
        self._image_waits = False
        self._overtaken: dict[str, int] = {}  # request id -> newer requests admitted while its adapter had no slot
        self._num_swap_preemptions = 0
        self._num_recompute_preemptions = 0
        # The rows of the last step when it decoded every running sequence, kept for the next (_decode_steady);
        # dropped at every change to the running sequences other than the engine's one token a row.
        self._batch: DecodeBatch | None = None

    # --- requests -------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"request id {group.request_id!r} is already scheduled")
        if len(group.seqs) != 1 or group.seqs[0].status is not SequenceStatus.WAITING:
            raise ValueError("a new request must hold exactly one waiting sequence")
        self._groups[group.request_id] = group
        self._group_of[group.seqs[0].seq_id] = group
        error = self._rejection(group)
        if error is None:
            self.waiting.append(group)
        else:
            self._give_up(group, error, self._rejected)

    def _rejection(self, group: SequenceGroup) -> str | None:
        """Why the request can never run, whatever else happens; None if it can."""
        cfg, length = self.config, len(group.seqs[0])
        if length == 0:
            return "prompt is empty"
        if cfg.max_model_len is not None and length > cfg.max_model_len:
            return f"prompt has {length} tokens, more than max_model_len {cfg.max_model_len}"
        blocks = self.block_manager.blocks_for(length)
        if blocks > cfg.num_device_blocks:
            return (f"prompt has {length} tokens and needs {blocks} KV-cache blocks of {cfg.block_size} "
                    f"tokens, more than the device pool holds ({cfg.num_device_blocks})")
        return samples_problem(group.width, cfg.max_num_seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._rejected)

    def fork(self, group: SequenceGroup, seq: Sequence, n: int) -> list[Sequence]:
        """n children of seq sharing all its blocks; seq stays sample 0. Call after on_step_done."""
        self._check_between_steps(group, [seq])
        if len(group.seqs) + n > max(group.width, 1):
            raise ValueError(f"request {group.request_id!r} runs {group.width} sequence(s) at most: "
                             f"cannot fork {n} more from {len(group.seqs)}")
        children = [self._spawn(group, seq, len(group.seqs)) for _ in range(n)]
        group.forked = True
        return children

    def next_beams(self, group: SequenceGroup, beams: list[tuple[Sequence, int]]) -> list[Sequence]:
        """One step of a beam search: the group's live beams become `beams`, (parent, next token)
        pairs in rank order. A live beam no pair names is pruned, its blocks returned at once; a
        parent named k times is forked k - 1 times by reference (the blocks shared, the partly
        written last one copied on its next write). Returns the new beams, token appended, in rank
        order (their sample_index). Call after on_step_done."""
        live = group.unfinished_seqs()
        self._check_between_steps(group, [parent for parent, _ in beams])
        if not 1 <= len(beams) <= group.width:
            raise ValueError(f"request {group.request_id!r}: {len(beams)} beams for beam width {group.width}")
        named = {parent.seq_id for parent, _ in beams}
        self._drop_batch()
        for seq in live:
            if seq.seq_id not in named:
                self._release(seq, "pruned")
                self._group_of.pop(seq.seq_id)
        group.seqs = [seq for seq in group.seqs if seq.seq_id in named]
        beam_seqs, used = [], set()
        for rank, (parent, _) in enumerate(beams):
            if parent.seq_id in used:
                beam_seqs.append(self._spawn(group, parent, rank))
            else:
                used.add(parent.seq_id)
                beam_seqs.append(parent)
        for rank, (seq, (_, token)) in enumerate(zip(beam_seqs, beams, strict=True)):
            seq.sample_index = rank
            seq.append_token(token)
        group.seqs = beam_seqs
        group.forked = True
        return beam_seqs

    def _check_between_steps(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        if self._pending is not None:
            raise RuntimeError("fork() or next_beams() called before on_step_done() of the last step")
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING or self._group_of.get(seq.seq_id) is not group:
                raise ValueError(f"sequence {seq.seq_id} is not running in request {group.request_id!r}")

    def _spawn(self, group: SequenceGroup, seq: Sequence, sample_index: int) -> Sequence:
        self._drop_batch()
        child = seq.spawn(sample_index=sample_index)
        self.block_manager.fork(seq, child)
        group.seqs.append(child)
        self._group_of[child.seq_id] = group
        return child

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished():
            return
        group = self._group_of[seq.seq_id]
        status = seq.status
        self._release(seq, reason)
        if group.is_finished():
            queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.SWAPPED: self.swapped,
                     SequenceStatus.WAITING: self.waiting}[status]
            queue.remove(group)
            self._forget(group)

    def abort(self, request_id: str) -> bool:
        group = self._groups.get(request_id)
        if group is None:
            return False
        for seq in group.unfinished_seqs():
            self.finish_seq(seq, "abort")
        return True

    def _release(self, seq: Sequence, reason: str) -> None:
        self._drop_batch()
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _drop_batch(self) -> None:
        """The running sequences change otherwise than by one token each: the kept rows are stale."""
        if self._batch is not None:
            self._batch.valid = False
            self._batch = None

    def _forget(self, group: SequenceGroup) -> None:
        del self._groups[group.request_id]
        self._overtaken.pop(group.request_id, None)
        for seq in group.seqs:
            self._group_of.pop(seq.seq_id, None)

    def _give_up(self, group: SequenceGroup, error: str, report: list[SequenceGroup]) -> None:
        """Finishes a group that is in no queue with an error, to be reported in `ignored`."""
        group.error = error
        for seq in group.unfinished_seqs():
            self._release(seq, "abort")
        self._forget(group)
        report.append(group)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._pending is not None:
            raise RuntimeError("schedule() called again before on_step_done() of the last step")
        out = SchedulerOutput(ignored=self._rejected)
        self._rejected = []
        self._tokens_left = self.config.max_num_batched_tokens
        self._prefilling = False  # whether a running sequence may have a chunk to compute (_decode_writes)
        self._image_waits = False  # whether a prefill chunk waits for room for a whole image (_chunk)
        preempted = self._schedule_decodes(out)
        # Sequence slots left for swap-ins and admissions (steps 2 and 4); with nothing swapped or waiting, no
        # step reads them, and the count would cost a call per running request.
        self._seqs_left = (self.config.max_num_seqs - sum(g.max_num_running_seqs() for g in self.running)
                           if self.swapped or self.waiting else 0)
        if not preempted:
            self._swap_in(out)
        self._schedule_prefill_chunks(out)
        if not preempted and not self.swapped and not self._image_waits:
            self._admit(out)
        self._pending = out
        return out

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The runner has executed `out`: the fed tokens' K/V is in the cache now."""
        if out is not self._pending:
            raise RuntimeError("on_step_done() got an output that is not the last schedule()'s")
        self._pending = None
        bm, decoded = self.block_manager, []
        if out.decode is not None and out.decode.batch.valid:  # kept rows, none finished since: each one position
            seqs = out.decode.batch.seqs
            for seq, end in zip(seqs, (out.decode.positions + 1).tolist(), strict=True):
                seq.num_computed_tokens = end
            bm.mark_decoded(seqs)
            return
        for s in out.scheduled:
            seq, start = s.seq, s.start
            if seq.status is _FINISHED:
                continue  # aborted meanwhile
            assert seq.num_computed_tokens == start, f"sequence {seq.seq_id} moved under the runner"
            seq.num_computed_tokens = end = start + s.num_new_tokens
            if end - start == 1:
                decoded.append(seq)
                continue
            bm.mark_decoded(decoded)  # the decodes before it first: blocks are registered in the step's order
            decoded = []
            bm.mark_computed(seq, start, end)
        bm.mark_decoded(decoded)

    def _feed(self, out: SchedulerOutput, group: SequenceGroup, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed_tokens
        out.blocks_to_copy += self.block_manager.prepare_write(seq, start, start + num_tokens)
        out.scheduled.append(ScheduledSeq(seq, group, num_tokens, start))
        out.decode = None  # not a steady decode step any more (its rows are in scheduled)
        if seq.lora_id:
            out.lora_slots[seq.lora_id] = self.adapters.slot_of(seq.lora_id)
        self._tokens_left -= num_tokens

    def _chunk(self, seq: Sequence) -> int:
        """The tokens of seq's next prefill chunk: what the budget allows, and with images whose tokens attend
        both ways (Gemma 3) never ending inside one (0: the image waits for a step with room for it)."""
        start = seq.num_computed_tokens
        end = start + min(seq.num_uncomputed_tokens, self._tokens_left)
        if seq.multi_modal is not None:
            end = seq.multi_modal.chunk_end(start, end)
            self._image_waits |= end == start
        return end - start

    def _decode_writes(self, group: SequenceGroup) -> list[tuple[Sequence, int, int]]:
        writes = []
        for seq in group.unfinished_seqs():
            length = len(seq.token_ids)  # not len(seq) nor the properties: this runs for every sequence every step
            left = length - seq.num_computed_tokens
            if left == 0 and group.beam_width:
                continue  # a beam whose logits wait for its siblings' (after a preemption)
            if left == 0:
                raise RuntimeError(f"sequence {seq.seq_id} of request {group.request_id!r} was sampled but "
                                   "got no new token and was not finished")
            if left == 1:
                writes.append((seq, length - 1, length))
            else:
                self._prefilling = True
        return writes

    def _schedule_decodes(self, out: SchedulerOutput) -> bool:
        """Step 1. Returns whether anything was preempted."""
        if self._decode_steady(out) or self._decode_all(out):
            return False
        self._drop_batch()
        bm = self.block_manager
        queue, kept, preempted = deque(self.running), [], False
        while queue:
            group = queue.popleft()
            writes = self._decode_writes(group)
            need = bm.num_blocks_to_write(writes)
            if need > bm.num_free_device_blocks:
                while need > bm.num_free_device_blocks and queue:
                    self._preempt(queue.pop(), out)
                    preempted = True
                if need > bm.num_free_device_blocks:
                    if kept:
                        self._preempt(group, out)
                        preempted = True
                    else:
                        self._give_up(group, self._too_big(group, need, "continue"), out.ignored)
                    continue
            for seq, _, _ in writes:
                self._feed(out, group, seq, 1)
            kept.append(group)
        self.running = kept
        return preempted

    def _decode_all(self, out: SchedulerOutput) -> bool:
        """Step 1 in one pass when it preempts nothing: every running sequence with one token left decodes, and
        the blocks they take all together fit. Feeds them as the loop of _schedule_decodes would (same order,
        same blocks) and returns True; returns False, having fed nothing, where that loop must decide group by
        group: the blocks do not fit, a block is shared (copy-on-write counts depend on the group), or a
        sequence was sampled without getting a token (where the loop raises). The common step, at a cost per
        sequence of a few attribute reads instead of calls.

        A group that never forked holds its one sequence's partly written last block alone (the prefix cache
        shares full blocks only), so its decode takes a block exactly when its table is full, which is read
        off the table's length; the block manager looks at the blocks of the others (decode_writes)."""
        bm, bs = self.block_manager, self.config.block_size
        seqs: list[Sequence] = []
        groups: list[SequenceGroup] = []
        writes: list[Sequence] = []  # the decodes that take a new block (or a copy), in order
        keep = True  # every decode can be kept for the next steps (decode_batch.keepable)
        for group in self.running:
            if not group.forked and len(group.seqs) == 1:
                seq = group.seqs[0]
                length = len(seq.token_ids)
                left = length - seq.num_computed_tokens
                if left == 1:
                    seqs.append(seq)
                    groups.append(group)
                    if (length - 1) // bs >= len(seq.block_table):
                        writes.append(seq)
                    keep = keep and keepable(group, seq)
                elif left > 1:
                    self._prefilling = True
                elif not group.beam_width:
                    return False
                else:
                    keep = False
                continue
            decodes = [seq for seq, _, _ in self._decode_writes(group)]
            group_writes = bm.decode_writes(decodes)
            if group_writes is None:
                return False
            seqs += decodes
            groups += [group] * len(decodes)
            writes += group_writes
            keep = keep and all(keepable(group, seq) for seq in decodes)
        if len(writes) > bm.num_free_device_blocks:
            return False
        for seq in writes:  # as _feed's prepare_write in the loop's order: the others' are no-ops
            start = seq.num_computed_tokens
            out.blocks_to_copy += bm.prepare_write(seq, start, start + 1)
        self._tokens_left -= len(seqs)
        if keep and seqs and not self._prefilling:  # every running sequence decodes: the rows are kept
            self._batch = DecodeBatch(seqs, groups)
            out.decode = DecodeStep(self._batch, self._batch.lengths - 1)
            return True
        scheduled = out.scheduled
        for seq, group in zip(seqs, groups, strict=True):
            scheduled.append(ScheduledSeq(seq, group, 1, seq.num_computed_tokens, not group.prefill_only))
            if seq.lora_id:
                out.lora_slots[seq.lora_id] = self.adapters.slot_of(seq.lora_id)
        return True

    def _decode_steady(self, out: SchedulerOutput) -> bool:
        """Step 1 from the rows kept at the last step (engine/decode_batch.py): when nothing has changed since but
        one token more on every row, every running sequence decodes again, in the same order, and the rows whose
        table is full take a block each, as _decode_all would decide; returns True. Returns False, having fed
        nothing and dropped the rows, where a row's length is not one more (the loops decide, or raise), or the
        blocks do not fit (the group loop preempts); False with no rows kept."""
        batch = self._batch
        if batch is None:
            return False
        bm = self.block_manager
        lengths = batch.read_lengths()
        if not np.array_equal(lengths, batch.lengths + 1):
            self._drop_batch()
            return False
        positions = lengths - 1
        grow = batch.rows_to_grow(positions, self.config.block_size).tolist()
        if len(grow) > bm.num_free_device_blocks:
            self._drop_batch()
            return False
        for row in grow:  # the last block of a kept row is its own: a write takes a new block or nothing
            position = int(positions[row])
            out.blocks_to_copy += bm.prepare_write(batch.seqs[row], position, position + 1)
        batch.grown(grow)
        batch.lengths = lengths
        out.decode = DecodeStep(batch, positions)
        self._tokens_left -= len(batch)
        return True

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Step 2."""
        bm = self.block_manager
        while self.swapped:
            group = self.swapped[0]
            seqs = group.unfinished_seqs()
            writes = self._decode_writes(group)
            need = bm.num_blocks_to_swap(seqs) + bm.num_blocks_to_write(writes)
            if not self._fits(need):
                if self.running:
                    return
                self.swapped.pop(0)
                self._give_up(group, self._too_big(group, need, "resume"), out.ignored)
                continue
            if group.max_num_running_seqs() > self._seqs_left or len(writes) > self._tokens_left:
                return
            if not self._take_adapter(group, out):
                return
            self.swapped.pop(0)
            out.blocks_to_swap_in += bm.swap_in(seqs)
            self._set_running(group, seqs)
            for seq, _, _ in writes:
                self._feed(out, group, seq, 1)

    def _schedule_prefill_chunks(self, out: SchedulerOutput) -> None:
        """Step 3: sequences with more than one token to compute (one-token ones decoded already); none when
        steps 1 and 2 saw none (_decode_writes looks at every running sequence)."""
        if not self._prefilling:
            return
        for group in self.running:
            for seq in group.unfinished_seqs():
                if self._tokens_left == 0:
                    return
                if seq.num_uncomputed_tokens > 1 and (tokens := self._chunk(seq)):
                    self._feed(out, group, seq, tokens)

    def _admit(self, out: SchedulerOutput) -> None:
        """Step 4. A request whose LoRA adapter gets no slot waits, and those behind it may pass; once
        max_num_seqs of them have, the oldest such reserves the least recently used adapter's slot
        (`draining`: see adapter_slots.py)."""
        bm = self.block_manager
        draining: int | None = None
        blocked: SequenceGroup | None = None
        computing: set[int] = set()  # first-block keys of the prompts admitted in this step
        i = 0
        while i < len(self.waiting) and self._tokens_left > 0:
            group = self.waiting[i]
            seqs = group.unfinished_seqs()
            key = bm.first_block_key(seqs[0]) if len(seqs) == 1 and not seqs[0].num_computed_tokens else None
            if key is not None and key in computing and not bm.is_cached(key):
                # Its twin (a multiple-choice question's other choice, the same system prompt) computes the
                # shared prefix in this step: admitted in the next, it finds it in the prefix cache instead
                # of computing it again beside it. Outputs never depend on the step a request starts in.
                i += 1
                continue
            need = bm.num_blocks_to_allocate(seqs)
            if not self._fits(need):
                if self.running:
                    return
                del self.waiting[i]
                verb = "resume" if group.num_preemptions else "start"
                self._give_up(group, self._too_big(group, need, verb), out.ignored)
                continue
            if group.max_num_running_seqs() > self._seqs_left:
                return
            if group.lora_id and (group.lora_id == draining or not self._take_adapter(group, out)):
                if blocked is None:
                    blocked = group
                    if self._overtaken.get(group.request_id, 0) >= self.config.max_num_seqs:
                        draining = self.adapters.eviction_candidate()
                i += 1
                continue
            del self.waiting[i]
            self._overtaken.pop(group.request_id, None)
            if blocked is not None:
                self._overtaken[blocked.request_id] = self._overtaken.get(blocked.request_id, 0) + 1
            for seq in seqs:
                bm.allocate(seq)
            self._set_running(group, seqs)
            if key is not None:
                computing.add(key)
            for seq in seqs:
                if self._tokens_left == 0:
                    break
                if tokens := self._chunk(seq):
                    self._feed(out, group, seq, tokens)

    def _take_adapter(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Whether the group's adapter (if any) has a device slot now, given one if it can have it without
        evicting an adapter of a running request; a new one is loaded before the step (adapters_to_load)."""
        if not group.lora_id:
            return True
        got = self.adapters.acquire(group.lora_id, {g.lora_id for g in self.running})
        if got is None:
            return False
        slot, load = got
        if load:
            out.adapters_to_load.append((slot, group.lora_id))
        return True

    def _fits(self, need: int) -> bool:
        """Admissions and swap-ins leave the watermark free, unless nothing else runs."""
        reserve = self.config.watermark_blocks if self.running else 0
        return need <= self.block_manager.num_free_device_blocks - reserve

    def _set_running(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        self._drop_batch()
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, group, key=_by_arrival)
        self._seqs_left -= group.max_num_running_seqs()

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self._drop_batch()
        bm, seqs = self.block_manager, group.unfinished_seqs()
        if self.config.preemption_mode == "swap" and bm.num_blocks_to_swap(seqs) <= bm.num_free_cpu_blocks:
            out.blocks_to_swap_out += bm.swap_out(seqs)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=_by_arrival)
            self._num_swap_preemptions += 1
        else:
            # Recompute: the samples keep their tokens and are prefilled again (prompt and
            # outputs), each on its own; prefix caching finds their freed full blocks again.
            for seq in seqs:
                bm.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            self._requeue(group)
            self._num_recompute_preemptions += 1
        group.num_preemptions += 1
        out.preempted.append(group)

    def _requeue(self, group: SequenceGroup) -> None:
        """Back into waiting at its arrival place: in front of all newer requests. Victims are
        older than the requests that never ran, so the scan stops near the front."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < group.arrival:
            i += 1
        self.waiting.insert(i, group)

    def _too_big(self, group: SequenceGroup, need: int, verb: str) -> str:
        seqs, total = group.unfinished_seqs(), self.config.num_device_blocks
        what = f"{len(seqs)} sequence(s) of up to {max(len(s) for s in seqs)} tokens"
        if verb == "continue":
            why = f"its {what} fill the device pool ({total} blocks) alone and need {need} more blocks"
        else:
            why = f"to {verb} its {what} it needs {need} free blocks, more than the device pool's {total}"
        return f"out of KV-cache memory: {why}; give the KV cache more memory or lower n, beam_width or max_tokens"

    # --- reporting --------------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        blocks = self.block_manager.stats()
        return SchedulerStats(
            **vars(blocks),
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            num_running_seqs=sum(len(g.unfinished_seqs()) for g in self.running),
            num_swap_preemptions=self._num_swap_preemptions,
            num_recompute_preemptions=self._num_recompute_preemptions,
        )
