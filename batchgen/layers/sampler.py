"""Turns the logits of one step into tokens, one row per sample, all rows at once.

Randomness is per row, never per batch: each row draws with one uniform number computed from
(request seed, sample index, output position), by inverting its cumulative distribution, so a
seeded sample gets the same tokens whatever else is in the batch, however the work is split into
steps, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for r, row in enumerate(rows):
        p = row.params
        if p.presence_penalty or p.frequency_penalty:
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long, device=logits.device)
            picked = logits[r, seen]
            logits[r, seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)


# Candidates kept by top-k/top-p/min-p are looked for among this many most likely tokens first
# (a partial top-k is far cheaper than sorting the vocabulary); when a row's filter keeps all of
# them, the search is redone with 8 times as many, up to the whole vocabulary.
_CANDIDATES = 64


def _uniform(row: SamplingRow) -> float:
    """The row's one uniform number in [0, 1) for this position, from its seed alone."""
    return (mix_seed(row.seed, row.sample_index, len(row.output_token_ids)) >> 10) / 2.0**53


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i]: drawn with probability weights[i] / total."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1).squeeze(1)


def _sample_filtered(probs: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Draws from probs restricted by each row's top-k, top-p and min-p."""
    device, vocab = probs.device, probs.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    k = min(vocab, max([_CANDIDATES] + [p.top_k for p in params if p.top_k > 0]))
    while True:
        cand_probs, cand_ids = probs.topk(k, dim=-1)  # sorted, most likely first
        rank = torch.arange(k, device=device)
        keep = rank[None, :] < top_k[:, None]
        keep &= cand_probs.cumsum(dim=-1) - cand_probs < top_p[:, None]
        keep &= cand_probs >= min_p[:, None] * cand_probs[:, :1]
        keep[:, 0] = True  # the most likely token always stays
        if k == vocab or not keep[:, -1].any():
            break
        k = min(vocab, 8 * k)
    picked = _inverse_cdf(cand_probs * keep, u)
    return cand_ids.gather(1, picked[:, None]).squeeze(1)


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
    """logits: float32 [len(rows), vocab]; modified in place."""
    device = logits.device
    model_logprobs = logits.log_softmax(dim=-1)
    for r, row in enumerate(rows):
        if row.banned_token_ids:
            logits[r, row.banned_token_ids] = float("-inf")
    _apply_penalties(logits, rows)

    chosen = logits.argmax(dim=-1)
    random_rows = [r for r, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        params = [rows[r].params for r in random_rows]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        probs = (logits[random_rows] / temperature[:, None]).softmax(dim=-1)
        u = torch.tensor([_uniform(rows[r]) for r in random_rows], device=device, dtype=probs.dtype)
        filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
        plain = sorted(set(range(len(params))) - set(filtered))
        drawn = torch.empty(len(random_rows), dtype=torch.long, device=device)
        if plain:
            drawn[plain] = _inverse_cdf(probs[plain], u[plain])
        if filtered:
            drawn[filtered] = _sample_filtered(probs[filtered], [params[i] for i in filtered], u[filtered])
        chosen[random_rows] = drawn

    token_ids = chosen.tolist()
    chosen_logprobs = model_logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    top: list[dict[int, float] | None] = [None] * len(rows)
    wanted = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    if wanted:
        k = max(rows[r].params.logprobs for r in wanted)
        values, indices = model_logprobs[wanted].topk(max(k, 1), dim=-1)
        for i, r in enumerate(wanted):
            n = rows[r].params.logprobs
            entry = dict(zip(indices[i, :n].tolist(), values[i, :n].tolist(), strict=True))
            entry[token_ids[r]] = chosen_logprobs[r]
            top[r] = entry
    return SampledTokens(token_ids, chosen_logprobs, top)
