"""Turns the logits of one step into tokens, one row per sample, all rows at once.

Randomness is per row, never per batch: each row draws with one uniform number computed from
(request seed, sample index, output position), by inverting its cumulative distribution, so a
seeded sample gets the same tokens whatever else is in the batch, however the work is split into
steps, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen import ops
from batchgen.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A stable 63-bit hash of integers (splitmix64 steps), for seeding torch.Generator."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h >> 1


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int  # the request's effective seed
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # e.g. EOS while min_tokens is not reached


@dataclass
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float]  # of the chosen token under the model's distribution
    top_logprobs: list[dict[int, float] | None]


def _apply_bans_and_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, on a float32 copy of the rows' logits."""
    for r, row in enumerate(rows):
        if row.banned_token_ids:
            logits[r, row.banned_token_ids] = float("-inf")
        p = row.params
        if p.presence_penalty or p.frequency_penalty:
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long, device=logits.device)
            picked = logits[r, seen]
            logits[r, seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)


# Rows are sampled in chunks of this many: every temporary is then a few MB, which the allocator
# reuses from step to step. A temporary of the whole batch (256 rows x 49k vocabulary = 50 MB) is
# mapped fresh from the OS on every call, and its page faults cost more than the arithmetic.
_CHUNK_ROWS = 16


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without the copy when rows are all of t's rows in order (a chunk of random rows, as "parallel"
    samples, is one 3 MB copy per index otherwise)."""
    return t if rows == list(range(len(t))) else t[rows]


def _uniform(row: SamplingRow) -> float:
    """The row's one uniform number in [0, 1) for this position, from its seed alone."""
    return (mix_seed(row.seed, row.sample_index, len(row.output_token_ids)) >> 10) / 2.0**53


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i]: drawn with probability weights[i] / total."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1).squeeze(1)


# Candidates kept by top-k/top-p/min-p are looked for among this many most likely tokens first
# (a partial top-k is far cheaper than sorting the vocabulary); the rows whose filter keeps all of
# them are searched again with 8 times as many, up to the whole vocabulary. Real nuclei are
# mostly small (SmolLM2 at temperature 0.8, top_p 0.95: median 7 tokens, 90% within 85), so only
# a few rows pay for a wide search.
_CANDIDATES = 64


def _sample_filtered(weights: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Draws from weights (unnormalised, maximum 1) restricted by each row's top-k, top-p and min-p."""
    device, vocab = weights.device, weights.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    totals = weights.sum(-1, keepdim=True)
    drawn = torch.empty(len(params), dtype=torch.long, device=device)
    todo = torch.arange(len(params), device=device)
    k = min(vocab, max([_CANDIDATES] + [p.top_k for p in params if p.top_k > 0]))
    searched = weights  # the rows of todo
    while True:
        cand, cand_ids = searched.topk(k, dim=-1)  # sorted, most likely first
        probs = cand / totals[todo]
        keep = torch.arange(k, device=device)[None, :] < top_k[todo, None]
        keep &= probs.cumsum(dim=-1) - probs < top_p[todo, None]
        keep &= cand >= min_p[todo, None]  # relative to the maximum weight, 1
        keep[:, 0] = True  # the most likely token always stays
        done = ~keep[:, -1] if k < vocab else torch.ones_like(keep[:, -1])
        picked = _inverse_cdf(cand[done] * keep[done], u[todo[done]])
        drawn[todo[done]] = cand_ids[done].gather(1, picked[:, None]).squeeze(1)
        todo = todo[~done]
        if len(todo) == 0:
            return drawn
        searched = weights[todo]
        k = min(vocab, 8 * k)


def _draw(work: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Samples one token per row of work (logits after bans and penalties, a copy it overwrites)."""
    device = work.device
    params = [row.params for row in rows]
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=work.dtype)
    weights = work.div_(temperature[:, None])
    weights = weights.sub_(weights.amax(-1, keepdim=True)).exp_()  # maximum 1 in every row
    u = torch.tensor([_uniform(row) for row in rows], device=device, dtype=work.dtype)
    filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
    plain = sorted(set(range(len(rows))) - set(filtered))
    drawn = torch.empty(len(rows), dtype=torch.long, device=device)
    if plain:
        drawn[plain] = _inverse_cdf(_take(weights, plain), u[plain])
    if filtered:
        drawn[filtered] = _sample_filtered(_take(weights, filtered), [params[i] for i in filtered], u[filtered])
    return drawn


def _sample_chunk(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their log-probabilities under the model's distribution (before bans and penalties).

    A plain greedy row needs only its argmax; the other rows are copied to float32 and edited."""
    chosen, log_total = ops.argmax_logsumexp(logits)
    edited_rows = [r for r, row in enumerate(rows)
                   if not row.params.greedy or row.banned_token_ids or row.params.penalized]
    if edited_rows:
        edited = _take(logits, edited_rows).to(torch.float32, copy=True)
        _apply_bans_and_penalties(edited, [rows[r] for r in edited_rows])
        random_rows = [i for i, r in enumerate(edited_rows) if not rows[r].params.greedy]
        greedy_edited = len(random_rows) < len(edited_rows)  # greedy rows with bans or penalties
        picks = edited.argmax(dim=-1) if greedy_edited else torch.empty_like(chosen[edited_rows])
        if random_rows:  # _draw overwrites what it is given, which nothing reads afterwards
            picks[random_rows] = _draw(_take(edited, random_rows), [rows[edited_rows[i]] for i in random_rows])
        chosen[edited_rows] = picks
    return chosen, logits.gather(1, chosen[:, None]).squeeze(1).float() - log_total


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
    """logits: [len(rows), vocab] in the model's dtype (float32 or bfloat16); left as they are."""
    chosen, logprobs = [], []
    for start in range(0, len(rows), _CHUNK_ROWS):
        tokens, lps = _sample_chunk(logits[start : start + _CHUNK_ROWS], rows[start : start + _CHUNK_ROWS])
        chosen.append(tokens)
        logprobs.append(lps)
    token_ids = torch.cat(chosen).tolist()
    chosen_logprobs = torch.cat(logprobs).tolist()
    top: list[dict[int, float] | None] = [None] * len(rows)
    wanted = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    if wanted:
        k = max(rows[r].params.logprobs for r in wanted)
        values, indices = logits[wanted].float().log_softmax(dim=-1).topk(max(k, 1), dim=-1)
        for i, r in enumerate(wanted):
            n = rows[r].params.logprobs
            entry = dict(zip(indices[i, :n].tolist(), values[i, :n].tolist(), strict=True))
            entry[token_ids[r]] = chosen_logprobs[r]
            top[r] = entry
    return SampledTokens(token_ids, chosen_logprobs, top)
