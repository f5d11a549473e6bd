import pytest
import torch

from batchgen.layers.linear import linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_batch_size(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(576, 1536, generator=gen) * 0.05).to(dtype)
    for _ in range(20):
        x = torch.randn(64, 1536, generator=gen).to(dtype)
        full = linear(x, weight)
        for rows in (1, 2, 3, 5, 17):
            assert torch.equal(linear(x[:rows], weight), full[:rows]), rows
