"""The sampler's ops at real models' vocabularies (SmolLM2's 49,152, Llama 3's 128,256, Qwen 2.5's 151,936,
Gemma 3's 262,144) against torch, on every instruction set; and batch invariance of the vocabulary split."""

import math

import pytest
import torch

from batchgen import _C, ops
from batchgen.layers import sampler
from batchgen.layers.sampler import SamplingRow, sample
from batchgen.ops import reference
from batchgen.sampling_params import SamplingParams

VOCABS = [49152, 128256, 151936, 262144]
DTYPES = [torch.float32, torch.bfloat16]
BLOCK = 8192  # argmax_logsumexp's block (sampling_ops.cpp): ties and maxima placed on both sides of its edges


def edge_case_logits(vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows covering ties within and across blocks, maxima at block edges and in the ragged tail, banned
    tokens, nothing allowed, NaN and +inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(12, vocab, generator=gen)).to(dtype)
    top = float(logits.float().max()) + 1
    logits[1, [BLOCK - 1, BLOCK]] = top  # a tie across a block edge: the lower index wins
    logits[2, [5 * BLOCK + 3, 2 * BLOCK + 9, 2 * BLOCK + 10]] = top  # ties in one block and a later one
    logits[3, vocab - 1] = top  # the maximum in the last element
    logits[4, : vocab - 100] = float("-inf")  # banned tokens: the rest in the last block
    logits[5] = float("-inf")  # nothing allowed: argmax 0, logsumexp -inf
    logits[6, [3 * BLOCK + 1, vocab - 2]] = float("nan")  # the first NaN is the argmax, logsumexp NaN
    logits[7, [BLOCK + 7, 4 * BLOCK]] = float("inf")  # +inf: the first one, logsumexp +inf
    logits[8, ::2] = float("-inf")  # every other token banned
    logits[9] = 0.0  # flat: all tie, argmax 0, logsumexp log(vocab)
    return logits


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_argmax_logsumexp_matches_torch(vocab, dtype, cpu_isas):
    logits = edge_case_logits(vocab, dtype, seed=vocab)
    expected_argmax = logits.argmax(dim=-1)
    expected_total = torch.logsumexp(logits.float(), dim=-1)
    assert expected_argmax[1:4].tolist() == [BLOCK - 1, 2 * BLOCK + 9, vocab - 1]  # the cases hold
    assert expected_argmax[6] == 3 * BLOCK + 1 and math.isnan(expected_total[6])
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        argmax, log_total = ops.argmax_logsumexp(logits)
        assert torch.equal(argmax, expected_argmax), isa
        torch.testing.assert_close(log_total, expected_total, rtol=1e-6, atol=1e-5, equal_nan=True, msg=isa)


@pytest.mark.parametrize("k", [1, 5, 20, 32, 33, 64, 704])  # a sorted list up to 32, a heap past it
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_is_a_stable_descending_sorts_first_k(vocab, dtype, k, cpu_isas):
    """Values and ids equal a stable descending sort's first k (NaN first, ties by the lower id), on every table:
    ties across block edges, -inf rows, NaN, +inf and a flat row included."""
    logits = edge_case_logits(vocab, dtype, seed=vocab + k)
    logits[10, BLOCK - 3 : BLOCK + 80] = float(logits[10].float().max()) + 2  # more ties than k, over an edge
    expected_values, expected_ids = reference.top_k(logits, k)
    assert expected_ids[10, 0] == BLOCK - 3 and expected_ids[9].tolist() == list(range(k))  # the cases hold
    assert math.isnan(expected_values[6, 0]) and expected_ids[6, 0] == 3 * BLOCK + 1
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        values, ids = ops.top_k(logits, k)
        assert torch.equal(ids, expected_ids), isa
        assert torch.equal(bits(values), bits(expected_values)), isa


