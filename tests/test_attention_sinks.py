"""Attention sinks (GPT-OSS): a learned score per query head that joins every row's softmax with a zero value.

The reference (batchgen.ops.reference) is checked against transformers' own GPT-OSS attention; the kernels against
the reference on every CPU instruction set (and on CUDA where there is one) for decode and prefill, with windows,
soft caps, fp8 caches and samples that share their prompt's blocks; a sink of -inf is no sink, bit for bit; bad
sinks are refused in one line.
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


def sink_values(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    """From well below the scores to well above them: some heads give the sink most of a row's weight, others
    almost none."""
    return torch.linspace(-6.0, 8.0, num_heads)[torch.randperm(num_heads, generator=gen)].contiguous()


# (context, q_len) per sequence of a prefill batch: whole prompts, chunks behind a cached context, single tokens.
PREFILL_SEQS = [(0, 1), (0, 37), (20, 30), (45, 19), (64, 1), (3, 70), (130, 2)]


@pytest.mark.parametrize("window", [0, 16])
def test_reference_matches_transformers_gpt_oss_attention(window):
    """The reference's sinks are GPT-OSS's: transformers' eager attention (the sink a column of the scores,
    dropped after the softmax), float32, over the same causal or sliding-window mask."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, scale = 8, 2, 64, 0.125
    lens = [c + n for c, n in PREFILL_SEQS]
    kv = paged_kv(lens, kv_heads, head_dim, 16, torch.float32, "cpu", gen)
    starts = torch.tensor([0, *itertools.accumulate(n for _, n in PREFILL_SEQS)], dtype=torch.int32)
    query = random_query(int(starts[-1]), heads, head_dim, torch.float32, "cpu", gen)
    sinks = sink_values(heads, gen)
    got = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                            starts, scale, sliding_window=window, sinks=sinks)
    module = torch.nn.Module().eval()
    module.sinks, module.num_key_value_groups = sinks, heads // kv_heads
    mask_fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    for i, (context, n) in enumerate(PREFILL_SEQS):
        keys = reference.gather_sequence(kv.key_cache, kv.block_tables[i], lens[i])
        values = reference.gather_sequence(kv.value_cache, kv.block_tables[i], lens[i])
        seen = mask_fn(0, 0, torch.arange(context, context + n)[:, None], torch.arange(lens[i])[None, :])
        mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
        rows = slice(int(starts[i]), int(starts[i + 1]))
        want, _ = eager_attention_forward(module, query[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], mask[None, None], scale)
        assert rel_err(got[rows], want[0]) < 1e-5, f"sequence {i}"


# (dtype, block_size, (num_heads, num_kv_heads), head_dim, window, cap): every dtype, MHA/GQA/MQA, GPT-OSS's
# window of 128 and shorter ones, a soft cap beside the sinks.
SINK_CASES = [
    (torch.float32, 16, (8, 2), 64, 0, 0.0),
    (torch.float32, 8, (8, 1), 128, 37, 3.0),
    (torch.bfloat16, 16, (16, 2), 64, 128, 0.0),
    (torch.bfloat16, 32, (4, 4), 80, 0, 0.0),
    (torch.float16, 16, (9, 3), 64, 20, 0.0),
]


def case_id(case):
    dtype, block_size, heads, head_dim, window, cap = case
    return f"{str(dtype).removeprefix('torch.')}-bs{block_size}-h{heads[0]}kv{heads[1]}-d{head_dim}-w{window}-cap{cap}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SINK_CASES, ids=case_id)
def test_decode_with_sinks_matches_reference(device, isas, case):
    dtype, block_size, (heads, kv_heads), head_dim, window, cap = case
    gen = torch.Generator().manual_seed(2)
    lens = [1, block_size, 5 * block_size + 7, 150, 300, 700]
    kv = paged_kv(lens, kv_heads, head_dim, block_size, dtype, "cpu", gen)
    query = random_query(len(lens), heads, head_dim, dtype, "cpu", gen)
    sinks = sink_values(heads, gen)
    variant = dict(sliding_window=window, logits_soft_cap=cap)
    with single_threaded():
        expected = reference.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                    kv.seq_lens, 0.125, sinks=sinks, **variant)
        plain = reference.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                 kv.seq_lens, 0.125, **variant)
    assert rel_err(plain, expected) > 0.05  # the sinks matter here
    args = [t.to(device) for t in (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)]
    for isa in isas:
        use_isa(isa)
        for threads in (1, 2):
            with torch_threads(threads):
                out = ops.paged_attention_decode(*args, 0.125, sinks=sinks.to(device), **variant)
            err = rel_err(out.cpu(), expected)
            assert err < tolerance(dtype, device), f"isa={isa} threads={threads}: rel_err {err:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SINK_CASES, ids=case_id)
