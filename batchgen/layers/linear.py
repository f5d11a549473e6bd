"""Linear layers: fast on CPU, and with every output row independent of how many rows the batch has.

On CPU the weights are packed once, after loading. bf16 weights go into the panels of batchgen's own
GEMM (`batchgen.ops.gemm_bf16`, engine_src/csrc/cpu/gemm_impl.h, on AMX tiles where the processor has
them, gemm_amx.h, and gemm_avx2.h on processors without AVX-512): measured on 2 cores without AMX
with SmolLM2's 30 layers, each weight from memory, it runs the layers' projections 1.4x faster than
oneDNN's packed GEMMs at 16-64 rows and 1.1x at 256-2048; with AMX, 1.3-1.7x faster at 8-40 rows
and within ~10% of oneDNN's AMX GEMMs at 128-256. Without AVX512-BF16 (Intel's Skylake-SP, Cascade Lake
and Ice Lake Xeons) the GEMM widens the pairs to float32 FMAs, at about oneDNN's float32 rate, where oneDNN's
emulated bf16 ran at a third of it (Zen 4 with both capped to that instruction set). On AVX2 alone (AMD
Zen 2 and 3) it widens the same way, in a tile sized for 16 registers: 1.1-3.5x oneDNN's float32 GEMM on
float32 copies at 1-64 rows and 0.95-1.0x at 256-1024 (Zen 4 capped to AVX2), in half their memory. Other
weights go into oneDNN's blocked layout (the `torch.ops.mkldnn` linear ops that torch.compile's
freezing also uses): `F.linear` re-blocks the weight on every call, which costs most at the small
batches of decoding (packed: 25-60% faster at 8-64 rows in bf16, ~2.4x in float32).

Batch invariance: BLAS libraries pick GEMM kernels by shape, and a kernel for a very short
matrix can round differently from the one for a tall matrix (unpacked torch 2.13 on CPU: float32
rows differ between M <= 3 and M >= 4, bfloat16 rows between M = 1 and M >= 2). A lone decode step
would then give its sequence slightly different logits than the same step in a full batch, and a
seeded sample would change with batch composition. Unpacked, short inputs are padded to MIN_ROWS
rows, which keeps every row on the tall-matrix kernels; batchgen's GEMM sums every output in one
order whatever the rows, and oneDNN's packed GEMMs gave identical rows for every M measured (1 to
2048): neither needs padding. tests/test_linear.py checks all three.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchgen import ops

MIN_ROWS = 8
_PACK_BATCH_HINT = 64  # rows oneDNN tunes the blocked layout for; 8..256 measured within noise


def _on_min_rows(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """gemm(x) for x of at least MIN_ROWS rows; shorter x is padded with zero rows (see above)."""
    rows = x.shape[0]
    if rows >= MIN_ROWS:
        return gemm(x)
    return gemm(F.pad(x, (0, 0, 0, MIN_ROWS - rows)))[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _on_min_rows(lambda rows: F.linear(rows, weight, bias), x)


def forward_on_min_rows(module: nn.Module) -> None:
    """Makes `module`, one that multiplies its input by a weight of its own with F.linear (transformers' MoE
    routers), run on at least MIN_ROWS rows, as `linear` runs F.linear: its input [..., rows, features] is padded
    with zero rows, and each tensor it returns cut back to `rows` along the first dimension of the padded count.
    The module itself stays in place (its parent may read its attributes); only its forward is wrapped."""
    inner = module.forward

    def forward(x: torch.Tensor, *args, **kwargs):
        rows = x.shape[-2]
        if rows >= MIN_ROWS:
            return inner(x, *args, **kwargs)
        out = inner(F.pad(x, (0, 0, 0, MIN_ROWS - rows)), *args, **kwargs)
        return tuple(_cut_rows(t, rows) for t in out) if isinstance(out, tuple) else _cut_rows(out, rows)

    module.forward = forward


def _cut_rows(t, rows: int):
    if not isinstance(t, torch.Tensor) or MIN_ROWS not in t.shape:
        return t
    return t.narrow(list(t.shape).index(MIN_ROWS), 0, rows)


def onednn_bf16() -> bool:
    """Whether bf16 weights may go to oneDNN here: it needs AVX-512 (or AVX-NE-CONVERT), and raises on an AVX2-only
    CPU; and where batchgen's GEMM widens bf16 (AVX-512 without AVX512-BF16) oneDNN only emulates bf16, at a third
    of its float32 rate, so a bf16 weight the panels do not take goes float32 there."""
    return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and not ops.gemm_widens_bf16())


def compute_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype a CPU weight packs and multiplies in: its own (float32; bf16 in batchgen's GEMM panels or
    oneDNN's bf16), float32 for a 16-bit weight that neither takes (float16; bf16 of an odd depth where oneDNN has
    no native bf16), None where nothing packs (a GPU). On AVX2, torch's own bf16 linear ran at ~1 GFLOP/s: 64 x 576
    x 1536 took 76 ms where a packed float32 copy takes 2.4 ms (31x; 4.4x at 16 rows, 7.6x at 512; even at 1 row).
    The float32 copy holds twice the weight's bytes; the inputs are widened and the outputs rounded to the model's
    dtype, so a row's result is its float32 sum rounded once, as in torch's bf16 linear."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and (
            uses_gemm_panels(weight) or onednn_bf16())):
        return weight.dtype
    return torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else None


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` packs, into batchgen's bf16 GEMM panels or oneDNN's layout (see compute_dtype)."""
    return compute_dtype(weight) is not None


