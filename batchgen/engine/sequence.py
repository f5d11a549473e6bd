"""Sequence (one sample being generated) and SequenceGroup (one request: a prompt and its samples)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from batchgen.models.vision.inputs import MultiModalInputs
from batchgen.sampling_params import SamplingParams
from batchgen.tokens import PromptThenOutputs

_fork_ids = itertools.count(1 << 48)  # ids for forked children, far from the engine's own ids


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no KV blocks; waits for (re-)admission
    RUNNING = "running"  # block table holds device block ids
    SWAPPED = "swapped"  # block table holds CPU block ids
    FINISHED = "finished"  # blocks freed; finish_reason says why


_FINISHED = SequenceStatus.FINISHED


@dataclass(eq=False, slots=True)  # slots: every step reads each sequence's fields several times
class Sequence(PromptThenOutputs):
    """Token ids are the prompt followed by the generated tokens.

    num_computed_tokens counts the leading tokens whose K/V is in the cache; the scheduler
    feeds the rest. The last token is normally not computed yet: it is fed in the next step,
    whose logits give the following token.

    keep_hidden_from: the first position whose final hidden state the request still needs (prompt
    logprobs, scoring, pooling); None when it needs only the last token's. The prefix cache never
    skips that position: a cached prefix stops at the block holding it.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int = -1  # -1: all of token_ids is prompt
    sample_index: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Grown in place by appends only; any other change is a new list (engine/block_tables.py keeps tables by list).
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    keep_hidden_from: int | None = None
    lora_id: int = 0  # the LoRA adapter it runs with (LoRARequest.lora_int_id); 0: the base model
    # A vision-language prompt's images (shared by the request's samples); None: a text prompt.
    multi_modal: MultiModalInputs | None = field(default=None, repr=False)
    # Content hashes of the leading full blocks (prefix caching); kept by the block manager.
    block_hashes: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __bool__(self) -> bool:  # a sequence object is never falsy, even with no tokens
        return True

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def spawn(self, sample_index: int) -> Sequence:
        """A copy with a new id, sharing nothing mutable; the block manager gives it its table."""
        return Sequence(
            seq_id=next(_fork_ids),
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            sample_index=sample_index,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs),
            extra=dict(self.extra),
            lora_id=self.lora_id,
            multi_modal=self.multi_modal,
            block_hashes=list(self.block_hashes),
        )


@dataclass(eq=False, slots=True)
class SequenceGroup:
    """One request. It starts with one sequence holding the prompt; after the prompt's prefill
    the engine forks n-1 children from it (Scheduler.fork), or, for beam search, replaces its
    live beams after every step (Scheduler.next_beams). The group is the unit the scheduler
    admits, preempts, swaps and reports on."""

    request_id: str
    arrival: int  # admission order (FCFS); lower is older
    sampling_params: SamplingParams
    seqs: list[Sequence]
    error: str | None = None  # why the scheduler gave up on the request
    num_preemptions: int = 0
    forked: bool = False
    beam_width: int = 0  # > 0: a beam search with this many live beams at most
    # Scoring and pooling requests: the prompt is computed and the request ends; nothing is sampled.
    prefill_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def width(self) -> int:
        """The most sequences the group runs at once: its beams or its samples."""
        return self.beam_width or (1 if self.prefill_only else self.sampling_params.n)

    @property
    def lora_id(self) -> int:
        return self.seqs[0].lora_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    # Both run for every sequence at every step: the status is compared here rather than through
    # Sequence.is_finished(), a call per sequence.
    def is_finished(self) -> bool:
        return all(seq.status is _FINISHED for seq in self.seqs)

    def unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.status is not _FINISHED]

    def max_num_running_seqs(self) -> int:
        """Sequences this group will hold on the device: its width before the first fork, the live
        ones after; a beam search's width throughout, as its beams may grow back to it."""
        unfinished = len(self.unfinished_seqs())
        if self.beam_width and unfinished:
            return self.beam_width
        if not self.forked and self.width > 1:
            return max(unfinished, self.width)
        return unfinished
