"""The engine's side of a steady decode step (engine/decode_batch.py): its sampling rows and stop limits, kept.

While the scheduler keeps a step's rows, the engine keeps what it made for them at the step where every row's
sampling row could be kept (no grammar, no bans before min_tokens, no fork, no beam search): the rows in batch
order, and per row the length at which a stop check is due and the union of the tokens that may stop one. A
steady step then samples those rows, appends every token in one tight loop, and runs the stop checks only on
the rows the arrays single out: a length limit reached, or a token that may stop its sample (every row where a
request has stop strings, as StopChecker.watch says).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from batchgen.engine.decode_batch import DecodeBatch
from batchgen.engine.sequence import Sequence
from batchgen.engine.stopping import StopDecision
from batchgen.layers.sampler import SampledTokens, SamplingRow


@dataclass(slots=True)
class KeptRows:
    batch: DecodeBatch  # the scheduler's kept rows these belong to
    rows: list[SamplingRow]  # batch order
    targets: list  # (_Request, Sequence) per row, batch order
    stop_lens: np.ndarray  # int64: each row's StopWatch.length
    stop_tokens: frozenset[int] | None  # the union of the rows' StopWatch.tokens; None: some row checks every token
    wants_top: bool  # some row returns top logprobs

    @classmethod
    def of(cls, batch: DecodeBatch, rows: list[SamplingRow], targets: list) -> KeptRows:
        watches = [req.watch for req, _ in targets]
        every = any(w.tokens is None for w in watches)
        return cls(batch, rows, targets, np.array([w.length for w in watches], dtype=np.int64),
                   None if every else frozenset().union(*(w.tokens for w in watches)),
                   any(row.params.logprobs is not None for row in rows))

    def append(self, result: SampledTokens, lengths: np.ndarray,
               check: Callable[..., StopDecision | None], finish: Callable[[Sequence, str], None]) -> list:
        """Each sampled token onto its sequence (`lengths`: theirs after it), then the stop checks that are due, in
        row order, as LLMEngine._append_tokens does row by row. Returns the (request, sequence) pairs of the
        sequences finished, in row order."""
        for (_, seq), token, logprob in zip(self.targets, result.token_ids, result.logprobs, strict=True):
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprob
        if self.wants_top:
            for (_, seq), top in zip(self.targets, result.top_logprobs, strict=True):
                if top is not None:
                    seq.logprobs.append(top)
        if self.stop_tokens is None:
            due: list[int] = list(range(len(self.rows)))
        else:
            due = np.flatnonzero(lengths >= self.stop_lens).tolist()
            if self.stop_tokens:
                stops = self.stop_tokens
                due = sorted({*due, *(i for i, token in enumerate(result.token_ids) if token in stops)})
        finished = []
        for i in due:  # a row due by another row's stop token only: check says None, as its own watch would
            req, seq = self.targets[i]
            decision = check(req.params, seq.token_ids, seq.num_prompt_tokens)
            if decision is not None:
                req.stop_reasons[seq.seq_id] = decision.stop_reason
                finish(seq, decision.reason)
                finished.append((req, seq))
        return finished
