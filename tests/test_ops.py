"""batchgen.ops kernels against the pure-torch reference (batchgen.ops.reference).

Cases use shuffled block tables, ragged lengths (1, exact block boundaries, ends mid-block) and
caches whose unused slots hold NaN, so a kernel reading past a sequence's end fails loudly.
Attention outputs are compared by rel_err = max|kernel - reference| / max|reference|, which must
stay below 1e-5 in float32 and 1e-2 in bfloat16/float16. On CPU every case runs on each
instruction set the processor supports (scalar, avx2, avx512, avx512_bf16). The axes are
sampled: the cheap ones (dtype, head_dim, block_size) as a full cross product, head layouts
rotating through it.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import (
    DEVICES,
    DTYPES,
    HEAD_CONFIGS,
    paged_kv,
    random_query,
    rel_err,
    single_threaded,
    tolerance,
    torch_threads,
    use_isa,
)

from batchgen import _C, ops
from batchgen.ops import reference

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAD_DIMS = ops.SUPPORTED_HEAD_DIMS
BLOCK_SIZES = ops.SUPPORTED_BLOCK_SIZES


def crossed_with_heads():
    """dtype x head_dim x block_size, each combined with one head layout, in rotation."""
    cases = itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES)
    return [(*case, HEAD_CONFIGS[i % len(HEAD_CONFIGS)]) for i, case in enumerate(cases)]


def case_id(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return "h{}kv{}".format(*value)
    return None


def check_on_isas(isas, run, expected, dtype, what=""):
    for isa in isas:
        use_isa(isa)
        got = run()
        err = rel_err(got, expected)
        assert err < tolerance(dtype, got.device), f"{what} isa={isa}: rel_err {err:.3g}"


def ragged_lengths(block_size):
    return [1, block_size, 2 * block_size, block_size + 3, 2 * block_size - 1, 5 * block_size + 7]


# --- decode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim,block_size,heads", crossed_with_heads(), ids=case_id)
def test_decode_matches_reference(device, isas, dtype, head_dim, block_size, heads):
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads = heads
    lens = ragged_lengths(block_size)
    kv = paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device, gen)
    query = random_query(len(lens), num_heads, head_dim, dtype, device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    with single_threaded():
        expected = reference.paged_attention_decode(*args)
    check_on_isas(isas, lambda: ops.paged_attention_decode(*args), expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=case_id)
def test_decode_long_contexts(device, isas, dtype, heads):
    """Few sequences with long contexts (many tiles in one walk) and a large scale (peaked softmax, so
    the running max moves)."""
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads = heads
    lens = [1500, 700, 1]
    kv = paged_kv(lens, num_kv_heads, 128, 16, dtype, device, gen)
    query = random_query(len(lens), num_heads, 128, dtype, device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.5)
    with single_threaded():
        expected = reference.paged_attention_decode(*args)
    with torch_threads(max(2, torch.get_num_threads())):
        check_on_isas(isas, lambda: ops.paged_attention_decode(*args), expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=case_id)
def test_decode_many_sequences(device, isas, dtype, heads):
    """Sequences enough for several per thread: the CPU kernel then gives each task all the kv
    heads of a sequence and walks its blocks through every head."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads = heads
    lens = [1 + (37 * i) % 300 for i in range(24)]
    kv = paged_kv(lens, num_kv_heads, 64, 16, dtype, device, gen)
    query = random_query(len(lens), num_heads, 64, dtype, device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    with single_threaded():
        expected = reference.paged_attention_decode(*args)
    for threads in (1, 2):
        with torch_threads(threads):
            check_on_isas(isas, lambda: ops.paged_attention_decode(*args), expected, dtype, f"threads={threads}")


# Runs of samples side by side (group id, members, blocks the members take from the run's first
# member's table, lengths in blocks + extra tokens): a long shared prompt with its last block
# private (8 samples), one sample diverging after 2 of the others' 6 shared blocks, a share too
# short to pay (read by each), a lone sample, and a group id seen again further on (its own run).
SHARED_RUNS = [
    (0, 8, 9, [(9, 1 + 3 * j) for j in range(8)]),
    (1, 4, 6, [(6, 5), (6, 1), (2, 20), (7, 0)]),
    (2, 2, 1, [(1, 4), (1, 9)]),
    (3, 1, 0, [(4, 2)]),
    (0, 2, 5, [(5, 1), (8, 3)]),
]
# Runs enough for a task per run over all kv heads (few runs get one task per kv head).
MANY_SHARED_RUNS = [(g, 3, 8, [(8, 1 + g), (8, 7), (9, 2 * g)]) for g in range(10)]
# One run: on 2 threads its members are cut into parts, each reading the shared blocks.
ONE_SHARED_RUN = [(0, 8, 6, [(6 + j % 3, 1 + 5 * j) for j in range(8)])]


def shared_prefix_case(runs, block_size, num_heads, num_kv_heads, head_dim, dtype, device, gen):
    """Decode batch whose runs read the first blocks of their first member's table (see
    SHARED_RUNS), and its seq_groups."""
    lens, groups, shares = [], [], []
    for group, count, shared, members in runs:
        assert len(members) == count
        for j, (blocks, extra) in enumerate(members):
            lens.append(blocks * block_size + extra)
            groups.append(group)
            shares.append(min(shared, blocks) if j else 0)
    kv = paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device, gen)
    tables = kv.block_tables.clone()
    first = 0
    for _, count, _, _ in runs:
        for j in range(first + 1, first + count):
            tables[j, : shares[j]] = tables[first, : shares[j]]
        first += count
    query = random_query(len(lens), num_heads, head_dim, dtype, device, gen)
    args = (query, kv.key_cache, kv.value_cache, tables, kv.seq_lens, head_dim**-0.5)
    return args, torch.tensor(groups, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("runs", [SHARED_RUNS, MANY_SHARED_RUNS, ONE_SHARED_RUN], ids=["few_runs", "many_runs",
                                                                                   "one_run"])
@pytest.mark.parametrize("dtype,head_dim,block_size,heads", crossed_with_heads(), ids=case_id)
def test_decode_of_samples_sharing_blocks_matches_reference(device, isas, runs, dtype, head_dim, block_size, heads):
    """With seq_groups the CPU kernel reads a run's shared blocks once for all its samples (or for
    parts of them), then each sample's own blocks; the result must not change (beyond rounding)."""
    gen = torch.Generator().manual_seed(4)
    args, groups = shared_prefix_case(runs, block_size, *heads, head_dim, dtype, device, gen)
    with single_threaded():
        expected = reference.paged_attention_decode(*args)
    for threads in (1, 2):
        with torch_threads(threads):
            check_on_isas(isas, lambda: ops.paged_attention_decode(*args, seq_groups=groups), expected, dtype,
                          f"threads={threads}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_strided_query_and_out(device, isas):
    """query and out may be views with any token and head strides (unit stride in head_dim)."""
    gen = torch.Generator().manual_seed(2)
    kv = paged_kv([5, 40, 17], 2, 64, 16, torch.float32, device, gen)
    wide = random_query(3, 11, 64, torch.float32, device, gen)
    query = wide[:, 1:9]  # token stride 11 * 64
    with single_threaded():
        expected = reference.paged_attention_decode(
            query.contiguous(), kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125
        )
    out_storage = torch.zeros(8, 3, 64, device=device)

    def run():
        out = out_storage.transpose(0, 1)  # token stride 64, head stride 3 * 64
        ops.paged_attention_decode(
            query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125, out=out
        )
        return out

    check_on_isas(isas, run, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=case_id)
def test_decode_returns_values_exactly_under_uniform_attention(device, isas, dtype):
    """All keys zero and every token of a sequence holding the same value row: the output is that
    row, bit for bit, including tiny (fp16 subnormal) and huge values - a check of the 16-bit
    conversions on load and store."""
    if dtype == torch.float16:
        row = [0.0, -1.5, 3.0e-6, -6.0e-8, 6.0e4, -6.5e4, 1.0 / 3.0, 2.0e-5]
    else:
        row = [0.0, -1.5, 1.0e-30, -3.0e-35, 1.0e36, -2.0e35, 1.0 / 3.0, 7.0e-3]
    values = torch.tensor(row * 8, dtype=dtype)  # head_dim 64
    lens = [1, 19, 37]
    gen = torch.Generator().manual_seed(3)
    kv = paged_kv(lens, 1, 64, 8, dtype, "cpu", gen)
    for i, n in enumerate(lens):
        for b in range(math.ceil(n / 8)):
            block = kv.block_tables[i, b]
            kv.key_cache[block] = 0
            kv.value_cache[block] = values.roll(i)
    query = random_query(len(lens), 2, 64, dtype, device, gen)
    caches = (kv.key_cache.to(device), kv.value_cache.to(device))
    tables, seq_lens = kv.block_tables.to(device), kv.seq_lens.to(device)
    for isa in isas:
        use_isa(isa)
        out = ops.paged_attention_decode(query, *caches, tables, seq_lens, 0.125)
        for i in range(len(lens)):
            expected = values.roll(i).to(device).expand(2, 64)
            assert torch.equal(out[i], expected), f"isa={isa} sequence {i}"


# --- prefill ------------------------------------------------------------------------------------


def prefill_batch(block_size, num_heads, num_kv_heads, head_dim, dtype, device, gen, seqs=None):
    """A flat batch of (context, q_len) sequences: plain prefills, chunks after a cached context
    (at and off block boundaries), a decode-like single token."""
    if seqs is None:
        bs = block_size
        seqs = [(0, 1), (0, bs), (0, 2 * bs + 3), (bs, 5), (3, 2 * bs), (2 * bs - 1, 1), (bs + 1, bs - 1)]
    lens = [context + q_len for context, q_len in seqs]
    kv = paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device, gen)
    starts = torch.tensor([0] + list(itertools.accumulate(q for _, q in seqs)), dtype=torch.int32)
    query = random_query(int(starts[-1]), num_heads, head_dim, dtype, device, gen)
    return query, kv, starts.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim,block_size,heads", crossed_with_heads(), ids=case_id)
def test_prefill_matches_reference(device, isas, dtype, head_dim, block_size, heads):
    gen = torch.Generator().manual_seed(4)
    query, kv, starts = prefill_batch(block_size, *heads, head_dim, dtype, device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts, head_dim**-0.5)
    with single_threaded():
        expected = reference.paged_attention_prefill(*args)
    check_on_isas(isas, lambda: ops.paged_attention_prefill(*args), expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=case_id)
def test_prefill_long_chunks(device, isas, heads):
    """Long chunks after long contexts: many query tiles per sequence on the CPU."""
    gen = torch.Generator().manual_seed(5)
    seqs = [(300, 130), (0, 250), (77, 64)]
    query, kv, starts = prefill_batch(16, *heads, 64, torch.bfloat16, device, gen, seqs)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts, 0.3)
    with single_threaded():
        expected = reference.paged_attention_prefill(*args)
    check_on_isas(isas, lambda: ops.paged_attention_prefill(*args), expected, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=case_id)
