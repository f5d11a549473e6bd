"""The segmented LoRA kernel (`ops.lora_shrink_expand`) and the GEMMs' float32 addend against pure torch.

Each kernel test runs under every kernel table this processor has (the reference is `ops.reference`): float32
results agree to float32 rounding, bf16 ones to one bf16 step. A row's result must not depend on its segment,
its neighbours, the tile it lands in or the thread count (batch invariance), and padding ranks must change
nothing.
"""

from __future__ import annotations

import re

import pytest
import torch
from kernel_cases import every_isa, torch_threads  # noqa: F401 - every_isa: the fixture

from batchgen import _C, ops
from batchgen.ops import reference

SLOTS, IN, OUT = 3, 200, 136  # neither a multiple of any vector width: every tail runs


pytestmark = pytest.mark.usefixtures("every_isa")


def _weights(rank: int, seed: int = 0, slots: int = SLOTS, n_in: int = IN, n_out: int = OUT):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, rank, n_in, generator=gen) * 0.1
    b_t = torch.randn(slots, rank, n_out, generator=gen) * 0.1
    return a, b_t


def _rows(count: int, dtype: torch.dtype, width: int = IN, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _segments(*triples: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(triples, dtype=torch.int32).reshape(-1, 3)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:  # one bf16 step either way: the kernel's float32 sum may round the other way
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)


SEGMENTS = _segments((0, 5, 1), (5, 6, 0), (9, 30, 2), (30, 31, 1))  # rows 6-8 and 31-33: no adapter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("y_dtype", ["x", torch.float32])
def test_add_matches_reference(dtype, y_dtype):
    a, b_t = _weights(16)
    x = _rows(34, dtype)
    y = _rows(34, dtype if y_dtype == "x" else y_dtype, OUT, seed=2)
    expected = y.clone()
    reference.lora_shrink_expand(expected, x, SEGMENTS, a, b_t, scale=0.5)
    ops.lora_shrink_expand(y, x, SEGMENTS, a, b_t, scale=0.5)
    _close(y, expected)
    untouched = _rows(34, y.dtype, OUT, seed=2)
    assert torch.equal(y[6:9], untouched[6:9]) and torch.equal(y[31:], untouched[31:])
    assert not torch.equal(y[:6], untouched[:6])  # the terms are there: the check above can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_the_terms_and_negative_zero_elsewhere(dtype):
    a, b_t = _weights(8)
    ranks = torch.tensor([8, 0, 5], dtype=torch.int32)  # slot 1 has no adapter on this projection
    x = _rows(34, dtype)
    y = torch.full((34, OUT), 7.0)
    expected = torch.empty(34, OUT)
    reference.lora_shrink_expand(expected, x, SEGMENTS, a, b_t, ranks, store=True)
    ops.lora_shrink_expand(y, x, SEGMENTS, a, b_t, ranks, store=True)
    _close(y, expected)
    empty_rows = torch.tensor([r for r in range(34) if not (5 <= r < 6 or 9 <= r < 30)])
    assert torch.equal(y[empty_rows].view(torch.int32), torch.full((len(empty_rows), OUT), -0.0).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_in_a_batch(dtype):
    """Batch invariance: every row of a 4-row tile, a tail and a segment split over threads gives the bits it
    gives alone, under 1 or 2 threads."""
    a, b_t = _weights(64)
    x = _rows(71, dtype)
    segments = _segments((0, 3, 0), (3, 40, 2), (40, 41, 1), (43, 71, 0))
    together, checked = _each_row_alone_equals_together(x, segments, a, b_t, dtype)
    assert checked == 69 and together[41:43].eq(0).all() and together[:41].ne(0).any()


def _each_row_alone_equals_together(x, segments, a, b_t, y_dtype) -> tuple[torch.Tensor, int]:
    """The segments' terms of all rows at once on 2 threads, each row's bits checked against the row alone on 1;
    returns the former and the rows checked."""
    together = torch.zeros(x.shape[0], b_t.shape[2], dtype=y_dtype)
    with torch_threads(2):
        ops.lora_shrink_expand(together, x, segments, a, b_t)
    checked = 0
    for start, end, slot in segments.tolist():
        for row in range(start, end):
            alone = torch.zeros(1, b_t.shape[2], dtype=y_dtype)
            with torch_threads(1):
                ops.lora_shrink_expand(alone, x[row:row + 1], _segments((0, 1, slot)), a, b_t)
            assert torch.equal(alone[0], together[row]), row
            checked += 1
    return together, checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_ranks_changes_nothing(dtype):
    """An adapter of rank 8 in slots of rank 32: zero-padded weights, or `ranks` saying 8, or the bare rank-8
    weights all give the same bits."""
    a8, b8 = _weights(8)
    a32, b32 = torch.zeros(SLOTS, 32, IN), torch.zeros(SLOTS, 32, OUT)
    a32[:, :8], b32[:, :8] = a8, b8
    x = _rows(13, dtype)
    segments = _segments((0, 13, 1))
    outs = []
    for a, b_t, ranks in ((a8, b8, None), (a32, b32, None), (a32, b32, torch.full((SLOTS,), 8, dtype=torch.int32))):
        y = torch.zeros(13, OUT, dtype=dtype)
        ops.lora_shrink_expand(y, x, segments, a, b_t, ranks)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert outs[0].ne(0).any()


def test_bad_arguments_are_one_line_value_errors():
    a, b_t = _weights(4)
    x, y = _rows(6, torch.float32), torch.zeros(6, OUT)
    cases = {
        "segment 1 covers rows [2, 9)": (_segments((0, 3, 0), (2, 9, 0)), a, b_t),
        "names slot 3 of 3": (_segments((0, 3, 3)), a, b_t),
        "a [slots, rank, 200]": (_segments((0, 3, 0)), a[:, :, :10].contiguous(), b_t),
    }
    for message, (segments, wa, wb) in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            _C.lora_shrink_expand(y, x, segments, wa, wb)
    with pytest.raises(ValueError, match="ranks"):
        _C.lora_shrink_expand(y, x, _segments((0, 3, 0)), a, b_t, torch.tensor([1, 9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="store needs a float32 y"):
        _C.lora_shrink_expand(y.bfloat16(), x.bfloat16(), _segments((0, 3, 0)), a, b_t, store=True)


@pytest.mark.parametrize("silu", [False, True])
def test_gemm_addend_is_added_before_rounding_and_negative_zero_adds_nothing(silu):
    if not _C.has_gemm_bf16():
        pytest.skip("the scalar kernels have no bf16 GEMM")
    gen = torch.Generator().manual_seed(3)
    cols, depth = 100, 64
    x = torch.randn(11, depth, generator=gen).bfloat16()
    w, up = (ops.pack_gemm_weight(torch.randn(cols, depth, generator=gen).bfloat16()) for _ in range(2))
    addend = torch.randn(11, 2 * cols if silu else cols, generator=gen)
    addend[4:7] = -0.0

    def run(terms):
        if silu:
            return ops.gemm_silu_mul_bf16(x, w, up, cols, addend=terms)
        return ops.gemm_bf16(x, w, cols, addend=terms)

    got, plain = run(addend), run(None)
    expected = (reference.gemm_silu_mul_bf16(x, w, up, cols, addend) if silu
                else reference.gemm_bf16(x, w, cols, addend=addend))
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2**-7)
    assert torch.equal(got[4:7], plain[4:7]) and not torch.equal(got[:4], plain[:4])


# The bf16 form: bf16 x, A and B in pairs for the bf16 dot product (ops.pack_lora_bf16), t rounded to bf16.


def _bf16_weights(rank: int, seed: int = 0, n_in: int = IN, n_out: int = OUT, capacity: int | None = None):
    a, b_t = _weights(rank, seed, n_in=n_in, n_out=n_out)
    a, b_t = a.bfloat16().float(), b_t.bfloat16().float()  # exact in bf16, as adapters loaded in a bf16 model
    return a, b_t, ops.pack_lora_bf16(a, b_t, capacity)


def test_pack_lora_bf16_round_trips_and_pads():
    a, b_t, (a_pairs, b_pairs) = _bf16_weights(5, n_in=IN + 1, capacity=20)
    assert a_pairs.shape == (SLOTS, (IN + 2) // 2, 32, 2) and b_pairs.shape == (SLOTS, 16, OUT, 2)
    assert a_pairs[:, -1, :, 1].eq(0).all()  # the odd input's missing partner
    back_a, back_b = reference.unpack_lora_bf16(a_pairs, b_pairs, IN + 1)
    assert torch.equal(back_a[:, :5], a) and torch.equal(back_b[:, :5], b_t)
    assert back_a[:, 5:].eq(0).all() and back_b[:, 5:].eq(0).all()
    assert torch.equal(a_pairs[1, 3, 2], a[1, 2, 6:8].bfloat16())  # pair k of rank r at [k, r]


@pytest.mark.parametrize(("n_in", "n_out"), [(IN, OUT), (IN + 1, OUT + 16)])  # 8 or 9 whole 16-column slices
@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("store", [False, True])
def test_bf16_form_matches_the_reference_that_rounds_t(n_in, n_out, y_dtype, store):
    """Against pure torch with t rounded to bf16: within float32 rounding plus one bf16 step of each t (where
    the kernel's float32 sum and torch's round t the other way), and much closer than without the rounding."""
    if store and y_dtype != torch.float32:
        pytest.skip("store writes float32")
    # Two groups of 16 ranks, the second partial.
    a, b_t, (a_pairs, b_pairs) = _bf16_weights(20, n_in=n_in, n_out=n_out, capacity=32)
    ranks = torch.tensor([20, 0, 9], dtype=torch.int32)
    x = _rows(34, torch.bfloat16, n_in)
    y = _rows(34, y_dtype, n_out, seed=2)
    expected, unrounded = y.clone().float(), y.clone().float()
    reference.lora_shrink_expand(expected, x, SEGMENTS, a_pairs, b_pairs, ranks, scale=0.75, store=store)
    reference.lora_shrink_expand(unrounded, x, SEGMENTS, a, b_t, ranks, scale=0.75, store=store)
    ops.lora_shrink_expand(y, x, SEGMENTS, a_pairs, b_pairs, ranks, scale=0.75, store=store)
    # |t| * 2^-7 bounds one bf16 step of t; summed against |B| it bounds the expand's change.
    bound = torch.zeros(34, n_out)
    for start, end, slot in SEGMENTS.tolist():
        rank = int(ranks[slot])
        t = 0.75 * (x[start:end].float() @ a[slot, :rank].T)
        bound[start:end] = (t.abs() * 2**-7) @ b_t[slot, :rank].abs()
    y_step = 2**-8 * expected.abs() if y_dtype == torch.bfloat16 else 0
    err = (y.float() - expected).abs()
    assert (err <= bound + 1e-5 * expected.abs() + 1e-6 + y_step).all()
    if y_dtype == torch.float32:  # the kernel rounds t: the unrounded sums are farther away than its own error
        assert err.max() * 4 < (unrounded - expected).abs().max()
    if store:
        empty_rows = [r for r in range(34) if not (5 <= r < 6 or 9 <= r < 30)]  # slot 1 has rank 0 here
        negative_zero = torch.full((len(empty_rows), n_out), -0.0)
        assert torch.equal(y[empty_rows].view(torch.int32), negative_zero.view(torch.int32))
    else:
        untouched = _rows(34, y_dtype, n_out, seed=2)
        assert torch.equal(y[6:9], untouched[6:9]) and not torch.equal(y[9:30], untouched[9:30])


@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32])
def test_bf16_form_row_alone_equals_the_row_in_any_batch(y_dtype):
    """Batch invariance of the bf16 form: each row gives the bits it gives alone (1 thread) in segments of
    every size (tiles of 1-4 rows and their tails) under 2 threads, and in a second, shuffled composition."""
    _, _, (a_pairs, b_pairs) = _bf16_weights(64, n_in=IN + 1)
    x = _rows(71, torch.bfloat16, IN + 1)
    compositions = [_segments((0, 3, 0), (3, 40, 2), (40, 41, 1), (43, 71, 0)),
                    _segments((0, 1, 0), (1, 6, 0), (6, 13, 2), (13, 14, 2), (15, 71, 1))]
    checked = 0
    for segments in compositions:
        together, rows = _each_row_alone_equals_together(x, segments, a_pairs, b_pairs, y_dtype)
        assert together[:3].ne(0).any()
        checked += rows
    assert checked == 69 + 70


def test_bf16_form_padding_ranks_changes_nothing():
    """Rank 9 in capacities of 16 and 48, with or without `ranks`: the same bits."""
    outs = []
    x = _rows(13, torch.bfloat16)
    for capacity, ranks in ((16, None), (48, None), (48, torch.full((SLOTS,), 9, dtype=torch.int32))):
        _, _, (a_pairs, b_pairs) = _bf16_weights(9, capacity=capacity)
        y = torch.zeros(13, OUT)
        ops.lora_shrink_expand(y, x, _segments((0, 13, 1)), a_pairs, b_pairs, ranks)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]) and outs[0].ne(0).any()


def test_bf16_form_bad_arguments_are_one_line_value_errors():
    _, _, (a_pairs, b_pairs) = _bf16_weights(4)
    x, y = _rows(6, torch.bfloat16), torch.zeros(6, OUT)
    with pytest.raises(ValueError, match="bf16 a and b_t need a bf16 x"):
        _C.lora_shrink_expand(y, x.float(), _segments((0, 3, 0)), a_pairs, b_pairs)
    with pytest.raises(ValueError, match=re.escape("a multiple of 16")):
        _C.lora_shrink_expand(y, x, _segments((0, 3, 0)), a_pairs[:, :, :8].contiguous(), b_pairs[:, :4].contiguous())
    with pytest.raises(ValueError, match=re.escape("bf16 a [slots, 100, rank, 2]")):
        _C.lora_shrink_expand(y, x, _segments((0, 3, 0)), a_pairs[:, :50].contiguous(), b_pairs)
