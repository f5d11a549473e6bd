"""Paged KV cache and element-wise layer operations: the Python face of the batchgen._C kernels.

Layouts and contracts are in engine_src/README.md. These wrappers run per layer per step, so they
only allocate outputs; the C++ side checks dtypes, shapes, devices and index values and raises
ValueError naming the offending argument. `batchgen.ops.reference` has a pure-torch version of
every op with the same signature. The element-wise layer ops (RMSNorm, rotary) have CPU kernels
for float32 and bfloat16 only; on other devices and for float16 they run the reference
(plain torch, the arithmetic transformers uses).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
from dataclasses import dataclass

import torch

try:
    from batchgen import _C
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "batchgen._C (the C++ kernels) is not built or does not match this torch: run "
        "`bash scripts/setup.sh`, or `pip install --no-build-isolation -e .` in the repository root"
    ) from exc

from batchgen.ops import host_memory, reference  # noqa: E402 - after the clearer error above

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# KV cache element types beside the activations' own: fp8 caches (quantized on write, per-kv-head scales).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

__all__ = [
    "DecoderStack",
    "FP8_CACHE_DTYPES",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "allocate_kv_cache",
    "argmax_logsumexp",
    "copy_blocks",
    "fused_add_rms_norm",
    "gemm_bf16",
    "gemm_on_tiles",
    "gemm_widens_bf16",
    "gemm_silu_mul_bf16",
    "has_gemm_bf16",
    "Int8Weight",
    "gemm_int8",
    "linear_int8",
    "checkpoint_int8_weight",
    "pack_int8_weight",
    "quantize_int8_rows",
    "quantize_int8_weight",
    "lora_shrink_expand",
    "mask_logits",
    "move_onto_huge_pages",
    "pack_gemm_weight",
    "pack_lora_bf16",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "sample_tokens",
    "swap_blocks",
    "top_k",
]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` at `slot_mapping` (int64, -1 skips).
    fp8 caches (`FP8_CACHE_DTYPES`) store `round(key / k_scale[head])` (`k_scale`, `v_scale`: float32
    `[num_kv_heads]`, None for 1.0), to nearest even, saturating at the format's largest finite value."""
    _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    seq_groups: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence (`query` `[num_seqs, num_heads, head_dim]`), the
    query at position `seq_lens[i] - 1`; scores are `scale * q.k` (any scale, not only head_dim**-0.5).
    `seq_groups` (int32 `[num_seqs]`, optional): sequences side by side with the same id, such as
    the n samples of a request, may read the cache blocks their tables share once for all of them
    (the CPU kernel does, with the same result bit for bit: see engine_src/README.md, batch invariance).
    `sliding_window` (0 or None off): the query at position p sees only keys j with
    p - sliding_window < j <= p (transformers' rule); blocks wholly outside the window are not read.
    `logits_soft_cap` (0 or None off): each score s becomes `logits_soft_cap * tanh(s / logits_soft_cap)`
    before the softmax (Gemma 2). None is taken as off, as Hugging Face configs write it.
    fp8 caches read as `byte * k_scale[kv head]` and `byte * v_scale[kv head]` (float32, None for 1.0).
    `sinks` (float32 `[num_heads]` on the query's device, optional): each head's attention sink (GPT-OSS), a
    score in the scaled scores' units that joins every row's softmax with a zero value, so that a row's weights
    sum to less than 1."""
    if out is None:
        out = torch.empty_like(query)
    _C.paged_attention_decode(out, query, key_cache, value_cache, block_tables, seq_lens, float(scale), seq_groups,
                              int(sliding_window or 0), float(logits_soft_cap or 0.0), k_scale, v_scale, sinks)
    return out


def read_decode_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, whole_blocks: bool = False) -> int:
    """Reads the K/V bytes `paged_attention_decode` reads for these sequences (every key), with no
    arithmetic, on the threads and tasks decode would use, in decode's order (tiles of 64 keys, each
    (block, kv head) piece of K then of V, kv heads inner) or with `whole_blocks` each block's kv heads
    together. The yardstick of decode attention's read rate (scripts/bench_kv_fp8.py --decode). Returns the
    bytes' sum as 64-bit words, so that the reads cannot be skipped. CPU caches only."""
    return _C.read_decode_blocks(key_cache, value_cache, block_tables, seq_lens, bool(whole_blocks))


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key_limit: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch of query tokens `[num_tokens, num_heads, head_dim]`; the
    tokens of sequence i are rows `query_start_loc[i]:query_start_loc[i + 1]` and come last in it
    (row j at position `context + j`, `context = seq_lens[i] - q_len`). `sliding_window` and
    `logits_soft_cap`, `k_scale`, `v_scale` and `sinks` as for `paged_attention_decode`. `key_limit` (int32
    `[num_tokens]`, optional): row t sees the keys up to position key_limit[t] (at least its own, at most its
    sequence's last) instead of up to its own, the sliding window still counted from its own (Gemma 3's
    image tokens, which see their whole image)."""
    if out is None:
        out = torch.empty_like(query)
    _C.paged_attention_prefill(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, float(scale),
        int(sliding_window or 0), float(logits_soft_cap or 0.0), k_scale, v_scale, key_limit, sinks,
    )
    return out


def _has_kernel(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype != torch.float16


def rms_norm(
    input: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' RMSNorm of the rows of `input` (`[n, d]` or `[n, h, d]`); `out` may be `input`."""
    if not _has_kernel(input):
        return reference.rms_norm(input, weight, eps, out)
    if out is None:
        out = torch.empty_like(input)
    _C.rms_norm(out, input, weight, eps)
    return out


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: `residual += input`, then `input = rms_norm(residual)` (one pass on CPU)."""
    if not _has_kernel(input):
        return reference.fused_add_rms_norm(input, residual, weight, eps)
    _C.fused_add_rms_norm(input, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotates `x` `[num_tokens, num_heads, head_dim]` in place (Llama's rotate-half layout); row t
    by the angles of `positions[t]` (int64); `cos_sin_cache` `[max_position, head_dim]` (float32 or x.dtype)
    holds cos then sin of the head_dim / 2 angles of each position."""
    if not _has_kernel(x):
        return reference.rotary_embedding(positions, x, cos_sin_cache)
    _C.rotary_embedding(positions, x, cos_sin_cache)


def has_gemm_bf16() -> bool:
    """Whether the active CPU kernels have the bf16 GEMM (every x86-64 table but the scalar one)."""
    return _C.has_gemm_bf16()


def gemm_widens_bf16() -> bool:
    """Whether the active CPU kernels' bf16 GEMM widens to float32 FMAs (the avx512 kernels, AVX-512 without
    AVX512-BF16, and the avx2 ones), where oneDNN's bf16 is emulated, or absent."""
    return _C.gemm_widens_bf16()


def gemm_on_tiles() -> bool:
    """Whether the active CPU kernels run the bf16 GEMM on AMX tiles (the amx_bf16 kernels)."""
    return _C.cpu_isa() in ("amx_bf16", "amx_emulated")


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [out_features, in_features] (in_features even) as the GEMM's panels
    [ceil(out / P), in / 2, P, 2], P = `_C.GEMM_PANEL_COLS`: per panel of P output features, the pairs
    (w[n, 2i], w[n, 2i + 1]) of every feature side by side, zero features padding the last panel."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or in_features % 2:
        raise ValueError(f"pack_gemm_weight: needs a bfloat16 weight with an even number of input features, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    cols = _C.GEMM_PANEL_COLS
    count = -(-out_features // cols)
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, count * cols - out_features))
    return padded.reshape(count, cols, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, addend: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] (bf16) @ W^T (+ addend, float32 [rows, out_features]) (+ bias, float32) for W packed by
    `pack_gemm_weight`: [rows, out_features] in `out_dtype`, bf16 or float32 (the float32 sums, unrounded). A
    row's result does not depend on the other rows of x."""
    if not (x.is_cpu and has_gemm_bf16()):
        return reference.gemm_bf16(x, weight, out_features, bias, out_dtype, addend)
    out = torch.empty(x.shape[0], out_features, dtype=out_dtype)
    _C.gemm_bf16(out, x, weight, bias, addend)
    return out


def gemm_silu_mul_bf16(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out_features: int,
                       addend: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x G^T) * (x U^T) for G and U packed by `pack_gemm_weight`, rounded to bf16 once; `addend` (float32
    [rows, 2 * out_features]) adds its first half to the gate's sums and its second to the up's."""
    if not (x.is_cpu and has_gemm_bf16()):
        return reference.gemm_silu_mul_bf16(x, gate, up, out_features, addend)
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    _C.gemm_silu_mul_bf16(out, x, gate, up, addend)
    return out


def moe_silu_experts_bf16(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                          gates: list[torch.Tensor], ups: list[torch.Tensor], downs: list[torch.Tensor],
                          intermediate: int) -> torch.Tensor:
    """A mixture of experts' SiLU-gated experts, each packed by `pack_gemm_weight`: for token t (hidden [tokens,
    features], bf16), the sum over its experts e = expert_ids[t, r] (int64 [tokens, k]), in ascending e, of
    weights[t, r] * down[e](silu(hidden[t] gate[e]^T) * (hidden[t] up[e]^T)), in float32 and rounded to bf16 once
    (the SiLU product rounded to bf16 as `gemm_silu_mul_bf16` rounds it). One call for the layer: no Python step an
    expert. A token's result depends on that token alone."""
    weights = weights.float().contiguous()
    if not (hidden.is_cpu and has_gemm_bf16()):
        return reference.moe_silu_experts_bf16(hidden, expert_ids, weights, gates, ups, downs, intermediate)
    out = torch.empty_like(hidden)
    _C.moe_silu_experts_bf16(out, hidden, expert_ids.contiguous(), weights, gates, ups, downs, intermediate)
    return out


