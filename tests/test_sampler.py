import math

import pytest
import torch

from batchgen import _C, ops
from batchgen.layers import sampler
from batchgen.layers.sampler import SamplingRow, mix_seed, sample
from batchgen.sampling_params import SamplingParams


def row(params: SamplingParams, seed: int = 0, index: int = 0, outputs=(), prompt=(1, 2), banned=()) -> SamplingRow:
    return SamplingRow.of(params, seed, index, list(prompt), list(outputs), list(banned))


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    result = sample(logits.clone(), [row(SamplingParams(temperature=0))] * 4)
    assert result.token_ids == logits.argmax(-1).tolist()


def test_seeded_row_is_independent_of_batch():
    torch.manual_seed(0)
    target = torch.randn(1, 1000)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    alone = sample(target.clone(), [row(params, seed=7)]).token_ids[0]
    others = torch.randn(5, 1000)
    batch = torch.cat([others[:2], target, others[2:]])
    rows = [row(SamplingParams(temperature=1.0), seed=s) for s in (1, 2)]
    rows += [row(params, seed=7)] + [row(SamplingParams(temperature=0.5), seed=s) for s in (3, 4, 5)]
    assert sample(batch, rows).token_ids[2] == alone


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    rows = [row(SamplingParams(temperature=1.0), seed=s) for s in range(4000)]
    counts = torch.bincount(torch.tensor(sample(logits, rows).token_ids), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_top_p_top_k_min_p_exclude_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(500, 1)
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, top_k=1), {0}),
        (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),
    ]:
        tokens = sample(logits.clone(), [row(params, seed=s) for s in range(500)]).token_ids
        assert set(tokens) == allowed, params


