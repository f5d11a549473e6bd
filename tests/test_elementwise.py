"""layers/elementwise.py: an elementwise function's result for a row does not depend on how many rows are around
it, with thread counts that split torch's loops unevenly, where torch's own kernels (shown here) do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import torch_threads

from batchgen.layers.elementwise import GRAIN, VECTOR_STEP, invariant, padded_size, thread_counts

FUNCTIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "tanh": torch.tanh,
}
WIDTH = 1000  # rows of 1,000: the loops' shares and tails fall inside rows
ROWS = (1, 3, 7, 40, 67, 99, 130)


def rows_differing(fn, x: torch.Tensor) -> list[int]:
    """The row counts r for which fn(x[:r]) is not fn(x)[:r] bit for bit."""
    whole = fn(x)
    return [r for r in ROWS if not torch.equal(fn(x[:r]), whole[:r])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_each_row_its_own_with_three_threads(name, dtype):
    fn = FUNCTIONS[name]
    x = (torch.randn(max(ROWS), WIDTH, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with torch_threads(3):
        assert rows_differing(lambda t: invariant(fn, t), x) == []
        got = invariant(fn, x)
    want = fn(x).float()  # the same function: equal but for the elements torch took through its scalar path
    assert (got.float() - want).abs().max() <= (2e-6 if dtype == torch.float32 else 1e-2) * want.abs().max()


def test_torch_alone_is_not_row_invariant_there():
    """What the helper is for: the same comparison on torch's kernels finds rows that changed (float32: every
    function above differs in the last bits between its scalar and vector paths somewhere in these rows)."""
    x = torch.randn(max(ROWS), WIDTH, generator=torch.Generator().manual_seed(0)) * 3
    with torch_threads(3):
        assert any(rows_differing(fn, x) for fn in FUNCTIONS.values())


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 6, 16, 24])
def test_every_threads_share_is_whole_vector_steps(threads):
    for n in (1, 63, 64, 65, GRAIN - 1, GRAIN, GRAIN + 1, 3 * GRAIN + 17, 1_000_003, 10_000_019):
        size = padded_size(n, threads)
        assert size >= n and all(size % (VECTOR_STEP * t) == 0 for t in thread_counts(size, threads)), (n, size)
        assert size - n < VECTOR_STEP * threads * threads


@pytest.mark.parametrize("threads", [3, 5])
def test_the_gate_half_of_a_fused_projection_too(threads):
    """A [tokens, width] view of a [tokens, 2 x width] tensor (Gemma's gate), width a whole number of vector
    steps: taken as it is where its size splits evenly, else copied; row for row the same either way."""
    counts = (*ROWS, 48, 96, 160)
    fused = torch.randn(max(counts), 2 * 1024, generator=torch.Generator().manual_seed(1)).bfloat16() * 3
    taken_as_is = [rows for rows in counts if padded_size(rows * 1024, threads) == rows * 1024]
    assert taken_as_is and len(taken_as_is) < len(counts), "both ways, uncopied and copied, are tried"
    with torch_threads(threads):
        gelu = FUNCTIONS["gelu_tanh"]
        whole = invariant(gelu, fused[:, :1024])
        for rows in counts:
            assert torch.equal(invariant(gelu, fused[:rows, :1024]), whole[:rows]), rows
