"""Prefill attention with per-token key limits (Gemma 3's image tokens, which see their whole image).

The reference (batchgen.ops.reference) is checked against a dense computation whose mask is transformers' own
(causal OR same image block, AND the sliding window: `create_masks_for_vision_model`'s composition); the kernels
are then checked against the reference on every CPU instruction set (and on CUDA where there is one) with random
limits, image-like spans, sliding windows, GQA and every block size. Blocks past every row's limit hold NaN (the
tails of `paged_kv`'s sequences), as do blocks wholly before every window, so a kernel that reads them fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import (
    DEVICES,
    paged_kv,
    random_query,
    rel_err,
    single_threaded,
    tolerance,
    use_isa,
)
from test_attention_variants import (
    PREFILL_SEQS,
    VARIANT_CASES,
    poison_outside_windows,
    prefill_batch,
    variant_id,
)

from batchgen import ops
from batchgen.ops import reference


def image_spans(seqs: list[tuple[int, int]], gen: torch.Generator) -> list[list[tuple[int, int]]]:
    """Per sequence (context, q_len): disjoint [start, end) spans of "image" positions, some beginning before the
    chunk (in the cached context: a prefix-cache hit ending inside an image), none ending after the sequence."""
    out = []
    for context, q_len in seqs:
        length, spans, at = context + q_len, [], max(0, context - 3)
        while True:
            start = at + int(torch.randint(0, 6, (1,), generator=gen))
            end = start + int(torch.randint(1, 40, (1,), generator=gen))
            if end > length:
                break
            spans.append((start, end))
            at = end + 1
        out.append(spans)
    return out


def limits_of(seqs, spans) -> torch.Tensor:
    """int32 key limit of each query row: its own position, or the last position of its image."""
    limits = []
    for (context, q_len), own in zip(seqs, spans, strict=True):
        row = torch.arange(context, context + q_len)
        for start, end in own:
            row[(row >= start) & (row < end)] = end - 1
        limits.append(row)
    return torch.cat(limits).int()


def random_limits(seqs, gen) -> torch.Tensor:
    """Any limit a row may have: half the rows their own position, the others anything up to the sequence's end."""
    limits = []
    for context, q_len in seqs:
        own = torch.arange(context, context + q_len)
        far = own + (torch.rand(q_len, generator=gen) * (context + q_len - own)).long()
        limits.append(torch.where(torch.rand(q_len, generator=gen) < 0.5, own, far))
    return torch.cat(limits).int()


