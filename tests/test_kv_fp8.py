"""The opt-in fp8 KV cache (docs/kv-cache.md): the cache-write op's quantization against torch's own fp8
conversion, every CPU attention path against the pure-torch reference on fp8 caches, bit-for-bit batch
invariance within the fp8 path, block copies and swaps, and the engine end to end on a tiny model."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    HEAD_CONFIGS,
    every_isa,  # noqa: F401 - the fixture
    paged_kv,
    random_query,
    rel_err,
    single_threaded,
    tolerance,
    torch_threads,
)
from test_reproducibility import TINY_BLOCK, VARIANTS, check_variants, seeded, tiny_prompts

from batchgen import LLM, SamplingParams, ops
from batchgen.config import ConfigError
from batchgen.layers.attention import fp8_kv_scales
from batchgen.ops import reference

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
with_variants = pytest.mark.parametrize("variant", [{}, {"sliding_window": 40}, {"logits_soft_cap": 5.0}],
                                        ids=["plain", "window", "softcap"])


def fmt_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(params=FORMATS, ids=fmt_id)
def fp8(request) -> torch.dtype:
    return request.param


def random_scales(num_kv_heads: int, gen: torch.Generator) -> torch.Tensor:
    """Per-head scales far from 1, so that a scale applied to the wrong head or twice shows."""
    return torch.rand(num_kv_heads, generator=gen) * 0.3 + 0.05


def fp8_cache_like(cache: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    return torch.zeros(cache.shape, dtype=fp8)


def edge_values(fp8: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties), values just beside them,
    values past the largest finite one, and float32 subnormals: as float32 [n]."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    beside = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    limit = reference.FP8_LIMITS[fp8]
    far = torch.tensor([limit * 1.01, limit * 1.07, limit * 4, 1e30, 1e-30, 1e-42, 0.0, -0.0])
    values = torch.cat([finite, mids, beside, far])
    return torch.cat([values, -values])


pytestmark_isa = pytest.mark.usefixtures("every_isa")


# --- the cache-write op ------------------------------------------------------------------------


@pytestmark_isa
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
def test_cache_write_rounds_as_torch_does(fp8, activation):
    """reshape_and_cache's bytes are torch's conversion of x / scale clamped to the largest finite value,
    for every value the format has, every tie between two of them and values past both ends."""
    values = edge_values(fp8)
    head_dim, kv_heads = 64, 2
    rows = -(-values.numel() // (head_dim * kv_heads))
    flat = torch.zeros(rows * head_dim * kv_heads)
    flat[: values.numel()] = values
    key = flat.view(rows, kv_heads, head_dim).to(activation)
    value = -key.flip(0)
    k_scale, v_scale = torch.tensor([1.0, 0.5]), torch.tensor([2.0, 1.0])
    slots = torch.randperm(rows + 8, generator=torch.Generator().manual_seed(0))[:rows]
    got = [torch.zeros(1 + (rows + 8) // 16, kv_heads, 16, head_dim, dtype=fp8) for _ in range(2)]
    want = [c.clone() for c in got]
    ops.reshape_and_cache(key, value, *got, slots, k_scale, v_scale)
    reference.reshape_and_cache(key, value, *want, slots, k_scale, v_scale)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
def test_cache_write_gives_the_same_bytes_on_every_table(cpu_isas, fp8, activation):
    """The row loop each kernel table compiles (vectorized where the table can) writes the bytes of the portable
    table's for every bf16 and fp16 bit pattern and a million random float32 ones (NaNs, infinities and
    subnormals among them), with a scale of 1 and another."""
    if activation == torch.float32:
        gen = torch.Generator().manual_seed(5)
        bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    else:
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    head_dim, kv_heads = 64, 2
    key = bits.view(activation).view(-1, kv_heads, head_dim)
    rows = key.shape[0]
    scales = torch.tensor([1.0, 0.375])
    written = {}
    for isa in cpu_isas:
        ops._C.set_cpu_isa(isa)
        caches = [torch.zeros(rows // 16, kv_heads, 16, head_dim, dtype=fp8) for _ in range(2)]
        ops.reshape_and_cache(key, key.flip(0), *caches, torch.arange(rows), scales, scales.flip(0))
        written[isa] = [c.view(torch.uint8) for c in caches]
    assert "scalar" in written and len(written) > 1, written.keys()
    for isa, caches in written.items():
        assert all(torch.equal(a, b) for a, b in zip(caches, written["scalar"], strict=True)), isa


@pytestmark_isa
def test_cache_write_without_scales_is_scale_one(fp8):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(20, 3, 64, generator=gen) * 40
    value = torch.randn(20, 3, 64, generator=gen)
    slots = torch.arange(20) + 5
    got = [torch.zeros(4, 3, 8, 64, dtype=fp8) for _ in range(2)]
    want = [c.clone() for c in got]
    ops.reshape_and_cache(key, value, *got, slots)
    reference.reshape_and_cache(key, value, *want, slots, torch.ones(3), torch.ones(3))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_cache_write_skips_padding_and_keeps_other_slots(fp8):
    caches = [torch.full((2, 1, 8, 64), 3.0, dtype=fp8) for _ in range(2)]
    key = torch.ones(3, 1, 64)
    ops.reshape_and_cache(key, key, *caches, torch.tensor([1, -1, 9]))
    written = caches[0].float().view(16, 64)
    assert torch.all(written[[1, 9]] == 1.0) and torch.all(written[[0, 2, 8, 15]] == 3.0)


# --- attention -------------------------------------------------------------------------------


def fp8_case(lens, num_kv_heads, head_dim, block_size, fp8, gen):
    """paged_kv's random sequences, written into fp8 caches by the reference with random scales; every slot that
    belongs to no sequence holds the byte 0xff, NaN in both formats (e5m2's reads as NaN, e4m3's as -480), as
    paged_kv's own padding holds NaN: a kernel that reads V past a sequence's end shows it in its output."""
    kv = paged_kv(lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu", gen)
    k_scale, v_scale = random_scales(num_kv_heads, gen), random_scales(num_kv_heads, gen)
    key_cache, value_cache = fp8_cache_like(kv.key_cache, fp8), fp8_cache_like(kv.value_cache, fp8)
    # Written from the float32 caches' contents (scaled up to use the format's range), slot by slot.
    blocks, heads, bs, d = kv.key_cache.shape
    slots = torch.arange(blocks * bs)
    as_rows = [c.permute(0, 2, 1, 3).reshape(blocks * bs, heads, d).nan_to_num(0.0) * 3 for c in (kv.key_cache,
                                                                                                    kv.value_cache)]
    reference.reshape_and_cache(*as_rows, key_cache, value_cache, slots, k_scale, v_scale)
    for cache, padded in ((key_cache, kv.key_cache.isnan()), (value_cache, kv.value_cache.isnan())):
        assert padded.any(), "the case has padding"
        cache.view(torch.uint8)[padded] = 0xFF
    return kv, key_cache, value_cache, k_scale, v_scale


@pytestmark_isa
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
@pytest.mark.parametrize("heads", HEAD_CONFIGS[1:], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8), (80, 32)])
def test_decode_matches_reference(fp8, activation, heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    num_heads, num_kv_heads = heads
    lens = [1, 17, 64, 65, 200, 9]
    kv, k_cache, v_cache, k_scale, v_scale = fp8_case(lens, num_kv_heads, head_dim, block_size, fp8, gen)
    q = random_query(len(lens), num_heads, head_dim, activation, "cpu", gen)
    got = ops.paged_attention_decode(q, k_cache, v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5,
                                     k_scale=k_scale, v_scale=v_scale)
    with single_threaded():
        want = reference.paged_attention_decode(q, k_cache, v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5,
                                                k_scale=k_scale, v_scale=v_scale)
    assert rel_err(got, want) < tolerance(activation)


@pytestmark_isa
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
@with_variants
def test_prefill_and_chunks_match_reference(fp8, activation, variant):
    """Whole prompts, chunks behind cached context (prefix hits) and one-token rows, in one call."""
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    lens = [150, 33, 80, 1]
    q_lens = [150, 10, 47, 1]  # all of it, a chunk behind 23 cached tokens, one behind 33, a single token
    kv, k_cache, v_cache, k_scale, v_scale = fp8_case(lens, num_kv_heads, head_dim, 16, fp8, gen)
    q = random_query(sum(q_lens), num_heads, head_dim, activation, "cpu", gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k_cache, v_cache, kv.block_tables, kv.seq_lens, starts, 0.125)
    got = ops.paged_attention_prefill(*args, **variant, k_scale=k_scale, v_scale=v_scale)
    with single_threaded():
        want = reference.paged_attention_prefill(*args, **variant, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(got, want) < tolerance(activation)


@pytestmark_isa
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
def test_one_key_reads_back_each_value_exactly(fp8, activation):
    """A query over a single key returns that key's value: every byte of the format, widened and scaled,
    equals the reference's float32 value times the scale (rounded once to the activations), e5m2's infinities
    and NaNs included (e4m3's NaN reads as 480: fp8.h). Every table's conversions: in registers, through
    float32, and bf16's integer steps (BytesToBF16)."""
    codes = torch.arange(256, dtype=torch.uint8)
    tested = codes[(codes & 0x7F) != 0x7F] if fp8 == torch.float8_e4m3fn else codes
    head_dim = 64
    rows = -(-tested.numel() // head_dim)
    bytes_ = torch.zeros(rows * head_dim, dtype=torch.uint8)
    bytes_[: tested.numel()] = tested
    v_cache = bytes_.view(fp8).view(rows, 1, 1, head_dim).expand(rows, 1, 8, head_dim).contiguous()
    k_cache = torch.zeros_like(v_cache)
    v_scale = torch.tensor([0.375])
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    lens = torch.ones(rows, dtype=torch.int32)
    q = torch.randn(rows, 2, head_dim).to(activation)
    got = ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125, v_scale=v_scale)
    want = (v_cache[:, :, 0].float() * v_scale).to(activation).expand(rows, 2, head_dim)
    if fp8 == torch.float8_e5m2:
        assert not want.isfinite().all(), "the infinities and NaNs are in the case"
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def shared_prompt_case(fp8, gen):
    """fp8_case's caches for a request's three samples sharing a 128-key prompt (seq_groups: read once for all
    three, the tiles from 128 on each sample's own), a lone sequence across tiles and one of a single key."""
    lens = [130, 129, 200, 300, 1]
    kv, k_cache, v_cache, k_scale, v_scale = fp8_case(lens, 3, 64, 16, fp8, gen)
    tables = kv.block_tables.clone()
    tables[1:3, :8] = tables[0, :8]
    groups = torch.tensor([0, 0, 0, 1, 2], dtype=torch.int32)
    return kv.seq_lens, tables, groups, k_cache, v_cache, k_scale, v_scale


@pytestmark_isa
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
@with_variants
def test_decode_variants_and_shared_runs_match_reference(fp8, activation, variant):
    """Decode with a window or a soft cap, alone and with samples sharing their prompt's blocks."""
    gen = torch.Generator().manual_seed(19)
    lens, tables, groups, k_cache, v_cache, k_scale, v_scale = shared_prompt_case(fp8, gen)
    q = random_query(len(lens), 9, 64, activation, "cpu", gen)
    args = (q, k_cache, v_cache, tables, lens, 0.125)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    with single_threaded():
        want = reference.paged_attention_decode(*args, **variant, **scales)
    for seq_groups in (None, groups):
        got = ops.paged_attention_decode(*args, seq_groups=seq_groups, **variant, **scales)
        assert rel_err(got, want) < tolerance(activation), seq_groups


@pytestmark_isa
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
def test_prefill_with_key_limits_matches_reference(fp8, activation):
    """Prefill whose tokens see keys past their own position (key_limit), with and without a window."""
    gen = torch.Generator().manual_seed(23)
    lens, q_lens = [150, 80], [150, 47]
    kv, k_cache, v_cache, k_scale, v_scale = fp8_case(lens, 3, 64, 16, fp8, gen)
    q = random_query(sum(q_lens), 9, 64, activation, "cpu", gen)
    starts = torch.tensor([0, 150, 197], dtype=torch.int32)
    positions = torch.cat([torch.arange(n - q_n, n) for n, q_n in zip(lens, q_lens, strict=True)])
    ends = torch.cat([torch.full((q_n,), n - 1) for n, q_n in zip(lens, q_lens, strict=True)])
    limits = (positions + (torch.rand(len(positions), generator=gen) * (ends - positions + 1)).long()).int()
    args = (q, k_cache, v_cache, kv.block_tables, kv.seq_lens, starts, 0.125)
    for window in (0, 40):
        kwargs = dict(sliding_window=window, key_limit=limits, k_scale=k_scale, v_scale=v_scale)
        with single_threaded():
            want = reference.paged_attention_prefill(*args, **kwargs)
        assert rel_err(ops.paged_attention_prefill(*args, **kwargs), want) < tolerance(activation), window


# --- batch invariance within the fp8 path ------------------------------------------------------


def invariance_cache(fp8: torch.dtype, num_kv_heads: int, head_dim: int, gen: torch.Generator, blocks: int = 200):
    shape = (blocks, num_kv_heads, 16, head_dim)
    k = (torch.randn(shape, generator=gen) * 4).to(fp8)
    v = (torch.randn(shape, generator=gen) * 4).to(fp8)
    return k, v, random_scales(num_kv_heads, gen), random_scales(num_kv_heads, gen)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
def test_rows_do_not_depend_on_the_step(cpu_isas, fp8, activation):
    """A sequence's rows have the same bits from one whole prefill, from chunks behind its cached context,
    from decode, beside other sequences, from copied blocks, on 1 or 2 threads, on every kernel table."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 9, 3, 64
    k, v, k_scale, v_scale = invariance_cache(fp8, kv_heads, d, gen)
    seq_len = 150
    table = torch.randperm(200, generator=gen)[:10].int()
    moved = torch.randperm(200, generator=gen)[:10].int()
    k[moved.long()], v[moved.long()] = k[table.long()], v[table.long()]
    other = torch.randperm(200, generator=gen)[:12].int()
    q = (torch.randn(seq_len, heads, d, generator=gen)).to(activation)
    q_other = (torch.randn(170, heads, d, generator=gen)).to(activation)
    scales = {"k_scale": k_scale, "v_scale": v_scale}

    def prefill(pieces: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        query = torch.cat([(q_other if t is other else q)[s : s + n] for t, s, n in pieces])
        width = max(len(t) for t, _, _ in pieces)
        tables = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t, _, _ in pieces])
        lens = torch.tensor([s + n for _, s, n in pieces], dtype=torch.int32)
        starts = torch.tensor([0, *torch.tensor([n for _, _, n in pieces]).cumsum(0).tolist()], dtype=torch.int32)
        out = ops.paged_attention_prefill(query, k, v, tables, lens, starts, 0.125, **scales)
        return [out[starts[i] : starts[i + 1]] for i in range(len(pieces))]

    for isa in cpu_isas:
        ops._C.set_cpu_isa(isa)
        for threads in (1, 2):
            with torch_threads(threads):
                (whole,) = prefill([(table, 0, seq_len)])
                chunks = torch.cat([prefill([(table, s, n)])[0] for s, n in ((0, 37), (37, 63), (100, 1), (101, 49))])
                assert torch.equal(chunks, whole), (isa, threads, "chunks")
                beside = prefill([(other, 0, 170), (moved, 60, 90)])[1]
                assert torch.equal(beside, whole[60:]), (isa, threads, "beside another, copied blocks")
                for pos in (0, 63, 64, 149):
                    query = torch.stack([q[pos], q[10], q[pos]])
                    tables = torch.stack([table, other[:10], moved])
                    lens = torch.tensor([pos + 1, 120, pos + 1], dtype=torch.int32)
                    out = ops.paged_attention_decode(query, k, v, tables, lens, 0.125, **scales)
                    assert torch.equal(out[0], whole[pos]) and torch.equal(out[2], whole[pos]), (isa, pos)


def test_samples_sharing_blocks_decode_as_if_alone(fp8):
    """Decode's shared runs (seq_groups: the samples of one request read their prompt's blocks once) give
    each sample the bits it gets alone."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d = 9, 3, 64
    k, v, k_scale, v_scale = invariance_cache(fp8, kv_heads, d, gen)
    prompt = torch.randperm(200, generator=gen)[:24].int()
    own = torch.randperm(200, generator=gen)[:8].int()
    tables = torch.stack([torch.cat([prompt[:16], own[i : i + 1]]) for i in range(4)])
    lens = torch.tensor([16 * 16 + 3, 16 * 16 + 9, 16 * 16 + 1, 16 * 16 + 16], dtype=torch.int32)
    q = torch.randn(4, heads, d, generator=gen)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    together = ops.paged_attention_decode(q, k, v, tables, lens, 0.125, seq_groups=torch.zeros(4, dtype=torch.int32),
                                          **scales)
    for i in range(4):
        alone = ops.paged_attention_decode(q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], 0.125, **scales)
        assert torch.equal(together[i], alone[0]), i


