"""Sliding-window and soft-capped paged attention (Mistral's and Gemma 2's variants).

The reference (batchgen.ops.reference) is checked against an independent dense computation, its
mask taken from transformers' own mask functions (`sliding_window_causal_mask_function`) and the
attention from torch's `scaled_dot_product_attention`, or written out in float64 for the soft cap.
The kernels are then checked against the reference on every CPU instruction set (and on CUDA where
there is one), with block sizes 8/16/32, MHA/GQA/MQA, windows smaller than, equal to and larger than
the sequences and not aligned to blocks, prefill chunks behind a cached context across the window's
edge, and non-default scales. Blocks wholly outside every window hold NaN, so a kernel that reads
them (rather than skip them) fails. With seq_groups the CPU decode must stay bit-identical.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from kernel_cases import (
    DEVICES,
    paged_kv,
    random_query,
    rel_err,
    single_threaded,
    tolerance,
    torch_threads,
    use_isa,
)

from batchgen import ops
from batchgen.ops import reference

# --- the reference against a dense computation --------------------------------------------------


def dense_attention(query, keys, values, positions, scale, window, cap):
    """float64 attention of query [n, H, D] at `positions` over one sequence's keys/values [L, KVH, D]."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    mask_fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    q_idx = torch.tensor(positions)[:, None]
    kv_idx = torch.arange(keys.shape[0])[None, :]
    mask = mask_fn(0, 0, q_idx, kv_idx)  # [n, L], True where the query attends
    q = query.double().transpose(0, 1)  # [H, n, D]
    k, v = keys.double().transpose(0, 1), values.double().transpose(0, 1)
    if not cap:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = cap * torch.tanh(q @ k.transpose(1, 2) * scale / cap)
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1)


# (context, q_len) per sequence: plain prefills, chunks behind a cached context crossing the window's
# edge (on and off block boundaries), single tokens (decode).
PREFILL_SEQS = [(0, 1), (0, 37), (20, 30), (45, 19), (64, 1), (3, 70), (130, 2)]


@pytest.mark.parametrize("window", [0, 1, 7, 16, 37, 48, 200], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("cap", [0.0, 2.5], ids=lambda c: f"cap{c}")
def test_reference_matches_dense_attention(window, cap):
    """The reference's mask is transformers' (`kv_idx > q_idx - sliding_window`, causal) and its soft
    cap `cap * tanh(s / cap)`; windows shorter than, equal to (48 = the longest) and longer than the
    sequences."""
    gen = torch.Generator().manual_seed(10)
    lens = [c + n for c, n in PREFILL_SEQS]
    kv_heads, heads, head_dim, block_size = 2, 8, 64, 16
    kv = paged_kv(lens, kv_heads, head_dim, block_size, torch.float32, "cpu", gen)
    starts = torch.tensor([0, *itertools.accumulate(n for _, n in PREFILL_SEQS)], dtype=torch.int32)
    query = random_query(int(starts[-1]), heads, head_dim, torch.float32, "cpu", gen)
    scale = 0.3  # not head_dim ** -0.5
    with single_threaded():
        got = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                                starts, scale, sliding_window=window, logits_soft_cap=cap)
        for i, (context, _) in enumerate(PREFILL_SEQS):
            keys = reference.gather_sequence(kv.key_cache, kv.block_tables[i], lens[i])
            values = reference.gather_sequence(kv.value_cache, kv.block_tables[i], lens[i])
            rows = slice(int(starts[i]), int(starts[i + 1]))
            want = dense_attention(query[rows], keys, values, list(range(context, lens[i])), scale, window, cap)
            assert rel_err(got[rows], want) < 1e-5, f"sequence {i}"
    if window and window < max(lens):  # the window changes the result
        full = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                                 starts, scale, logits_soft_cap=cap)
        assert not torch.allclose(full, got)


# --- the kernels against the reference ----------------------------------------------------------


