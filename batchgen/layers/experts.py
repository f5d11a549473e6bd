"""A mixture of experts' weights packed per expert, each token's result independent of the batch.

transformers keeps an MoE layer's experts as 3-D tensors ([experts, out, in]) and multiplies the tokens routed to
each expert with `torch.mm`/`grouped_mm` on the raw weights: on CPU every call re-blocks the weight, and the rows'
bits depend on how many tokens the expert got in that step (BLAS picks kernels by shape), so a seeded sample changed
with its neighbours. Here each expert's projections are packed once as the dense layers' are (layers/linear.py:
batchgen's bf16 GEMM panels, else oneDNN's packed layout), whose rows never depend on the other rows, and a token's
k expert outputs are weighted and summed in float32 in ascending expert order (the order of transformers' eager
loop; its grouped implementation sums in float32 too), rounded once: the order is the token's own, whatever else
the step holds. SiLU-gated experts (Mixtral, Qwen-MoE, Granite MoE, ...) on batchgen's bf16 panels or on int8 run
as one C++ call a layer (`ops.moe_silu_experts_bf16`, `ops.moe_silu_experts_int8`), the same arithmetic as the
loop here without its Python step for each expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchgen import ops
from batchgen.layers.linear import Int8Linear, Int8SiluAndMul, PackedLinear, PackedSiluAndMul


class PackedExperts(nn.Module):
    """One MoE layer's experts: `up[e]` (gate and up projections, or up alone) then `gate_fn` then `down[e]`.

    `up[e]` may be a `PackedSiluAndMul` (SiLU-gated experts with [gate; up] weights), which applies the gate
    itself; then `gate_fn` is None."""

    def __init__(self, up: list[nn.Module], down: list[nn.Module], gate_fn: Callable | None,
                 post_norm: Callable | None = None):
        super().__init__()
        self.up, self.down = nn.ModuleList(up), nn.ModuleList(down)
        self.gate_fn, self.post_norm = gate_fn, post_norm
        self.num_experts = len(up)
        # Whether the layer runs as one call: SiLU-gated experts on batchgen's bf16 panels or on int8, nothing
        # around them.
        self.int8 = all(isinstance(m, Int8SiluAndMul) for m in up) and all(
            isinstance(m, Int8Linear) and m.bias is None and m.out_dtype == torch.float32 for m in down)
        bf16_panels = all(isinstance(m, PackedSiluAndMul) and m.uses_panels for m in up) and all(
            isinstance(m, PackedLinear) and m.uses_panels and m.bias is None for m in down)
        self.one_call = gate_fn is None and post_norm is None and (self.int8 or bf16_panels)
        # The one call's weight operands, gathered once rather than from every expert's modules at every step.
        if self.int8:
            self.operands = ([m.weight for m in up], [m.weight for m in down])
        elif bf16_panels:
            self.operands = ([m.gate for m in up], [m.up for m in up], [m.packed for m in down], up[0].out_features)

    @classmethod
    def pack(cls, up_weights: torch.Tensor, down_weights: torch.Tensor, *, up_bias: torch.Tensor | None = None,
             down_bias: torch.Tensor | None = None, fused_silu: bool = False, gate_fn: Callable | None = None,
             post_norm: Callable | None = None, transposed: bool = False, int8: bool = False) -> PackedExperts:
        """From transformers' 3-D expert weights, [experts, out, in] (`transposed`: [experts, in, out]).
        `fused_silu`: the up weights are [gate; up] and the gate is silu(gate) * up. `int8`: on int8 compute
        (`Int8SiluAndMul`, `Int8Linear`; docs/int8.md), the down projection's results in float32 as here."""
        def weight(weights: torch.Tensor, e: int) -> torch.Tensor:
            return (weights[e].t() if transposed else weights[e]).contiguous()

        def bias(biases: torch.Tensor | None, e: int) -> torch.Tensor | None:
            return None if biases is None else biases[e]

        up: list[nn.Module] = []
        down: list[nn.Module] = []
        for e in range(up_weights.shape[0]):
            if fused_silu:
                up.append((Int8SiluAndMul if int8 else PackedSiluAndMul)(weight(up_weights, e)))
            else:
                up.append((Int8Linear if int8 else PackedLinear)(weight(up_weights, e), bias(up_bias, e)))
            down.append((Int8Linear if int8 else PackedLinear)(weight(down_weights, e), bias(down_bias, e),
                                                               float_out=True))
        return cls(up, down, None if fused_silu else gate_fn, post_norm)

    def forward(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [tokens, features]; expert_ids and weights [tokens, k]: each token's experts and their weights.
        Returns [tokens, features] in hidden's dtype."""
        if self.one_call:
            one_call = ops.moe_silu_experts_int8 if self.int8 else ops.moe_silu_experts_bf16
            return one_call(hidden.contiguous(), expert_ids.long(), weights, *self.operands)
        tokens, k = expert_ids.shape
        slots = expert_ids.reshape(-1)
        order = torch.argsort(slots, stable=True)  # the (token, rank) slots grouped by expert
        counts = torch.bincount(slots, minlength=self.num_experts).tolist()
        token_of = order // k
        rows = hidden.index_select(0, token_of)
        slot_weights = weights.reshape(-1).float().index_select(0, order)
        total = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32)
        start = 0
        for e, count in enumerate(counts):  # ascending expert ids: each token's sum in one order, its own
            if count == 0:
                continue
            end = start + count
            x = self.up[e](rows[start:end])
            if self.gate_fn is not None:
                x = self.gate_fn(x)
            x = self.down[e](x)  # float32, unrounded
            if self.post_norm is not None:
                x = self.post_norm(x.to(hidden.dtype)).float()
            total.index_add_(0, token_of[start:end], x.mul_(slot_weights[start:end, None]))  # no token twice
            start = end
        return total.to(hidden.dtype)
