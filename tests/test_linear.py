import pytest
import torch
from torch import nn

from batchgen import _C, ops
from batchgen.layers import linear as linear_module
from batchgen.layers.linear import (
    Linear,
    PackedLinear,
    PackedSiluAndMul,
    gather_panels,
    linear,
    logits_head,
    onednn_bf16,
    pack_linears,
)

# With AMX, oneDNN picks its kernels by the number of rows in ranges (see layers/linear.py): bf16
# oneDNN rows and unpacked F.linear rows depend on the batch there, and the engine uses neither.
ONEDNN_AMX = "amx_bf16" in _C.supported_cpu_isas()
ONEDNN_AMX_REASON = "oneDNN's AMX kernels round rows by batch size; the engine does not use this path there"

# (dtype, layout): bf16 packs into batchgen's GEMM panels where the processor has AVX-512,
# into oneDNN's bf16 layout where it has AVX-512, and as a float32 copy elsewhere (float16 always); each is
# tested here, the latter two by refusing the panels (and oneDNN's bf16).
LAYOUTS = [(torch.float32, "onednn"), (torch.bfloat16, "float32"), (torch.float16, "float32"),
           pytest.param(torch.bfloat16, "onednn", marks=[
               pytest.mark.skipif(ONEDNN_AMX, reason=ONEDNN_AMX_REASON),
               pytest.mark.skipif(not onednn_bf16(),
                                  reason="oneDNN takes no bf16 here (AVX2 only, or AVX-512 without AVX512-BF16)")]),
           pytest.param(torch.bfloat16, "panels", marks=pytest.mark.skipif(
               not ops.has_gemm_bf16(), reason="no bf16 GEMM in these kernels (scalar)"))]


@pytest.fixture
def layout(request, monkeypatch):
    if request.param in ("onednn", "float32"):
        monkeypatch.setattr(linear_module, "uses_gemm_panels", lambda weight: False)
    if request.param == "float32":
        monkeypatch.setattr(linear_module, "onednn_bf16", lambda: False)
    return request.param


