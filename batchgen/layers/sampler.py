"""Turns the logits of one step into tokens, one row per sample, all rows at once.

Randomness is per row, never per batch: each row draws with one uniform number computed from
(request seed, sample index, output position), by inverting its cumulative distribution, so a
seeded sample gets the same tokens whatever else is in the batch, however the work is split into
steps, and after a preemption.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import numpy as np
import torch

from batchgen import ops
from batchgen.outputs import Logprob, LogprobDict
from batchgen.sampling_params import LogitsProcessor, SamplingParams, processor_arity
from batchgen.tokens import PromptThenOutputs

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


def mix_seeds(*columns: list[int]) -> np.ndarray:
    """mix_seed of each row of the columns (a value per row in each), bit for bit, in numpy (uint64): a step's rows
    in a few array operations, where mix_seed in Python costs ~3 us a row."""
    h = np.full(len(columns[0]), 0x9E3779B97F4A7C15, dtype=np.uint64)
    for column in columns:
        h ^= np.array([v & _MASK64 for v in column], dtype=np.uint64)
        h *= np.uint64(0xBF58476D1CE4E5B9)  # wraps modulo 2**64, as the masked product does
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(29)
    return h >> np.uint64(1)


@dataclass
class SamplingRow(PromptThenOutputs):
    params: SamplingParams
    seed: int  # the request's effective seed
    sample_index: int
    # The prompt then the outputs: the sequence's own list, read in place (a row is made every step, and copying
    # a long sequence's tokens into it was most of its cost), so it must not change before the row is sampled.
    token_ids: list[int]
    num_prompt_tokens: int
    banned_token_ids: list[int]  # e.g. EOS while min_tokens is not reached
    # Structured outputs: the tokens the row's grammar allows, a packed int32 bitmask (bit j of
    # word i allows token 32 i + j); None for an unconstrained row.
    allowed: torch.Tensor | None = None

    @classmethod
    def of(cls, params: SamplingParams, seed: int, sample_index: int, prompt_token_ids: list[int],
           output_token_ids: list[int], banned_token_ids: list[int], allowed: torch.Tensor | None = None
           ) -> SamplingRow:
        """A row from its prompt and outputs apart."""
        return cls(params, seed, sample_index, list(prompt_token_ids) + list(output_token_ids), len(prompt_token_ids),
                   banned_token_ids, allowed)

    @property
    def edits_logits(self) -> bool:
        """A grammar, bans or penalties change the row's logits before it is sampled."""
        return self.allowed is not None or bool(self.banned_token_ids) or _params_edit_logits(self.params)


@dataclass
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float]  # of the chosen token under the model's distribution
    top_logprobs: list[LogprobDict | None]


def _editable_copy(logits: torch.Tensor, which: list[int], rows: list[SamplingRow]) -> torch.Tensor:
    """A float32 copy of the logits' rows that `which` names (`rows` theirs), with -inf where a row's grammar
    refuses a token: the constrained rows through `ops.mask_logits`, the others converted in one pass (row by row
    for some of the rows: taking them, then converting them, would be two)."""
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    if len(masked) == len(rows):
        return ops.mask_logits(logits, torch.stack([row.allowed for row in rows]).cpu(), _selection(logits, which))
    if _every_row(logits, which):
        out = logits.to(torch.float32, copy=True)
    else:
        out = torch.empty(len(which), logits.shape[1], dtype=torch.float32, device=logits.device)
        for i, r in enumerate(which):
            if rows[i].allowed is None:
                out[i].copy_(logits[r])
    if masked:
        allowed = torch.stack([rows[i].allowed for i in masked]).cpu()
        out[masked] = ops.mask_logits(logits, allowed, _selection(logits, [which[i] for i in masked])).to(out.device)
    return out