def fp8_and_widened(shape, fp8, activation, gen):
    """Random fp8 K and V caches, and the same values in the activations' dtype (exact: every fp8 value is a
    float32, bf16 and fp16 value): ((k, v) in fp8, (k, v) widened)."""
    caches = [(torch.randn(shape, generator=gen) * 3).to(fp8) for _ in range(2)]
    return tuple(caches), tuple(c.to(activation) for c in caches)


def assert_same_bits(op, caches, widened, query, *args, **kwargs):
    got = op(query, *caches, *args, **kwargs)
    assert torch.equal(got, op(query, *widened, *args, **kwargs)), (op.__name__, query.shape, sorted(kwargs))


@pytestmark_isa
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
@with_variants
def test_fp8_gives_the_bits_of_the_same_values_in_the_activations_dtype(fp8, activation, variant):
    """Without scales an fp8 cache reads bit for bit as a cache of the activations' dtype holding the same
    values: the loops that convert fp8 in registers, and the paths that widen a tile first, sum in the order
    of the plain cache's loops. Decode alone and with samples sharing their prompt's blocks (seq_groups),
    prefill whole, in chunks behind a cached context and with key limits; row groups of 1, 3 and 4 rows."""
    gen = torch.Generator().manual_seed(17)
    head_dim, block_size, blocks = 64, 16, 64
    for heads, kv_heads in ((4, 4), (9, 3), (8, 1)):
        caches, widened = fp8_and_widened((blocks, kv_heads, block_size, head_dim), fp8, activation, gen)
        # Decode: the first three share a 128-key prompt.
        lens = torch.tensor([130, 129, 200, 1, 64, 65, 300], dtype=torch.int32)
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:20] for _ in range(len(lens))]).int()
        tables[1:3, :8] = tables[0, :8]
        q = torch.randn(len(lens), heads, head_dim, generator=gen).to(activation)
        groups = torch.tensor([0, 0, 0, 1, 2, 3, 4], dtype=torch.int32)
        for seq_groups in (None, groups):
            assert_same_bits(ops.paged_attention_decode, caches, widened, q, tables, lens, 0.125,
                             seq_groups=seq_groups, **variant)
        # Prefill: a whole prompt, chunks behind 23 and 100 cached keys, one token; then with key limits.
        lens, q_lens = [150, 33, 170, 9], [150, 10, 70, 1]
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:12] for _ in lens]).int()
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(activation)
        ends = torch.cat([torch.full((q_n,), n - 1) for n, q_n in zip(lens, q_lens, strict=True)]).int()
        for key_limit in (None, ends):
            assert_same_bits(ops.paged_attention_prefill, caches, widened, q, tables,
                             torch.tensor(lens, dtype=torch.int32), starts, 0.125, key_limit=key_limit, **variant)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=fmt_id)