@pytest.mark.parametrize("k", [1, 33, 704])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_top_k_without_a_kernel_is_the_stable_sorts_first_k(dtype, k, monkeypatch):
    """Where no kernel runs (CUDA, float16): torch.topk over keys that cannot tie gives the stable sort's order
    and bits; -0.0 and +0.0 tie, as the sort holds them."""
    logits = edge_case_logits(VOCABS[0], dtype, seed=k)
    logits[10, BLOCK - 3 : BLOCK + 80] = float(logits[10].float().max()) + 2  # more ties than k
    all_ones = torch.tensor([-1], dtype=torch.int32 if dtype == torch.float32 else torch.int16)
    logits[6, 200] = all_ones.view(dtype)[0]  # a NaN with its sign bit set (x86's invalid operations give one)
    if dtype != torch.float16:  # torch widens every float16 NaN to a positive one
        assert logits[6, 200:201].float().view(torch.int32) < 0
    logits[11, :] = -1.0
    logits[11, [7, 900, 40000]] = -0.0
    logits[11, [30, 5000]] = 0.0
    expected_values, expected_ids = reference.top_k(logits, k)
    assert reference.top_k(logits[11:], 5)[1][0].tolist() == [7, 30, 900, 5000, 40000]  # signed zeros tie
    for chunk_rows in (len(logits), 5):  # all rows at once, and in chunks of 5, 5 and 2 rows
        monkeypatch.setattr(ops, "TOP_K_CHUNK", chunk_rows * logits.shape[1])
        values, ids = ops.top_k_by_keys(logits, k)
        assert torch.equal(ids, expected_ids), chunk_rows
        assert torch.equal(bits(values), bits(expected_values)), chunk_rows
    if dtype == torch.float16:  # the public op takes this path for float16
        assert torch.equal(ops.top_k(logits, k)[1], expected_ids)


def test_top_k_is_batch_and_thread_invariant(cpu_isas):
    logits = edge_case_logits(151936, torch.bfloat16, seed=4)
    threads = torch.get_num_threads()
    try:
        for isa in cpu_isas:
            _C.set_cpu_isa(isa)
            for count in (1, 2):
                torch.set_num_threads(count)
                values, ids = ops.top_k(logits, 8)
                alone = [ops.top_k(logits[r : r + 1], 8) for r in range(len(logits))]
                assert torch.equal(ids, torch.cat([i for _, i in alone])), (isa, count)
                assert torch.equal(bits(values), bits(torch.cat([v for v, _ in alone]))), (isa, count)
    finally:
        torch.set_num_threads(threads)


def test_top_k_refuses_k_outside_the_vocabulary():
    with pytest.raises(ValueError, match="k <= vocab"):
        ops.top_k(torch.zeros(2, 10), 11)


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as their bit patterns: equal NaNs compare equal."""
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_argmax_logsumexp_is_batch_and_thread_invariant(dtype, cpu_isas):
    """A row's argmax and logsumexp, bit for bit, alone or among others, on 1 or 2 threads: its blocks and their
    combination do not depend on the batch or on how the threads share the blocks."""
    vocab = 151936
    batch = edge_case_logits(vocab, dtype, seed=3)
    threads = torch.get_num_threads()
    try:
        for isa in cpu_isas:
            _C.set_cpu_isa(isa)
            results = []
            for count in (1, 2):
                torch.set_num_threads(count)
                together = ops.argmax_logsumexp(batch)
                alone = [ops.argmax_logsumexp(batch[r : r + 1]) for r in range(len(batch))]
                assert torch.equal(together[0], torch.cat([a for a, _ in alone])), (isa, count)
                assert torch.equal(bits(together[1]), bits(torch.cat([t for _, t in alone]))), (isa, count)
                results.append(together)
            assert torch.equal(results[0][0], results[1][0]), isa
            assert torch.equal(bits(results[0][1]), bits(results[1][1])), isa
    finally:
        torch.set_num_threads(threads)


def peaked_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Language-model-like rows: a noisy floor and 24 likely tokens far above it (the floor holds ~1e-4 of the
    mass, so draws rarely fall where float sums in another order could move a boundary), anywhere in the
    vocabulary, 0.25 apart (distinct in bf16 too: the kernel breaks ties by token id, torch.topk as it may)."""
    logits = torch.randn(rows, vocab, generator=gen)
    for r in range(rows):
        likely = torch.randperm(vocab, generator=gen)[:24]
        logits[r, likely] = 14 + 0.25 * torch.randperm(24, generator=gen).float()
    return logits