def poison_outside_windows(kv, first_positions, window):
    """NaN into the K/V of every block that lies wholly before the window of a sequence's first query."""
    block_size = kv.key_cache.shape[2]
    for i, pos in enumerate(first_positions):
        begin = max(0, pos - window + 1) if window else 0
        for b in range(begin // block_size):
            block = kv.block_tables[i, b]
            kv.key_cache[block] = float("nan")
            kv.value_cache[block] = float("nan")


# (dtype, block_size, (num_heads, num_kv_heads), head_dim, window, cap, scale): every dtype, block size
# and head layout, windows of 1 key, under a block, one block, unaligned, longer than the longest
# sequence; soft caps that saturate (cap 3 on scores up to ~10) and that barely bend them.
VARIANT_CASES = [
    (torch.float32, 8, (4, 4), 64, 5, 0.0, 0.125),
    (torch.float32, 16, (8, 2), 128, 37, 3.0, 0.3),
    (torch.float32, 32, (8, 1), 80, 1, 0.0, 0.2),
    (torch.float32, 16, (9, 3), 64, 0, 3.0, 1.0),
    (torch.float32, 32, (8, 2), 96, 2000, 50.0, 0.1),
    (torch.bfloat16, 8, (8, 1), 64, 16, 3.0, 0.125),
    (torch.bfloat16, 16, (9, 3), 128, 100, 0.0, 0.0625),
    (torch.bfloat16, 32, (4, 4), 256, 40, 20.0, 0.3),
    (torch.bfloat16, 16, (8, 2), 80, 0, 3.0, 0.5),
    (torch.float16, 16, (8, 2), 64, 23, 3.0, 0.2),
    (torch.float16, 32, (8, 1), 128, 64, 0.0, 0.125),
    (torch.float16, 8, (9, 3), 96, 9, 10.0, 0.25),
]


def variant_id(case):
    dtype, block_size, heads, head_dim, window, cap, scale = case
    return f"{str(dtype).removeprefix('torch.')}-bs{block_size}-h{heads[0]}kv{heads[1]}-d{head_dim}-w{window}-cap{cap}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=variant_id)
def test_decode_variants_match_reference(device, isas, case):
    dtype, block_size, (heads, kv_heads), head_dim, window, cap, scale = case
    gen = torch.Generator().manual_seed(11)
    lens = [1, block_size, 2 * block_size + 3, 5 * block_size + 7, 150, 300, 64]
    kv = paged_kv(lens, kv_heads, head_dim, block_size, dtype, "cpu", gen)
    query = random_query(len(lens), heads, head_dim, dtype, "cpu", gen)
    variant = dict(sliding_window=window, logits_soft_cap=cap)
    with single_threaded():
        expected = reference.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                    kv.seq_lens, scale, **variant)
    poison_outside_windows(kv, [n - 1 for n in lens], window)
    args = [t.to(device) for t in (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)]
    for isa in isas:
        use_isa(isa)
        for threads in (1, 2):
            with torch_threads(threads):
                out = ops.paged_attention_decode(*args, scale, **variant)
            err = rel_err(out.cpu(), expected)
            assert err < tolerance(dtype, device), f"isa={isa} threads={threads}: rel_err {err:.3g}"


def prefill_batch(case, seqs, gen):
    """A random flat prefill batch of a VARIANT_CASES case for `seqs` [(context, q_len)] and two more sequences
    (one across block edges, one long behind a long context): (the seqs, paged K/V, query_start_loc, queries)."""
    dtype, block_size, (heads, kv_heads), head_dim, *_ = case
    seqs = [*seqs, (2 * block_size - 1, 3 * block_size + 1), (300, 90)]
    kv = paged_kv([c + n for c, n in seqs], kv_heads, head_dim, block_size, dtype, "cpu", gen)
    starts = torch.tensor([0, *itertools.accumulate(n for _, n in seqs)], dtype=torch.int32)
    return seqs, kv, starts, random_query(int(starts[-1]), heads, head_dim, dtype, "cpu", gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=variant_id)
def test_prefill_variants_match_reference(device, isas, case):
    dtype, _, _, _, window, cap, scale = case
    seqs, kv, starts, query = prefill_batch(case, PREFILL_SEQS, torch.Generator().manual_seed(12))
    variant = dict(sliding_window=window, logits_soft_cap=cap)
    with single_threaded():
        expected = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                     kv.seq_lens, starts, scale, **variant)
    poison_outside_windows(kv, [c for c, _ in seqs], window)
    args = [t.to(device) for t in (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts)]
    for isa in isas:
        use_isa(isa)
        out = ops.paged_attention_prefill(*args, scale, **variant)
        err = rel_err(out.cpu(), expected)
        assert err < tolerance(dtype, device), f"isa={isa}: rel_err {err:.3g}"


