"""batchgen's bf16 GEMM (`ops.gemm_bf16`, `ops.gemm_silu_mul_bf16`) against float64 products.

Every output must be the exact product rounded to bf16, give or take one bf16 step (the kernel sums
in float32), and a row's result must not depend on the other rows, the thread count or where the
row sits in a tile. Each test runs under every kernel table with the GEMM this processor has: the
AVX2 loop widening the pairs to float32 FMAs in 16 registers (avx2), the AVX-512 one (avx512), the same loop on
the bf16 dot product (avx512_bf16) and the AMX tiles (amx_bf16, or amx_emulated on an emulated tile unit where
the processor has no AMX). The scalar kernels run the reference instead (tested too).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import moe_by_expert_calls, moe_routing, torch_threads

from batchgen import _C, ops
from batchgen.ops import reference


def _tables_with_the_gemm() -> list[str]:
    active = _C.cpu_isa()
    try:
        found = []
        for isa in _C.supported_cpu_isas():
            _C.set_cpu_isa(isa)
            if _C.has_gemm_bf16():
                found.append(isa)
        return found
    finally:
        _C.set_cpu_isa(active)


GEMM_ISAS = _tables_with_the_gemm()
needs_gemm = pytest.mark.skipif(not GEMM_ISAS, reason="not an x86-64 processor with AVX2")
PANEL = _C.GEMM_PANEL_COLS


@pytest.fixture(params=GEMM_ISAS)
def gemm_isa(request):
    active = _C.cpu_isa()
    _C.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        _C.set_cpu_isa(active)


def needs_kernel(test):
    """The test runs once per kernel table with the GEMM (skipped where there is none)."""
    return needs_gemm(pytest.mark.usefixtures("gemm_isa")(test))


def _operands(rows: int, depth: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).bfloat16()
    w = (torch.randn(cols, depth, generator=gen) / depth**0.5).bfloat16()
    return x, w


def _assert_rounded_exact(actual: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> None:
    """actual within one bf16 step of the float64 `exact`; `scale` (sum of |terms|) bounds float32's own error."""
    assert actual.dtype == torch.bfloat16 and actual.shape == exact.shape
    error = (actual.double() - exact).abs()
    allowed = exact.abs() * 2**-7 + scale * 1e-6
    assert bool((error <= allowed).all()), f"worst excess {(error - allowed).max().item():.3g}"


def _exact(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.double() @ w.double().T, x.double().abs() @ w.double().abs().T


def test_pack_and_unpack_are_inverse():
    _, w = _operands(1, 40, 100, 0)
    panels = ops.pack_gemm_weight(w)
    assert panels.shape == (3, 20, PANEL, 2)
    assert torch.equal(panels[2, :, 100 - 2 * PANEL :], torch.zeros(20, 3 * PANEL - 100, 2, dtype=torch.bfloat16))
    assert panels[0, 3, 5, 1] == w[5, 7] and panels[1, 0, 2, 0] == w[PANEL + 2, 0]
    assert torch.equal(reference.unpack_gemm_weight(panels, 100), w)


def test_pack_rejects_what_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="even number of input features"):
        ops.pack_gemm_weight(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        ops.pack_gemm_weight(torch.zeros(4, 6))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 200])
@pytest.mark.parametrize(("depth", "cols"),
                         [(576, 960), (64, 49), (1536, 576), (96, 16), (10, 2 * PANEL + 1), (600, 50)])
def test_gemm_is_the_rounded_product(rows, depth, cols):
    x, w = _operands(rows, depth, cols, rows * 7 + cols)
    panels = ops.pack_gemm_weight(w)
    bias = torch.randn(cols, generator=torch.Generator().manual_seed(3))
    exact, scale = _exact(x, w)
    for threads in (1, 2):
        with torch_threads(threads):
            _assert_rounded_exact(ops.gemm_bf16(x, panels, cols), exact, scale)
            _assert_rounded_exact(ops.gemm_bf16(x, panels, cols, bias), exact + bias.double(), scale)


@needs_kernel
def test_float32_out_is_the_unrounded_sum():
    """The logits' GEMM: float32 sums, within float32's own error of the exact product."""
    x, w = _operands(21, 576, 2 * PANEL + 7, 4)
    panels = ops.pack_gemm_weight(w)
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(5))
    exact, scale = _exact(x, w)
    actual = ops.gemm_bf16(x, panels, w.shape[0], bias, out_dtype=torch.float32)
    assert actual.dtype == torch.float32
    assert bool(((actual.double() - exact - bias.double()).abs() <= scale * 1e-6 + 1e-6).all())
    rounded = ops.gemm_bf16(x, panels, w.shape[0], bias)
    assert torch.equal(actual.bfloat16(), rounded)
    assert not torch.equal(actual, rounded.float())


