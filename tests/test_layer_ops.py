"""The element-wise layer ops (RMSNorm, fused add + RMSNorm, rotary) against their references.

bf16 results must be bitwise what transformers' arithmetic gives (the kernels round every
intermediate the way the torch ops do), up to the rare last-bit flip where a sum of squares is
accumulated in another order; float32 ones agree to a few ulp.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import every_isa, subnormal_count  # noqa: F401 - the fixture

from batchgen import ops
from batchgen.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("every_isa")  # every test on each instruction set's row kernels


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    # 16-bit: a row's sum of squares may round differently, flipping the last bit of a few outputs.
    torch.testing.assert_close(actual, expected, rtol=2**-7, atol=1e-3)
    assert (actual != expected).float().mean() < 0.01


def _rows(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_reference(dtype, rows):
    x, weight = _rows(dtype, (rows, 576), 0), _rows(dtype, (576,), 1)
    _close(ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_on_strided_heads(dtype):
    """Qwen3's per-head q/k norm: a [tokens, heads, head_dim] slice of the fused qkv output."""
    qkv = _rows(dtype, (9, 960), 2)
    weight = _rows(dtype, (64,), 3)
    q = qkv[:, :576].view(9, 9, 64)
    expected = reference.rms_norm(q, weight, 1e-6)
    untouched = qkv[:, 576:].clone()
    assert ops.rms_norm(q, weight, 1e-6, out=q) is q
    _close(q, expected)
    assert torch.equal(qkv[:, 576:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(dtype):
    x, residual, weight = _rows(dtype, (130, 576), 4), _rows(dtype, (130, 576), 5), _rows(dtype, (576,), 6)
    x_ref, residual_ref = x.clone(), residual.clone()
    reference.fused_add_rms_norm(x_ref, residual_ref, weight, 1e-5)
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, residual_ref)  # one rounding of the sum, like residual + x
    _close(x, x_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", ["float32", "model"])
def test_rotary_matches_reference_on_a_strided_view(dtype, table_dtype):
    tokens, heads, head_dim = 37, 12, 64
    qkv = _rows(dtype, (tokens, 960), 7)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # token stride 960
    angles = torch.rand(4096, head_dim // 2, generator=torch.Generator().manual_seed(8)) * 100
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    table = table if table_dtype == "float32" else table.to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(9))
    expected, v = qk.clone(), qkv[:, heads * head_dim :].clone()
    reference.rotary_embedding(positions, expected, table)
    ops.rotary_embedding(positions, qk, table)
    if dtype == torch.float32:
        torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, heads * head_dim :], v)


def test_rotary_matches_transformers():
    transformers = pytest.importorskip("transformers.models.llama.modeling_llama")
    from batchgen.layers.rotary import RotaryEmbedding, rotate

    head_dim, theta = 64, 10000.0
    x = _rows(torch.bfloat16, (5, 4, head_dim), 10)
    positions = torch.tensor([0, 1, 17, 500, 2047])
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    expected = x * cos + transformers.rotate_half(x) * sin
    rope = RotaryEmbedding(head_dim, 2048, theta).angles(positions)
    rotate(x, rope)
    assert torch.equal(x, expected)


def test_bad_arguments_name_the_argument():
    x, weight = torch.randn(4, 64), torch.randn(32)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, weight, 1e-5)
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_embedding(torch.tensor([0, 1, 2, 99]), torch.randn(4, 2, 64), torch.randn(50, 64))
    with pytest.raises(ValueError, match="residual"):
        ops.fused_add_rms_norm(x, torch.randn(4, 32), torch.randn(64), 1e-5)


# The AVX512-BF16 tables round bf16 rows with the processor's conversion, which flushes subnormals to zero; a
# vector meeting one takes the exact rounding, as the reference rounds it. The inputs below make every
# implementation compute the same float32 values, so the bf16 results must match the reference to the bit.
SUBNORMAL_WEIGHT = (torch.logspace(-41, -36, 576) * torch.tensor([1.0, -1.0]).repeat(288)).bfloat16()


def test_rms_norm_keeps_subnormal_results():
    x = torch.full((3, 576), 2.0, dtype=torch.bfloat16)  # a row of 2s: its inverse rms is 0.5 exactly
    out = ops.rms_norm(x, SUBNORMAL_WEIGHT, 0.0)
    assert subnormal_count(out) > 100 and torch.equal(out, reference.rms_norm(x, SUBNORMAL_WEIGHT, 0.0))


def test_fused_add_keeps_subnormal_sums():
    x, residual = _rows(torch.bfloat16, (5, 576), 11) * 1e-38, _rows(torch.bfloat16, (5, 576), 12) * 1e-38
    x_ref, residual_ref = x.clone(), residual.clone()
    reference.fused_add_rms_norm(x_ref, residual_ref, SUBNORMAL_WEIGHT, 1e-5)
    ops.fused_add_rms_norm(x, residual, SUBNORMAL_WEIGHT, 1e-5)
    assert subnormal_count(residual) > 100 and torch.equal(residual, residual_ref)


def test_rotary_keeps_subnormal_results():
    qk = _rows(torch.bfloat16, (6, 4, 64), 13) * 1e-37
    angles = torch.rand(16, 32, generator=torch.Generator().manual_seed(14)) * 100
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).bfloat16()
    positions, expected = torch.arange(6), qk.clone()
    reference.rotary_embedding(positions, expected, table)
    ops.rotary_embedding(positions, qk, table)
    assert subnormal_count(expected) > 50 and torch.equal(qk, expected)