def test_prefill_with_sinks_matches_reference(device, isas, case):
    dtype, block_size, (heads, kv_heads), head_dim, window, cap = case
    gen = torch.Generator().manual_seed(3)
    seqs = [*PREFILL_SEQS, (300, 90)]
    kv = paged_kv([c + n for c, n in seqs], kv_heads, head_dim, block_size, dtype, "cpu", gen)
    starts = torch.tensor([0, *itertools.accumulate(n for _, n in seqs)], dtype=torch.int32)
    query = random_query(int(starts[-1]), heads, head_dim, dtype, "cpu", gen)
    sinks = sink_values(heads, gen)
    variant = dict(sliding_window=window, logits_soft_cap=cap)
    with single_threaded():
        expected = reference.paged_attention_prefill(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                     kv.seq_lens, starts, 0.125, sinks=sinks, **variant)
    args = [t.to(device) for t in (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts)]
    for isa in isas:
        use_isa(isa)
        out = ops.paged_attention_prefill(*args, 0.125, sinks=sinks.to(device), **variant)
        err = rel_err(out.cpu(), expected)
        assert err < tolerance(dtype, device), f"isa={isa}: rel_err {err:.3g}"


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_sinks_over_an_fp8_cache(cpu_isas, fp8):
    """Over fp8 caches (the paths that read the bytes themselves and those that widen a tile), with per-head
    scales: the sink joins the sum whatever the values' scale."""
    gen = torch.Generator().manual_seed(4)
    lens = [3, 40, 200]
    kv = paged_kv(lens, 2, 64, 16, torch.float32, "cpu", gen)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 4.0])
    key_cache = (kv.key_cache / k_scale[None, :, None, None]).to(fp8)
    value_cache = (kv.value_cache / v_scale[None, :, None, None]).to(fp8)
    sinks = sink_values(8, gen)
    starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        query = random_query(sum(lens), 8, 64, dtype, "cpu", gen)
        args = (query, key_cache, value_cache, kv.block_tables, kv.seq_lens, starts, 0.125)
        scales = dict(k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        with single_threaded():
            expected = reference.paged_attention_prefill(*args, **scales)
            expected_decode = reference.paged_attention_decode(query[:3], *args[1:5], 0.125, **scales)
        for isa in cpu_isas:
            use_isa(isa)
            assert rel_err(ops.paged_attention_prefill(*args, **scales), expected) < tolerance(dtype), isa
            decoded = ops.paged_attention_decode(query[:3], *args[1:5], 0.125, **scales)
            assert rel_err(decoded, expected_decode) < tolerance(dtype), isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_samples_sharing_blocks_keep_their_bits_with_sinks(cpu_isas, dtype):
    """seq_groups (the samples of a request read their shared prompt blocks once): with sinks every row keeps the
    bits of the ungrouped call, at 1 and 2 threads."""
    gen = torch.Generator().manual_seed(5)
    lens = [256 + e for e in (1, 5, 30, 70)] + [53]
    kv = paged_kv(lens, 2, 64, 16, dtype, "cpu", gen)
    tables = kv.block_tables.clone()
    tables[1:4, :16] = tables[0, :16]
    groups = torch.tensor([4, 4, 4, 4, 5], dtype=torch.int32)
    query = random_query(len(lens), 8, 64, dtype, "cpu", gen)
    sinks = sink_values(8, gen)
    args = (query, kv.key_cache, kv.value_cache, tables, kv.seq_lens, 0.125)
    for isa in cpu_isas:
        use_isa(isa)
        alone = ops.paged_attention_decode(*args, sinks=sinks)
        for threads in (1, 2):
            with torch_threads(threads):
                assert torch.equal(ops.paged_attention_decode(*args, seq_groups=groups, sinks=sinks), alone), isa


def test_a_sink_of_minus_infinity_is_no_sink(cpu_isas):
    """exp(-inf) adds exactly 0 to a row's sum: the rows keep the bits of the call without sinks."""
    gen = torch.Generator().manual_seed(6)
    lens = [1, 17, 100]
    kv = paged_kv(lens, 2, 64, 16, torch.bfloat16, "cpu", gen)
    query = random_query(len(lens), 4, 64, torch.bfloat16, "cpu", gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    none = torch.full((4,), -math.inf)
    for isa in cpu_isas:
        use_isa(isa)
        assert torch.equal(ops.paged_attention_decode(*args, sinks=none), ops.paged_attention_decode(*args))
        assert torch.equal(ops.paged_attention_prefill(*args[:5], starts, 0.125, sinks=none),
                           ops.paged_attention_prefill(*args[:5], starts, 0.125))


@pytest.mark.parametrize("call", ["decode", "prefill"])
@pytest.mark.parametrize("sinks, pattern", [
    (torch.zeros(4, dtype=torch.bfloat16), "sinks must be Float"),
    (torch.zeros(3), "sinks has 3 entries but query has 4 heads"),
    (torch.zeros(2, 2), r"sinks must be 1-D \[num_heads\], got shape \[2, 2\]"),
    (torch.tensor([0.0, math.nan, 0.0, 0.0]), r"sinks\[1\] is NaN"),
])
def test_bad_sinks_are_refused(call, sinks, pattern):
    gen = torch.Generator().manual_seed(7)
    kv = paged_kv([5, 9], 2, 64, 8, torch.float32, "cpu", gen)
    query = random_query(2, 4, 64, torch.float32, "cpu", gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match=pattern):
        if call == "decode":
            ops.paged_attention_decode(*args, 0.125, sinks=sinks)
        else:
            ops.paged_attention_prefill(*args, torch.tensor([0, 1, 2], dtype=torch.int32), 0.125, sinks=sinks)


def test_the_backend_refuses_sinks_that_are_not_one_per_head():
    """transformers passes some models' sinks per token (a projection of the hidden states): the backend's
    attention refuses them in one line rather than keep the first step's."""
    from batchgen.models.transformers_backend import LayerAttention, Step

    layer = LayerAttention(Step(), window=0)
    query, key = torch.zeros(1, 4, 3, 64), torch.zeros(1, 2, 3, 64)
    with pytest.raises(NotImplementedError, match=r"sinks have shape \[1, 4, 3, 1\].*one per query head \(4\)"):
        layer(query, key, key, 0.125, None, None, torch.zeros(1, 4, 3, 1))