@pytest.mark.parametrize("kernels", [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in GEMM_ISAS, reason=f"no {isa} kernels here")) for isa in ("avx2", "avx512")], indirect=True)
def test_the_widened_gemm_rounds_subnormal_outputs_as_from_float(kernels):
    """Without AVX512-BF16 (avx2, avx512) the bf16 stores round in integer steps, as `from_float` does: a subnormal
    result keeps its bits (the bf16 tables' conversion instruction flushes it to zero), the same as torch's rounding."""
    x, w = _operands(9, 64, 2 * PANEL + 7, 21)
    w = (w.float() * 2.0**-126).bfloat16()  # sums of 64 products below float32's smallest normal, 2^-126
    panels = ops.pack_gemm_weight(w)
    sums = ops.gemm_bf16(x, panels, w.shape[0], out_dtype=torch.float32)
    rounded = ops.gemm_bf16(x, panels, w.shape[0])
    assert torch.equal(sums.bfloat16(), rounded)
    subnormal = (rounded != 0) & (rounded.float().abs() < 2.0**-126)
    assert subnormal.float().mean() > 0.5


@pytest.mark.skipif(not {"avx2", "avx512"} <= set(GEMM_ISAS), reason="needs both widening kernel tables")
def test_the_avx2_and_avx512_loops_give_the_same_bits():
    """Both widen the pairs and sum each output in one order, the even element's product first, in tiles of their
    own (4 rows x 16 columns, 8 rows x 48): the same bits, with a bias, an addend, the SiLU product, float32 out."""
    outputs = {}
    active = _C.cpu_isa()
    try:
        for isa in ("avx2", "avx512"):
            _C.set_cpu_isa(isa)
            got = []
            # 4,100 deep: the AVX2 loop's depth blocks of 1,024 pairs, the last one short
            for rows, depth, cols, seed in [(1, 64, 50, 31), (7, 576, 2 * PANEL + 37, 32), (13, 130, 17, 33),
                                            (6, 4100, PANEL + 20, 34)]:
                x, w = _operands(rows, depth, cols, seed)
                panels, up = ops.pack_gemm_weight(w), ops.pack_gemm_weight(w.flip(0))
                gen = torch.Generator().manual_seed(seed)
                bias, addend = torch.randn(cols, generator=gen), torch.randn(rows, 2 * cols, generator=gen)
                got += [ops.gemm_bf16(x, panels, cols, bias), ops.gemm_silu_mul_bf16(x, panels, up, cols, addend),
                        ops.gemm_bf16(x, panels, cols, None, torch.float32, addend[:, :cols].contiguous())]
            outputs[isa] = got
    finally:
        _C.set_cpu_isa(active)
    assert len(outputs["avx2"]) == 12
    for a, b in zip(outputs["avx2"], outputs["avx512"], strict=True):
        assert torch.equal(a, b)


@needs_kernel
def test_a_nan_sum_stays_nan_through_the_rounded_store():
    """A NaN sum rounds to a NaN, never to an infinity or a zero: the widening tables round in integer steps, and a
    NaN of bits 0x7fffffff (here from the addend) would carry into the sign there, giving -0, without its quieting."""
    cols = PANEL + 9
    x, w = _operands(5, 64, cols, 41)
    addend = torch.zeros(5, cols)
    addend.view(torch.int32)[2] = 0x7FFFFFFF
    addend.view(torch.int32)[3, ::2] = 0x7F800001  # a signalling NaN
    out = ops.gemm_bf16(x, ops.pack_gemm_weight(w), cols, addend=addend)
    assert out[2].isnan().all() and out[3, ::2].isnan().all()
    assert not out[[0, 1, 4]].isnan().any() and not out[3, 1::2].isnan().any()


@needs_kernel
def test_rows_past_a_cache_block_of_x():
    """x of over 4 MiB (300 rows x 8,192) goes through the panels in blocks of rows (and on AVX2, the depth in
    blocks of 2,048)."""
    x, w = _operands(300, 8192, 50, 17)
    exact, scale = _exact(x, w)
    _assert_rounded_exact(ops.gemm_bf16(x, ops.pack_gemm_weight(w), 50), exact, scale)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 8, 41])
