"""batchgen's int8 GEMM (`ops.quantize_int8_rows`, `ops.gemm_int8`, `ops.linear_int8`) against the pure-torch
reference (`batchgen.ops.reference`): the same quantized operands must give the same int32 sums and the same
float32 / bf16 outputs bit for bit, on every loop this processor runs (scalar, AVX2, AVX-VNNI, AVX512-VNNI,
AMX-INT8) and under every kernel table (which picks the loop by default); a row's output must not depend on
the other rows or the thread count. The MLP's gate and up in one call (`ops.linear_silu_mul_int8`) gives the
reference's product within the rounding of the SiLU's exp.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import moe_by_expert_calls, moe_routing, subnormal_count, torch_threads

from batchgen import _C, ops
from batchgen.ops import reference

INT8_KERNELS = _C.supported_int8_kernels()


@pytest.fixture(params=INT8_KERNELS)
def int8_kernel(request):
    _C.set_int8_kernel(request.param)
    try:
        yield request.param
    finally:
        _C.set_int8_kernel("")


def _operands(rows: int, depth: int, cols: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, depth, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to(dtype)
    w = torch.randn(cols, depth, generator=gen) / depth**0.5
    bias = torch.randn(cols, generator=gen)
    return x, ops.pack_int8_weight(w), w, bias


SHAPES = [(1, 64, 48), (2, 100, 37), (7, 130, 96), (16, 576, 49), (17, 64, 1), (45, 1000, 160), (300, 70, 15)]


@pytest.mark.parametrize(("rows", "depth", "cols"), SHAPES)
@pytest.mark.usefixtures("int8_kernel")
def test_sums_and_outputs_equal_the_reference_bit_for_bit(rows, depth, cols):
    x, packed, _, bias = _operands(rows, depth, cols, seed=rows + depth + cols)
    q, scale = ops.quantize_int8_rows(x)
    sums = ops.gemm_int8(q, scale, packed, out_dtype=torch.int32)
    assert torch.equal(sums, reference.gemm_int8(q, scale, packed, out_dtype=torch.int32))
    assert sums.abs().max() > 1000  # sums of many products, not a degenerate case
    for out_dtype in (torch.float32, torch.bfloat16):
        for b in (None, bias):
            expected = reference.gemm_int8(q, scale, packed, b, out_dtype)
            assert torch.equal(ops.gemm_int8(q, scale, packed, b, out_dtype), expected), (out_dtype, b is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_quantize_like_the_reference(dtype):
    x, *_ = _operands(37, 130, 8, seed=3, dtype=dtype)
    x[5] = 0  # a row of zeros: scale 1, all q = 0
    q, scale = ops.quantize_int8_rows(x)
    expected_q, expected_scale = reference.quantize_int8_rows(x)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)
    assert q.shape == (37, 192) and bool((q[:, 130:] == 128).all())
    assert scale[5] == 1 and bool((q[5] == 128).all())
    assert int(q.min()) == 1 and int(q.max()) == 255  # every row's largest |x| maps to +-127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_ties_round_half_to_even(dtype):
    """Scale 1 (the row's largest |x| is 127), so every x.5 is a tie: the vector loops (32 and 8 at a time) and
    the tail round them as the reference does."""
    ties = [127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5, -126.5]
    x = torch.tensor([ties * 6 + ties[:3]], dtype=dtype)  # 51 values: 32 at once, two vectors and a tail of 3
    q, scale = ops.quantize_int8_rows(x)
    expected_q, expected_scale = reference.quantize_int8_rows(x)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale) and float(scale[0]) == 1.0
    assert q[0, :8].tolist() == [255, 130, 126, 132, 128, 128, 130, 2]


def test_activations_near_half_integers_round_as_their_quotients_do():
    """Quotients a few ulps from k + 0.5 round as the reference's division rounds them, where a product by 1 / s
    (a tempting replacement for the division, measured no faster) rounds many the other way."""
    gen = torch.Generator().manual_seed(7)
    rows, depth = 64, 256 + 8 + 3  # blocks of 32, a vector of 8 and a tail
    amax = torch.rand(rows, generator=gen) * 50 + 0.5
    scale = amax / 127
    x = (torch.randint(-126, 126, (rows, depth), generator=gen) + 0.5) * scale[:, None]
    for _ in range(3):  # up to 3 ulps either way
        step = torch.randint(-1, 2, (rows, depth), generator=gen).float()
        x = torch.nextafter(x, torch.where(step == 0, x, step * torch.inf))
    x[:, 5] = amax
    x[4] = x[4] * 1e-38  # subnormal values and scale
    expected_q, expected_scale = reference.quantize_int8_rows(x)
    by_product = torch.round(x * (1 / expected_scale)[:, None]).clamp(-127, 127) + 128
    assert int((by_product != expected_q[:, :depth].float()).sum()) > 100  # near ties indeed
    q, scale = ops.quantize_int8_rows(x)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_table_quantizes_like_the_reference(cpu_isas, dtype):
    """The quantization is each table's own (whole vectors of 8 or 16, blocks of 32, a tail): every width from 1
    to 70, rows of zeros, an infinity, subnormals, near-ties (scale 1: every x.5 a tie) and a NaN, whose row takes
    scale 1 as torch's amax makes it NaN; a NaN quotient (NaN, inf / inf) is the byte of -127 on every table."""
    gen = torch.Generator().manual_seed(13)
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        for depth in range(1, 71):
            x = (torch.randn(9, depth, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
            x[1] = 0
            x[2, depth // 2] = float("inf")
            x[3] = x[3] * 1e-38  # subnormals in float32; in bf16 some flush to zero
            x[4] = torch.round(x[4].float() * 2) / 2
            x[4, 0] = 127
            x[5, depth - 1] = float("nan")
            q, scale = ops.quantize_int8_rows(x)
            want_q, want_scale = reference.quantize_int8_rows(x)
            assert torch.equal(scale, want_scale) and float(scale[5]) == 1.0, (isa, depth)
            undefined = torch.isnan(x.float() / scale[:, None])  # inf / inf, NaN: torch makes them byte 0
            want_q[:, :depth][undefined] = 1
            assert torch.equal(q, want_q), (isa, depth)
            assert int(undefined.sum()) == 2 and int(q[5, depth - 1]) == 1


def test_weights_quantize_per_output_feature():
    w = torch.randn(50, 70) * torch.logspace(-3, 1, 50)[:, None]
    packed = ops.pack_int8_weight(w)
    q = reference.unpack_int8_weight(packed)
    assert q.dtype == torch.int8 and q.shape == (50, 70)
    assert torch.equal(q.abs().amax(dim=1), torch.full((50,), 127, dtype=torch.int8))
    dequantized = q.float() * packed.scale[:50, None]
    assert bool(((dequantized - w).abs() <= packed.scale[:50, None] / 2 * (1 + 1e-6)).all())
    assert torch.equal(packed.compensation[:50], q.sum(dim=1, dtype=torch.int32) * 128)


@pytest.mark.parametrize("rows", [1, 7, 16, 45])
@pytest.mark.usefixtures("int8_kernel")
def test_a_checkpoints_full_int8_range_sums_exactly(rows):
    """Weights quantized ahead (compressed-tensors' rule, max |w| / 127.5) reach -128, which the AVX2 loop's
    sign trick cannot negate; against activations at +-127 every product is at its largest."""
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-128, 128, (70, 200), generator=gen)
    q[::3, ::2], q[1::3, 1::2] = -128, 127
    packed = ops.pack_int8_weight(q.float(), torch.rand(70, 1, generator=gen) / 100)
    assert torch.equal(reference.unpack_int8_weight(packed), q.to(torch.int8))
    x = torch.randn(rows, 200, generator=gen)
    x[:, ::5] = x.abs().amax() * torch.sign(torch.randn(rows, 40, generator=gen))  # q = +-127 there
    xq, scale = ops.quantize_int8_rows(x)
    assert int(xq.min()) == 1 and int(xq.max()) == 255
    assert torch.equal(ops.gemm_int8(xq, scale, packed, out_dtype=torch.int32),
                       reference.gemm_int8(xq, scale, packed, out_dtype=torch.int32))
    assert torch.equal(ops.linear_int8(x, packed), reference.linear_int8(x, packed))


def test_a_checkpoints_weights_are_checked():
    for bad in (0.5, 128.0, -129.0, float("nan")):
        with pytest.raises(ValueError, match=r"int8 weights must be integers in \[-128, 127\]"):
            ops.pack_int8_weight(torch.full((4, 64), bad), torch.ones(4))
    with pytest.raises(ValueError, match=r"one per output feature \(4\) or one in all"):
        ops.pack_int8_weight(torch.ones(4, 64), torch.ones(3))
    with pytest.raises(ValueError, match="scales must be finite"):
        ops.pack_int8_weight(torch.ones(4, 64), torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    one_scale = ops.pack_int8_weight(torch.ones(4, 64, dtype=torch.bfloat16), torch.tensor([0.5]))
    assert torch.equal(one_scale.scale[:4], torch.full((4,), 0.5))


@pytest.mark.usefixtures("int8_kernel")
def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    x, packed, _, bias = _operands(200, 576, 200, seed=11)
    with torch_threads(1):
        alone = torch.cat([ops.linear_int8(x[i : i + 1], packed, bias) for i in range(0, 200, 13)])
    with torch_threads(2):
        batched = ops.linear_int8(x, packed, bias)[::13]
    assert torch.equal(alone, batched)


def test_every_kernel_table_runs_the_int8_gemm_like_the_reference(cpu_isas):
    x, packed, w, bias = _operands(33, 200, 70, seed=5)
    exact = x.float() @ w.T + bias
    loops = {}
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        loops[isa] = _C.int8_kernel()
        out = ops.linear_int8(x, packed, bias)
        assert torch.equal(out, reference.linear_int8(x, packed, bias)), isa
        assert float((out.float() - exact).abs().max()) < 0.05 * float(exact.abs().max())
    assert loops["scalar"] == "scalar"  # the loop follows the table
    assert loops.get("avx2", "avx2") in ("avx2", "avx_vnni")
    if "amx_bf16" in loops and "amx_int8" in INT8_KERNELS:
        assert loops["amx_bf16"] == "amx_int8"
    if "amx_emulated" in loops:
        assert loops["amx_emulated"] == "amx_int8_emulated"
    for isa in set(loops) - {"amx_emulated"}:
        assert loops[isa] != "amx_int8_emulated", isa  # never chosen but under its own table


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(t.dtype, t.dtype))


def test_every_kernel_tables_epilogue_gives_the_references_bits(cpu_isas):
    """The float epilogue is each kernel table's own, vectorized for it: every output kind, with a bias and without,
    in whole and partial panels, the sign of zero (a zero row's sums times negative weight scales are -0 without a
    bias, +0 with a zero bias) and subnormal outputs as the reference has them."""
    x, packed, _, bias = _operands(21, 130, 100, seed=9)  # 100 outputs: two whole panels and a partial one
    x[3] = 0
    x[4] = x[4] * 1e-38  # subnormal outputs, which the AVX512-BF16 tables' bf16 conversion would flush to zero
    bias[::5] = 0.0
    q, scale = ops.quantize_int8_rows(x)
    negative = dataclasses.replace(packed, scale=-packed.scale)
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        for w in (packed, negative):
            for out_dtype in (torch.int32, torch.float32, torch.bfloat16):
                for b in (None, bias) if out_dtype != torch.int32 else (None,):
                    got, want = ops.gemm_int8(q, scale, w, b, out_dtype), reference.gemm_int8(q, scale, w, b, out_dtype)
                    assert torch.equal(_bits(got), _bits(want)), (isa, out_dtype, b is None)
    assert bool((_bits(reference.gemm_int8(q, scale, negative))[3] < 0).all())  # the -0 case is there
    assert subnormal_count(reference.gemm_int8(q, scale, packed, out_dtype=torch.bfloat16)[4]) > 10  # and those


def _silu_mul_operands(rows: int, depth: int, cols: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, depth, generator=gen) * 3).to(dtype)
    w = torch.randn(2 * cols, depth, generator=gen) / depth**0.5
    return x, w, ops.pack_int8_gate_up(w)


def test_gate_up_panels_alternate_the_two_halves():
    _, w, packed = _silu_mul_operands(1, 130, 100, seed=2)  # 100 outputs: three panels each, the last padded
    assert packed.gate_up and packed.out_features == 100 and packed.panels.shape[0] == 6
    for half, want in zip(reference.gate_up_halves(packed), (w[:100], w[100:]), strict=True):
        alone = ops.pack_int8_weight(want)
        for name in ("panels", "scale", "compensation"):
            assert torch.equal(getattr(half, name), getattr(alone, name)), name


def _assert_silu_mul_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 within the SiLU's rounding (its exp is not torch's); bf16 the same value but where that rounding
    crosses a bf16 boundary (one unit in the last place)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    ulp = want.float().abs() * 2.0**-7 + 1e-30
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert float((got == want).float().mean()) > 0.99


@pytest.mark.parametrize(("rows", "depth", "cols"), [(1, 64, 48), (5, 130, 100), (16, 576, 96), (67, 200, 37),
                                                     (130, 64, 150)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("int8_kernel")
def test_silu_mul_equals_the_reference(rows, depth, cols, dtype):
    x, _, packed = _silu_mul_operands(rows, depth, cols, seed=rows + cols, dtype=dtype)
    got = ops.linear_silu_mul_int8(x, packed)
    assert got.dtype == dtype and got.shape == (rows, cols)
    _assert_silu_mul_close(got, reference.linear_silu_mul_int8(x, packed))


def test_every_kernel_table_runs_silu_mul_like_the_reference(cpu_isas):
    x, _, packed = _silu_mul_operands(40, 300, 120, seed=6)
    want = reference.linear_silu_mul_int8(x, packed)
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        _assert_silu_mul_close(ops.linear_silu_mul_int8(x, packed), want)


def test_every_kernel_tables_silu_mul_rounds_subnormals_as_the_reference(cpu_isas):
    """Gate sums of 64, where silu(g) is g exactly in float32 (exp(-g) is lost in 1 + exp(-g)), so the bf16 output
    is bf16(bf16(gate) * bf16(up)) to the bit; up's scales (a checkpoint's) reach down into the subnormals, which
    the processor's bf16 conversion (on the AVX512-BF16 tables) flushes to zero: those vectors must take the exact
    rounding."""
    cols, depth = 200, 64
    gen = torch.Generator().manual_seed(21)
    gate = torch.full((cols, depth), 100.0)
    up = torch.randint(-127, 128, (cols, depth), generator=gen).float()
    scale = torch.cat([torch.full((cols,), 0.01), torch.logspace(-45, -41, cols)])
    scale[cols::7] = 1.0  # and some normal products among them
    packed = ops.pack_int8_gate_up(torch.cat([gate, up]), scale)
    x = torch.ones(3, depth, dtype=torch.bfloat16)
    q, x_scale = ops.quantize_int8_rows(x)
    g, u = (reference.gemm_int8(q, x_scale, w) for w in reference.gate_up_halves(packed))
    assert float(g.min()) >= 17.0
    want = (g.bfloat16().float() * u.bfloat16().float()).bfloat16()
    assert 50 < subnormal_count(want) < want.numel() - 50  # subnormal outputs, and normal ones
    for isa in cpu_isas:
        _C.set_cpu_isa(isa)
        assert torch.equal(_bits(ops.linear_silu_mul_int8(x, packed)), _bits(want)), isa


@pytest.mark.usefixtures("int8_kernel")
def test_a_silu_mul_row_does_not_depend_on_the_batch_or_the_threads():
    x, _, packed = _silu_mul_operands(200, 576, 200, seed=12)
    with torch_threads(1):
        alone = torch.cat([ops.linear_silu_mul_int8(x[i : i + 1], packed) for i in range(0, 200, 13)])
    with torch_threads(2):
        batched = ops.linear_silu_mul_int8(x, packed)[::13]
    assert torch.equal(alone, batched)


def test_bad_operands_are_refused_in_one_line():
    x, packed, _, _ = _operands(4, 64, 48, seed=1)
    q, scale = ops.quantize_int8_rows(x)
    with pytest.raises(ValueError, match="gemm_int8: q must be a uint8"):
        _C.gemm_int8(torch.empty(4, 48), q.to(torch.int8), scale, packed.panels, packed.compensation, packed.scale)
    with pytest.raises(ValueError, match="gemm_int8: weight must be"):
        _C.gemm_int8(torch.empty(4, 97), q, scale, packed.panels, packed.compensation, packed.scale)
    with pytest.raises(ValueError, match="the weight must come from pack_int8_gate_up"):
        ops.linear_silu_mul_int8(x, packed)
    with pytest.raises(ValueError, match="linear_silu_mul_int8: weight must be .* 24 outputs of gate and up"):
        _C.linear_silu_mul_int8(torch.empty(4, 24), x, packed.panels, packed.compensation, packed.scale)
    with pytest.raises(ValueError, match="linear_silu_mul_int8: out must be float32 or bfloat16"):
        _C.linear_silu_mul_int8(torch.empty(4, 24, dtype=torch.int32), x, packed.panels.repeat(2, 1, 1, 1),
                                packed.compensation.repeat(2), packed.scale.repeat(2))
    with pytest.raises(ValueError, match="int8 GEMM kernel 'nope' is not supported"):
        _C.set_int8_kernel("nope")


def _int8_moe(num_experts: int, hidden: int, width: int, tokens: int, k: int, seed: int, dtype, idle=()):
    gen = torch.Generator().manual_seed(seed)
    gate_ups = [ops.pack_int8_gate_up(torch.randn(2 * width, hidden, generator=gen) / hidden**0.5)
                for _ in range(num_experts)]
    downs = [ops.pack_int8_weight(torch.randn(hidden, width, generator=gen) / width**0.5) for _ in range(num_experts)]
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(dtype)
    return x, *moe_routing(tokens, k, num_experts, gen, idle), gate_ups, downs


@pytest.mark.parametrize(("tokens", "k"), [(0, 2), (1, 1), (6, 2), (70, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("int8_kernel")
def test_moe_experts_are_the_per_expert_int8_calls_summed_in_expert_order(tokens, k, dtype):
    """`moe_silu_experts_int8` quantizes each token once and cuts every expert's panels among the threads in one
    call: bit for bit one call an expert, at 1-7 threads; experts 3 and 5 get no token. 200 features (padded to the
    depth step), 136 wide: 3 pairs of panels, the last partly filled."""
    x, ids, weights, gate_ups, downs = _int8_moe(9, 200, 136, tokens, k, seed=tokens, dtype=dtype, idle=(3, 5))
    want = moe_by_expert_calls(x, ids, weights, 9, lambda rows, e: ops.linear_int8(
        ops.linear_silu_mul_int8(rows, gate_ups[e]), downs[e], out_dtype=torch.float32))
    for threads in (1, 2, 3, 7):  # 7: idle threads, and shares that cut an expert's panels
        with torch_threads(threads):
            got = ops.moe_silu_experts_int8(x, ids, weights, gate_ups, downs)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, want), threads
    if tokens:
        ref = reference.moe_silu_experts_int8(x, ids, weights, gate_ups, downs)
        assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


def test_moe_int8_rows_do_not_depend_on_the_batch():
    x, ids, weights, gate_ups, downs = _int8_moe(16, 96, 64, 40, 3, seed=7, dtype=torch.bfloat16)
    full = ops.moe_silu_experts_int8(x, ids, weights, gate_ups, downs)
    for rows in ([7], [0, 1, 2], list(range(39, 14, -1))):
        assert torch.equal(ops.moe_silu_experts_int8(x[rows], ids[rows], weights[rows], gate_ups, downs), full[rows])


def test_moe_int8_bad_operands_are_value_errors():
    x, ids, weights, gate_ups, downs = _int8_moe(4, 64, 48, 5, 2, seed=8, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    def panels(weights):
        return [(w.panels, w.compensation, w.scale) for w in weights]
    cases = [
        ((out, x, ids.clone().fill_(4), weights, panels(gate_ups), panels(downs), 48), "token 0 names expert 4 of 4"),
        ((out, x, ids.int(), weights, panels(gate_ups), panels(downs), 48), "expert_ids and weights"),
        ((out, x, ids, weights[:4], panels(gate_ups), panels(downs), 48), "expert_ids and weights"),
        ((out, x, ids, weights, panels(gate_ups), panels(downs[:3]), 48), "same number"),
        ((out, x, ids, weights, panels(gate_ups), panels(downs), 50), "weight must be"),
        ((out.float(), x, ids, weights, panels(gate_ups), panels(downs), 48), "out must be"),
        ((out, x, ids, weights, panels(gate_ups), panels(downs[:3] + [ops.pack_int8_weight(torch.ones(64, 100))]),
          48), "weight must be"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            _C.moe_silu_experts_int8(*args)