def test_prefill_of_single_tokens_equals_decode(device, isas, dtype, heads):
    gen = torch.Generator().manual_seed(6)
    lens = ragged_lengths(16)
    kv = paged_kv(lens, heads[1], 96, 16, dtype, device, gen)
    query = random_query(len(lens), heads[0], 96, dtype, device, gen)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    tables = (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    for isa in isas:
        use_isa(isa)
        decode = ops.paged_attention_decode(query, *tables, 0.1)
        prefill = ops.paged_attention_prefill(query, *tables, starts, 0.1)
        assert rel_err(prefill, decode) < tolerance(dtype, device), f"isa={isa}"
        if device == "cpu":  # the CPU kernels walk a row the same way in both (batch invariance)
            assert torch.equal(prefill, decode), f"isa={isa}"


# --- cache operations ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim,block_size,heads", crossed_with_heads(), ids=case_id)
def test_reshape_and_cache_matches_reference(device, dtype, head_dim, block_size, heads):
    gen = torch.Generator().manual_seed(7)
    num_kv_heads = heads[1]
    num_blocks, num_tokens = 6, 4 * block_size
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    # key and value as slices of a fused projection: token stride larger than a token.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    slots = slots.to(device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim,block_size,heads", crossed_with_heads(), ids=case_id)
def test_copy_blocks_matches_reference(device, dtype, head_dim, block_size, heads):
    gen = torch.Generator().manual_seed(8)
    shape = (10, heads[1], block_size, head_dim)
    layers = [[torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2)] for _ in range(3)]
    mapping = torch.tensor([[0, 5], [3, 9], [3, 1], [7, 2]], dtype=torch.int64, device=device)
    expected = [[cache.clone() for cache in layer] for layer in layers]
    reference.copy_blocks([k for k, _ in expected], [v for _, v in expected], mapping)
    ops.copy_blocks([k for k, _ in layers], [v for _, v in layers], mapping)
    for got, want in zip(itertools.chain(*layers), itertools.chain(*expected), strict=True):
        assert torch.equal(got, want)


