"""Pure-torch reference of every op in batchgen.ops, with the same signatures.

Written to be obviously correct, not fast: attention gathers each sequence's keys and values
through its block table and computes softmax(q k^T * scale) v in float32 with an explicit causal
(and optionally sliding-window) mask, the scores optionally soft-capped, each head's attention sink
(optional) a score beside the keys' whose value is zero. Tests compare the kernels
against these functions.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_LIMITS = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # the largest finite values


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_LIMITS


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x `[n, num_kv_heads, head_dim]` as fp8 `round(x / scale[head])`: to nearest even, saturating at the
    format's largest finite value (torch's own conversion turns e5m2's overflow into inf, e4m3's into NaN)."""
    x = x.float()
    if scale is not None:
        x = x / scale.to(x.device)[None, :, None]
    limit = FP8_LIMITS[dtype]
    return x.clamp(-limit, limit).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp8 `[n, num_kv_heads, head_dim]` as float32 `x * scale[head]`."""
    x = x.float()
    return x if scale is None else x * scale.to(x.device)[None, :, None]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key, value = key[keep], value[keep]
    if is_fp8(key_cache):
        key, value = quantize_fp8(key, k_scale, key_cache.dtype), quantize_fp8(value, v_scale, value_cache.dtype)
    # cache[blocks, :, offsets] has shape [n, num_kv_heads, head_dim], like key[keep].
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first seq_len tokens of one sequence as float32 `[seq_len, num_kv_heads, head_dim]` (an fp8
    cache's times its per-kv-head `scale`)."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    used = -(-seq_len // block_size)
    blocks = cache[block_table[:used].long()]  # [used, num_kv_heads, block_size, head_dim]
    tokens = blocks.permute(0, 2, 1, 3).reshape(used * block_size, num_kv_heads, head_dim)
    return dequantize_fp8(tokens[:seq_len], scale) if is_fp8(cache) else tokens[:seq_len].float()


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    key_limit: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 attention of query `[n, num_heads, head_dim]` over keys/values
    `[seq_len, num_kv_heads, head_dim]`; query row i sees keys 0 .. positions[i] (0 .. key_limit[i] when
    `key_limit` is given), with a sliding window only keys j > positions[i] - sliding_window (transformers'
    `kv_idx > q_idx - sliding_window`). A soft cap c turns each score s into c * tanh(s / c). `sinks`
    `[num_heads]`: each head's attention sink, a score in every row's softmax whose value is zero (GPT-OSS)."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.float(), keys) * scale
    if logits_soft_cap:  # 0 or None: off
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    key_pos = torch.arange(keys.shape[0], device=keys.device)
    last = positions if key_limit is None else key_limit.to(positions)
    hidden = key_pos[None, :] > last[:, None]
    if sliding_window:  # 0 or None: off
        hidden |= key_pos[None, :] <= positions[:, None] - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink_scores = sinks.float().reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink_scores], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, values)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    seq_groups: torch.Tensor | None = None,  # a hint for the kernels' shared reads; every sequence reads its own here
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    one_query_each = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_attention_prefill(query, key_cache, value_cache, block_tables, seq_lens, one_query_each, scale, out,
                                   sliding_window, logits_soft_cap, k_scale, v_scale, sinks=sinks)


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
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[i], starts[i + 1]
        if begin == end:
            continue
        keys = gather_sequence(key_cache, block_tables[i], seq_len, k_scale)
        values = gather_sequence(value_cache, block_tables[i], seq_len, v_scale)
        context = seq_len - (end - begin)
        positions = torch.arange(context, seq_len, device=query.device)
        limit = None if key_limit is None else key_limit[begin:end]
        out[begin:end] = attend(query[begin:end], keys, values, positions, scale, sliding_window,
                                logits_soft_cap, limit, sinks).to(out.dtype)
    return out


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    for src, dst in block_mapping.tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    for src_block, dst_block in block_mapping.tolist():
        dst[dst_block] = src[src_block].to(dst.device)


def rms_norm(
    input: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in float32, rounded to the input dtype, times weight."""
    x = input.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(input.dtype)
    result = weight * normed
    return result if out is None else out.copy_(result)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    residual.add_(input)
    input.copy_(rms_norm(residual, weight, eps))


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """transformers' `x * cos + rotate_half(x) * sin` with cos and sin in x's dtype."""
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    x.copy_(x * torch.cat([cos, cos], dim=-1) + rotated * torch.cat([sin, sin], dim=-1))


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), torch.logsumexp(logits.float(), dim=-1)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True)
    return values[:, :k].contiguous(), ids[:, :k].contiguous()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A float32 copy of logits with -inf where bit i % 32 of allowed[r, i // 32] is 0. numpy's unpackbits (the
    int32 words read as little-endian bytes) is the fast unpack."""
    bits = np.unpackbits(allowed.cpu().numpy().view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
    refused = torch.from_numpy(bits).to(logits.device) == 0
    return logits.float().masked_fill(refused, float("-inf"))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i]: drawn with probability weights[i] / total."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1).squeeze(1)


# Candidates kept by top-k/top-p/min-p are looked for among this many most likely tokens first
# (a partial top-k is far cheaper than sorting the vocabulary); the rows whose filter keeps all of
# them are searched again with 8 times as many, up to the whole vocabulary. Real nuclei are
# mostly small (SmolLM2 at temperature 0.8, top_p 0.95: median 7 tokens, 90% within 85), so only
# a few rows pay for a wide search.
_CANDIDATES = 64


def _sample_filtered(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                     u: torch.Tensor) -> torch.Tensor:
    """Draws from weights (unnormalised, maximum 1) restricted by each row's top-k, top-p and min-p."""
    device, vocab = weights.device, weights.shape[1]
    k = min(vocab, max(_CANDIDATES, int(top_k.max())))
    top_k = torch.where(top_k > 0, top_k, vocab)
    totals = weights.sum(-1, keepdim=True)
    drawn = torch.empty(len(weights), dtype=torch.long, device=device)
    todo = torch.arange(len(weights), device=device)
    searched = weights  # the rows of todo
    while True:
        cand, cand_ids = searched.topk(k, dim=-1)  # sorted, most likely first
        probs = cand / totals[todo]
        keep = torch.arange(k, device=device)[None, :] < top_k[todo, None]
        keep &= probs.cumsum(dim=-1) - probs < top_p[todo, None]
        keep &= cand >= min_p[todo, None]  # relative to the maximum weight, 1
        keep[:, 0] = True  # the most likely token always stays
        done = ~keep[:, -1]
        last = k == vocab or bool(done.all())  # no row left to search wider: none to pick out (a GPU syncs once)
        rows = slice(None) if last else done
        picked = _inverse_cdf(cand[rows] * keep[rows], u[todo[rows]])
        drawn[todo[rows]] = cand_ids[rows].gather(1, picked[:, None]).squeeze(1)
        if last:
            return drawn
        todo = todo[~done]
        searched = weights[todo]
        k = min(vocab, 8 * k)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    weights = logits.float() / temperature[:, None]
    weights = weights.sub_(weights.amax(-1, keepdim=True)).exp_()  # maximum 1 in every row
    filtered = (top_k > 0) | (top_p < 1) | (min_p > 0)
    if not filtered.any():  # the rows mostly share their parameters: no row to pick out (a GPU syncs once or twice)
        return _inverse_cdf(weights, u)
    if filtered.all():
        return _sample_filtered(weights, top_k, top_p, min_p, u)
    drawn = torch.empty(len(logits), dtype=torch.long, device=logits.device)  # both kinds of row, from here on
    drawn[~filtered] = _inverse_cdf(weights[~filtered], u[~filtered])
    drawn[filtered] = _sample_filtered(weights[filtered], top_k[filtered], top_p[filtered], min_p[filtered],
                                       u[filtered])
    return drawn