MAX_PANEL_DEPTH = 5120  # two panels of 48 outputs x this many inputs fill a 1 MiB L2; see uses_gemm_panels


def uses_gemm_panels(weight: torch.Tensor) -> bool:
    """Whether `weight` packs into the panels of batchgen's bf16 GEMM rather than oneDNN's layout. Deeper
    weights stay with oneDNN on the vector loop: it does not block the depth, and once a panel no longer
    fits in L2 twice it ran 13% slower than oneDNN at 16 rows (8,192 deep; faster up to 4,096 deep). On
    AMX tiles every depth packs: oneDNN's bf16 rows would depend on the batch, and the tiles ran within
    -20% / +20% of it at 8,192-14,336 deep. Where oneDNN does not take bf16 (`onednn_bf16`: it emulates it
    without AVX512-BF16) every depth packs too."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0
            and (weight.shape[1] <= MAX_PANEL_DEPTH or ops.gemm_on_tiles() or not onednn_bf16())
            and ops.has_gemm_bf16())


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows with a unit last stride, as batchgen's GEMM reads them; x itself in the engine's
    case (reshaping every call cost ~2 us, x 120 calls a step)."""
    return x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()


def _with_leading_shape(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The GEMM's 2-D rows `out` back in x's leading dimensions (undoes `_as_rows`)."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)


class PackedModule(nn.Module):
    """What the packed modules share: their features, which layout they packed into (`uses_panels`) and
    the names of the tensors holding batchgen's GEMM panels (`panel_names`, moved by gather_panels)."""

    panel_names: tuple[str, ...] = ()
    in_features: int
    out_features: int
    uses_panels: bool

    def extra_repr(self) -> str:
        layout = "gemm panels" if self.uses_panels else "oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed ({layout})"


class PackedLinear(PackedModule):
    """y = x W^T + b with W packed for batchgen's bf16 GEMM or in oneDNN's blocked layout, in `compute_dtype(W)`
    (or the `compute` given). Inference only.

    `float_out`: float32 results, unrounded (for logits: bf16 logits of ~16-32 are 0.125 apart, so close
    candidates tie and argmax takes the lower token id); otherwise W's dtype."""

    panel_names = ("packed",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False,
                 compute: torch.dtype | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = torch.float32 if float_out else weight.dtype
        weight = weight.detach().to(compute or compute_dtype(weight))
        self.uses_panels = uses_gemm_panels(weight)
        self.packed = ops.pack_gemm_weight(weight) if self.uses_panels else _pack(weight)
        # batchgen's GEMM adds a float32 bias to its float32 sums; oneDNN takes W's dtype. A copy: the bias may be a
        # view of the checkpoint's memory-mapped file, which a plain attribute would keep mapped (own_memory sees
        # only parameters and buffers).
        self.bias = None if bias is None else bias.detach().to(torch.float32 if self.uses_panels else weight.dtype,
                                                               copy=True)
        self.compute = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_panels:
            return _with_leading_shape(ops.gemm_bf16(_as_rows(x), self.packed, self.out_features, self.bias,
                                                     self.out_dtype), x)
        out = _on_min_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(
            rows, self.packed, self.bias, "none", [], ""), _as_rows(x).to(self.compute).contiguous())
        return _with_leading_shape(out.to(self.out_dtype), x)


def logits_head(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """The head that turns hidden states into float32 logits with `weight` on the CPU; None where nothing packs (a
    GPU: the plain weight). A 16-bit head runs in float32 unless batchgen's GEMM panels take it (they sum in
    float32): oneDNN's and torch's bf16 linears round the logits to bf16, where SmolLM2's two best first tokens for
    "What is the capital of France?" tied on a Zen 2 (25.52 and 25.50 in float32) and argmax took the lower id
    ("L'Étoile..." instead of "The capital..."). The float32 copy holds twice the head's bytes."""
    if not can_pack(weight):
        return None
    return PackedLinear(weight, bias, float_out=True, compute=None if uses_gemm_panels(weight) else torch.float32)


class PackedSiluAndMul(PackedModule):
    """silu(x W_gate^T) * (x W_up^T) from a fused [gate; up] weight, the activations never making a trip
    through memory on their own: batchgen's bf16 GEMM computes both products of a tile and rounds
    silu(gate) * up once; oneDNN's (other weights) runs two GEMMs whose epilogues apply the SiLU and the
    product (~8% faster than a GEMM, silu and mul at 2048 rows). transformers rounds silu(gate) first."""

    panel_names = ("gate", "up")

    def __init__(self, gate_up_weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = gate_up_weight.shape[1], gate_up_weight.shape[0] // 2
        self.out_dtype = gate_up_weight.dtype
        gate_up_weight = gate_up_weight.detach().to(compute_dtype(gate_up_weight))
        gate, up = gate_up_weight[: self.out_features], gate_up_weight[self.out_features :]
        self.uses_panels = uses_gemm_panels(gate_up_weight)
        pack = ops.pack_gemm_weight if self.uses_panels else _pack
        self.gate, self.up = pack(gate), pack(up)
        self.compute = gate_up_weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_panels:
            return _with_leading_shape(ops.gemm_silu_mul_bf16(_as_rows(x), self.gate, self.up, self.out_features), x)
        def silu_mul(rows: torch.Tensor) -> torch.Tensor:
            gate = torch.ops.mkldnn._linear_pointwise(rows, self.gate, None, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(rows, gate, self.up, None, "mul")

        out = _on_min_rows(silu_mul, _as_rows(x).to(self.compute).contiguous())
        return _with_leading_shape(out.to(self.out_dtype), x)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def plain_linear(module: nn.Module, kinds: tuple[type[nn.Linear], ...] = (nn.Linear,)) -> bool:
    """Whether module is a linear of `kinds` computing x W^T + b and nothing else: a subclass with a forward of its
    own (one of transformers' MoE routers, an nn.Linear returning its routing) is not."""
    return isinstance(module, kinds) and any(type(module).forward is kind.forward for kind in kinds)


def replace_linears(module: nn.Module, kinds: tuple[type[nn.Linear], ...],
                    replacement: Callable[[nn.Linear], nn.Module | None]) -> dict[str, nn.Linear]:
    """Replaces every plain linear of `kinds` below module by `replacement(linear)` where that gives a module (None:
    left as it is); returns the replaced linears by their qualified names."""
    replaced = {}
    for name, child in list(module.named_children()):
        if not plain_linear(child, kinds):
            replaced |= {f"{name}.{key}": m for key, m in replace_linears(child, kinds, replacement).items()}
        elif (new := replacement(child)) is not None:
            setattr(module, name, new)
            replaced[name] = child
    return replaced


def pack_linears(module: nn.Module, kinds: tuple[type[nn.Linear], ...] = (Linear,)) -> dict[str, nn.Linear]:
    """Replaces every packable plain linear of `kinds` below module by a `PackedLinear` (dropping the plain
    weight); returns the replaced modules by their qualified names."""
    return replace_linears(module, kinds, lambda linear: PackedLinear(linear.weight, linear.bias)
                           if can_pack(linear.weight) else None)


class Int8Linear(nn.Module):
    """y = x W^T + b on int8 compute (`ops.linear_int8`, opt-in: quantization="int8", docs/int8.md): W quantized
    per output feature at load, x per row on every call, exact int32 sums scaled back in float32; y in x's
    dtype. A row's result depends on that row alone. `scale`: W was quantized ahead (a checkpoint's int8 values
    and their scales, `ops.checkpoint_int8_weight`). Inference only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 float_out: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = ops.pack_int8_weight(weight, scale)
        self.bias = None if bias is None else bias.detach().to(torch.float32, copy=True)  # as PackedLinear's
        self.out_dtype = torch.float32 if float_out else None  # float_out: the float32 results, unrounded

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _with_leading_shape(ops.linear_int8(_as_rows(x), self.weight, self.bias, self.out_dtype), x)


class Int8SiluAndMul(nn.Module):
    """silu(x W_gate^T) * (x W_up^T) on int8 compute from a fused [gate; up] weight (`ops.linear_silu_mul_int8`):
    x quantized once, the product taken while the GEMM's results are in cache. `scale` as Int8Linear's. Inference
    only."""

    def __init__(self, gate_up_weight: torch.Tensor, scale: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = gate_up_weight.shape[1], gate_up_weight.shape[0] // 2
        self.weight = ops.pack_int8_gate_up(gate_up_weight, scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _with_leading_shape(ops.linear_silu_mul_int8(_as_rows(x), self.weight), x)


def quantize_linears(module: nn.Module, kinds: tuple[type[nn.Linear], ...] = (Linear,),
                     keep: frozenset[int] = frozenset()) -> dict[str, nn.Linear]:
    """Replaces every plain linear of `kinds` below module, but those whose id is in `keep`, by an `Int8Linear`
    (dropping the plain weight); one with a `weight_scale` holds a checkpoint's int8 weight, packed as it is.
    Returns the replaced modules by their qualified names."""
    return replace_linears(module, kinds, lambda linear: None if id(linear) in keep else Int8Linear(
        linear.weight, linear.bias, getattr(linear, "weight_scale", None)))


def gather_panels(module: nn.Module) -> None:
    """Moves the GEMM panels of every packed module below `module` side by side onto huge pages
    (`ops.move_onto_huge_pages`): each step streams them all from memory, 4 KiB page by 4 KiB page otherwise."""
    ops.move_onto_huge_pages([(m, name) for m in module.modules() if isinstance(m, PackedModule) and m.uses_panels
                              for name in m.panel_names])