SWAP_DEVICES = [
    ("cpu", "cpu"),
    *[
        pytest.param(src, dst, marks=DEVICES[1].marks, id=f"{src}-{dst}")
        for src, dst in [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda")]
    ],
]


@pytest.mark.parametrize("src_device,dst_device", SWAP_DEVICES)
@pytest.mark.parametrize("dtype,head_dim,block_size,heads", crossed_with_heads(), ids=case_id)
def test_swap_blocks_matches_reference(src_device, dst_device, dtype, head_dim, block_size, heads):
    gen = torch.Generator().manual_seed(9)
    src = torch.randn(6, heads[1], block_size, head_dim, generator=gen).to(dtype).to(src_device)
    dst = torch.randn(9, heads[1], block_size, head_dim, generator=gen).to(dtype).to(dst_device)
    # Out of order, with a run of 3 blocks consecutive on both sides (copied at once on CUDA).
    mapping = torch.tensor([[0, 8], [5, 0], [3, 4], [2, 3], [4, 5], [1, 1]], dtype=torch.int64)
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    if dst.is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(dst, expected)


def test_allocate_kv_cache():
    key_cache, value_cache = ops.allocate_kv_cache(7, 3, 16, 64, torch.bfloat16, "cpu", pin_memory=True)
    assert key_cache.shape == value_cache.shape == (7, 3, 16, 64)
    assert key_cache.dtype == torch.bfloat16 and not key_cache.any()
    assert key_cache.data_ptr() != value_cache.data_ptr()
    assert key_cache.is_contiguous() and key_cache.data_ptr() % (2 << 20) == 0  # tiles never straddle pages
    for bad in [{"head_dim": 48}, {"block_size": 12}, {"dtype": torch.int8}, {"num_blocks": 0}]:
        args = {"num_blocks": 4, "num_kv_heads": 1, "block_size": 8, "head_dim": 64, "dtype": torch.float32}
        with pytest.raises(ValueError, match=next(iter(bad))):
            ops.allocate_kv_cache(**(args | bad), device="cpu")


def _huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="transparent huge pages are off or absent")
def test_host_kv_cache_lies_on_huge_pages():
    key_cache, value_cache = ops.allocate_kv_cache(1024, 2, 16, 64, torch.bfloat16, "cpu")  # 4 MiB each
    for cache in (key_cache, value_cache):
        assert cache.data_ptr() % (2 << 20) == 0 and not cache.any()
        cache.fill_(1)  # pages come as they are first written
        assert _huge_page_kib(cache.data_ptr()) >= 2048


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings")
def test_host_kv_cache_without_prefault_takes_memory_as_written():
    import psutil

    def rss_mib() -> float:
        return psutil.Process().memory_info().rss / 2**20

    before = rss_mib()
    lazy = ops.allocate_kv_cache(2048, 4, 16, 128, torch.bfloat16, "cpu", prefault=False)  # 2 x 32 MiB
    grown = rss_mib() - before
    assert grown < 8, f"an untouched cache took {grown:.0f} MiB"
    lazy[0][:1024].fill_(1)  # 16 MiB written
    assert rss_mib() - before >= 12
    assert not lazy[1].any() and lazy[0][1024:].eq(0).all()
    before = rss_mib()
    eager = ops.allocate_kv_cache(2048, 4, 16, 128, torch.bfloat16, "cpu", prefault=True)
    assert rss_mib() - before >= 56 and not eager[0].any()


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="transparent huge pages are off or absent")
def test_weights_move_onto_huge_pages_side_by_side_freeing_each_original():
    import types
    import weakref

    tensors = [torch.randn(1000, 700), torch.arange(11, dtype=torch.int32), torch.randn(3, 5).bfloat16(),
               torch.randn(900, 800).bfloat16()]
    owners = [types.SimpleNamespace(weight=t.clone()) for t in tensors]
    originals = [weakref.ref(owner.weight) for owner in owners]
    ops.move_onto_huge_pages([(owner, "weight") for owner in owners])
    copies = [owner.weight for owner in owners]
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and torch.equal(copy, tensor) and copy.data_ptr() % 64 == 0
    assert all(ref() is None for ref in originals), "the move kept an original alive"
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    assert copies[0].data_ptr() % (2 << 20) == 0 and _huge_page_kib(copies[0].data_ptr()) >= 2048
    ops.move_onto_huge_pages([])