def unpack_gemm_weight(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out_features, in_features] weight that `batchgen.ops.pack_gemm_weight` packed into `panels`."""
    count, pairs, cols, _ = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(count * cols, 2 * pairs)[:out_features]


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, addend: torch.Tensor | None = None) -> torch.Tensor:
    out = x.float() @ unpack_gemm_weight(weight, out_features).float().T
    out = out if addend is None else out + addend
    return (out if bias is None else out + bias).to(out_dtype)


def gemm_silu_mul_bf16(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out_features: int,
                       addend: torch.Tensor | None = None) -> torch.Tensor:
    g = x.float() @ unpack_gemm_weight(gate, out_features).float().T
    u = x.float() @ unpack_gemm_weight(up, out_features).float().T
    if addend is not None:
        g, u = g + addend[:, :out_features], u + addend[:, out_features:]
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def _moe_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, expert) -> torch.Tensor:
    """Each token's sum, in ascending expert order, of weight * expert(row, e) (float32 [1, features])."""
    total = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        for e, w in sorted(zip(expert_ids[t].tolist(), weights[t].float().tolist(), strict=True)):
            total[t] += expert(hidden[t : t + 1], e)[0] * w
    return total.to(hidden.dtype)


def moe_silu_experts_bf16(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                          gates: list[torch.Tensor], ups: list[torch.Tensor], downs: list[torch.Tensor],
                          intermediate: int) -> torch.Tensor:
    return _moe_experts(hidden, expert_ids, weights, lambda row, e: gemm_bf16(
        gemm_silu_mul_bf16(row, gates[e], ups[e], intermediate), downs[e], hidden.shape[1], out_dtype=torch.float32))