def dense_vision_attention(query, keys, values, positions, spans, scale, window):
    """float64 attention with transformers' Gemma 3 mask: OR(causal, same image) (AND the sliding window)."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )

    groups = torch.full((1, keys.shape[0]), -1)
    for i, (start, end) in enumerate(spans):
        groups[0, start:end] = i
    mask_fn = or_masks(causal_mask_function, blockwise_overlay(groups))
    if window:
        mask_fn = and_masks(mask_fn, sliding_window_overlay(window))
    q_idx = torch.tensor(positions)[:, None]
    kv_idx = torch.arange(keys.shape[0])[None, :]
    mask = mask_fn(0, 0, q_idx, kv_idx)
    q = query.double().transpose(0, 1)
    k, v = keys.double().transpose(0, 1), values.double().transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


SEQS = [*PREFILL_SEQS, (0, 130), (40, 90)]


@pytest.mark.parametrize("window", [0, 5, 16, 200], ids=lambda w: f"w{w}")
def test_reference_matches_transformers_image_mask(window):
    gen = torch.Generator().manual_seed(20)
    lens = [c + n for c, n in SEQS]
    kv = paged_kv(lens, 2, 64, 16, torch.float32, "cpu", gen)
    starts = torch.tensor([0, *itertools.accumulate(n for _, n in SEQS)], dtype=torch.int32)
    query = random_query(int(starts[-1]), 8, 64, torch.float32, "cpu", gen)
    spans = image_spans(SEQS, gen)
    assert sum(len(s) for s in spans) >= 5  # images to see both ways
    limits = limits_of(SEQS, spans)
    with single_threaded():
        got = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                                starts, 0.3, sliding_window=window, key_limit=limits)
        causal = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                   kv.seq_lens, starts, 0.3, sliding_window=window)
        for i, (context, _) in enumerate(SEQS):
            keys = reference.gather_sequence(kv.key_cache, kv.block_tables[i], lens[i])
            values = reference.gather_sequence(kv.value_cache, kv.block_tables[i], lens[i])
            rows = slice(int(starts[i]), int(starts[i + 1]))
            want = dense_vision_attention(query[rows], keys, values, list(range(context, lens[i])), spans[i], 0.3,
                                          window)
            assert rel_err(got[rows], want) < 1e-5, f"sequence {i}"
    assert not torch.allclose(got, causal)  # the images changed the result


def limit_cases():
    """VARIANT_CASES (every dtype, block size, head layout, window, cap) with limits of images and random ones."""
    return [(*case, kind) for case in VARIANT_CASES for kind in ("images", "random")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", limit_cases(), ids=lambda c: f"{variant_id(c[:-1])}-{c[-1]}")
def test_prefill_with_key_limits_matches_reference(device, isas, case):
    *variant_case, kind = case
    dtype, _, _, _, window, cap, scale = variant_case
    gen = torch.Generator().manual_seed(21)
    seqs, kv, starts, query = prefill_batch(variant_case, SEQS, gen)
    limits = limits_of(seqs, image_spans(seqs, gen)) if kind == "images" else random_limits(seqs, gen)
    own = torch.cat([torch.arange(c, c + n) for c, n in seqs]).int()
    assert (limits > own).sum() >= 50  # rows that see keys after their own
    variant = dict(sliding_window=window, logits_soft_cap=cap)
    with single_threaded():
        expected = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                     kv.seq_lens, starts, scale, key_limit=limits, **variant)
    poison_outside_windows(kv, [c for c, _ in seqs], window)
    args = [t.to(device) for t in (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts)]
    for isa in isas:
        use_isa(isa)
        out = ops.paged_attention_prefill(*args, scale, key_limit=limits.to(device), **variant)
        err = rel_err(out.cpu(), expected)
        assert err < tolerance(dtype, device), f"isa={isa}: rel_err {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_own_positions_as_limits_change_nothing(cpu_isas, dtype):
    """key_limit holding each row's own position is the causal op, bit for bit; a row's limit changes its row
    alone."""
    gen = torch.Generator().manual_seed(22)
    seqs = [(0, 70), (30, 45), (128, 3)]
    kv = paged_kv([c + n for c, n in seqs], 2, 64, 16, dtype, "cpu", gen)
    starts = torch.tensor([0, *itertools.accumulate(n for _, n in seqs)], dtype=torch.int32)
    query = random_query(int(starts[-1]), 4, 64, dtype, "cpu", gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts, 0.125)
    own = torch.cat([torch.arange(c, c + n) for c, n in seqs]).int()
    moved = own.clone()
    moved[10] = 69  # row 10 of the first sequence sees all of it
    for isa in cpu_isas:
        use_isa(isa)
        plain = ops.paged_attention_prefill(*args, sliding_window=20)
        assert torch.equal(ops.paged_attention_prefill(*args, sliding_window=20, key_limit=own), plain)
        changed = ops.paged_attention_prefill(*args, sliding_window=20, key_limit=moved)
        differs = (changed != plain).flatten(1).any(dim=1)
        assert differs.nonzero().flatten().tolist() == [10], f"isa={isa}"


@pytest.mark.parametrize("limit, pattern", [
    (lambda own: own.long(), "key_limit must be Int, got Long"),
    (lambda own: own[:-1], "key_limit has 9 entries but query has 10 tokens"),
    (lambda own: own - (own == 6).int(), r"key_limit\[6\] = 5 is outside \[its position 6"),
    (lambda own: own + (own == 3).int() * 20, r"key_limit\[3\] = 23 is outside .* seq_lens\[0\] - 1 = 9\]"),
])
def test_bad_key_limits_are_refused(limit, pattern):
    gen = torch.Generator().manual_seed(23)
    kv = paged_kv([10], 1, 64, 8, torch.float32, "cpu", gen)
    query = random_query(10, 2, 64, torch.float32, "cpu", gen)
    own = torch.arange(10, dtype=torch.int32)
    with pytest.raises(ValueError, match=pattern):
        ops.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                    torch.tensor([0, 10], dtype=torch.int32), 0.125, key_limit=limit(own))