# --- argument errors ----------------------------------------------------------------------------


def decode_args(device):
    gen = torch.Generator().manual_seed(10)
    kv = paged_kv([5, 20], 2, 64, 8, torch.bfloat16, device, gen)
    query = random_query(2, 4, 64, torch.bfloat16, device, gen)
    return {
        "query": query,
        "key_cache": kv.key_cache,
        "value_cache": kv.value_cache,
        "block_tables": kv.block_tables,
        "seq_lens": kv.seq_lens,
        "scale": 0.125,
    }


def both_caches(args, edit):
    return {name: edit(args[name]).contiguous() for name in ("key_cache", "value_cache")}


def with_entry(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


# (what is wrong, argument changes, message pattern); each case changes one argument.
DECODE_ERRORS = [
    ("query dtype", lambda a: {"query": a["query"].float()}, "query has dtype"),
    ("query head_dim", lambda a: {"query": a["query"][..., :32]}, "head_dim"),
    ("query rank", lambda a: {"query": a["query"][0]}, "query must be 3-D"),
    ("num_heads", lambda a: {"query": a["query"][:, :3]}, "num_heads"),
    ("query strided head_dim", lambda a: {"query": torch.zeros(2, 4, 128).bfloat16()[..., ::2]}, "query must be"),
    ("cache dtype", lambda a: {"value_cache": a["value_cache"].half()}, "value_cache has dtype"),
    ("cache shape", lambda a: {"value_cache": a["value_cache"][:-1]}, "value_cache has shape"),
    ("cache layout", lambda a: {"key_cache": a["key_cache"].transpose(1, 2)}, "key_cache must be contiguous"),
    ("head_dim", lambda a: both_caches(a, lambda c: c[..., :32]), "head_dim"),
    ("block_size", lambda a: both_caches(a, lambda c: c[:, :, :4]), "block_size"),
    ("tables dtype", lambda a: {"block_tables": a["block_tables"].long()}, "block_tables must be Int"),
    ("tables rows", lambda a: {"block_tables": a["block_tables"][:1]}, "block_tables has 1 rows"),
    ("lens count", lambda a: {"seq_lens": a["seq_lens"][:1]}, "seq_lens"),
    ("device", lambda a: {"seq_lens": a["seq_lens"].to("meta")}, "seq_lens is on meta"),
    ("scale", lambda a: {"scale": float("nan")}, "scale"),
    ("groups dtype", lambda a: {"seq_groups": a["seq_lens"].long()}, "seq_groups must be Int"),
    ("groups count", lambda a: {"seq_groups": a["seq_lens"][:1]}, "seq_groups has 1 entries"),
    ("groups device", lambda a: {"seq_groups": a["seq_lens"].to("meta")}, "seq_groups is on meta"),
]

# Values read through pointers: checked by the CPU implementation (the CUDA one cannot look
# at device memory without a synchronisation).
DECODE_VALUE_ERRORS = [
    ("block id too large", lambda a: {"block_tables": with_entry(a["block_tables"], (1, 2), 10**6)},
     r"block_tables\[1, 2\] = 1000000"),
    ("negative block id", lambda a: {"block_tables": with_entry(a["block_tables"], (0, 0), -1)},
     r"block_tables\[0, 0\] = -1"),
    ("empty sequence", lambda a: {"seq_lens": with_entry(a["seq_lens"], 0, 0)}, r"seq_lens\[0\] = 0"),
    ("sequence past its table", lambda a: {"seq_lens": with_entry(a["seq_lens"], 1, 10**4)}, r"seq_lens\[1\]"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,pattern", [c[1:] for c in DECODE_ERRORS], ids=[c[0] for c in DECODE_ERRORS])
def test_decode_rejects_bad_arguments(device, change, pattern):
    args = decode_args(device)
    with pytest.raises(ValueError, match=pattern):
        ops.paged_attention_decode(**(args | change(args)))


@pytest.mark.parametrize(
    "change,pattern", [c[1:] for c in DECODE_VALUE_ERRORS], ids=[c[0] for c in DECODE_VALUE_ERRORS]
)
def test_decode_rejects_bad_values(change, pattern):
    args = decode_args("cpu")
    with pytest.raises(ValueError, match=pattern):
        ops.paged_attention_decode(**(args | change(args)))


def test_table_entries_past_the_end_are_not_read():
    args = decode_args("cpu")
    expected = ops.paged_attention_decode(**args)
    tables = args["block_tables"].clone()
    tables[0, 1:] = 10**6  # sequence 0 has 5 tokens: only its first block is used
    assert torch.equal(ops.paged_attention_decode(**(args | {"block_tables": tables})), expected)


@pytest.mark.parametrize("whole_blocks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [3, 40])  # under and over the count at which a task takes all kv heads
def test_read_decode_blocks_reads_exactly_the_blocks_decode_reads(num_seqs, threads, block_size, dtype, whole_blocks):
    """The benchmark's yardstick returns the sum of the 64-bit words of every (block, kv head) of K and V a
    sequence's keys lie in, once each, and of nothing else: blocks past a sequence's length hold words that would
    show."""
    kv_heads, head_dim, max_blocks = 3, 64, 6
    gen = torch.Generator().manual_seed(num_seqs * block_size)
    lens = torch.randint(1, max_blocks * block_size + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    num_blocks = num_seqs * max_blocks
    tables = torch.randperm(num_blocks, generator=gen).int().view(num_seqs, max_blocks)
    k, v = ops.allocate_kv_cache(num_blocks, kv_heads, block_size, head_dim, dtype, "cpu")
    words_k, words_v = k.view(torch.int64), v.view(torch.int64)
    words_k.copy_(torch.randint(0, 1000, words_k.shape, generator=gen))
    words_v.copy_(torch.randint(0, 1000, words_v.shape, generator=gen))
    read = [tables[s, : (int(lens[s]) + block_size - 1) // block_size] for s in range(num_seqs)]
    expected = sum(int(words_k[r.long()].sum() + words_v[r.long()].sum()) for r in read)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert ops.read_decode_blocks(k, v, tables, lens, whole_blocks=whole_blocks) == expected
    finally:
        torch.set_num_threads(previous)


def test_read_decode_blocks_rejects_bad_tables():
    args = decode_args("cpu")
    tables = args["block_tables"].clone()
    tables[0, 0] = 10**6
    with pytest.raises(ValueError, match=r"read_decode_blocks: block_tables\[0, 0\] = 1000000 is not a block"):
        ops.read_decode_blocks(args["key_cache"], args["value_cache"], tables, args["seq_lens"])
    with pytest.raises(ValueError, match="read_decode_blocks: block_tables has 2 rows but seq_lens has 1"):
        ops.read_decode_blocks(args["key_cache"], args["value_cache"], args["block_tables"], args["seq_lens"][:1])


def test_decode_out_must_match_query():
    args = decode_args("cpu")
    with pytest.raises(ValueError, match="out has shape"):
        ops.paged_attention_decode(**args, out=torch.empty(2, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out has dtype"):
        ops.paged_attention_decode(**args, out=torch.empty(2, 4, 64))


@pytest.mark.parametrize(
    "starts,lens,pattern",
    [
        ([0, 2], [6, 20], "query_start_loc has 2 entries"),
        ([0, 2, 3], [6, 20], "end at the number of query tokens"),
        ([0, 3, 4], [2, 20], "sequence 0 has 3 query tokens"),
        ([0, 5, 4], [6, 20], "sequence 1 has -1 query tokens"),
    ],
)
def test_prefill_rejects_bad_query_start_loc(starts, lens, pattern):
    args = decode_args("cpu")
    args["query"] = args["query"].repeat(2, 1, 1)  # 4 tokens
    args["seq_lens"] = torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=pattern):
        ops.paged_attention_prefill(query_start_loc=torch.tensor(starts, dtype=torch.int32), **args)


def cache_args():
    gen = torch.Generator().manual_seed(11)
    key_cache = torch.zeros(4, 2, 8, 64)
    return {
        "key": torch.randn(3, 2, 64, generator=gen),
        "value": torch.randn(3, 2, 64, generator=gen),
        "key_cache": key_cache,
        "value_cache": torch.zeros_like(key_cache),
        "slot_mapping": torch.tensor([0, 31, -1]),
    }


@pytest.mark.parametrize(
    "change,pattern",
    [
        ({"slot_mapping": torch.tensor([0, 32, -1])}, r"slot_mapping\[1\] = 32"),
        ({"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int32)}, "slot_mapping must be Long"),
        ({"slot_mapping": torch.tensor([0, 1])}, "slot_mapping has 2 entries"),
        ({"key": torch.zeros(3, 2, 64, dtype=torch.bfloat16)}, "key has dtype"),
        ({"value": torch.zeros(3, 1, 64)}, "value has shape"),
        ({"value": torch.zeros(2, 2, 64)}, "value has shape"),
    ],
)
def test_reshape_and_cache_rejects_bad_arguments(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        ops.reshape_and_cache(**(cache_args() | change))


def test_copy_and_swap_reject_bad_block_mappings():
    cache = torch.zeros(4, 2, 8, 64)
    with pytest.raises(ValueError, match=r"block_mapping\[1, 1\] = 4"):
        ops.copy_blocks([cache], [cache.clone()], torch.tensor([[0, 1], [2, 4]]))
    with pytest.raises(ValueError, match="block_mapping must have shape"):
        ops.copy_blocks([cache], [cache.clone()], torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="1 key caches but 2 value caches"):
        ops.copy_blocks([cache], [cache, cache], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"block_mapping\[0, 0\] = -1"):
        ops.swap_blocks(cache, torch.zeros(9, 2, 8, 64), torch.tensor([[-1, 1]]))
    with pytest.raises(ValueError, match=r"block_mapping\[0, 1\] = 4"):
        ops.swap_blocks(torch.zeros(9, 2, 8, 64), cache, torch.tensor([[8, 4]]))
    with pytest.raises(ValueError, match="dst blocks have shape"):
        ops.swap_blocks(cache, torch.zeros(4, 2, 16, 64), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="dst has dtype"):
        ops.swap_blocks(cache, cache.half(), torch.tensor([[0, 1]]))


# --- instruction set selection ------------------------------------------------------------------


def test_set_cpu_isa_rejects_unknown_names():
    with pytest.raises(ValueError, match="not supported"):
        _C.set_cpu_isa("avx9000")
    assert "scalar" in _C.supported_cpu_isas()


def test_the_bf16_tables_are_offered_exactly_where_the_processor_has_their_instructions():
    """avx512_bf16 (and the AMX tables above it) need AVX512-BF16 and AVX512-VBMI, whose byte lookups convert fp8
    caches: offered wherever Linux lists both (every Zen 4 on and Sapphire Rapids on), not on a Cooper Lake."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    if not avx512:
        pytest.skip("no AVX-512 here")
    assert "avx512" in _C.supported_cpu_isas()
    assert ("avx512_bf16" in _C.supported_cpu_isas()) == ({"avx512_bf16", "avx512vbmi"} <= flags)


@pytest.mark.parametrize("isa,expect", [("scalar", "scalar"), ("avx9000", "ValueError")])
def test_isa_from_environment(isa, expect):
    code = (
        "from batchgen.ops import _C\n"
        "try:\n    print(_C.cpu_isa())\n"
        "except ValueError as e:\n    print('ValueError', e)\n"
    )
    env = os.environ | {"BATCHGEN_CPU_ISA": isa}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith(expect), result.stdout + result.stderr