@pytest.mark.skipif(ONEDNN_AMX, reason=ONEDNN_AMX_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_batch_size(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(576, 1536, generator=gen) * 0.05).to(dtype)
    for _ in range(20):
        x = torch.randn(64, 1536, generator=gen).to(dtype)
        full = linear(x, weight)
        for rows in (1, 2, 3, 5, 17):
            assert torch.equal(linear(x[:rows], weight), full[:rows]), rows


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
@pytest.mark.parametrize(("dtype", "layout"), LAYOUTS, indirect=["layout"])
def test_packed_linear_matches_and_rows_do_not_depend_on_batch_size(dtype, layout):
    gen = torch.Generator().manual_seed(1)
    # float32 at SmolLM2's down_proj depth, where oneDNN with AMX rounds a lone row differently (padded)
    cols, depth = (576, 1536) if dtype == torch.float32 else (960, 576)
    weight = (torch.randn(cols, depth, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(cols, generator=gen).to(dtype)
    packed = PackedLinear(weight, bias)
    assert packed.uses_panels == (layout == "panels")
    assert packed.compute == (torch.float32 if layout == "float32" else dtype)
    for _ in range(10):
        x = torch.randn(64, depth, generator=gen).to(dtype)
        full = packed(x)
        assert full.dtype == dtype
        expected = torch.nn.functional.linear(x, weight, bias)
        if layout == "float32":  # float32 sums of the same products, rounded once to the weight's dtype
            exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
            torch.testing.assert_close(full.double(), exact.to(dtype).double(), rtol=2**-7, atol=1e-2)
        elif layout == "panels":  # float32 sums in another order: a last-bit flip here and there
            torch.testing.assert_close(full, expected, rtol=2**-7, atol=1e-2)
            assert (full != expected).float().mean() < 0.01
        elif dtype == torch.bfloat16:
            assert torch.equal(full, expected)  # bitwise what F.linear gives
        else:
            torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 3, 5, 17):
            assert torch.equal(packed(x[:rows]), full[:rows]), rows


def test_pack_linears_replaces_every_projection():
    model = torch.nn.Sequential(Linear(8, 16), torch.nn.Sequential(Linear(16, 4, bias=False)), torch.nn.ReLU())
    x = torch.randn(3, 8)
    expected = model(x)
    assert len(pack_linears(model)) == (2 if torch.backends.mkldnn.is_available() else 0)
    if torch.backends.mkldnn.is_available():
        assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
@pytest.mark.parametrize(("dtype", "layout"), LAYOUTS, indirect=["layout"])
def test_packed_silu_and_mul_matches_and_rows_do_not_depend_on_batch_size(dtype, layout):
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(2 * 384, 576, generator=gen) * 0.05).to(dtype)
    fused = PackedSiluAndMul(weight)
    assert fused.uses_panels == (layout == "panels")
    assert fused.compute == (torch.float32 if layout == "float32" else dtype)
    for _ in range(5):
        x = torch.randn(64, 576, generator=gen).to(dtype)
        full = fused(x)
        assert full.dtype == dtype
        gate, up = (x.float() @ weight.float().T).chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(full.float(), expected, rtol=tol, atol=tol)
        for rows in (1, 2, 3, 5, 17):
            assert torch.equal(fused(x[:rows]), full[:rows]), rows


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an own lm_head, a tied one
def test_loaded_cpu_model_runs_packed_gemms(tiny_model_dirs, arch):
    """Parity tests pass packed or not; this one fails if loading stops packing."""
    from transformers import AutoConfig

    from batchgen.models.loader import load_model

    path = tiny_model_dirs[arch]
    model = load_model(path, AutoConfig.from_pretrained(path), torch.bfloat16, torch.device("cpu"), 256)
    head = model.lm_head if model.lm_head is not None else model._tied_head
    assert isinstance(head, PackedLinear)
    assert head.uses_panels == ops.has_gemm_bf16()
    # The head's logits come out in float32 everywhere (bf16 logits tie near-equal tokens): batchgen's GEMM's
    # float32 sums, or a float32 copy of the head where the panels do not take it.
    assert head.compute == (torch.bfloat16 if ops.has_gemm_bf16() else torch.float32)
    assert model.compute_logits(torch.randn(3, model.cfg.hidden_size).bfloat16()).dtype == torch.float32
    assert not [name for name, m in model.named_modules() if isinstance(m, Linear)]
    assert all(isinstance(layer.mlp.packed_gate_up, PackedSiluAndMul) for layer in model.layers)
    assert all(layer.mlp.packed_gate_up.uses_panels == ops.has_gemm_bf16() for layer in model.layers)
    # bf16 weights pack in bf16 (batchgen's panels, oneDNN's bf16) or, under the scalar kernels, as float32 copies.
    native = ops.has_gemm_bf16() or onednn_bf16()
    assert model.layers[0].mlp.packed_gate_up.compute == (torch.bfloat16 if native else torch.float32)
    x = torch.randn(5, model.cfg.hidden_size).bfloat16()
    assert model.layers[0].mlp.packed_gate_up(x).dtype == torch.bfloat16
    # Every panel lies in the one huge-page mapping gather_panels made.
    panels = [getattr(m, n) for m in model.modules() if getattr(m, "uses_panels", False) for n in m.panel_names]
    assert len({t.untyped_storage().data_ptr() for t in panels}) == (1 if ops.has_gemm_bf16() else 0)


def test_loaded_model_buffers_equal_a_fresh_build(tiny_model_dirs):
    """The loader builds the model on the meta device, so no checkpoint fills its buffers (today the rotary
    table): every buffer must equal that of a model built the ordinary way."""
    from transformers import AutoConfig

    from batchgen.models.llama import LlamaForCausalLM
    from batchgen.models.loader import load_model, native_config

    path = tiny_model_dirs["llama"]
    hf_config = AutoConfig.from_pretrained(path)
    loaded = dict(load_model(path, hf_config, torch.bfloat16, torch.device("cpu"), 256).named_buffers())
    fresh = dict(LlamaForCausalLM(native_config(hf_config, 256)).to(torch.bfloat16).named_buffers())
    assert "rotary.cos_sin" in fresh and loaded.keys() == fresh.keys()
    for name, buffer in fresh.items():
        assert loaded[name].device.type == "cpu" and torch.equal(loaded[name], buffer), name


@pytest.mark.skipif(not ops.has_gemm_bf16(), reason="no bf16 GEMM in these kernels (scalar)")
def test_gathered_panels_give_the_same_outputs():
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(2 * 96, 64, generator=gen) * 0.1).bfloat16()
    x = torch.randn(7, 64, generator=gen).bfloat16()
    parent = nn.ModuleDict({"linear": PackedLinear(weight), "fused": PackedSiluAndMul(weight)})
    expected = parent["linear"](x), parent["fused"](x)
    gather_panels(parent)
    gathered = parent["linear"].packed, parent["fused"].gate, parent["fused"].up
    assert len({t.untyped_storage().data_ptr() for t in gathered}) == 1
    assert torch.equal(parent["linear"](x), expected[0]) and torch.equal(parent["fused"](x), expected[1])