def moe_silu_experts_int8(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_ups: list,
                          downs: list) -> torch.Tensor:
    return _moe_experts(hidden, expert_ids, weights, lambda row, e: linear_int8(
        linear_silu_mul_int8(row, gate_ups[e]), downs[e], None, torch.float32))


def unpack_lora_bf16(a: torch.Tensor, b_t: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 a [slots, rank, in] and b_t [slots, rank, out] that `batchgen.ops.pack_lora_bf16` packed."""
    slots, pairs, rank, _ = a.shape
    a = a.transpose(1, 2).reshape(slots, rank, 2 * pairs)[:, :, :in_features]
    return a.float(), b_t.transpose(2, 3).reshape(slots, rank, b_t.shape[2]).float()


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, segments: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
                       ranks: torch.Tensor | None = None, scale: float = 1.0, store: bool = False) -> None:
    """In place: each segment's rows of y get scale * (x A[slot]^T) B[slot] in float32 (see ops); with the bf16
    form (bf16 a and b_t, `ops.pack_lora_bf16`) t = scale * x A^T rounded to bf16 before the expand."""
    pairs = a.dtype == torch.bfloat16
    if pairs:
        a, b_t = unpack_lora_bf16(a, b_t, x.shape[1])
    if store:
        y.fill_(-0.0)
    for start, end, slot in segments.tolist():
        rank = a.shape[1] if ranks is None else int(ranks[slot])
        if start == end or rank == 0:
            continue
        t = scale * (x[start:end].float() @ a[slot, :rank].T)
        term = (t.bfloat16().float() if pairs else t) @ b_t[slot, :rank]
        y[start:end] = term if store else (y[start:end].float() + term).to(y.dtype)


def quantize_int8_rows(x: torch.Tensor, depth_step: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = (torch.round(xf / scale[:, None]).clamp_(-127, 127) + 128).to(torch.uint8)
    depth = -(-x.shape[1] // depth_step) * depth_step
    return torch.nn.functional.pad(q, (0, depth - x.shape[1]), value=128), scale


def unpack_int8_weight(weight) -> torch.Tensor:
    """The int8 [out_features, in_features] that `batchgen.ops.pack_int8_weight` packed into `weight.panels`."""
    count, groups, cols, _ = weight.panels.shape
    full = weight.panels.permute(0, 2, 1, 3).reshape(count * cols, 4 * groups)
    return full[: weight.out_features, : weight.in_features]


def gemm_int8(q: torch.Tensor, x_scale: torch.Tensor, weight, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact integer sums (float64 holds them exactly: |sum| < 2^53), then (sum * x_scale) * w_scale + bias in
    float32, the order of batchgen's epilogue."""
    signed = q[:, : weight.in_features].double() - 128
    sums = (signed @ unpack_int8_weight(weight).double().T).to(torch.int32)
    if out_dtype == torch.int32:
        return sums
    out = sums.float() * x_scale[:, None] * weight.scale[None, : weight.out_features]
    return (out if bias is None else out + bias).to(out_dtype)


def linear_int8(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return gemm_int8(*quantize_int8_rows(x), weight, bias, out_dtype or x.dtype)


def gate_up_halves(weight):
    """The gate's and the up projection's int8 weights that `batchgen.ops.pack_int8_gate_up` interleaved."""
    from batchgen.ops import Int8Weight

    count = weight.panels.shape[0] // 2

    def half(t: torch.Tensor, which: int) -> torch.Tensor:
        return t.view(count, 2, -1)[:, which].reshape(-1, *t.shape[1:]).contiguous()

    return [Int8Weight(half(weight.panels, i), half(weight.scale, i), half(weight.compensation, i),
                       weight.out_features, weight.in_features) for i in (0, 1)]


def linear_silu_mul_int8(x: torch.Tensor, weight) -> torch.Tensor:
    q, x_scale = quantize_int8_rows(x)
    gate, up = (gemm_int8(q, x_scale, w, out_dtype=x.dtype) for w in gate_up_halves(weight))
    return torch.nn.functional.silu(gate) * up
