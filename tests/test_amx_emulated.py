"""The amx_emulated kernel table: the amx_bf16 code (the bf16 GEMM, every bf16 attention path and the int8 GEMM on
AMX tiles) compiled again on an emulated tile unit, offered where the processor has AVX512-BF16 and no AMX, so
that the tile paths are tested on machines without AMX. The kernel tests of other files run under every table,
this one included; here: where it is offered, that it is never the default, and that its work does go through
the emulated tiles (the unit counts its tile products)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import paged_kv, random_query, rel_err

from batchgen import _C, ops
from batchgen.ops import reference

ISAS = _C.supported_cpu_isas()
EMULATED = "amx_emulated" in ISAS
ASKED = os.environ.get("BATCHGEN_EMULATE_AMX") == "1"  # where AMX runs, the emulation too (to compare the two)
needs_emulation = pytest.mark.skipif(not EMULATED, reason="AMX runs here (or AVX512-BF16 does not): amx_bf16 is tested")


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    return set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()


def test_the_emulated_tables_are_offered_exactly_where_amx_is_not():
    assert EMULATED == ("avx512_bf16" in ISAS and ("amx_bf16" not in ISAS or ASKED))
    int8 = _C.supported_int8_kernels()
    assert ("amx_int8_emulated" in int8) == ("avx512_vnni" in int8 and ("amx_int8" not in int8 or ASKED))
    flags = _cpu_flags()
    if {"avx512_bf16", "avx512_vnni"} <= flags and not flags & {"amx_tile", "amx_bf16"}:
        assert EMULATED and "amx_int8_emulated" in int8  # CI's Zen 4/5 machines run the tile paths emulated
    if EMULATED:
        assert ISAS[0] == "amx_emulated" and ISAS[-1] != "amx_emulated"


def _chosen(extra_env: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHGEN_CPU_ISA", "BATCHGEN_EMULATE_AMX")} | extra_env
    code = "import torch; from batchgen import _C; print(_C.cpu_isa(), _C.int8_kernel())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.split()


@needs_emulation
def test_the_emulated_table_runs_only_when_asked_for():
    table, int8 = _chosen({})
    assert table != "amx_emulated" and int8 != "amx_int8_emulated"
    asked = {"BATCHGEN_CPU_ISA": "amx_emulated", "BATCHGEN_EMULATE_AMX": "1"}  # the second only matters with AMX
    assert _chosen(asked) == ["amx_emulated", "amx_int8_emulated"]
    assert _chosen({"BATCHGEN_EMULATE_AMX": "1"}) == [table, int8]  # offered, still not the default


@pytest.fixture
def emulated():
    active = _C.cpu_isa()
    _C.set_cpu_isa("amx_emulated")
    try:
        yield
    finally:
        _C.set_cpu_isa(active)


def _on_tiles(run):
    """run() under the emulated table, and how many tile products it computed."""
    before = _C.emulated_tile_products()
    result = run()
    return result, _C.emulated_tile_products() - before


@needs_emulation
def test_gemms_run_on_the_emulated_tiles(emulated):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(21, 96, generator=gen).bfloat16()
    w = torch.randn(100, 96, generator=gen).bfloat16()
    panels = ops.pack_gemm_weight(w)
    out, products = _on_tiles(lambda: ops.gemm_bf16(x, panels, 100))
    assert products >= 2 * 3 * 3  # 2 row blocks x 3 panels x 3 depth steps, at least
    assert rel_err(out, x.float() @ w.float().T) < 1e-2

    packed = ops.pack_int8_weight(w.float())
    out, products = _on_tiles(lambda: ops.linear_int8(x, packed))
    assert products > 0
    assert torch.equal(out, reference.linear_int8(x, packed))


@needs_emulation
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_attention_runs_on_the_emulated_tiles(emulated, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 37, 130]
    kv = paged_kv(lens, 2, 64, 16, torch.bfloat16, "cpu", gen)
    key_cache, value_cache = kv.key_cache.to(cache_dtype), kv.value_cache.to(cache_dtype)
    scales = {} if cache_dtype == torch.bfloat16 else {"k_scale": torch.ones(2), "v_scale": torch.ones(2)}
    q = random_query(len(lens), 4, 64, torch.bfloat16, "cpu", gen)
    args = (q, key_cache, value_cache, kv.block_tables, kv.seq_lens, 0.125)
    out, products = _on_tiles(lambda: ops.paged_attention_decode(*args, **scales))
    assert products > 0
    expected = reference.paged_attention_decode(*args, **scales)
    assert rel_err(out, expected) < 2e-2

    q = random_query(sum(lens), 4, 64, torch.bfloat16, "cpu", gen)
    starts = torch.tensor([0, 1, 38, 168], dtype=torch.int32)
    args = (q, key_cache, value_cache, kv.block_tables, kv.seq_lens, starts, 0.125)
    out, products = _on_tiles(lambda: ops.paged_attention_prefill(*args, **scales))
    assert products > 0
    assert rel_err(out, reference.paged_attention_prefill(*args, **scales)) < 2e-2


@pytest.mark.skipif(not {"amx_bf16", "amx_emulated"} <= set(ISAS),
                    reason="compares the emulation with the tile unit: needs AMX and BATCHGEN_EMULATE_AMX=1")
def test_the_emulated_unit_gives_the_tile_units_bits():
    """On an AMX processor with BATCHGEN_EMULATE_AMX=1: the GEMM, attention over bf16 and fp8 caches, and the int8
    GEMM give the same bits on the emulated unit as on the hardware's (whether tdpbf16ps rounds in the SDM's
    order). Where this fails, amx_emulated still tests the code's logic, and this says it is no bit-exact model."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(37, 608, generator=gen).bfloat16()  # 608: 19 tile steps of 32 and a rest
    w = torch.randn(100, 608, generator=gen).bfloat16()
    panels, packed = ops.pack_gemm_weight(w), ops.pack_int8_weight(w.float())
    lens = [1, 37, 130]
    kv = paged_kv(lens, 2, 64, 16, torch.bfloat16, "cpu", gen)
    q = random_query(len(lens), 4, 64, torch.bfloat16, "cpu", gen)
    fp8 = dict(k_scale=torch.full((2,), 0.5), v_scale=torch.full((2,), 0.25))
    fp8_kv = (kv.key_cache.to(torch.float8_e4m3fn), kv.value_cache.to(torch.float8_e4m3fn))

    def outputs():
        return [ops.gemm_bf16(x, panels, 100, out_dtype=torch.float32), ops.linear_int8(x, packed),
                ops.paged_attention_decode(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125),
                ops.paged_attention_decode(q, *fp8_kv, kv.block_tables, kv.seq_lens, 0.125, **fp8)]

    active = _C.cpu_isa()
    try:
        _C.set_cpu_isa("amx_bf16")
        hardware = outputs()
        _C.set_cpu_isa("amx_emulated")
        emulated, products = _on_tiles(outputs)
    finally:
        _C.set_cpu_isa(active)
    assert products > 0
    for name, a, b in zip(("gemm", "int8", "decode", "decode fp8"), hardware, emulated, strict=True):
        assert torch.equal(a, b), name