@pytest.mark.parametrize("depth", [576, 4100])  # 4,100: the AVX2 loop's depth blocks carry both sums
def test_gemm_silu_mul_is_the_rounded_product(rows, depth):
    cols = 2 * PANEL + 20
    x, w = _operands(rows, depth, 2 * cols, rows)
    gate, up = w[:cols], w[cols:]
    exact_gate, scale_gate = _exact(x, gate)
    exact_up, scale_up = _exact(x, up)
    exact = torch.nn.functional.silu(exact_gate) * exact_up
    actual = ops.gemm_silu_mul_bf16(x, ops.pack_gemm_weight(gate), ops.pack_gemm_weight(up), cols)
    # silu's float32 exp adds a few float32 steps of its own to the products' errors.
    _assert_rounded_exact(actual, exact, (scale_gate * exact_up.abs() + scale_up * exact_gate.abs()) * 4)
    assert (actual.double() - exact).abs().max() > 0  # not accidentally compared with itself
    ref = reference.gemm_silu_mul_bf16(x, ops.pack_gemm_weight(gate), ops.pack_gemm_weight(up), cols)
    assert (actual != ref).float().mean() < 0.01


@needs_kernel
def test_rows_do_not_depend_on_the_batch_or_threads():
    x, w = _operands(67, 584, 3 * PANEL, 11)  # 584: whole AMX steps of 32 and a rest
    panels, up = ops.pack_gemm_weight(w), ops.pack_gemm_weight(w.flip(0))
    with torch_threads(2):
        full = ops.gemm_bf16(x, panels, w.shape[0])
        full_mul = ops.gemm_silu_mul_bf16(x, panels, up, w.shape[0])
    for threads in (1, 2):
        with torch_threads(threads):
            for begin, end in [(0, 1), (5, 6), (3, 12), (7, 67), (60, 67)]:
                assert torch.equal(ops.gemm_bf16(x[begin:end], panels, w.shape[0]), full[begin:end]), (begin, end)
                assert torch.equal(ops.gemm_silu_mul_bf16(x[begin:end], panels, up, w.shape[0]), full_mul[begin:end])


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_few_panels_split_the_rows_between_threads(out_dtype):
    """Fewer panels than twice the threads: the rows are cut into runs of tiles, every row computed once."""
    x, w = _operands(67, 128, 40, 16)  # one panel
    panels = ops.pack_gemm_weight(w)
    exact, scale = _exact(x, w)
    with torch_threads(1):
        alone = ops.gemm_bf16(x, panels, 40, out_dtype=out_dtype)
    for threads in (2, 3):
        with torch_threads(threads):
            split = ops.gemm_bf16(x, panels, 40, out_dtype=out_dtype)
            assert torch.equal(split, alone), threads
    _assert_rounded_exact(alone.bfloat16(), exact, scale)


@needs_kernel
def test_strided_rows_in_and_out_and_nothing_written_outside():
    x_wide, w = _operands(19, 600, 100, 12)
    x = x_wide[:, :576]  # rows 600 elements apart
    w = w[:, :576].contiguous()
    out_wide = torch.full((19, 130), 7.0, dtype=torch.bfloat16)
    out = out_wide[:, :100]
    _C.gemm_bf16(out, x, ops.pack_gemm_weight(w), None)
    exact, scale = _exact(x, w)
    _assert_rounded_exact(out, exact, scale)
    assert bool((out_wide[:, 100:] == 7.0).all())


@needs_kernel
def test_no_rows_is_no_work():
    _, w = _operands(1, 64, 48, 13)
    assert ops.gemm_bf16(torch.zeros(0, 64, dtype=torch.bfloat16), ops.pack_gemm_weight(w), 48).shape == (0, 48)