def test_different_positions_and_samples_draw_differently():
    logits = torch.zeros(64, 1000)
    rows = [row(SamplingParams(temperature=1.0), seed=3, index=i % 8, outputs=[5] * (i // 8)) for i in range(64)]
    assert len(set(sample(logits, rows).token_ids)) > 40


def test_banned_tokens_and_penalties():
    logits = torch.tensor([[5.0, 4.0, 1.0, -1.0]])
    assert sample(logits.clone(), [row(SamplingParams(temperature=0), banned=[0])]).token_ids == [1]
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits.clone(), [row(rep, prompt=[0], outputs=[])]).token_ids == [1]  # 5/2 < 4
    pres = SamplingParams(temperature=0, presence_penalty=1.5)
    assert sample(logits.clone(), [row(pres, outputs=[0])]).token_ids == [1]
    freq = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sample(logits.clone(), [row(freq, outputs=[0, 0])]).token_ids == [1]


def test_logprobs_are_the_model_distribution():
    logits = torch.randn(2, 30)
    expected = logits.log_softmax(-1)
    result = sample(logits.clone(), [row(SamplingParams(temperature=0, logprobs=3))] * 2)
    for r in range(2):
        top = result.top_logprobs[r]
        assert len(top) == 3 and result.token_ids[r] in top
        for token, lp in top.items():
            assert math.isclose(lp, expected[r, token].item(), rel_tol=1e-6)
        assert math.isclose(result.logprobs[r], expected[r, result.token_ids[r]].item(), rel_tol=1e-6)


def test_mix_seed_is_stable_and_spreads():
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    assert len({mix_seed(1, i) for i in range(1000)}) == 1000
    assert 0 <= mix_seed(-5, 2**70) < 2**63


def test_a_steps_seeds_mixed_in_numpy_are_mix_seed_bit_for_bit():
    """mix_seeds and _uniforms, the vectorised forms the sampler draws with, against mix_seed and _uniform row by
    row: negative and over-wide values included, the float32 uniforms equal as the sampler passes them."""
    import random

    rng = random.Random(4)
    columns = [[rng.choice([rng.randrange(-2**70, 2**70), rng.randrange(2**63), rng.randrange(100), -1, 0, 2**64 - 1])
                for _ in range(2000)] for _ in range(3)]
    assert sampler.mix_seeds(*columns).tolist() == [mix_seed(a, b, c) for a, b, c in zip(*columns, strict=True)]
    rows = [row(SamplingParams(temperature=0.7), seed=rng.randrange(-2**63, 2**63), index=rng.randrange(8),
                outputs=range(rng.randrange(50))) for _ in range(500)]
    one_by_one = torch.tensor([sampler._uniform(r) for r in rows], dtype=torch.float32)
    assert torch.equal(torch.from_numpy(sampler._uniforms(rows)).to(torch.float32), one_by_one)
    assert sampler._uniforms(rows).tolist() == [sampler._uniform(r) for r in rows]


@pytest.mark.parametrize(
    "field,value",
    [("n", 0), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", 0), ("min_p", 2),
     ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", -3), ("max_tokens", 0),
     ("min_tokens", -1), ("logprobs", -1), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", 1.5)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_wide_nucleus_is_not_cut_to_the_first_candidates():
    logits = torch.zeros(300, 5000)  # flat: the 0.99 nucleus holds ~4950 tokens
    rows = [row(SamplingParams(temperature=1.0, top_p=0.99), seed=s) for s in range(300)]
    assert len(set(sample(logits, rows).token_ids)) > 250


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["chunks_of_the_vocabulary", "chunks_of_16_rows"])
def test_seeded_row_is_independent_of_its_chunk(chunk_bytes, monkeypatch):
    """Rows are sampled in chunks, and a chunk searches wider candidate sets for its rows with wide
    nuclei; neither may change what a seeded row draws."""
    if chunk_bytes is not None:
        monkeypatch.setattr(sampler, "_CHUNK_BYTES", chunk_bytes)
    assert sampler._chunk_rows(3000) == (16 if chunk_bytes else 1398)  # row 16 starts a chunk of its own, or not
    torch.manual_seed(1)
    target = torch.randn(1, 3000) * 3
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=500, seed=11)
    alone = sample(target.clone(), [row(params, seed=11)]).token_ids[0]
    flat = torch.zeros(1, 3000)  # a nucleus of ~2850 tokens, searched with the largest candidate set
    for position in (0, 7, 15, 16, 30):
        batch = torch.randn(40, 3000) * 3
        batch[position] = target[0]
        batch[(position + 1) % 40] = flat[0]
        rows = [row(SamplingParams(temperature=1.0, top_p=0.99), seed=s) for s in range(40)]
        rows[position] = row(params, seed=11)
        assert sample(batch, rows).token_ids[position] == alone, position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_logsumexp_matches_torch(dtype, cpu_isas):
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(37, 49157, generator=gen) * 4).to(dtype)  # a vocabulary with a ragged tail
    logits[3, 100] = logits[3, 20000] = logits[3].max() + 1  # a tie: the first index wins
    logits[5, :30000] = float("-inf")  # banned tokens
    logits[6] = float("-inf")  # nothing allowed: argmax 0, logsumexp -inf
    logits[7, 1234] = float("nan")  # a NaN is the maximum, as for torch.argmax
    expected = torch.logsumexp(logits.float(), dim=-1)
    for isa in cpu_isas:  # each instruction set's row kernel
        _C.set_cpu_isa(isa)
        argmax, log_total = ops.argmax_logsumexp(logits)
        assert torch.equal(argmax, logits.argmax(dim=-1)), isa
        assert log_total.dtype == torch.float32
        torch.testing.assert_close(log_total, expected, rtol=1e-6, atol=1e-5, equal_nan=True, msg=isa)


@pytest.mark.parametrize("with_bans", [True, False], ids=["bans", "no_bans"])
def test_bf16_logits_sample_like_their_float32_copy(with_bans):
    """Rows that bans or penalties edit are sampled from a float32 copy; the others (no_bans) straight from
    the bf16 logits: either way as from the float32 copy of the logits."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(40, 5000, generator=gen) * 3).to(torch.bfloat16)
    rows = [row(SamplingParams(temperature=0 if i % 2 else 0.8, top_p=0.9), seed=i,
                banned=[7] * (with_bans and i % 3 == 0)) for i in range(40)]
    from_bf16, from_float = sample(logits, rows), sample(logits.float(), rows)
    assert from_bf16.token_ids == from_float.token_ids
    assert from_bf16.logprobs == pytest.approx(from_float.logprobs, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_leaves_the_logits_alone_and_rows_independent(dtype):
    """The sampler skips copies when a chunk's rows are all random: it must still never write the caller's logits
    (the log-probs are read from them afterwards), and a row's token must not depend on its chunk's company."""
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(40, 300, generator=gen)).to(dtype)
    original = logits.clone()
    nucleus = SamplingParams(temperature=0.8, top_p=0.9)
    plain = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0)
    all_random = [row(nucleus if r % 2 else plain, seed=r) for r in range(40)]
    mixed = [row(greedy, banned=[int(original[r].float().argmax())]) if r % 3 == 0 else all_random[r]
             for r in range(40)]
    for rows in (all_random, mixed):
        result = sample(logits, rows)
        assert torch.equal(logits, original)
        expected = original.float().log_softmax(-1).gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
        assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
        for r in range(0, 40, 7):
            assert sample(original[r : r + 1].clone(), [rows[r]]).token_ids[0] == result.token_ids[r]
    banned_rows = range(0, 40, 3)
    assert all(result.token_ids[r] != int(original[r].float().argmax()) for r in banned_rows)


def _filter_cases(count: int, vocab: int, gen: torch.Generator):
    """Logits and per-row filters covering plain rows, each filter alone and together, flat and peaked rows,
    and banned tokens; no two logits of a row tie (the kernel breaks ties by token id, torch.topk as it may)."""
    logits = 3 * torch.randn(count, vocab, generator=gen)
    logits[1] = 0.01 * torch.randn(vocab, generator=gen)  # nearly flat: the nucleus holds most of the vocabulary
    logits[2, 17] = 40.0  # one token holds nearly all the mass
    logits[3, : vocab // 2] = float("-inf")  # banned tokens
    filters = [(0.7, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.3, 0, 0.95, 0.0), (0.8, 0, 0.999, 0.0), (1.0, 1, 1.0, 0.0),
               (0.9, 5, 1.0, 0.0), (1.0, 50, 0.8, 0.0), (1.0, 0, 1.0, 0.05), (0.6, 20, 0.9, 0.3), (1.0, 0, 0.5, 0.0)]
    rows = [filters[r % len(filters)] for r in range(count)]
    temperature, top_k, top_p, min_p = (torch.tensor(col) for col in zip(*rows, strict=True))
    u = torch.rand(count, generator=gen)
    return logits, temperature.float(), top_k.long(), top_p.float(), min_p.float(), u


def test_sample_tokens_matches_the_torch_reference_on_every_isa(cpu_isas):
    from batchgen.ops import reference

    case = _filter_cases(300, 4099, torch.Generator().manual_seed(8))  # a vocabulary with a ragged tail
    expected = reference.sample_tokens(*case)
    assert expected[2] == 17 and bool((expected[3] >= 4099 // 2).all()) and (case[0][3, expected[3]] > -1e9)
    for isa in cpu_isas:  # each instruction set's weights kernel
        _C.set_cpu_isa(isa)
        assert torch.equal(ops.sample_tokens(*case), expected), isa


def test_the_reference_draws_a_row_alike_in_any_company():
    """The torch path (CUDA's) takes shortcuts when no row or every row filters, and when no row's filter outgrows
    its first candidates: each subset of rows draws what the mixed batch drew for them."""
    from batchgen.ops import reference

    logits, temperature, top_k, top_p, min_p, u = _filter_cases(300, 4099, torch.Generator().manual_seed(9))
    expected = reference.sample_tokens(logits, temperature, top_k, top_p, min_p, u)
    filtered = (top_k > 0) | (top_p < 1) | (min_p > 0)
    assert filtered[1] and not filtered[0]  # row 1, nearly flat, searches past the first candidates
    top_k_rows = top_k > 0
    assert int(top_k.max()) < reference._CANDIDATES  # every top-k row is done with its first candidates
    for subset in (~filtered, filtered, top_k_rows):
        assert 0 < int(subset.sum()) < len(logits)
        got = reference.sample_tokens(logits[subset], temperature[subset], top_k[subset], top_p[subset],
                                      min_p[subset], u[subset])
        assert torch.equal(got, expected[subset])


def test_sample_tokens_finds_candidates_in_every_lane_and_the_ragged_tail(cpu_isas):
    """The kernels collect a filter's candidates a vector of weights at a time: a token holding the nucleus at
    any lane of a vector, in the last whole vector or past it (4,099 is 3 past a multiple of 16), is the one
    drawn; and with three such tokens and top_k 3, the draws split between exactly those three."""
    vocab = 4099
    places = [0, 1, 7, 8, 15, 16, 31, 4079, 4095, 4096, 4097, 4098]
    logits = 0.1 * torch.randn(len(places), vocab, generator=torch.Generator().manual_seed(12))
    for row, place in enumerate(places):
        logits[row, place] = 30.0
    rows = len(places)
    args = (torch.ones(rows), torch.zeros(rows, dtype=torch.int64), torch.full((rows,), 0.5), torch.zeros(rows),
            torch.rand(rows, generator=torch.Generator().manual_seed(13)))
    trio = torch.zeros(300, vocab)
    trio[:, [5, 2050, 4098]] = 20.0
    u = (torch.arange(300) + 0.5) / 300
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        assert ops.sample_tokens(logits, *args).tolist() == places, isa
        drawn = ops.sample_tokens(trio, torch.ones(300), torch.full((300,), 3), torch.ones(300),
                                  torch.zeros(300), u)
        assert torch.bincount(drawn, minlength=vocab)[[5, 2050, 4098]].tolist() == [100, 100, 100], isa


def test_sample_tokens_reads_bf16_logits_as_their_float32_values(cpu_isas):
    logits, *per_row = _filter_cases(300, 4099, torch.Generator().manual_seed(11))
    bf16 = logits.to(torch.bfloat16)
    every_other = bf16[::2]  # rows further apart than a row
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        assert torch.equal(ops.sample_tokens(bf16, *per_row), ops.sample_tokens(bf16.float(), *per_row)), isa
        halves = [t[::2].contiguous() for t in per_row]
        assert torch.equal(ops.sample_tokens(every_other, *halves),
                           ops.sample_tokens(every_other.float(), *halves)), isa


def test_sample_tokens_draws_each_kept_token_in_proportion():
    """Evenly spaced u invert the kept tokens' cumulative distribution: each token gets its share of the draws."""
    weights = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.15, 0.08])  # sorted: 1, 3, 4, 5, 0, 2
    draws = 6000
    logits = weights.log().repeat(draws, 1)
    u = (torch.arange(draws) + 0.5) / draws

    def counts(top_k: int, top_p: float, min_p: float) -> list[int]:
        tokens = ops.sample_tokens(logits, torch.ones(draws), torch.full((draws,), top_k), torch.full((draws,), top_p),
                                   torch.full((draws,), min_p), u)
        return torch.bincount(tokens, minlength=6).tolist()

    def expected(kept: list[int]) -> list[int]:
        total = sum(weights[kept].tolist())
        return [round(draws * weights[t].item() / total) if t in kept else 0 for t in range(6)]

    for found, want in [(counts(0, 1.0, 0.0), expected([0, 1, 2, 3, 4, 5])),
                        (counts(0, 0.65, 0.0), expected([1, 3])),  # token 4 starts at mass 0.7 >= 0.65
                        (counts(0, 0.75, 0.0), expected([1, 3, 4])),
                        (counts(2, 1.0, 0.0), expected([1, 3])),
                        (counts(0, 1.0, 0.3), expected([1, 3, 4])),  # min_p relative to the most likely: >= 0.12
                        (counts(1, 0.9, 0.0), expected([1]))]:
        assert all(abs(f - w) <= 1 for f, w in zip(found, want, strict=True)), (found, want)