def test_cuda_kernels_read_fp8_caches(fp8, activation):
    """On a card: decode and prefill (whole, behind a cached context, one token) over fp8 caches with per-head
    scales against the reference, fp16 and bf16 prefill on tensor cores; and without scales the bits of a
    cache of the activations' dtype holding the same values, as the emulated kernels give them
    (tests/test_cuda_emulated.py)."""
    gen = torch.Generator().manual_seed(21)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    lens, q_lens = [150, 33, 80, 1], [150, 10, 47, 1]
    kv, k_cache, v_cache, k_scale, v_scale = fp8_case(lens, num_kv_heads, head_dim, 16, fp8, gen)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    on_card = {name: t.cuda() for name, t in scales.items()}
    q = random_query(sum(q_lens), num_heads, head_dim, activation, "cpu", gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k_cache, v_cache, kv.block_tables, kv.seq_lens, starts)
    got = ops.paged_attention_prefill(*(t.cuda() for t in args), 0.125, **on_card)
    want = reference.paged_attention_prefill(*args, 0.125, **scales)
    assert rel_err(got.cpu(), want) < tolerance(activation, "cuda")
    last = q[starts[1:] - 1].contiguous()  # each sequence's last token, decoded
    args = (last, k_cache, v_cache, kv.block_tables, kv.seq_lens)
    got = ops.paged_attention_decode(*(t.cuda() for t in args), 0.125, **on_card)
    want = reference.paged_attention_decode(*args, 0.125, **scales)
    assert rel_err(got.cpu(), want) < tolerance(activation, "cuda")
    caches, widened = fp8_and_widened(k_cache.shape, fp8, activation, gen)
    caches, widened = tuple(c.cuda() for c in caches), tuple(c.cuda() for c in widened)
    tables, lens = kv.block_tables.cuda(), kv.seq_lens.cuda()
    assert_same_bits(ops.paged_attention_prefill, caches, widened, q.cuda(), tables, lens, starts.cuda(), 0.125)
    assert_same_bits(ops.paged_attention_decode, caches, widened, last.cuda(), tables, lens, 0.125)