@needs_kernel
def test_bad_operands_are_value_errors():
    x, w = _operands(4, 64, 50, 14)
    panels = ops.pack_gemm_weight(w)
    out = torch.empty(4, 50, dtype=torch.bfloat16)
    cases = [
        ((out, x.float(), panels, None), "x must be a bfloat16"),
        ((out, x, panels[:, :16].contiguous(), None), "panels"),
        ((out, x, panels.transpose(1, 2), None), "panels|contiguous"),
        ((torch.empty(4, 97, dtype=torch.bfloat16), x, panels, None), "columns do not fill"),
        ((torch.empty(3, 50, dtype=torch.bfloat16), x, panels, None), "rows"),
        ((out, x, panels, torch.zeros(49)), "bias"),
        ((out, x, panels, torch.zeros(50, dtype=torch.bfloat16)), "bias"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            _C.gemm_bf16(*args)
    with pytest.raises(ValueError, match="up"):
        _C.gemm_silu_mul_bf16(out, x, panels, ops.pack_gemm_weight(_operands(1, 32, 50, 0)[1]))


def _moe_layer(num_experts: int, hidden: int, width: int, tokens: int, k: int, seed: int, idle: tuple[int, ...] = ()):
    """Packed SiLU-gated experts, tokens and their routing (k distinct experts each, none of `idle`)."""
    gen = torch.Generator().manual_seed(seed)
    def panels(rows: int, cols: int) -> list[torch.Tensor]:
        return [ops.pack_gemm_weight((torch.randn(rows, cols, generator=gen) / cols**0.5).bfloat16())
                for _ in range(num_experts)]
    gates, ups, downs = panels(width, hidden), panels(width, hidden), panels(hidden, width)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    return x, *moe_routing(tokens, k, num_experts, gen, idle), gates, ups, downs


@needs_kernel
@pytest.mark.parametrize(("tokens", "k"), [(0, 2), (1, 1), (6, 2), (70, 4)])
def test_moe_experts_are_the_per_expert_gemms_summed_in_expert_order(tokens, k):
    """`moe_silu_experts_bf16` cuts every expert's panels among the threads in one call: each token's result must be
    the per-expert GEMMs' (rows do not depend on the rows beside them), summed in ascending expert order; experts
    3 and 5 get no token. 200 features: 5 panels, the last partly filled; 136 wide: 3 panels."""
    x, ids, weights, gates, ups, downs = _moe_layer(9, 200, 136, tokens, k, seed=tokens, idle=(3, 5))
    want = moe_by_expert_calls(x, ids, weights, 9, lambda rows, e: ops.gemm_bf16(
        ops.gemm_silu_mul_bf16(rows, gates[e], ups[e], 136), downs[e], x.shape[1], out_dtype=torch.float32))
    for threads in (1, 2, 3, 7):  # 7: idle threads, and shares that cut an expert's panels
        with torch_threads(threads):
            got = ops.moe_silu_experts_bf16(x, ids, weights, gates, ups, downs, 136)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert torch.equal(got, want), threads
    if tokens:
        ref = reference.moe_silu_experts_bf16(x, ids, weights, gates, ups, downs, 136)
        assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


@needs_kernel
def test_moe_rows_do_not_depend_on_the_batch():
    x, ids, weights, gates, ups, downs = _moe_layer(16, 96, 64, 40, 3, seed=7)
    full = ops.moe_silu_experts_bf16(x, ids, weights, gates, ups, downs, 64)
    for rows in ([7], [0, 1, 2], list(range(39, 14, -1))):
        part = ops.moe_silu_experts_bf16(x[rows], ids[rows], weights[rows], gates, ups, downs, 64)
        assert torch.equal(part, full[rows]), rows


@needs_kernel
def test_moe_bad_operands_are_value_errors():
    x, ids, weights, gates, ups, downs = _moe_layer(4, 64, 48, 5, 2, seed=8)
    out = torch.empty_like(x)
    cases = [
        ((out, x, ids.clone().fill_(4), weights, gates, ups, downs, 48), "token 0 names expert 4 of 4"),
        ((out, x, ids.int(), weights, gates, ups, downs, 48), "expert_ids must be Long"),
        ((out, x, ids, weights[:4], gates, ups, downs, 48), "expert_ids and weights"),
        ((out, x, ids, weights, gates, ups[:3], downs, 48), "same number"),
        ((out, x, ids, weights, gates, ups, downs, 50), "gate|columns"),
        ((out, x.float(), ids, weights, gates, ups, downs, 48), "hidden must be a bfloat16"),
        ((out, x, ids, weights, gates, ups, downs[:3] + [gates[0]], 48), "down"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            _C.moe_silu_experts_bf16(*args)


def test_amx_kernels_run_where_the_processor_has_amx():
    """Linux lists amx_tile / amx_bf16 only where it also saves the tile state: the amx_bf16 kernels
    must then be found (their detection asks CPUID and the kernel's leave), and chosen by default."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        pytest.skip("no AMX here")
    assert "amx_bf16" in _C.supported_cpu_isas()
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_CPU_ISA"}
    chosen = subprocess.run([sys.executable, "-c", "import torch; from batchgen import _C; print(_C.cpu_isa())"],
                            capture_output=True, text=True, check=True, env=env)
    assert chosen.stdout.strip() == "amx_bf16"


@needs_gemm
def test_other_instruction_sets_run_the_reference():
    x, w = _operands(9, 64, 50, 15)
    panels = ops.pack_gemm_weight(w)
    active = _C.cpu_isa()
    try:
        _C.set_cpu_isa("scalar")
        assert not ops.has_gemm_bf16()
        assert torch.equal(ops.gemm_bf16(x, panels, 50), reference.gemm_bf16(x, panels, 50))
        with pytest.raises(ValueError, match="needs AVX2 or AVX-512 kernels"):
            _C.gemm_bf16(torch.empty(9, 50, dtype=torch.bfloat16), x, panels, None)
    finally:
        _C.set_cpu_isa(active)
    assert ops.has_gemm_bf16() == (active in GEMM_ISAS)