def _allowed_argmax_rows(chosen: torch.Tensor, rows: list[SamplingRow]) -> set[int]:
    """Greedy rows whose only edit is a grammar that allows the row's argmax: the masked argmax is
    that same token, so they skip the masked copy (most steps of a greedy constrained output)."""
    candidates = [r for r, row in enumerate(rows) if row.allowed is not None and row.params.greedy
                  and not row.banned_token_ids and not row.params.penalized and not row.params.logits_processors]
    if not candidates:
        return set()
    picks = chosen[candidates].cpu()
    words = torch.stack([rows[r].allowed for r in candidates]).cpu().gather(1, (picks >> 5)[:, None]).squeeze(1)
    bits = (words >> (picks & 31)) & 1
    return {r for r, bit in zip(candidates, bits.tolist(), strict=True) if bit}


def _seen_positions(logits: torch.Tensor,
                    tokens_of_rows: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct indices into logits.view(-1) of each (row, its tokens) pair's tokens, ascending, and how often
    each occurs: what torch.unique(positions, return_counts=True) gives, in numpy on one thread. A few thousand
    ids are too few for torch's threads to pay off: the sort within each row of a padded [rows, ids] array and
    the merge of equal runs take ~0.1 ms where torch.unique took ~0.35. `tokens_of_rows` in ascending row order."""
    kept = [(r, tokens) for r, tokens in tokens_of_rows if tokens]
    if not kept:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    padded = np.full((len(kept), max(len(tokens) for _, tokens in kept)), -1, dtype=np.int64)
    for i, (_, tokens) in enumerate(kept):
        padded[i, : len(tokens)] = np.frombuffer(array.array("q", tokens), dtype=np.int64)
    padded.sort(axis=1)
    offsets = np.array([r for r, _ in kept], dtype=np.int64)[:, None] * logits.shape[1]
    positions = (padded + offsets)[padded >= 0]  # row by row, each ascending: ascending
    starts = np.flatnonzero(np.concatenate(([True], positions[1:] != positions[:-1])))
    counts = np.diff(np.append(starts, len(positions)))
    return torch.from_numpy(positions[starts]).to(logits.device), torch.from_numpy(counts).to(logits.device)


def _apply_bans_and_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, on a float32 copy of the rows' logits: every row's bans, then its presence and frequency
    penalties, then its repetition penalty. Each is one gather and scatter over all rows' (row, token) pairs:
    the work follows the tokens the rows have seen, not the vocabulary, nor the number of rows."""
    flat, vocab = logits.view(-1), logits.shape[1]

    def per_pair(positions: torch.Tensor, value) -> torch.Tensor | float:
        values = [value(row.params) for row in rows]
        if len(set(values)) == 1:  # one value for every row (a job's rows mostly share their parameters)
            return values[0]
        return torch.tensor(values, dtype=logits.dtype, device=logits.device)[positions // vocab]

    banned = [(r, row.banned_token_ids) for r, row in enumerate(rows)]
    flat[_seen_positions(logits, banned)[0]] = float("-inf")
    counted = [(r, row.output_token_ids) for r, row in enumerate(rows)
               if (row.params.presence_penalty or row.params.frequency_penalty) and row.num_output_tokens]
    if counted:
        seen, counts = _seen_positions(logits, counted)
        counts = counts.to(logits.dtype)
        flat[seen] -= (per_pair(seen, lambda p: p.frequency_penalty) * counts
                       + per_pair(seen, lambda p: p.presence_penalty) * (counts > 0).to(logits.dtype))
    repeated = [(r, row.token_ids) for r, row in enumerate(rows)
                if row.params.repetition_penalty != 1.0]
    if repeated:
        seen = _seen_positions(logits, repeated)[0]
        picked, penalty = flat[seen], per_pair(seen, lambda p: p.repetition_penalty)
        flat[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)


def _apply_logits_processors(edited: torch.Tensor, rows: list[SamplingRow]) -> None:
    """The rows' SamplingParams.logits_processors, in order, each on its own row of `edited` (a float32 copy: what
    a processor does to it reaches no other row and not the model's logits). The slow path: Python calls per row
    and step."""
    for i, row in enumerate(rows):
        for fn in row.params.logits_processors or ():
            edited[i] = _call_processor(fn, row, edited[i])


def _call_processor(fn: LogitsProcessor, row: SamplingRow, logits: torch.Tensor) -> torch.Tensor:
    """vLLM's two forms: (generated_ids, logits) or (prompt_ids, generated_ids, logits); copies of the ids."""
    generated = row.token_ids[row.num_prompt_tokens:]
    if processor_arity(fn) == 3:
        return fn(row.token_ids[:row.num_prompt_tokens], generated, logits)
    return fn(generated, logits)


# Rows are sampled in chunks of up to this many bytes of float32 logits. Only the rows that edit their logits
# are copied (to float32), so a chunk's temporaries stay within it: below glibc's mmap threshold (32 MiB,
# ops/host_memory.py), they are reused from step to step, where a fresh mapping would pay its page faults
# again at every step. Within that, larger chunks mean fewer calls: 256 rows of a 49k vocabulary, greedy,
# top-p, penalised and logprob rows interleaved, sample 1.4x faster in chunks of 85 rows than of 16.
_CHUNK_BYTES = 16 << 20


def _chunk_rows(vocab: int) -> int:
    """Rows a chunk takes: 85 at SmolLM2's 49,152 tokens, 32 at Llama 3's 128,256, 16 at Gemma 3's 262,144."""
    return max(16, _CHUNK_BYTES // (4 * vocab))


def _every_row(t: torch.Tensor, rows: list[int]) -> bool:
    """`rows` are all of t's rows, in order."""
    return rows == list(range(len(t)))


def _selection(t: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """`rows` for the ops that read some rows of t in place (`ops.sample_tokens`, `ops.top_k`,
    `ops.mask_logits`); None for all of them."""
    return None if _every_row(t, rows) else torch.tensor(rows, dtype=torch.long)


def _uniform(row: SamplingRow) -> float:
    """The row's one uniform number in [0, 1) for this position, from its seed alone."""
    return (mix_seed(row.seed, row.sample_index, row.num_output_tokens) >> 10) / 2.0**53


def _uniforms(rows: list[SamplingRow]) -> np.ndarray:
    """_uniform of each row (float64), bit for bit, in numpy."""
    mixed = mix_seeds([row.seed for row in rows], [row.sample_index for row in rows],
                      [row.num_output_tokens for row in rows])
    return (mixed >> np.uint64(10)).astype(np.float64) / 2.0**53  # < 2**53: exact, as the int's true division


def _draw(work: torch.Tensor, which: list[int], rows: list[SamplingRow]) -> torch.Tensor:
    """One token for each row of work (logits, after bans and penalties where the rows have them) that `which`
    names, read in place as float32, sampled as the matching entry of `rows` says."""
    params = [row.params for row in rows]
    # One float64 table of the rows' parameters and uniforms: a GPU takes it in one copy, and each row rounds to its
    # op's type as from its own list (top_k's integers are exact in float64).
    table = np.array([[p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                      [p.min_p for p in params], _uniforms(rows)], dtype=np.float64)
    table = torch.from_numpy(table).to(work.device)
    temperature, _, top_p, min_p, u = table.float()
    return ops.sample_tokens(work, temperature, table[1].long(), top_p, min_p, u, _selection(work, which))


def _plain_greedy(rows: list[SamplingRow]) -> dict[int, bool]:
    """id() of each distinct SamplingParams of the rows -> whether its rows are greedy and edit nothing by their
    parameters (no penalties, no logits processors): each parameters object looked at once, not once a row (its
    properties cost ~0.5 us a row and step)."""
    distinct = {id(row.params): row.params for row in rows}
    return {key: p.greedy and not _params_edit_logits(p) for key, p in distinct.items()}


def _params_edit_logits(params: SamplingParams) -> bool:
    """The parameters' part of SamplingRow.edits_logits: penalties or logits processors."""
    return params.penalized or params.logits_processors is not None


def _sample_chunk(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, their log-probabilities under the model's distribution (before bans and penalties) and each
    row's logsumexp.

    A plain greedy row needs only its argmax; a random row whose logits stay as they are is drawn from
    them in place; the rows that edit their logits (a grammar, bans, penalties) from a float32 copy of theirs."""
    chosen, log_total = ops.argmax_logsumexp(logits)
    settled = _allowed_argmax_rows(chosen, rows)
    plain = _plain_greedy(rows)
    pending = [r for r, row in enumerate(rows)
               if not (plain[id(row.params)] and row.allowed is None and not row.banned_token_ids)  # edits_logits
               and r not in settled]
    in_place = [r for r in pending if not rows[r].edits_logits]
    if in_place:
        chosen[in_place] = _draw(logits, in_place, [rows[r] for r in in_place])
    editing = [r for r in pending if rows[r].edits_logits]
    if editing:
        samples = [rows[r] for r in editing]
        # The grammar's mask comes before bans and penalties; the caller's logits stay as they are.
        edited = _editable_copy(logits, editing, samples)
        _apply_logits_processors(edited, samples)
        _apply_bans_and_penalties(edited, samples)
        random_rows = [i for i, row in enumerate(samples) if not row.params.greedy]
        greedy_edited = len(random_rows) < len(editing)  # greedy rows with bans or penalties
        picks = ops.argmax_logsumexp(edited)[0] if greedy_edited else torch.empty_like(chosen[editing])
        if random_rows:
            picks[random_rows] = _draw(edited, random_rows, [samples[i] for i in random_rows])
        chosen[editing] = picks
    return chosen, logits.gather(1, chosen[:, None]).squeeze(1).float() - log_total, log_total


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
    """logits: [len(rows), vocab] in the model's dtype (float32 or bfloat16); left as they are."""
    chosen, logprobs, log_totals = [], [], []
    size = _chunk_rows(logits.shape[1])
    for start in range(0, len(rows), size):
        tokens, lps, log_total = _sample_chunk(logits[start : start + size], rows[start : start + size])
        chosen.append(tokens)
        logprobs.append(lps)
        log_totals.append(log_total)
    token_ids = torch.cat(chosen).tolist()
    chosen_logprobs = torch.cat(logprobs).tolist()
    top: list[LogprobDict | None] = [None] * len(rows)
    wanted = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    if wanted:
        # The most likely tokens straight from the logits (log_softmax keeps their order), then
        # logit - logsumexp: no float32 copy of the rows' whole vocabulary.
        k = min(max(1, *(rows[r].params.logprobs for r in wanted)), logits.shape[1])
        values, indices = ops.top_k(logits, k, _selection(logits, wanted))
        values = values - torch.cat(log_totals)[wanted, None]
        ranks = _chosen_ranks(logits, wanted, token_ids)
        top_ids, top_values = indices.tolist(), values.tolist()  # whole: a tensor's row by row costs ~10 us a row
        for i, r in enumerate(wanted):
            n = rows[r].params.logprobs
            entry = top_entry(top_ids[i][:n], top_values[i][:n])
            entry[token_ids[r]] = Logprob(chosen_logprobs[r], ranks[i])
            top[r] = entry
    return SampledTokens(token_ids, chosen_logprobs, top)


def _chosen_ranks(logits: torch.Tensor, wanted: list[int], token_ids: list[int]) -> list[int]:
    """The sampled token's rank in the model's distribution (before bans and penalties) of each wanted row."""
    picked = logits[torch.tensor(wanted, dtype=torch.long, device=logits.device)]
    chosen = torch.tensor([token_ids[r] for r in wanted], dtype=torch.long, device=logits.device)
    return vocab_ranks(picked, picked.gather(1, chosen[:, None])).tolist()


def vocab_ranks(logits: torch.Tensor, token_logits: torch.Tensor) -> torch.Tensor:
    """Each row's token's 1-based rank in its row of logits ([rows, 1] beside [rows, vocab]): the tokens
    scoring at least as high, itself included (vLLM's count, so a tie ranks below its equals)."""
    return (logits >= token_logits).sum(dim=-1)


def top_entry(ids: list[int], values: list[float]) -> dict[int, Logprob]:
    """The top k of one position, best first: ranks 1..k."""
    return {token: Logprob(value, rank) for rank, (token, value) in enumerate(zip(ids, values, strict=True), 1)}