@pytest.mark.skipif(not ops.has_gemm_bf16(), reason="no bf16 GEMM in these kernels (scalar)")
def test_gemm_panels_take_any_leading_shape_and_strided_rows():
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(2 * 100, 64, generator=gen) * 0.1).bfloat16()
    x = torch.randn(3, 5, 80, generator=gen).bfloat16()[..., 8:72]  # rows 80 elements apart
    flat = x.reshape(15, 64).contiguous()
    packed, fused = PackedLinear(weight), PackedSiluAndMul(weight)
    assert torch.equal(packed(x), packed(flat).view(3, 5, 200))
    assert torch.equal(packed(x[0]), packed(flat[:5]))  # a 2-D view with a row stride of its own
    assert torch.equal(fused(x), fused(flat).view(3, 5, 100))
    swapped = flat.view(3, 5, 64).transpose(0, 1).reshape(15, 64)
    assert torch.equal(fused(x.transpose(0, 1)), fused(swapped).view(5, 3, 100))


@pytest.mark.skipif(not ops.has_gemm_bf16(), reason="no bf16 GEMM in these kernels (scalar)")
def test_deep_weights_stay_with_onednn_unless_on_tiles_or_widened():
    """On the bf16 dot product, deep weights stay with oneDNN; on tiles, and without AVX512-BF16 (where oneDNN
    emulates bf16, or on AVX2 has none), every depth takes the panels."""
    deep = torch.zeros(48, linear_module.MAX_PANEL_DEPTH + 2, dtype=torch.bfloat16)
    expected = {"avx2": True, "avx512": True, "avx512_bf16": False, "amx_bf16": True, "amx_emulated": True}
    active = _C.cpu_isa()
    tables = [isa for isa in _C.supported_cpu_isas() if isa in expected]
    assert "avx2" in tables  # has_gemm_bf16: an x86-64 processor
    try:
        for isa in tables:
            _C.set_cpu_isa(isa)
            assert ops.gemm_widens_bf16() == (isa in ("avx2", "avx512"))
            # (where oneDNN has no bf16 at all, capped by ONEDNN_MAX_CPU_ISA, every depth packs on every table)
            assert PackedLinear(deep).uses_panels == (expected[isa] or not onednn_bf16()), isa
            assert PackedLinear(deep[:, : linear_module.MAX_PANEL_DEPTH]).uses_panels, isa
            # An odd depth, which no panel takes: oneDNN's bf16, or float32 where oneDNN emulates bf16 or has none
            # (the widening tables' processors; or oneDNN capped by ONEDNN_MAX_CPU_ISA).
            odd = PackedLinear(deep[:, :63])
            assert not odd.uses_panels and odd.compute == (torch.bfloat16 if onednn_bf16() else torch.float32), isa
            assert odd.compute == torch.float32 or isa not in ("avx2", "avx512"), isa  # never emulated bf16
    finally:
        _C.set_cpu_isa(active)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_head_gives_float32_logits_that_do_not_tie(dtype):
    """Two tokens whose logits differ by less than bf16's spacing there (20 and 20.0625; bf16 rounds both to 20,
    and argmax would take the lower id): the head's float32 logits keep them apart on every processor."""
    weight = torch.zeros(2, 16, dtype=dtype)
    weight[:, 0], weight[1, 1] = 20.0, 0.0625
    hidden = torch.ones(3, 16, dtype=dtype)
    assert torch.nn.functional.linear(hidden.bfloat16(), weight.bfloat16()).argmax(-1).tolist() == [0, 0, 0]
    logits = logits_head(weight)(hidden)
    assert logits.dtype == torch.float32
    assert logits.argmax(-1).tolist() == [1, 1, 1]
    torch.testing.assert_close(logits, torch.tensor([[20.0, 20.0625]] * 3))