def pack_lora_bf16(a: torch.Tensor, b_t: torch.Tensor, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA pairs a [slots, r, in] and b_t [slots, r, out] (B transposed) in bf16 as the bf16 dot product takes
    them (`lora_shrink_expand`'s bf16 form): a [slots, ceil(in / 2), rank, 2] holding (A[r, 2k], A[r, 2k + 1])
    at [k, r], b_t [slots, rank / 2, out, 2] holding (B^T[2i, o], B^T[2i + 1, o]) at [i, o]; `rank` (r by
    default) rounded up to a multiple of `_C.LORA_RANK_GROUP`, the ranks past r zero, as an odd in's last
    pair's second element."""
    slots, given, n_in = a.shape
    group = _C.LORA_RANK_GROUP
    rank = -(-max(rank or given, given) // group) * group
    a = torch.nn.functional.pad(a.to(torch.bfloat16), (0, n_in % 2, 0, rank - given))
    b_t = torch.nn.functional.pad(b_t.to(torch.bfloat16), (0, 0, 0, rank - given))
    a_pairs = a.reshape(slots, rank, -1, 2).transpose(1, 2).contiguous()
    b_pairs = b_t.reshape(slots, rank // 2, 2, b_t.shape[2]).transpose(2, 3).contiguous()
    return a_pairs, b_pairs


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, segments: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
                       ranks: torch.Tensor | None = None, scale: float = 1.0, store: bool = False) -> None:
    """Segmented LoRA, in place: for each segment (int32 [count, 3]: first row, end row, slot; in order and
    apart) y[rows] += scale * (x[rows] A[slot]^T) B[slot], summed in float32. a float32 [slots, rank, in],
    b_t float32 [slots, rank, out] (B transposed), slot s using its first ranks[s] ranks (int32 [slots]; all
    without). x float32 or bf16; y x's dtype or float32. `store` (y float32): y = the terms, and -0.0 in every
    other row (an addend that changes nothing). A row's result depends on its own data and slot alone.
    With bf16 x, a and b_t may be bf16 from `pack_lora_bf16`: the products then run on the bf16 dot product
    and t = scale * x A^T is rounded to bf16 before the expand. On CUDA (float32 a and b_t; x may also be
    float16) the kernel is engine_src/cuda/lora_kernels.cu; segments may be there too (no host read then)."""
    on_kernel = x.dtype in (torch.float32, torch.bfloat16) if x.is_cpu else x.is_cuda and _C.has_cuda()
    if not on_kernel:
        return reference.lora_shrink_expand(y, x, segments, a, b_t, ranks, scale, store)
    _C.lora_shrink_expand(y, x, segments, a, b_t, ranks, scale, store)


@dataclass(frozen=True)
class Int8Weight:
    """A weight [out_features, in_features] quantized to int8 per output feature and packed for the int8 GEMM
    (engine_src/csrc/cpu/gemm_int8.h): `panels` int8 [ceil(out / P), depth / 4, P, 4], P = `_C.GEMM_PANEL_COLS`,
    the depth in_features rounded up to `_C.INT8_DEPTH_STEP` with zeros; `scale` float32 and `compensation`
    (128 * the sum of a feature's int8 weights, for the loops that multiply activations offset by 128) int32,
    [ceil(out / P) * P] each, the padding features' scale 1 and weights 0. `gate_up` (`pack_int8_gate_up`): the
    panels, scales and compensations alternate those of a gate and an up projection of `out_features` each."""

    panels: torch.Tensor
    scale: torch.Tensor
    compensation: torch.Tensor
    out_features: int
    in_features: int
    gate_up: bool = False


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output feature: (q int8 [out, in] in [-127, 127], scale float32 [out]) with
    weight ~ q * scale[:, None], scale = max |w| / 127 of the feature (1 for a feature of zeros), q rounded half
    to even."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def checkpoint_int8_weight(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight quantized ahead, as a checkpoint holds it (int8 values in [-128, 127], in any dtype that holds
    them exactly, and their scales, one per output feature or one for all), as (q int8, scale float32 [out]);
    a ValueError where the values are not such integers."""
    w = weight.detach()
    q = w.to(torch.int8)
    if not (w.dtype == torch.int8 or torch.equal(q.to(w.dtype), w)):  # a third the time of checking the values
        raise ValueError("int8 weights must be integers in [-128, 127]")
    scale = scale.detach().float().reshape(-1)
    if scale.numel() not in (1, w.shape[0]) or not bool(torch.isfinite(scale).all()):
        raise ValueError(f"int8 weight scales must be finite, one per output feature ({w.shape[0]}) or one in all")
    return q, scale.expand(w.shape[0]).contiguous()


def pack_int8_weight(weight: torch.Tensor, scale: torch.Tensor | None = None) -> Int8Weight:
    """`weight` [out_features, in_features] quantized (quantize_int8_weight) and packed for `linear_int8`;
    with `scale`, `weight` is quantized already (`checkpoint_int8_weight`) and packed as it is."""
    out_features, in_features = weight.shape
    q, scale = quantize_int8_weight(weight) if scale is None else checkpoint_int8_weight(weight, scale)
    cols, step = _C.GEMM_PANEL_COLS, _C.INT8_DEPTH_STEP
    count, depth = -(-out_features // cols), -(-in_features // step) * step
    padded = torch.nn.functional.pad(q, (0, depth - in_features, 0, count * cols - out_features))
    panels = padded.reshape(count, cols, depth // 4, 4).permute(0, 2, 1, 3).contiguous()
    compensation = padded.sum(dim=1, dtype=torch.int32) * 128
    scale = torch.nn.functional.pad(scale, (0, count * cols - out_features), value=1.0)
    return Int8Weight(panels, scale.contiguous(), compensation.contiguous(), out_features, in_features)


def pack_int8_gate_up(weight: torch.Tensor, scale: torch.Tensor | None = None) -> Int8Weight:
    """A fused [gate; up] weight [2 * out_features, in_features] packed for `linear_silu_mul_int8`: each half
    quantized (or, with `scale` [2 * out_features], taken as quantized) as `pack_int8_weight` does, their panels
    alternating (gate's first), so that one task of the GEMM has a panel of both at hand."""
    half = weight.shape[0] // 2
    scales = (None, None) if scale is None else (scale.reshape(-1)[:half], scale.reshape(-1)[half:])
    gate, up = pack_int8_weight(weight[:half], scales[0]), pack_int8_weight(weight[half:], scales[1])
    count = gate.panels.shape[0]

    def alternate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # per panel: a's part, then b's
        return torch.stack((a.view(count, -1), b.view(count, -1)), dim=1).reshape(-1, *a.shape[1:])

    return Int8Weight(alternate(gate.panels, up.panels), alternate(gate.scale, up.scale),
                      alternate(gate.compensation, up.compensation), half, weight.shape[1], gate_up=True)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] (float32 or bf16) quantized per row: (q uint8 [rows, depth] = round(x / s) + 128, 128 in
    the padding up to `_C.INT8_DEPTH_STEP`, s float32 [rows] = max |x| / 127 of the row)."""
    if not x.is_cpu:
        return reference.quantize_int8_rows(x)
    depth = -(-x.shape[1] // _C.INT8_DEPTH_STEP) * _C.INT8_DEPTH_STEP
    q = torch.empty(x.shape[0], depth, dtype=torch.uint8)
    scale = torch.empty(x.shape[0], dtype=torch.float32)
    _C.quantize_int8_rows(x, q, scale)
    return q, scale


def gemm_int8(q: torch.Tensor, x_scale: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_scale[m] * weight.scale[n] * sum_k (q[m, k] - 128) w[n, k] (+ bias, float32) for rows quantized by
    `quantize_int8_rows`: [rows, out_features] in float32, bf16 or int32 (the exact sums, unscaled)."""
    if not q.is_cpu:
        return reference.gemm_int8(q, x_scale, weight, bias, out_dtype)
    out = torch.empty(q.shape[0], weight.out_features, dtype=out_dtype)
    _C.gemm_int8(out, q, x_scale, weight.panels, weight.compensation, weight.scale, bias)
    return out


def linear_int8(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`gemm_int8(*quantize_int8_rows(x), weight, bias)` in one call, in x's dtype unless `out_dtype` says.
    A row's result depends on that row alone (the sums are exact integers)."""
    out_dtype = out_dtype or x.dtype
    if not x.is_cpu:
        return reference.linear_int8(x, weight, bias, out_dtype)
    out = torch.empty(x.shape[0], weight.out_features, dtype=out_dtype)
    _C.linear_int8(out, x, weight.panels, weight.compensation, weight.scale, bias)
    return out


def linear_silu_mul_int8(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """silu(x G^T) * (x U^T) in x's dtype for G and U packed by `pack_int8_gate_up` (int8's MLP): x quantized
    once, the product taken in the GEMM's tasks, gate, up and the silu rounded to x's dtype as transformers'
    MLP rounds them."""
    if not weight.gate_up:
        raise ValueError("linear_silu_mul_int8: the weight must come from pack_int8_gate_up")
    if not x.is_cpu:
        return reference.linear_silu_mul_int8(x, weight)
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    _C.linear_silu_mul_int8(out, x, weight.panels, weight.compensation, weight.scale)
    return out


def moe_silu_experts_int8(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                          gate_ups: list[Int8Weight], downs: list[Int8Weight]) -> torch.Tensor:
    """`moe_silu_experts_bf16` on int8 compute: gate_ups from `pack_int8_gate_up`, downs from `pack_int8_weight`;
    for token t, the sum over its experts, in ascending expert order, of weights[t, r] *
    linear_int8(linear_silu_mul_int8(hidden[t], gate_up[e]), down[e], out_dtype=float32), in float32 and rounded to
    hidden's dtype (float32 or bf16) once. One call for the layer; a token's result depends on that token alone."""
    weights = weights.float().contiguous()
    if not hidden.is_cpu:
        return reference.moe_silu_experts_int8(hidden, expert_ids, weights, gate_ups, downs)
    out = torch.empty_like(hidden)
    _C.moe_silu_experts_int8(out, hidden, expert_ids.contiguous(), weights,
                             [(w.panels, w.compensation, w.scale) for w in gate_ups],
                             [(w.panels, w.compensation, w.scale) for w in downs], gate_ups[0].out_features)
    return out


# A Llama model's decoder layers on CPU in one call, through the ops above (contract: engine_src/README.md;
# built by LlamaForCausalLM._build_decoder_stack).
DecoderStack = _C.DecoderStack


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` `[n, vocab]`: the index of its first maximum (int64) and
    `logsumexp` (float32), read once from the model's own dtype."""
    if not _has_kernel(logits):
        return reference.argmax_logsumexp(logits)
    argmax = torch.empty(logits.shape[0], dtype=torch.int64)
    log_total = torch.empty(logits.shape[0], dtype=torch.float32)
    _C.argmax_logsumexp(logits, argmax, log_total)
    return argmax, log_total


def top_k(logits: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` `[n, vocab]` (or of `logits[rows]`, read in place: `rows` int64 indices): its k
    largest values (float32) and their indices (int64), largest first, NaN above everything and ties by the
    lower index (a stable descending sort's first k), read once from the model's own dtype. 1 <= k <= vocab."""
    if not _has_kernel(logits):
        return top_k_by_keys(logits if rows is None else logits[rows], k)
    count = logits.shape[0] if rows is None else len(rows)
    values = torch.empty(count, k, dtype=torch.float32)
    ids = torch.empty(count, k, dtype=torch.int64)
    _C.top_k(logits, k, values, ids, rows)
    return values, ids


TOP_K_CHUNK = 2**24


def top_k_by_keys(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k where no kernel runs it (CUDA, float16): one torch.topk over int64 keys, each the value's bits made
    to order as the floats do (-0 as +0, every NaN above +inf) over the id reversed, so that no two keys tie and
    their order is the stable sort's. A full sort of the vocabulary costs a step far more on a GPU. Rows go in
    chunks of at most TOP_K_CHUNK keys, so that a large batch over a large vocabulary never holds more than
    ~300 MB of them at once."""
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"top_k: needs 1 <= k <= vocab, got k={k} for a vocabulary of {vocab}")
    values = logits.float()
    reversed_ids = torch.arange(vocab - 1, -1, -1, dtype=torch.int64, device=values.device)
    ids = []
    for chunk in values.split(max(1, TOP_K_CHUNK // vocab)):
        bits = (chunk + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0, which a sort holds equal
        bits ^= (bits >> 31).bitwise_and_(0x7FFFFFFF)  # negative floats' magnitude flipped: ints in float order
        bits.masked_fill_(chunk.isnan(), torch.iinfo(torch.int32).max)
        keys = bits.to(torch.int64).bitwise_left_shift_(32).bitwise_or_(reversed_ids)
        ids.append(keys.topk(k, dim=-1).indices)
    ids = torch.cat(ids)
    return values.gather(-1, ids), ids


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 copy of `logits` `[n, vocab]` (or of `logits[rows]`, read in place: `rows` int64 indices) with
    -inf where a row's grammar refuses a token: bit j of word i of `allowed` (int32 `[n, >= vocab / 32]`, a row
    per row copied) allows token 32 i + j."""
    if not (_has_kernel(logits) and allowed.is_cpu and allowed.dtype == torch.int32):
        return reference.mask_logits(logits if rows is None else logits[rows], allowed)
    out = torch.empty(logits.shape[0] if rows is None else len(rows), logits.shape[1], dtype=torch.float32)
    _C.mask_logits(logits, allowed, out, rows)
    return out


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, u: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` `[n, vocab]` (float32, or bfloat16 read as float32) into int64 `[n]`, drawn
    from softmax(logits / temperature) by inverting its cumulative distribution at `u` (float32 in [0, 1)).
    Rows with top-k (int64, 0 off), top-p (1 off) or min-p (relative to the most likely token, 0 off) draw among
    the tokens those keep, most likely first; the others among all tokens in id order. temperature > 0. With
    `rows` (int64 indices), the rows of `logits[rows]`, read in place; the per-row tensors are then theirs."""
    if not (logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16)):
        return reference.sample_tokens(logits if rows is None else logits[rows], temperature, top_k, top_p, min_p, u)
    tokens = torch.empty(logits.shape[0] if rows is None else len(rows), dtype=torch.int64)
    _C.sample_tokens(logits, temperature, top_k, top_p, min_p, u, tokens, rows)
    return tokens


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy whole blocks within each layer's caches; `block_mapping` int64 `[n, 2]` of (src, dst).

    The destinations must be distinct and must not be sources in the same call."""
    _C.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks from cache `src` to cache `dst`, possibly on another device; `block_mapping` is an
    int64 CPU tensor `[n, 2]` of (src, dst). Host caches swapped with CUDA ones should be pinned."""
    _C.swap_blocks(src, dst, block_mapping)


def allocate_kv_cache(
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
    prefault: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (key_cache, value_cache) pair of shape `[num_blocks, num_kv_heads, block_size, head_dim]` that
    reads as zeros wherever it was never written.

    An unpinned host cache is (on Unix) a fresh anonymous mapping: it costs no time and no memory until its
    pages are first touched, and the OS hands out each page zeroed then, so a 4 GiB cache of which
    a run uses 100 MiB takes ~100 MiB (zero-filling 4 GiB at start took 1.4-13 s on a 2-core VM:
    scripts/PERF.md, "Start-up: lazy KV cache").
    `prefault` writes every page now instead: its page faults then happen here and not during the
    first steps that reach them, and a cache too large for the machine fails at once.
    `pin_memory` pins host caches for fast swaps with a GPU; without a CUDA device it is ignored.
    Pinned memory is locked page by page as it is allocated, so it cannot be lazy: it is allocated
    and zeroed now, whatever `prefault` says. Device (CUDA) caches are zeroed on the device."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} is not supported; supported: {SUPPORTED_BLOCK_SIZES}")
    if dtype not in (*SUPPORTED_DTYPES, *FP8_CACHE_DTYPES):
        raise ValueError(f"dtype {dtype} is not supported; supported: {SUPPORTED_DTYPES + FP8_CACHE_DTYPES}")
    if num_blocks < 1 or num_kv_heads < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and num_kv_heads ({num_kv_heads}) must be >= 1")
    device = torch.device(device)
    if pin_memory and device.type != "cpu":
        raise ValueError(f"pin_memory applies to host caches only, got device {device}")
    pin = pin_memory and torch.cuda.is_available()
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if device.type != "cpu":
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
    return tuple(_aligned_host_zeros(shape, dtype, pin, prefault) for _ in range(2))


_HUGE_PAGE = 2 << 20  # bytes


def _aligned_host_zeros(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool, prefault: bool) -> torch.Tensor:
    """A zeroed contiguous host tensor starting on a 2 MiB boundary, in memory that transparent huge
    pages back where the kernel allows (`_host_bytes`). torch's large allocations start 64 bytes into
    a page, so every 4 KiB (block, kv head) tile would straddle two pages and the CPU decode kernel
    would read K/V measurably slower. `prefault` writes the zeros to fault every page in now. The
    padding is never written, so it takes address space, not memory (pinned memory excepted)."""
    nbytes = math.prod(shape) * dtype.itemsize
    tensor = _aligned_host_bytes(nbytes, pin_memory).view(dtype).view(shape)
    return tensor.zero_() if prefault else tensor


RELEASE_EVERY = 256 << 20  # bytes moved between hand-backs of the freed originals (move_onto_huge_pages)


def move_onto_huge_pages(slots: list[tuple[object, str]]) -> None:
    """Moves each tensor `getattr(owner, name)` of `slots` into one mapping that transparent huge pages back (see
    `_host_bytes`), side by side, each on a 64-byte boundary: for weights read from memory at every step (SmolLM2's
    GEMM panels so placed made "mixed" ~0.8% faster, 3 interleaved pairs, each pair faster). Each attribute is
    replaced as soon as its copy is made, and the memory the originals held goes back to the OS every
    RELEASE_EVERY bytes (host_memory.release_freed_memory): a copy of all of them first, then the originals freed,
    held the weights twice at the load's peak (a 1.7 GB model: +1.1 GB)."""
    if not slots:
        return
    sizes = [(getattr(owner, name).nbytes + 63) // 64 * 64 for owner, name in slots]
    arena = _aligned_host_bytes(sum(sizes), pin_memory=False)
    moved = 0
    for (owner, name), start in zip(slots, itertools.accumulate(sizes, initial=0), strict=False):  # one more start
        tensor = getattr(owner, name)
        setattr(owner, name, arena[start : start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor))
        moved += tensor.nbytes
        del tensor
        if moved >= RELEASE_EVERY:
            host_memory.release_freed_memory()
            moved = 0
    host_memory.release_freed_memory()


def _aligned_host_bytes(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """nbytes of host memory (`_host_bytes`) starting on a 2 MiB boundary; the padding stays unwritten."""
    padded = _host_bytes(nbytes + _HUGE_PAGE, pin_memory)
    skip = -padded.data_ptr() % _HUGE_PAGE
    return padded[skip : skip + nbytes]


def _host_bytes(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """nbytes of zeroed host memory as a uint8 tensor. Unpinned on Unix, it is a fresh private anonymous
    mapping, which takes memory only as its pages are first touched, each then zeroed by the OS; on
    Linux advised for transparent huge pages (where the kernel refuses, plain pages):
    decode reads a sequence's K/V in scattered 2-6 KiB tiles across a cache of ~1.5 GB, and with 4 KiB
    pages nearly every tile costs a TLB miss. On SmolLM2's "mixed" run (2 cores) 2 MiB pages made the
    whole run ~3% faster (interleaved pairs), the GEMMs' weight streams included. With THP set to
    "madvise" (the common default) torch's own allocations never get them."""
    if pin_memory or not hasattr(mmap, "MAP_ANONYMOUS"):  # pinned, or not Unix: written with zeros now
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
