"""Turns the logits of one step into tokens, one row per sample, all rows at once.

Randomness is per row, never per batch: each row draws from its own generator seeded by
(request seed, sample index, output position), so a seeded sample gets the same tokens whatever
else is in the batch, however the work is split into steps, and after a preemption.
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


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) what top-k, top-p and min-p exclude, row by row; logits are already scaled."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    rank = torch.arange(vocab, device=logits.device)
    drop = rank[None, :] >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
    """logits: float32 [len(rows), vocab]; modified in place."""
    device, vocab = logits.device, logits.shape[1]
    model_logprobs = logits.log_softmax(dim=-1)
    for r, row in enumerate(rows):
        if row.banned_token_ids:
            logits[r, row.banned_token_ids] = float("-inf")
    _apply_penalties(logits, rows)

    chosen = logits.argmax(dim=-1)
    random_rows = [r for r, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=device)
        params = [rows[r].params for r in random_rows]
        scaled = logits[idx] / torch.tensor([p.temperature for p in params], device=device)[:, None]
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            min_p = torch.tensor([p.min_p for p in params], device=device)
            scaled = _filter(scaled, top_k, top_p, min_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, r in enumerate(random_rows):
            row = rows[r]
            gen = torch.Generator(device=device).manual_seed(
                mix_seed(row.seed, row.sample_index, len(row.output_token_ids))
            )
            noise[i].exponential_(generator=gen)
        # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i (the exponential race).
        chosen[idx] = (probs / noise).argmax(dim=-1)

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