# --- copies and swaps ----------------------------------------------------------------------------


def test_copy_blocks_and_swap_move_fp8_bytes(fp8):
    gen = torch.Generator().manual_seed(9)
    caches = [(torch.randn(12, 2, 16, 64, generator=gen) * 8).to(fp8) for _ in range(4)]
    want = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 5], [3, 7], [11, 2]])
    ops.copy_blocks(caches[:2], caches[2:], mapping)
    reference.copy_blocks(want[:2], want[2:], mapping)
    for g, w in zip(caches, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    host = ops.allocate_kv_cache(6, 2, 16, 64, fp8, "cpu")[0]
    ops.swap_blocks(caches[0], host, torch.tensor([[1, 0], [4, 5]]))
    back = torch.zeros_like(caches[0])
    ops.swap_blocks(host, back, torch.tensor([[0, 9], [5, 10]]))
    assert torch.equal(back[[9, 10]].view(torch.uint8), caches[0][[1, 4]].view(torch.uint8))


def test_allocated_fp8_cache_takes_one_byte_an_element(fp8):
    k, v = ops.allocate_kv_cache(4, 2, 16, 64, fp8, "cpu")
    assert k.dtype == fp8 and k.element_size() == 1 and torch.all(k.float() == 0)


# --- argument checks -----------------------------------------------------------------------------


def test_bad_arguments_are_named():
    k = torch.zeros(4, 2, 16, 64, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, 4, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale has 3 entries but the cache has 2 kv heads"):
        ops.paged_attention_decode(q, k, k, tables, lens, 0.1, k_scale=torch.ones(3))
    with pytest.raises(ValueError, match=r"v_scale\[1\] = -1 must be finite and > 0"):
        ops.paged_attention_decode(q, k, k, tables, lens, 0.1, v_scale=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="k_scale applies to fp8 caches only"):
        plain = torch.zeros(4, 2, 16, 64)
        ops.paged_attention_decode(q, plain, plain, tables, lens, 0.1, k_scale=torch.ones(2))
    with pytest.raises(ValueError, match="query has dtype"):
        ops.paged_attention_decode(q.to(torch.float8_e4m3fn), k, k, tables, lens, 0.1)
    with pytest.raises(ValueError, match="out has dtype"):
        ops.paged_attention_decode(q, k, k, tables, lens, 0.1, out=torch.zeros(1, 4, 64, dtype=torch.bfloat16))


def test_checkpoint_scales_spread_over_heads():
    scales = fp8_kv_scales(3, torch.device("cpu"), {"k_scale": torch.tensor(0.25)})
    assert scales.k.tolist() == [0.25] * 3 and scales.v.tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="v_scale must hold 1 or 3"):
        fp8_kv_scales(3, torch.device("cpu"), {"v_scale": torch.ones(2)})


# --- the engine ----------------------------------------------------------------------------------


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of generated tokens up to and including each sequence's first difference that agree: a
    sequence counts its tokens before it diverges (after that its context differs)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        first = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        same, total = same + first, total + len(x)
    return same / total


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "fp8"])
def test_engine_greedy_output_mostly_agrees_with_auto(tiny_model_dirs, kv_cache_dtype):
    model = tiny_model_dirs["llama"]
    prompts = tiny_prompts(400)
    want = greedy(LLM(model, dtype="float32", kv_cache_memory="32MiB"), prompts)
    llm = LLM(model, dtype="float32", kv_cache_memory="32MiB", kv_cache_dtype=kv_cache_dtype)
    assert llm.llm_engine.runner.device_caches[0][0].dtype in ops.FP8_CACHE_DTYPES
    got = greedy(llm, prompts)
    share = agreement(got, want)
    # Measured on this tiny random model against float32 with its own cache: e4m3 0.45, e5m2 0.32 of the tokens
    # before a first difference, where a bf16 model gives 0.70 and fp16 0.91 (random weights make flat logits,
    # which a small change flips; SmolLM2's numbers are in docs/kv-cache.md).
    assert share >= 0.25, share


