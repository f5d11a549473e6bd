"""Log-probabilities of given tokens (prompt logprobs, scoring), read from prefill's hidden states.

A prefill chunk feeding positions [start, end) leaves the final hidden state of each of them; the
state at position h, through the LM head, is the distribution of token h + 1. So a request's prompt
logprobs come chunk by chunk with its chunked prefill: each step turns the wanted rows of its hidden
states into logits, at most `LOGIT_ROWS` rows at a time, keeps each row's chosen and top-k logprobs
and drops the logits. Peak memory is `LOGIT_ROWS` x vocab floats (plus the step's hidden states),
whatever the prompt's length and `max_num_batched_tokens`.

The numbers are the sampler's: logprob = logit - logsumexp(logits) (`ops.argmax_logsumexp`), the top
k by logit. The head's GEMM computes every row from that row alone, so a token's logprob does not
depend on what shares its step or its sub-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen import ops
from batchgen.layers.sampler import top_entry, vocab_ranks
from batchgen.outputs import Logprob, LogprobDict

# Rows of logits made at once: 32 x a 152k vocabulary (Qwen) is 19 MB of float32. On SmolLM2 (49k) a
# 4,096-token prompt's logprobs grew a fresh process's peak RSS by 8-29 MiB at 32 rows, 76-104 MiB at 64
# (the heap keeps what the head's temporaries fragment), at the same speed: the head's GEMM is compute-bound
# from ~16 rows on.
LOGIT_ROWS = 32


@dataclass
class PromptLogprobs:
    """One request's logprobs of its tokens from position `first` (>= 1) to the end of its prompt, in order.

    `k`: top-k alternatives per position (None: the chosen token's logprob alone). `positions` counts
    the tokens done; `hidden_from` is the hidden state the next one needs (None once all are done),
    which is what the engine keeps the prefix cache from skipping.
    """

    token_ids: list[int]
    first: int
    k: int | None = None
    chosen: list[float] = field(default_factory=list)  # logprob of token first + i
    top: list[LogprobDict] = field(default_factory=list)  # when k is set: top k and the chosen token

    def __post_init__(self) -> None:
        if not 1 <= self.first <= len(self.token_ids):
            raise ValueError(f"logprobs from token {self.first} of {len(self.token_ids)}")

    @property
    def next_position(self) -> int:
        return self.first + len(self.chosen)

    @property
    def done(self) -> bool:
        return self.next_position >= len(self.token_ids)

    @property
    def hidden_from(self) -> int | None:
        return None if self.done else self.next_position - 1

    def wanted(self, start: int, end: int) -> range:
        """Hidden positions among [start, end) (a chunk just computed) that give still missing logprobs."""
        return range(max(start, self.next_position - 1), min(end, len(self.token_ids) - 1))

    def reset(self) -> None:
        self.chosen.clear()
        self.top.clear()

    def vllm_list(self) -> list[LogprobDict | None]:
        """vLLM's `RequestOutput.prompt_logprobs`: None for the first prompt token, then per token a dict
        of token id -> Logprob holding the token itself and the top k."""
        return [None] + list(self.top)


@dataclass
class _Wanted:
    reader: PromptLogprobs
    rows: range  # in the step's hidden states
    targets: list[int]


class LogprobBatch:
    """The step's wanted rows from every request, computed together (`compute`) and handed back in order."""

    def __init__(self) -> None:
        self._wanted: list[_Wanted] = []

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def add(self, reader: PromptLogprobs, first_row: int, positions: range) -> None:
        """Hidden rows first_row.. hold positions `positions` of reader's tokens."""
        if positions:
            rows = range(first_row, first_row + len(positions))
            self._wanted.append(_Wanted(reader, rows, reader.token_ids[positions.start + 1:positions.stop + 1]))

    def compute(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        rows = [r for w in self._wanted for r in w.rows]
        targets = torch.tensor([t for w in self._wanted for t in w.targets], dtype=torch.long, device=hidden.device)
        k = max((w.reader.k or 0 for w in self._wanted), default=0)
        ranked = any(w.reader.k is not None for w in self._wanted)  # the dicts hold Logprobs with ranks
        picked = hidden[torch.tensor(rows, device=hidden.device)]
        chosen, ranks, top_ids, top_values = [], [], [], []
        for start in range(0, len(rows), LOGIT_ROWS):
            logits = compute_logits(picked[start:start + LOGIT_ROWS])
            _, log_total = ops.argmax_logsumexp(logits)
            log_total = log_total.to(logits.device)
            span = targets[start:start + LOGIT_ROWS]
            target_logits = logits.gather(1, span[:, None])
            chosen.append(target_logits.squeeze(1).float() - log_total)
            if ranked:
                ranks.append(vocab_ranks(logits, target_logits))
            if k:
                values, ids = logits.topk(k, dim=-1)
                top_ids.append(ids)
                top_values.append(values.float() - log_total[:, None])
        chosen_list = torch.cat(chosen).tolist()
        rank_list = torch.cat(ranks).tolist() if ranked else None
        ids_list = torch.cat(top_ids).tolist() if k else None
        values_list = torch.cat(top_values).tolist() if k else None
        i = 0
        for w in self._wanted:
            n, reader = len(w.rows), w.reader
            reader.chosen += chosen_list[i:i + n]
            if reader.k is not None:
                for j in range(i, i + n):
                    entry = top_entry(ids_list[j][:reader.k], values_list[j][:reader.k]) if k else {}
                    entry[w.targets[j - i]] = Logprob(chosen_list[j], rank_list[j])
                    reader.top.append(entry)
            i += n



def name_tokens(positions: list[LogprobDict | None] | None, tokenizer: Any) -> None:
    """Sets each Logprob's `decoded_token` to its token's text alone (vLLM's: the token decoded by itself),
    decoding each distinct token once."""
    texts: dict[int, str] = {}
    for entry in positions or ():
        for token, logprob in (entry or {}).items():
            if token not in texts:
                texts[token] = tokenizer.decode([token])
            logprob.decoded_token = texts[token]