def test_sample_tokens_breaks_ties_by_token_id():
    draws = 300
    u = (torch.arange(draws) + 0.5) / draws
    tokens = ops.sample_tokens(torch.zeros(draws, 10), torch.ones(draws), torch.full((draws,), 3), torch.ones(draws),
                               torch.zeros(draws), u)
    assert torch.bincount(tokens, minlength=10).tolist() == [100, 100, 100] + [0] * 7
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2))
    only_the_top = ops.sample_tokens(logits, torch.full((4,), 0.7), torch.zeros(4, dtype=torch.int64), torch.ones(4),
                                     torch.ones(4), torch.rand(4))  # min_p 1 keeps the most likely token alone
    assert torch.equal(only_the_top, logits.argmax(-1))


def test_sample_tokens_rejects_bad_arguments():
    logits, temperature, top_k, top_p, min_p, u = _filter_cases(4, 50, torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match=r"temperature\[2\] = 0 must be > 0"):
        ops.sample_tokens(logits, temperature.index_fill(0, torch.tensor([2]), 0.0), top_k, top_p, min_p, u)
    with pytest.raises(ValueError, match="top_k must be"):
        ops.sample_tokens(logits, temperature, top_k.int(), top_p, min_p, u)
    with pytest.raises(ValueError, match="u must be a CPU tensor of 4 entries"):
        ops.sample_tokens(logits, temperature, top_k, top_p, min_p, u[:3])