def test_fp8_holds_twice_the_blocks_in_the_same_memory(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    blocks = {name: LLM(model, dtype="bfloat16", kv_cache_memory="8MiB", swap_space="2MiB",
                        kv_cache_dtype=name).llm_engine.scheduler.config for name in ("auto", "fp8_e4m3")}
    assert blocks["fp8_e4m3"].num_device_blocks == 2 * blocks["auto"].num_device_blocks
    assert blocks["fp8_e4m3"].num_cpu_blocks == 2 * blocks["auto"].num_cpu_blocks


def test_auto_leaves_the_cache_in_the_model_dtype(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="bfloat16", kv_cache_memory="8MiB", kv_cache_dtype="auto")
    assert llm.llm_engine.runner.device_caches[0][0].dtype == torch.bfloat16
    assert all(layer.kv_scales is None for layer in llm.llm_engine.runner.model.attention_layers())


def test_unknown_kv_cache_dtype_is_refused(tiny_model_dirs):
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be auto, fp8, fp8_e4m3 or fp8_e5m2"):
        LLM(tiny_model_dirs["llama"], kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_engine_fp8_outputs_do_not_depend_on_how_the_engine_runs_them(tiny_model_dirs, kv_cache_dtype):
    """Seeded samples with an fp8 cache: the same tokens and logprobs with and without the prefix cache,
    any max_num_seqs, chunked prefill, swapped or recomputed after preemption, on one thread, in another
    order (test_reproducibility's variants)."""
    prompts = tiny_prompts(400)
    base = {"kv_cache_memory": "32MiB", "swap_space": "8MiB", "kv_cache_dtype": kv_cache_dtype}
    check_variants(tiny_model_dirs["llama"], "float32", prompts, seeded(len(prompts)), TINY_BLOCK, base, VARIANTS)
