"""Beam search's decisions for one request, by transformers' rules (`generate(num_beams=k)`).

Each step takes the logits of the live beams (rank order) and ranks every continuation by its
cumulative logprob, in float32 as transformers does; equal ones by the beam's rank, then the token id
(ops.top_k's order: the same choice however the requests are batched). Of the best `num_candidates` continuations
(2k with one stop token; k more per further stop token), one that stops (EOS, a stop token or
string, max_tokens, max_model_len) becomes a finished hypothesis when it ranks among the first
k, scored `cumulative_logprob / num_output_tokens ** length_penalty` (EOS counted); the first k
that do not stop are the next beams. The k best hypotheses are kept. The search is done when
every candidate stopped, when early_stopping is set and k hypotheses are in, or when k
hypotheses are in and the best live beam, scored at its current length, cannot beat the worst.

The engine runs the beams as sequences of one SequenceGroup and moves them with
Scheduler.next_beams; this class sees only their token ids and scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen import ops
from batchgen.engine.sequence import Sequence
from batchgen.engine.stopping import StopChecker, StopDecision
from batchgen.sampling_params import BeamSearchParams


@dataclass
class Hypothesis:
    output_token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(output_token_ids) ** length_penalty, in float32
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None


@dataclass
class Continuation:
    parent: Sequence
    token_id: int
    cumulative_logprob: float


@dataclass
class BeamSearch:
    params: BeamSearchParams
    stopper: StopChecker
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    # The logprobs of live beams computed in a step, until every sibling's are (after a recompute
    # preemption the beams may be prefilled in different steps): seq id -> (a step's logprobs, row).
    pending: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # transformers keeps (1 + stop tokens) * k candidates, at least 2k, so that k survive even when
    # the k best all end; fixed for the request, so counted once.
    num_candidates: int = field(init=False)

    def __post_init__(self) -> None:
        stops = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stops |= self.stopper.eos_token_ids
        self.num_candidates = max(2, 1 + len(stops)) * self.params.beam_width

    def reset(self) -> None:
        self.hypotheses, self.done = [], False
        self.pending.clear()

    def step(self, beams: list[Sequence], logprobs: torch.Tensor) -> list[Continuation]:
        """The next beams from the live `beams` (rank order, all with the same number of outputs)
        and their float32 log-softmaxed logits `[len(beams), vocab]`, contiguous (used up: banned tokens
        are set to -inf and the beams' cumulative logprobs added in place); an empty list once the search
        is done."""
        width, sampling = self.params.beam_width, self.params.sampling_params
        num_outputs = beams[0].num_output_tokens
        banned = self.stopper.banned_tokens(sampling, num_outputs)
        if banned:  # after the softmax, as transformers' min-length processor
            logprobs[:, banned] = float("-inf")
        cumulative = torch.tensor([b.cumulative_logprob for b in beams], dtype=torch.float32, device=logprobs.device)
        totals = logprobs.add_(cumulative[:, None]).view(1, -1)  # the step's rows are this request's alone
        scores, index = ops.top_k(totals, min(self.num_candidates, totals.shape[1]))
        scores, index = scores[0], index[0]
        normalised = (scores / self._length_norm(num_outputs + 1)).tolist()
        vocab = logprobs.shape[1]
        parents, tokens, scores = (index // vocab).tolist(), (index % vocab).tolist(), scores.tolist()
        survivors: list[Continuation] = []
        finished: list[Hypothesis] = []
        all_stopped = True
        for rank, (p, token, score) in enumerate(zip(parents, tokens, scores, strict=True)):
            parent = beams[p]
            decision = self._stops(parent, token)
            if decision is None:
                all_stopped = False
                if len(survivors) < width:
                    survivors.append(Continuation(parent, token, score))
            elif rank < width:
                finished.append(Hypothesis(parent.output_token_ids + [token], score, normalised[rank],
                                           decision.reason, decision.stop_reason))
        merged = sorted(self.hypotheses + finished, key=lambda h: h.score, reverse=True)
        self.hypotheses = merged[:width]
        self.done = all_stopped or not survivors or self._cannot_improve(survivors[0], num_outputs + 1)
        return [] if self.done else survivors

    def _length_norm(self, num_outputs: int) -> float:
        return num_outputs ** self.params.length_penalty

    def _stops(self, parent: Sequence, token: int) -> StopDecision | None:
        parent.token_ids.append(token)
        try:
            return self.stopper.check(self.params.sampling_params, parent.token_ids, parent.num_prompt_tokens)
        finally:
            parent.token_ids.pop()

    def _cannot_improve(self, best: Continuation, num_outputs: int) -> bool:
        """transformers' heuristic: with k hypotheses in, the best live beam scored at today's
        length (not at any later one) must beat the worst of them to go on."""
        if len(self.hypotheses) < self.params.beam_width:
            return False
        if self.params.early_stopping:
            return True
        best_score = torch.tensor(best.cumulative_logprob, dtype=torch.float32) / self._length_norm(num_outputs)
        return not best_score.item() > self.hypotheses[-1].score