def samples_sharing_a_prompt(block_size, prompt_blocks, extras, kv_heads, head_dim, dtype, gen):
    """One request's samples: tables that begin with the same prompt_blocks blocks, lengths
    prompt_blocks * block_size + extra; and a lone sequence after them."""
    lens = [prompt_blocks * block_size + e for e in extras] + [3 * block_size + 5]
    kv = paged_kv(lens, kv_heads, head_dim, block_size, dtype, "cpu", gen)
    tables = kv.block_tables.clone()
    for j in range(1, len(extras)):
        tables[j, :prompt_blocks] = tables[0, :prompt_blocks]
    groups = torch.tensor([4] * len(extras) + [5], dtype=torch.int32)
    return kv, tables, groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [0, 20, 100, 150, 260, 400], ids=lambda w: f"w{w}")
def test_decode_of_samples_sharing_blocks_with_a_window_is_bit_identical(cpu_isas, dtype, block_size, window):
    """seq_groups lets the CPU decode read a run's shared blocks once; with a window only those in some
    sample's window are read (none when every window starts after them), and every row keeps the bits
    of the ungrouped call. Shared prompt of 256 keys; windows before it, across it, past it."""
    gen = torch.Generator().manual_seed(13)
    prompt_blocks = 256 // block_size
    extras = [1, 5, 30, 70, 2 * block_size + 1, 3]
    kv, tables, groups = samples_sharing_a_prompt(block_size, prompt_blocks, extras, 3, 64, dtype, gen)
    query = random_query(len(groups), 9, 64, dtype, "cpu", gen)
    variant = dict(sliding_window=window, logits_soft_cap=4.0 if window % 20 == 0 else 0.0)
    args = (query, kv.key_cache, kv.value_cache, tables, kv.seq_lens, 0.2)
    with single_threaded():
        expected = reference.paged_attention_decode(*args, **variant)
    for isa in cpu_isas:
        use_isa(isa)
        alone = ops.paged_attention_decode(*args, **variant)
        assert rel_err(alone, expected) < tolerance(dtype), f"isa={isa}"
        for threads in (1, 2):
            with torch_threads(threads):
                grouped = ops.paged_attention_decode(*args, seq_groups=groups, **variant)
            assert torch.equal(grouped, alone), f"isa={isa} threads={threads}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_variants_off_and_windows_past_the_sequence_change_nothing(cpu_isas, dtype):
    """sliding_window=0 and logits_soft_cap=0 are the plain op, and a window no shorter than a sequence
    leaves its rows bit for bit as they were."""
    gen = torch.Generator().manual_seed(14)
    lens = [1, 17, 64, 100]
    kv = paged_kv(lens, 2, 64, 16, dtype, "cpu", gen)
    query = random_query(len(lens), 4, 64, dtype, "cpu", gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    for isa in cpu_isas:
        use_isa(isa)
        plain = ops.paged_attention_decode(*args)
        assert torch.equal(ops.paged_attention_decode(*args, sliding_window=0, logits_soft_cap=0.0), plain)
        assert torch.equal(ops.paged_attention_decode(*args, sliding_window=None, logits_soft_cap=None), plain)
        assert torch.equal(ops.paged_attention_decode(*args, sliding_window=100), plain)
        assert torch.equal(ops.paged_attention_prefill(*args[:5], starts, 0.125, sliding_window=100), plain)
        assert not torch.equal(ops.paged_attention_decode(*args, sliding_window=99), plain)


@pytest.mark.parametrize("call", ["decode", "prefill"])
@pytest.mark.parametrize("change, pattern", [
    (dict(sliding_window=-1), "sliding_window must be >= 0"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be finite and >= 0"),
    (dict(logits_soft_cap=math.inf), "logits_soft_cap must be finite and >= 0"),
    (dict(logits_soft_cap=math.nan), "logits_soft_cap must be finite and >= 0"),
])
def test_bad_variants_are_refused(call, change, pattern):
    gen = torch.Generator().manual_seed(15)
    kv = paged_kv([5, 9], 1, 64, 8, torch.float32, "cpu", gen)
    query = random_query(2, 2, 64, torch.float32, "cpu", gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match=pattern):
        if call == "decode":
            ops.paged_attention_decode(*args, 0.125, **change)
        else:
            ops.paged_attention_prefill(*args, torch.tensor([0, 1, 2], dtype=torch.int32), 0.125, **change)