@pytest.mark.parametrize("vocab", VOCABS)
def test_sample_tokens_matches_the_torch_reference(vocab, cpu_isas):
    gen = torch.Generator().manual_seed(vocab + 1)
    rows = 10
    logits = peaked_logits(rows, vocab, gen)
    filters = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.95, 0.0), (1.0, 5, 1.0, 0.0), (1.2, 0, 1.0, 0.1), (0.8, 50, 0.9, 0.05)]
    temperature, top_k, top_p, min_p = (torch.tensor(col) for col in zip(*(filters * 2), strict=True))
    args = (temperature.float(), top_k.long(), top_p.float(), min_p.float(), torch.rand(rows, generator=gen))
    expected = reference.sample_tokens(logits, *args)
    bf16 = logits.to(torch.bfloat16)
    expected_bf16 = reference.sample_tokens(bf16.float(), *args)
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        assert torch.equal(ops.sample_tokens(logits, *args), expected), isa
        assert torch.equal(ops.sample_tokens(bf16, *args), expected_bf16), isa


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sampler_ops_read_the_rows_they_are_named_in_place(dtype, cpu_isas):
    """top_k, sample_tokens and mask_logits given `rows` read those rows of the logits where they lie, in that
    order (repeats too): bit for bit what they give on logits[rows], on every table."""
    vocab = 128256
    gen = torch.Generator().manual_seed(12)
    logits = peaked_logits(9, vocab, gen).to(dtype)
    picked = torch.tensor([7, 0, 3, 3, 8])
    temperature, top_k, top_p, min_p = torch.tensor([0.8, 1.0, 0.7, 1.2, 1.0]), torch.tensor([0, 5, 0, 0, 50]), \
        torch.tensor([0.95, 1.0, 0.9, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0])
    args = (temperature, top_k, top_p, min_p, torch.rand(5, generator=gen))
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        assert torch.equal(ops.sample_tokens(logits, *args, rows=picked), ops.sample_tokens(logits[picked], *args)), isa
        values, ids = ops.top_k(logits, 6, rows=picked)
        expected_values, expected_ids = ops.top_k(logits[picked], 6)
        assert torch.equal(ids, expected_ids) and torch.equal(bits(values), bits(expected_values)), isa
        allowed = random_bitmask(5, (vocab + 31) // 32, gen)
        assert torch.equal(ops.mask_logits(logits, allowed, rows=picked), ops.mask_logits(logits[picked], allowed))
    with pytest.raises(ValueError, match=r"rows\[1\] = 9 is not a row of the 9 logits rows"):
        ops.top_k(logits, 3, rows=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="temperature must be a CPU tensor of 2 entries"):  # one per row read
        ops.sample_tokens(logits, *args, rows=torch.tensor([0, 1]))


def test_a_chunk_of_every_kind_samples_each_row_as_alone():
    """Greedy, top-p (drawn from the logits in place), penalised and grammar-constrained (from a float32 copy of
    those rows only) and logprob rows interleaved in one chunk: each row's token, logprob and top logprobs as when
    it is sampled alone."""
    vocab = 128256
    gen = torch.Generator().manual_seed(13)
    logits = peaked_logits(16, vocab, gen).to(torch.bfloat16)
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95),
             SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5,
                            frequency_penalty=0.5),
             SamplingParams(temperature=0, logprobs=5)]
    seen = torch.randint(vocab, (16, 40), generator=gen).tolist()
    rows = [row(kinds[r % 4], outputs=seen[r][8:], prompt=seen[r][:8], seed=r) for r in range(16)]
    for r in (1, 2, 6):  # a grammar on two random rows, one of them penalised as well
        rows[r].allowed = random_bitmask(1, (vocab + 31) // 32, gen)[0]
    together = sample(logits, rows)
    for r in range(16):
        alone = sample(logits[r : r + 1].clone(), [rows[r]])
        assert together.token_ids[r] == alone.token_ids[0], r
        assert together.logprobs[r] == alone.logprobs[0], r
        assert together.top_logprobs[r] == alone.top_logprobs[0], r
    assert all(together.top_logprobs[r] is not None for r in range(3, 16, 4))
    assert len({together.token_ids[r] for r in range(1, 16, 4)}) > 1  # the random rows drew


def row(params: SamplingParams, outputs=(), prompt=(1, 2), seed: int = 0) -> SamplingRow:
    return SamplingRow.of(params, seed, 0, list(prompt), list(outputs), [])


def dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties applied to every token of the vocabulary, as transformers and vLLM write them."""
    out = logits.clone()
    for r, sample_row in enumerate(rows):
        p = sample_row.params
        counts = torch.bincount(torch.tensor(sample_row.output_token_ids, dtype=torch.long),
                                minlength=out.shape[1]).float()
        out[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        seen = torch.tensor(sample_row.prompt_token_ids + sample_row.output_token_ids, dtype=torch.long)
        picked = out[r, seen]
        out[r, seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    return out


@pytest.mark.parametrize("vocab", [49152, 262144])
def test_penalties_match_the_dense_formula_bit_for_bit(vocab):
    gen = torch.Generator().manual_seed(7)
    logits = 3 * torch.randn(4, vocab, generator=gen)
    logits[0, 10] = -0.0
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
              SamplingParams(temperature=0, presence_penalty=-1.5, frequency_penalty=-0.2),
              SamplingParams(temperature=0.8, frequency_penalty=1.1),
              SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.7)]
    outputs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (300, 40, 7, 0)]
    outputs[0] += [10, 10, vocab - 1]
    rows = [row(p, outputs=o, prompt=torch.randint(vocab, (50,), generator=gen).tolist())
            for p, o in zip(params, outputs, strict=True)]
    expected = dense_penalties(logits, rows)
    edited = logits.clone()
    sampler._apply_bans_and_penalties(edited, rows)
    assert not torch.equal(edited, logits)
    assert torch.equal(edited, expected)
    greedy = sample(logits, rows).token_ids
    assert [greedy[r] for r in (0, 1, 3)] == expected[[0, 1, 3]].argmax(-1).tolist()


def test_seen_positions_are_torch_uniques():
    """The penalties' (row, token) pairs and counts, found in numpy, are torch.unique's: rows with repeats, empty
    lists, rows skipped, lists of different lengths."""
    gen = torch.Generator().manual_seed(14)
    logits = torch.zeros(40, 1000)
    for case in range(50):
        rows = sorted(torch.randperm(40, generator=gen)[: 1 + case % 40].tolist())
        lists = [(r, torch.randint(1000, (int(torch.randint(0, 60, (1,), generator=gen)),), generator=gen).tolist())
                 for r in rows]
        flat = torch.tensor([t + r * 1000 for r, tokens in lists for t in tokens], dtype=torch.long)
        seen, counts = sampler._seen_positions(logits, lists)
        expected_seen, expected_counts = torch.unique(flat, return_counts=True)
        assert torch.equal(seen, expected_seen) and torch.equal(counts, expected_counts), case


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_and_logprobs_match_torch(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab + 2)
    logits = (4 * torch.randn(5, vocab, generator=gen)).to(dtype)
    logits[1, [100, vocab - 3]] = logits[1].max() + 1  # a tie: greedy takes the lower id
    wanted = SamplingParams(temperature=0, logprobs=5)
    rows = [row(wanted), row(wanted), row(SamplingParams(temperature=0)), row(wanted), row(wanted)]
    result = sample(logits, rows)
    assert result.token_ids == logits.argmax(-1).tolist() and result.token_ids[1] == 100
    expected = logits.double().log_softmax(-1)  # torch's float32 log_softmax is off by up to ~1e-5 here
    for r in (0, 1, 3, 4):
        top = result.top_logprobs[r]
        fifth = expected[r].topk(5).values[4].item()
        assert len(top) == 5 and result.token_ids[r] in top
        assert all(expected[r, token] >= fifth for token in top), r  # a top five (bf16 rows may tie at the cut)
        for token, lp in top.items():
            assert math.isclose(lp, expected[r, token].item(), rel_tol=1e-6, abs_tol=1e-5), (r, token)
    assert result.top_logprobs[2] is None


def random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [4099, *VOCABS])  # 4,099: a last word cut short; the others a word to spare
def test_mask_logits_matches_the_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab + 5)
    logits = (3 * torch.randn(6, vocab, generator=gen)).to(dtype)
    logits[2, 7] = float("nan")
    allowed = random_bitmask(6, vocab // 32 + 1, gen)
    allowed[3] = 0  # nothing allowed
    allowed[4] = -1  # everything
    expected = reference.mask_logits(logits, allowed)
    got = ops.mask_logits(logits, allowed)
    assert got.dtype == torch.float32 and torch.equal(bits(got), bits(expected))
    assert bool(torch.isinf(got[3]).all()) and torch.equal(got[4], logits[4].float())
    assert torch.isneginf(got).float().mean().item() == pytest.approx(3 / 6, abs=0.01)  # half of 4 random rows


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_grammar_rows_pick_among_their_allowed_tokens(dtype):
    """Constrained rows, alone in a chunk or among free ones, greedy and random: the token is the allowed argmax,
    or an allowed token."""
    vocab = 128256
    gen = torch.Generator().manual_seed(21)
    logits = (3 * torch.randn(6, vocab, generator=gen)).to(dtype)
    allowed = random_bitmask(6, vocab // 32, gen)
    unpacked = reference.mask_logits(torch.zeros(6, vocab), allowed) == 0
    logits[:, logits[0].float().argmax()] = 30  # the free argmax, refused where the grammar says so
    greedy, drawn = SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9)
    for constrained in ([0, 1, 2, 3, 4, 5], [1, 4]):
        rows = [row(greedy if r % 2 else drawn, seed=r) for r in range(6)]
        for r in constrained:
            rows[r].allowed = allowed[r]
        tokens = sample(logits, rows).token_ids
        for r in constrained:
            assert unpacked[r, tokens[r]], (constrained, r)
            if r % 2:
                expected = logits[r].float().masked_fill(~unpacked[r], float("-inf")).argmax()
                assert tokens[r] == expected, (constrained, r)
