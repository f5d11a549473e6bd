// Python bindings of batchgen._C. Every op checks its arguments here (dtype, shape, device,
// contiguity; a ValueError naming the argument) and then calls the CPU implementation (ops.h)
// or, for CUDA tensors, the CUDA one (cuda_ops.h). Index values (slots, block ids, lengths) are
// checked by the CPU implementations; block mappings, which live on the host, are checked here.
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "checked_ops.h"
#include "cpu/gemm_int8.h"
#include "cpu/isa.h"
#include "cpu/moe_slots.h"
#include "decoder_stack.h"
#include "ops.h"
#ifdef WITH_CUDA
#include "cuda_ops.h"
#endif

namespace {

using torch::Tensor;

#ifdef WITH_CUDA
#define BATCHGEN_CUDA_CALL(fn, ...) batchgen::cuda::fn(__VA_ARGS__)
#else
#define BATCHGEN_CUDA_CALL(fn, ...) \
  TORCH_CHECK(false, #fn ": batchgen._C was built without CUDA (torch without CUDA or no nvcc at build time)")
#endif

bool supported_head_dim(int64_t d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }
bool supported_block_size(int64_t b) { return b == 8 || b == 16 || b == 32; }
bool supported_dtype(const Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16 ||
         t.scalar_type() == torch::kFloat16;
}

// True for CUDA tensors, false for CPU ones; any other device is an error.
bool on_cuda(const char* op, const Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), op, ": tensors must be on CPU or CUDA, got ", t.device());
  return t.is_cuda();
}

void check_rank(const char* op, const char* name, const Tensor& t, int64_t dim, const char* shape) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D ", shape, ", got shape ", t.sizes());
}

void check_tensor(const char* op, const char* name, const Tensor& t, int64_t dim, const char* shape) {
  check_rank(op, name, t, dim, shape);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Rows of activations ([tokens, heads, head_dim]): any token and head strides, unit stride in
// the last dimension (e.g. slices of a fused qkv projection).
void check_rows(const char* op, const char* name, const Tensor& t, const char* shape) {
  check_rank(op, name, t, 3, shape);
  TORCH_CHECK_VALUE(t.stride(2) == 1, op, ": ", name,
                    " must be contiguous in its last dimension, got strides ", t.strides());
}

void check_index(const char* op, const char* name, const Tensor& t, torch::ScalarType dtype, int64_t dim,
                 const char* shape) {
  check_tensor(op, name, t, dim, shape);
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_same_device(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device());
}

bool fp8_cache(const Tensor& cache) {
  return cache.scalar_type() == torch::kFloat8_e4m3fn || cache.scalar_type() == torch::kFloat8_e5m2;
}

// Activations beside a cache: its dtype, or any supported one beside an fp8 cache.
void check_data(const char* op, const char* name, const Tensor& t, const Tensor& cache) {
  if (fp8_cache(cache)) {
    TORCH_CHECK_VALUE(supported_dtype(t), op, ": ", name, " has dtype ", t.scalar_type(),
                      " (float32, bfloat16 or float16 beside an fp8 cache)");
  } else {
    TORCH_CHECK_VALUE(t.scalar_type() == cache.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
                      " but the cache has ", cache.scalar_type(), " (they must match)");
  }
  check_same_device(op, name, t, cache, "key_cache");
}

// k_scale and v_scale: optional float32 [num_kv_heads] on the caches' device, for fp8 caches only; on the
// host each must be finite and > 0.
batchgen::cpu::KVScales checked_scales(const char* op, const c10::optional<Tensor>& k_scale,
                                       const c10::optional<Tensor>& v_scale, const Tensor& key_cache) {
  for (const auto& [name, scale] : {std::pair<const char*, const c10::optional<Tensor>&>{"k_scale", k_scale},
                                    {"v_scale", v_scale}}) {
    if (!scale.has_value()) continue;
    TORCH_CHECK_VALUE(fp8_cache(key_cache), op, ": ", name, " applies to fp8 caches only (the cache is ",
                      key_cache.scalar_type(), ")");
    check_index(op, name, *scale, torch::kFloat32, 1, "[num_kv_heads]");
    TORCH_CHECK_VALUE(scale->size(0) == key_cache.size(1), op, ": ", name, " has ", scale->size(0),
                      " entries but the cache has ", key_cache.size(1), " kv heads");
    check_same_device(op, name, *scale, key_cache, "key_cache");
    if (!scale->is_cpu()) continue;
    const float* values = scale->data_ptr<float>();
    for (int64_t h = 0; h < scale->size(0); ++h) {
      TORCH_CHECK_VALUE(std::isfinite(values[h]) && values[h] > 0, op, ": ", name, "[", h, "] = ", values[h],
                        " must be finite and > 0");
    }
  }
  return {k_scale, v_scale};
}

// key_cache and value_cache: [num_blocks, num_kv_heads, block_size, head_dim], equal, supported.
void check_caches(const char* op, const Tensor& key_cache, const Tensor& value_cache) {
  constexpr const char* shape = "[num_blocks, num_kv_heads, block_size, head_dim]";
  check_tensor(op, "key_cache", key_cache, 4, shape);
  check_tensor(op, "value_cache", value_cache, 4, shape);
  TORCH_CHECK_VALUE(supported_dtype(key_cache) || fp8_cache(key_cache), op, ": key_cache dtype ",
                    key_cache.scalar_type(), " is not supported (float32, bfloat16, float16, float8_e4m3fn, float8_e5m2)");
  TORCH_CHECK_VALUE(value_cache.scalar_type() == key_cache.scalar_type(), op, ": value_cache has dtype ",
                    value_cache.scalar_type(), " but key_cache has ", key_cache.scalar_type());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), op, ": value_cache has shape ", value_cache.sizes(),
                    " but key_cache has ", key_cache.sizes());
  check_same_device(op, "value_cache", value_cache, key_cache, "key_cache");
  TORCH_CHECK_VALUE(key_cache.size(1) >= 1, op, ": key_cache has no kv heads");
  TORCH_CHECK_VALUE(supported_block_size(key_cache.size(2)), op, ": block_size (key_cache.shape[2]) ",
                    key_cache.size(2), " is not supported (8, 16, 32)");
  TORCH_CHECK_VALUE(supported_head_dim(key_cache.size(3)), op, ": head_dim (key_cache.shape[3]) ", key_cache.size(3),
                    " is not supported (64, 80, 96, 128, 256)");
}

// Block tables and sequence lengths beside the caches.
void check_tables(const char* op, const Tensor& block_tables, const Tensor& seq_lens, const Tensor& key_cache) {
  check_index(op, "block_tables", block_tables, torch::kInt32, 2, "[num_seqs, max_blocks_per_seq]");
  check_same_device(op, "block_tables", block_tables, key_cache, "key_cache");
  check_index(op, "seq_lens", seq_lens, torch::kInt32, 1, "[num_seqs]");
  check_same_device(op, "seq_lens", seq_lens, key_cache, "key_cache");
  TORCH_CHECK_VALUE(block_tables.size(0) == seq_lens.size(0), op, ": block_tables has ", block_tables.size(0),
                    " rows but seq_lens has ", seq_lens.size(0), " sequences");
}

// query and out [num_tokens, num_heads, head_dim] against the caches; tables and lengths.
void check_attention(const char* op, const Tensor& out, const Tensor& query, const Tensor& key_cache,
                     const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens, double scale) {
  check_caches(op, key_cache, value_cache);
  check_rows(op, "query", query, "[num_tokens, num_heads, head_dim]");
  check_data(op, "query", query, key_cache);
  TORCH_CHECK_VALUE(query.size(2) == key_cache.size(3), op, ": query head_dim ", query.size(2),
                    " differs from the cache's ", key_cache.size(3));
  TORCH_CHECK_VALUE(query.size(1) >= 1 && query.size(1) % key_cache.size(1) == 0, op, ": num_heads (query.shape[1] = ",
                    query.size(1), ") must be a positive multiple of num_kv_heads (", key_cache.size(1), ")");
  check_rows(op, "out", out, "like query");
  check_data(op, "out", out, key_cache);
  TORCH_CHECK_VALUE(out.scalar_type() == query.scalar_type(), op, ": out has dtype ", out.scalar_type(),
                    " but query has ", query.scalar_type());
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), op, ": out has shape ", out.sizes(), " but query has ",
                    query.sizes());
  check_tables(op, block_tables, seq_lens, key_cache);
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
}

// The attention variants: sliding_window >= 0 (0 off), logits_soft_cap finite and >= 0 (0 off).
void check_variants(const char* op, int64_t sliding_window, double logits_soft_cap,
                    const c10::optional<Tensor>& sinks, const Tensor& query) {
  TORCH_CHECK_VALUE(sliding_window >= 0, op, ": sliding_window must be >= 0 (0 for none), got ", sliding_window);
  TORCH_CHECK_VALUE(std::isfinite(logits_soft_cap) && logits_soft_cap >= 0, op,
                    ": logits_soft_cap must be finite and >= 0 (0 for none), got ", logits_soft_cap);
  if (!sinks.has_value()) return;
  check_index(op, "sinks", *sinks, torch::kFloat32, 1, "[num_heads]");
  TORCH_CHECK_VALUE(sinks->size(0) == query.size(1), op, ": sinks has ", sinks->size(0), " entries but query has ",
                    query.size(1), " heads");
  check_same_device(op, "sinks", *sinks, query, "query");
  if (!sinks->is_cpu()) return;
  const float* values = sinks->data_ptr<float>();
  for (int64_t h = 0; h < sinks->size(0); ++h) {
    TORCH_CHECK_VALUE(!std::isnan(values[h]), op, ": sinks[", h, "] is NaN");
  }
}

// block_mapping int64 [n, 2] of (src, dst) pairs; when it is on the host, every id is checked.
void check_block_mapping(const char* op, const Tensor& block_mapping, int64_t src_blocks, int64_t dst_blocks) {
  check_index(op, "block_mapping", block_mapping, torch::kInt64, 2, "[n, 2] of (src, dst) block ids");
  TORCH_CHECK_VALUE(block_mapping.size(1) == 2, op, ": block_mapping must have shape [n, 2], got ",
                    block_mapping.sizes());
  if (!block_mapping.is_cpu()) return;
  const int64_t* map = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_mapping.size(0); ++i) {
    TORCH_CHECK_VALUE(map[2 * i] >= 0 && map[2 * i] < src_blocks, op, ": block_mapping[", i, ", 0] = ", map[2 * i],
                      " is not a source block (", src_blocks, " blocks)");
    TORCH_CHECK_VALUE(map[2 * i + 1] >= 0 && map[2 * i + 1] < dst_blocks, op, ": block_mapping[", i,
                      ", 1] = ", map[2 * i + 1], " is not a destination block (", dst_blocks, " blocks)");
  }
}

}  // namespace

namespace batchgen::checked {

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping, const c10::optional<Tensor>& k_scale,
                       const c10::optional<Tensor>& v_scale) {
  const char* op = "reshape_and_cache";
  check_caches(op, key_cache, value_cache);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"key", key}, {"value", value}}) {
    check_rows(op, name, t, "[num_tokens, num_kv_heads, head_dim]");
    check_data(op, name, t, key_cache);
    TORCH_CHECK_VALUE(t.size(1) == key_cache.size(1) && t.size(2) == key_cache.size(3), op, ": ", name,
                      " has shape ", t.sizes(), " but the cache has ", key_cache.size(1), " kv heads of head_dim ",
                      key_cache.size(3));
  }
  TORCH_CHECK_VALUE(value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type(), op,
                    ": value has shape ", value.sizes(), " and dtype ", value.scalar_type(), " but key has ",
                    key.sizes(), " and ", key.scalar_type());
  const batchgen::cpu::KVScales scales = checked_scales(op, k_scale, v_scale, key_cache);
  check_index(op, "slot_mapping", slot_mapping, torch::kInt64, 1, "[num_tokens]");
  check_same_device(op, "slot_mapping", slot_mapping, key_cache, "key_cache");
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), op, ": slot_mapping has ", slot_mapping.size(0),
                    " entries but key has ", key.size(0), " tokens");
  if (on_cuda(op, key_cache)) {
    BATCHGEN_CUDA_CALL(reshape_and_cache, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  } else {
    batchgen::cpu::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, scales);
  }
}

// seq_groups is a hint: the CPU kernel reads blocks shared by sequences side by side with the same
// id once for all of them; the CUDA kernel reads every sequence's blocks itself and ignores it.
void paged_attention_decode(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                            const Tensor& block_tables, const Tensor& seq_lens, double scale,
                            const c10::optional<Tensor>& seq_groups, int64_t sliding_window, double logits_soft_cap,
                            const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                            const c10::optional<Tensor>& sinks) {
  const char* op = "paged_attention_decode";
  check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens, scale);
  const batchgen::cpu::KVScales scales = checked_scales(op, k_scale, v_scale, key_cache);
  check_variants(op, sliding_window, logits_soft_cap, sinks, query);
  TORCH_CHECK_VALUE(seq_lens.size(0) == query.size(0), op, ": seq_lens has ", seq_lens.size(0),
                    " sequences but query has ", query.size(0), " (one query token per sequence)");
  if (seq_groups.has_value()) {
    check_index(op, "seq_groups", *seq_groups, torch::kInt32, 1, "[num_seqs]");
    check_same_device(op, "seq_groups", *seq_groups, key_cache, "key_cache");
    TORCH_CHECK_VALUE(seq_groups->size(0) == seq_lens.size(0), op, ": seq_groups has ", seq_groups->size(0),
                      " entries but seq_lens has ", seq_lens.size(0), " sequences");
  }
  if (on_cuda(op, key_cache)) {
    BATCHGEN_CUDA_CALL(paged_attention_decode, out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                       sliding_window, logits_soft_cap, k_scale, v_scale, sinks);
  } else {
    batchgen::cpu::paged_attention_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                          seq_groups, sliding_window, logits_soft_cap, scales, sinks);
  }
}

int64_t read_decode_blocks(const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
                           const Tensor& seq_lens, bool whole_blocks) {
  const char* op = "read_decode_blocks";
  check_caches(op, key_cache, value_cache);
  check_tables(op, block_tables, seq_lens, key_cache);
  TORCH_CHECK_VALUE(!on_cuda(op, key_cache), op, ": CPU caches only");
  return batchgen::cpu::read_decode_blocks(key_cache, value_cache, block_tables, seq_lens, whole_blocks);
}

void paged_attention_prefill(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                             const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                             double scale, int64_t sliding_window, double logits_soft_cap,
                             const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                             const c10::optional<Tensor>& key_limit, const c10::optional<Tensor>& sinks) {
  const char* op = "paged_attention_prefill";
  check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens, scale);
  const batchgen::cpu::KVScales scales = checked_scales(op, k_scale, v_scale, key_cache);
  check_variants(op, sliding_window, logits_soft_cap, sinks, query);
  check_index(op, "query_start_loc", query_start_loc, torch::kInt32, 1, "[num_seqs + 1]");
  check_same_device(op, "query_start_loc", query_start_loc, key_cache, "key_cache");
  TORCH_CHECK_VALUE(query_start_loc.size(0) == seq_lens.size(0) + 1, op, ": query_start_loc has ",
                    query_start_loc.size(0), " entries but seq_lens has ", seq_lens.size(0),
                    " sequences (need num_seqs + 1)");
  if (key_limit.has_value()) {
    check_index(op, "key_limit", *key_limit, torch::kInt32, 1, "[num_tokens]");
    check_same_device(op, "key_limit", *key_limit, key_cache, "key_cache");
    TORCH_CHECK_VALUE(key_limit->size(0) == query.size(0), op, ": key_limit has ", key_limit->size(0),
                      " entries but query has ", query.size(0), " tokens");
  }
  if (on_cuda(op, key_cache)) {
    BATCHGEN_CUDA_CALL(paged_attention_prefill, out, query, key_cache, value_cache, block_tables, seq_lens,
                       query_start_loc, scale, sliding_window, logits_soft_cap, k_scale, v_scale, key_limit, sinks);
  } else {
    batchgen::cpu::paged_attention_prefill(out, query, key_cache, value_cache, block_tables, seq_lens,
                                           query_start_loc, scale, sliding_window, logits_soft_cap, scales,
                                           key_limit, sinks);
  }
}

}  // namespace batchgen::checked

namespace {

void copy_blocks(std::vector<Tensor>& key_caches, std::vector<Tensor>& value_caches, const Tensor& block_mapping) {
  const char* op = "copy_blocks";
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), op, ": ", key_caches.size(), " key caches but ",
                    value_caches.size(), " value caches");
  if (key_caches.empty()) return;
  for (size_t i = 0; i < key_caches.size(); ++i) {
    check_caches(op, key_caches[i], value_caches[i]);
    TORCH_CHECK_VALUE(key_caches[i].sizes() == key_caches[0].sizes() &&
                          key_caches[i].scalar_type() == key_caches[0].scalar_type() &&
                          key_caches[i].device() == key_caches[0].device(),
                      op, ": the cache of layer ", i, " differs from layer 0 in shape, dtype or device");
  }
  const Tensor& first = key_caches[0];
  check_block_mapping(op, block_mapping, first.size(0), first.size(0));
  TORCH_CHECK_VALUE(block_mapping.is_cpu() || block_mapping.device() == first.device(), op,
                    ": block_mapping must be on the host or on the caches' device (", first.device(), "), got ",
                    block_mapping.device());
  if (on_cuda(op, first)) {
    BATCHGEN_CUDA_CALL(copy_blocks, key_caches, value_caches, block_mapping);
  } else {
    batchgen::cpu::copy_blocks(key_caches, value_caches, block_mapping);
  }
}

void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const char* op = "swap_blocks";
  constexpr const char* shape = "[num_blocks, ...block shape]";
  check_tensor(op, "src", src, 4, shape);
  check_tensor(op, "dst", dst, 4, shape);
  TORCH_CHECK_VALUE(dst.scalar_type() == src.scalar_type(), op, ": dst has dtype ", dst.scalar_type(),
                    " but src has ", src.scalar_type());
  TORCH_CHECK_VALUE(dst.sizes().slice(1) == src.sizes().slice(1), op, ": dst blocks have shape ",
                    dst.sizes().slice(1), " but src blocks have ", src.sizes().slice(1));
  check_block_mapping(op, block_mapping, src.size(0), dst.size(0));
  TORCH_CHECK_VALUE(block_mapping.is_cpu(), op, ": block_mapping must be a CPU tensor, got ", block_mapping.device());
  const bool src_cuda = on_cuda(op, src), dst_cuda = on_cuda(op, dst);
  if (src_cuda || dst_cuda) {
    BATCHGEN_CUDA_CALL(swap_blocks, src, dst, block_mapping);
  } else {
    batchgen::cpu::swap_blocks(src, dst, block_mapping);
  }
}

// Activations of the element-wise layer ops: 2-D [n, d] or 3-D [n, h, d], unit stride in the
// last dimension, float32 or bfloat16, on the host (batchgen.ops runs torch otherwise).
void check_activation(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == 2 || t.dim() == 3, op, ": ", name, " must be 2-D [n, d] or 3-D [n, h, d], got shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.stride(-1) == 1, op, ": ", name, " must be contiguous in its last dimension, got strides ",
                    t.strides());
  TORCH_CHECK_VALUE(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, op, ": ", name,
                    " dtype ", t.scalar_type(), " is not supported (float32, bfloat16)");
  TORCH_CHECK_VALUE(t.is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

void check_like(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* ref_name) {
  check_activation(op, name, t);
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes() && t.scalar_type() == ref.scalar_type(), op, ": ", name,
                    " has shape ", t.sizes(), " and dtype ", t.scalar_type(), " but ", ref_name, " has ", ref.sizes(),
                    " and ", ref.scalar_type());
}

void check_norm_weight(const char* op, const Tensor& weight, const Tensor& input, double eps) {
  check_tensor(op, "weight", weight, 1, "[hidden]");
  TORCH_CHECK_VALUE(weight.scalar_type() == input.scalar_type() && weight.size(0) == input.size(-1) &&
                        weight.is_cpu(),
                    op, ": weight must be a CPU ", input.scalar_type(), " vector of ", input.size(-1),
                    " elements like input's last dimension, got ", weight.scalar_type(), " ", weight.sizes(), " on ",
                    weight.device());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

}  // namespace

namespace batchgen::checked {

void rms_norm(Tensor& out, const Tensor& input, const Tensor& weight, double eps) {
  const char* op = "rms_norm";
  check_activation(op, "input", input);
  check_like(op, "out", out, input, "input");
  check_norm_weight(op, weight, input, eps);
  batchgen::cpu::rms_norm(out, input, weight, eps);
}

void fused_add_rms_norm(Tensor& input, Tensor& residual, const Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  check_activation(op, "input", input);
  check_like(op, "residual", residual, input, "input");
  check_norm_weight(op, weight, input, eps);
  batchgen::cpu::fused_add_rms_norm(input, residual, weight, eps);
}

void rotary_embedding(const Tensor& positions, Tensor& x, const Tensor& cos_sin_cache) {
  const char* op = "rotary_embedding";
  check_activation(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": x must be 3-D [num_tokens, num_heads, head_dim], got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(2) % 2 == 0 && x.size(2) <= 1024, op, ": head_dim must be even and <= 1024, got ",
                    x.size(2));
  check_index(op, "positions", positions, torch::kInt64, 1, "[num_tokens]");
  TORCH_CHECK_VALUE(positions.is_cpu() && positions.size(0) == x.size(0), op, ": positions must be a CPU tensor of ",
                    x.size(0), " entries (one per token of x), got ", positions.size(0), " on ", positions.device());
  check_tensor(op, "cos_sin_cache", cos_sin_cache, 2, "[max_position, head_dim]");
  TORCH_CHECK_VALUE(cos_sin_cache.is_cpu() && cos_sin_cache.size(1) == x.size(2) &&
                        (cos_sin_cache.scalar_type() == torch::kFloat32 ||
                         cos_sin_cache.scalar_type() == x.scalar_type()),
                    op, ": cos_sin_cache must be a float32 or ", x.scalar_type(), " CPU tensor [max_position, ",
                    x.size(2), "], got ", cos_sin_cache.scalar_type(), " ", cos_sin_cache.sizes(), " on ",
                    cos_sin_cache.device());
  batchgen::cpu::rotary_embedding(positions, x, cos_sin_cache);
}

}  // namespace batchgen::checked

namespace {

void argmax_logsumexp(const Tensor& logits, Tensor& argmax, Tensor& log_total) {
  const char* op = "argmax_logsumexp";
  check_activation(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) >= 1, op, ": logits must be [n, vocab], got shape ",
                    logits.sizes());
  check_index(op, "argmax", argmax, torch::kInt64, 1, "[n]");
  check_index(op, "log_total", log_total, torch::kFloat32, 1, "[n]");
  TORCH_CHECK_VALUE(argmax.is_cpu() && log_total.is_cpu() && argmax.size(0) == logits.size(0) &&
                        log_total.size(0) == logits.size(0),
                    op, ": argmax and log_total must be CPU tensors of ", logits.size(0), " entries");
  batchgen::cpu::argmax_logsumexp(logits, argmax, log_total);
}

// The number of rows a sampler op reads from logits [n, vocab]: rows' length (int64 [m], each in [0, n)), or n.
int64_t selected_rows(const char* op, const Tensor& logits, const c10::optional<Tensor>& rows) {
  if (!rows.has_value()) return logits.size(0);
  check_index(op, "rows", *rows, torch::kInt64, 1, "[m]");
  TORCH_CHECK_VALUE(rows->is_cpu() && rows->is_contiguous(), op, ": rows must be a contiguous CPU tensor");
  const int64_t* ids = rows->data_ptr<int64_t>();
  for (int64_t r = 0; r < rows->size(0); ++r) {
    TORCH_CHECK_VALUE(ids[r] >= 0 && ids[r] < logits.size(0), op, ": rows[", r, "] = ", ids[r], " is not a row of the ",
                      logits.size(0), " logits rows");
  }
  return rows->size(0);
}

void top_k(const Tensor& logits, int64_t k, Tensor& values, Tensor& ids, const c10::optional<Tensor>& rows) {
  const char* op = "top_k";
  check_activation(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() == 2 && k >= 1 && k <= logits.size(1), op,
                    ": logits must be [n, vocab] and 1 <= k <= vocab, got shape ", logits.sizes(), " and k ", k);
  const int64_t n = selected_rows(op, logits, rows);
  check_index(op, "ids", ids, torch::kInt64, 2, "[n, k]");
  TORCH_CHECK_VALUE(values.is_cpu() && values.scalar_type() == torch::kFloat32 && values.is_contiguous() &&
                        ids.is_cpu() && values.sizes() == ids.sizes() && values.size(0) == n && values.size(1) == k,
                    op, ": values (float32) and ids must be contiguous CPU tensors [", n, ", ", k, "]");
  batchgen::cpu::top_k(logits, k, values, ids, rows);
}

void sample_tokens(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p,
                   const Tensor& min_p, const Tensor& u, Tensor& tokens, const c10::optional<Tensor>& rows) {
  const char* op = "sample_tokens";
  check_rank(op, "logits", logits, 2, "[n, vocab]");
  const bool float32_or_bf16 = logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK_VALUE(logits.is_cpu() && float32_or_bf16 && logits.stride(1) == 1 && logits.size(1) >= 1 &&
                        logits.size(1) <= std::numeric_limits<int32_t>::max(),
                    op, ": logits must be a float32 or bfloat16 CPU tensor [n, vocab] with contiguous rows, got ",
                    logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides(), " on ", logits.device());
  const int64_t n = selected_rows(op, logits, rows);
  const std::pair<const char*, const Tensor*> per_row[] = {
      {"temperature", &temperature}, {"top_p", &top_p}, {"min_p", &min_p}, {"u", &u}};
  for (const auto& [name, t] : per_row) {
    check_index(op, name, *t, torch::kFloat32, 1, "[n]");
    TORCH_CHECK_VALUE(t->is_cpu() && t->size(0) == n, op, ": ", name, " must be a CPU tensor of ", n, " entries");
  }
  check_index(op, "top_k", top_k, torch::kInt64, 1, "[n]");
  check_index(op, "tokens", tokens, torch::kInt64, 1, "[n]");
  TORCH_CHECK_VALUE(top_k.is_cpu() && tokens.is_cpu() && top_k.size(0) == n && tokens.size(0) == n, op,
                    ": top_k and tokens must be CPU tensors of ", n, " entries");
  const float* temp = temperature.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_VALUE(temp[r] > 0.0f, op, ": temperature[", r, "] = ", temp[r], " must be > 0 (greedy rows take argmax)");
  }
  batchgen::cpu::sample_tokens(logits, temperature, top_k, top_p, min_p, u, tokens, rows);
}

void mask_logits(const Tensor& logits, const Tensor& allowed, Tensor& out, const c10::optional<Tensor>& rows) {
  const char* op = "mask_logits";
  check_activation(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) >= 1, op, ": logits must be [n, vocab], got shape ",
                    logits.sizes());
  const int64_t n = selected_rows(op, logits, rows), vocab = logits.size(1);
  check_rank(op, "allowed", allowed, 2, "[n, words]");
  TORCH_CHECK_VALUE(allowed.is_cpu() && allowed.scalar_type() == torch::kInt32 && allowed.stride(1) == 1 &&
                        allowed.size(0) == n && allowed.size(1) * 32 >= vocab,
                    op, ": allowed must be an int32 CPU tensor [", n, ", >= ", (vocab + 31) / 32,
                    "] with contiguous rows, got ", allowed.scalar_type(), " ", allowed.sizes(), " on ",
                    allowed.device());
  check_tensor(op, "out", out, 2, "[n, vocab]");
  TORCH_CHECK_VALUE(out.is_cpu() && out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.size(0) == n &&
                        out.size(1) == vocab,
                    op, ": out must be a contiguous float32 CPU tensor [", n, ", ", vocab, "], got ", out.scalar_type(),
                    " ", out.sizes());
  batchgen::cpu::mask_logits(logits, allowed, out, rows);
}

// A float32 CPU tensor [rows, cols] with contiguous rows.
void check_float_rows(const char* op, const char* name, const Tensor& t, int64_t rows, int64_t cols) {
  check_rank(op, name, t, 2, "[rows, features]");
  TORCH_CHECK_VALUE(t.is_cpu() && t.scalar_type() == torch::kFloat32 && t.stride(1) == 1 && t.size(0) == rows &&
                        t.size(1) == cols,
                    op, ": ", name, " must be a float32 CPU tensor [", rows, ", ", cols,
                    "] contiguous in its last dimension, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// The bf16 GEMMs: x [rows, depth] bf16 and out [rows, cols] bf16 or float32 on the host with unit stride
// in their last dimension; weights packed in panels [ceil(cols / panel cols), depth / 2, panel cols, 2].
void check_gemm_operands(const char* op, const Tensor& out, const Tensor& x, const Tensor& weight, const char* name) {
  for (const auto& [what, t] : {std::pair<const char*, const Tensor*>{"x", &x}, {"out", &out}}) {
    check_rank(op, what, *t, 2, "[rows, features]");
    const bool dtype_ok = t->scalar_type() == torch::kBFloat16 || (t == &out && out.scalar_type() == torch::kFloat32);
    TORCH_CHECK_VALUE(dtype_ok && t->is_cpu() && t->stride(1) == 1, op, ": ", what, " must be a ",
                      t == &out ? "bfloat16 or float32" : "bfloat16",
                      " CPU tensor contiguous in its last dimension, got ", t->scalar_type(), " ", t->sizes(),
                      " strides ", t->strides(), " on ", t->device());
  }
  TORCH_CHECK_VALUE(out.size(0) == x.size(0), op, ": out has ", out.size(0), " rows but x has ", x.size(0));
  check_tensor(op, name, weight, 4, "[panels, depth / 2, panel columns, 2]");
  const int64_t cols = batchgen::cpu::kGemmPanelCols;
  TORCH_CHECK_VALUE(weight.scalar_type() == torch::kBFloat16 && weight.is_cpu() && weight.size(2) == cols &&
                        weight.size(3) == 2 && 2 * weight.size(1) == x.size(1),
                    op, ": ", name, " must be bfloat16 CPU panels [panels, ", x.size(1) / 2, ", ", cols,
                    ", 2] for x's ", x.size(1), " features, got ", weight.scalar_type(), " ", weight.sizes(), " on ",
                    weight.device());
  TORCH_CHECK_VALUE(out.size(1) > (weight.size(0) - 1) * cols && out.size(1) <= weight.size(0) * cols, op, ": out's ",
                    out.size(1), " columns do not fill ", name, "'s ", weight.size(0), " panels of ", cols);
}

}  // namespace

namespace batchgen::checked {

void gemm_bf16(Tensor& out, const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
               const c10::optional<Tensor>& addend) {
  const char* op = "gemm_bf16";
  check_gemm_operands(op, out, x, weight, "weight");
  if (bias.has_value()) {
    check_index(op, "bias", *bias, torch::kFloat32, 1, "[out_features]");
    TORCH_CHECK_VALUE(bias->is_cpu() && bias->size(0) == out.size(1), op, ": bias must be a CPU tensor of ",
                      out.size(1), " entries");
  }
  if (addend.has_value()) check_float_rows(op, "addend", *addend, out.size(0), out.size(1));
  batchgen::cpu::gemm_bf16(out, x, weight, bias, addend);
}

void gemm_silu_mul_bf16(Tensor& out, const Tensor& x, const Tensor& gate, const Tensor& up,
                        const c10::optional<Tensor>& addend) {
  const char* op = "gemm_silu_mul_bf16";
  check_gemm_operands(op, out, x, gate, "gate");
  check_gemm_operands(op, out, x, up, "up");
  if (addend.has_value()) check_float_rows(op, "addend", *addend, out.size(0), 2 * out.size(1));
  batchgen::cpu::gemm_silu_mul_bf16(out, x, gate, up, addend);
}

void moe_silu_experts_bf16(Tensor& out, const Tensor& hidden, const Tensor& expert_ids, const Tensor& weights,
                           const std::vector<Tensor>& gates, const std::vector<Tensor>& ups,
                           const std::vector<Tensor>& downs, int64_t intermediate) {
  const char* op = "moe_silu_experts_bf16";
  TORCH_CHECK_VALUE(!gates.empty() && ups.size() == gates.size() && downs.size() == gates.size(), op,
                    ": needs the same number (> 0) of gate, up and down weights, got ", gates.size(), ", ", ups.size(),
                    " and ", downs.size());
  TORCH_CHECK_VALUE(intermediate > 0 && intermediate % 2 == 0, op, ": intermediate must be even and positive, got ",
                    intermediate);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"hidden", &hidden}, {"out", &out}}) {
    check_rank(op, name, *t, 2, "[tokens, features]");
    TORCH_CHECK_VALUE(t->scalar_type() == torch::kBFloat16 && t->is_cpu() && t->stride(1) == 1 &&
                          t->sizes() == hidden.sizes(),
                      op, ": ", name, " must be a bfloat16 CPU tensor ", hidden.sizes(),
                      " contiguous in its last dimension, got ", t->scalar_type(), " ", t->sizes(), " strides ",
                      t->strides(), " on ", t->device());
  }
  batchgen::cpu::check_routing(op, hidden, expert_ids, weights);
  // Every expert's panels checked as gemm_*_bf16 checks one call's, on tensors of one row of the right shape.
  const Tensor one_row = hidden.narrow(0, 0, std::min<int64_t>(1, hidden.size(0)));
  const Tensor gated = torch::empty({one_row.size(0), intermediate}, hidden.options());
  const Tensor summed = torch::empty({one_row.size(0), hidden.size(1)}, hidden.options().dtype(torch::kFloat32));
  for (size_t e = 0; e < gates.size(); ++e) {
    check_gemm_operands(op, gated, one_row, gates[e], "gate");
    check_gemm_operands(op, gated, one_row, ups[e], "up");
    check_gemm_operands(op, summed, gated, downs[e], "down");
    TORCH_CHECK_VALUE(gates[e].sizes() == gates[0].sizes() && ups[e].sizes() == gates[0].sizes() &&
                          downs[e].sizes() == downs[0].sizes(),
                      op, ": expert ", e, "'s panels are not the shape of expert 0's");
  }
  batchgen::cpu::moe_silu_experts_bf16(out, hidden, expert_ids, weights, gates, ups, downs, intermediate);
}

void lora_shrink_expand(Tensor& y, const Tensor& x, const Tensor& segments, const Tensor& a, const Tensor& b_t,
                        const c10::optional<Tensor>& ranks, double scale, bool store) {
  const char* op = "lora_shrink_expand";
  const bool cuda = on_cuda(op, x);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"x", &x}, {"y", &y}}) {
    check_rank(op, name, *t, 2, "[rows, features]");
    TORCH_CHECK_VALUE(t->device() == x.device() && t->stride(1) == 1 &&
                          (t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kBFloat16 ||
                           (cuda && t->scalar_type() == torch::kFloat16)),
                      op, ": ", name, " must be a float32 or bfloat16 (CUDA: or float16) tensor on x's device, "
                      "contiguous in its last dimension, got ", t->scalar_type(), " ", t->sizes(), " strides ",
                      t->strides(), " on ", t->device());
  }
  TORCH_CHECK_VALUE(y.scalar_type() == x.scalar_type() || y.scalar_type() == torch::kFloat32, op,
                    ": y must be x's dtype or float32, got ", y.scalar_type());
  TORCH_CHECK_VALUE(!store || y.scalar_type() == torch::kFloat32, op, ": store needs a float32 y");
  TORCH_CHECK_VALUE(y.size(0) == x.size(0), op, ": y has ", y.size(0), " rows but x has ", x.size(0));
  check_index(op, "segments", segments, torch::kInt32, 2, "[count, 3]");
  TORCH_CHECK_VALUE((segments.is_cpu() || (cuda && segments.device() == x.device())) && segments.size(1) == 3, op,
                    ": segments must be a tensor [count, 3] (first row, end row, slot) on the CPU (or on x's CUDA "
                    "device), got ", segments.sizes(), " on ", segments.device());
  const int64_t slots = a.size(0);
  int64_t capacity;
  if (a.scalar_type() == torch::kBFloat16) {  // the bf16 form: pairs for the bf16 dot product
    TORCH_CHECK_VALUE(!cuda, op, ": the bf16 form of a and b_t is CPU-only; give CUDA float32 a and b_t");
    const int64_t pairs = (x.size(1) + 1) / 2;
    check_index(op, "a", a, torch::kBFloat16, 4, "[slots, ceil(in_features / 2), rank, 2]");
    check_index(op, "b_t", b_t, torch::kBFloat16, 4, "[slots, rank / 2, out_features, 2]");
    capacity = a.size(2);
    TORCH_CHECK_VALUE(x.scalar_type() == torch::kBFloat16, op, ": bf16 a and b_t need a bf16 x, got ",
                      x.scalar_type());
    TORCH_CHECK_VALUE(a.is_cpu() && b_t.is_cpu() && a.size(1) == pairs && a.size(3) == 2 && b_t.size(0) == slots &&
                          2 * b_t.size(1) == capacity && b_t.size(2) == y.size(1) && b_t.size(3) == 2 &&
                          capacity % batchgen::cpu::kLoRARankGroup == 0 && capacity <= batchgen::cpu::kMaxLoRARank,
                      op, ": bf16 a [slots, ", pairs, ", rank, 2] and b_t [slots, rank / 2, ", y.size(1),
                      ", 2] must be CPU tensors of one rank, a multiple of ", batchgen::cpu::kLoRARankGroup,
                      " up to ", batchgen::cpu::kMaxLoRARank, " (ops.pack_lora_bf16), got ", a.sizes(), " and ",
                      b_t.sizes());
  } else {
    check_index(op, "a", a, torch::kFloat32, 3, "[slots, rank, in_features]");
    check_index(op, "b_t", b_t, torch::kFloat32, 3, "[slots, rank, out_features]");
    capacity = a.size(1);
    TORCH_CHECK_VALUE(a.device() == x.device() && b_t.device() == x.device() && a.size(2) == x.size(1) &&
                          b_t.size(2) == y.size(1) && b_t.size(0) == slots && b_t.size(1) == capacity &&
                          capacity <= batchgen::cpu::kMaxLoRARank,
                      op, ": a [slots, rank, ", x.size(1), "] and b_t [slots, rank, ", y.size(1),
                      "] must be tensors on x's device of one rank <= ", batchgen::cpu::kMaxLoRARank, ", got ",
                      a.sizes(), " and ", b_t.sizes(), " on ", a.device(), " and ", b_t.device());
  }
  if (ranks.has_value()) {
    check_index(op, "ranks", *ranks, torch::kInt32, 1, "[slots]");
    TORCH_CHECK_VALUE((ranks->is_cpu() || ranks->device() == x.device()) && ranks->size(0) == slots, op,
                      ": ranks must be a tensor of ", slots, " entries (one a slot) on the CPU or x's device");
  }
  if (cuda) {
    BATCHGEN_CUDA_CALL(lora_shrink_expand, y, x, segments, a, b_t, ranks, scale, store);
  } else {
    batchgen::cpu::lora_shrink_expand(y, x, segments, a, b_t, ranks, scale, store);
  }
}

}  // namespace batchgen::checked

namespace {

bool has_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace batchgen::checked;  // NOLINT: the checked ops are what Python calls
  // The ops run without the GIL, so other Python threads (readers, writers) keep going meanwhile.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "batchgen paged KV cache kernels (see engine_src/README.md for layouts and contracts)";
  m.def("reshape_and_cache", &reshape_and_cache, "Write key/value rows into the caches at slot_mapping",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), no_gil);
  m.def("paged_attention_decode", &paged_attention_decode, "Attention of one query token per sequence",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("seq_groups") = py::none(), py::arg("sliding_window") = 0,
        py::arg("logits_soft_cap") = 0.0, py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("sinks") = py::none(), no_gil);
  m.def("read_decode_blocks", &read_decode_blocks,
        "Read the K/V bytes paged_attention_decode reads, nothing else done (a benchmark's yardstick)",
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("whole_blocks") = false, no_gil);
  m.def("paged_attention_prefill", &paged_attention_prefill, "Causal attention of a flat varlen batch",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"), py::arg("sliding_window") = 0,
        py::arg("logits_soft_cap") = 0.0, py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("key_limit") = py::none(), py::arg("sinks") = py::none(), no_gil);
  m.def("copy_blocks", &copy_blocks, "Copy blocks within each layer's caches", py::arg("key_caches"),
        py::arg("value_caches"), py::arg("block_mapping"), no_gil);
  m.def("swap_blocks", &swap_blocks, "Copy blocks from one cache to another, across devices", py::arg("src"),
        py::arg("dst"), py::arg("block_mapping"), no_gil);
  m.def("rms_norm", &rms_norm, "out = weight * x / rms(x), rounded like transformers' RMSNorm", py::arg("out"),
        py::arg("input"), py::arg("weight"), py::arg("eps"), no_gil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += input; input = rms_norm(residual), in place",
        py::arg("input"), py::arg("residual"), py::arg("weight"), py::arg("eps"), no_gil);
  m.def("rotary_embedding", &rotary_embedding, "Rotate x [tokens, heads, head_dim] in place (rotate-half layout)",
        py::arg("positions"), py::arg("x"), py::arg("cos_sin_cache"), no_gil);
  m.def("argmax_logsumexp", &argmax_logsumexp, "Per row of logits: first argmax and logsumexp", py::arg("logits"),
        py::arg("argmax"), py::arg("log_total"), no_gil);
  m.def("top_k", &top_k,
        "Per row of logits (those `rows` names, or all): the k largest as float32 (NaN first, ties lower index first)",
        py::arg("logits"), py::arg("k"), py::arg("values"), py::arg("ids"), py::arg("rows") = py::none(), no_gil);
  m.def("sample_tokens", &sample_tokens,
        "One token per row of logits (those `rows` names, or all), drawn at u from softmax(logits / temperature) "
        "under top-k/top-p/min-p",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        py::arg("tokens"), py::arg("rows") = py::none(), no_gil);
  m.def("mask_logits", &mask_logits,
        "float32 logits (of the rows `rows` names, or all) with -inf where a packed int32 bitmask refuses a token",
        py::arg("logits"), py::arg("allowed"), py::arg("out"), py::arg("rows") = py::none(), no_gil);
  m.attr("GEMM_PANEL_COLS") = batchgen::cpu::kGemmPanelCols;
  m.def("has_gemm_bf16", &batchgen::cpu::has_gemm_bf16, "Whether the active CPU kernels have the bf16 GEMM");
  m.def("gemm_widens_bf16", &batchgen::cpu::gemm_widens_bf16,
        "Whether the active CPU kernels' bf16 GEMM widens the pairs to float32 FMAs (no bf16 dot product)");
  m.def("gemm_bf16", &gemm_bf16, "out = x weight^T (+ addend) (+ bias) on bf16 weights packed in panels",
        py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("addend") = py::none(),
        no_gil);
  m.def("gemm_silu_mul_bf16", &gemm_silu_mul_bf16,
        "out = silu(x gate^T + addend's first half) * (x up^T + its second half) on bf16 panels", py::arg("out"),
        py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("addend") = py::none(), no_gil);
  m.def("moe_silu_experts_bf16", &moe_silu_experts_bf16,
        "A mixture of experts' SiLU-gated experts on bf16 panels, each token's k outputs weighted and summed in "
        "float32 in ascending expert order", py::arg("out"), py::arg("hidden"), py::arg("expert_ids"),
        py::arg("weights"), py::arg("gates"), py::arg("ups"), py::arg("downs"), py::arg("intermediate"), no_gil);
  m.attr("LORA_RANK_GROUP") = batchgen::cpu::kLoRARankGroup;
  m.def("lora_shrink_expand", &lora_shrink_expand,
        "Segmented LoRA: y[segment rows] += scale * (x A[slot]^T) B[slot] (or, with store, y = that)", py::arg("y"),
        py::arg("x"), py::arg("segments"), py::arg("a"), py::arg("b_t"), py::arg("ranks") = py::none(), py::arg("scale") = 1.0,
        py::arg("store") = false, no_gil);
  py::class_<batchgen::DecoderStack>(m, "DecoderStack", "A Llama model's decoder layers on CPU in one call")
      .def(py::init([](const std::vector<std::vector<Tensor>>& layers,
                       const std::vector<c10::optional<Tensor>>& qkv_biases, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t hidden, int64_t intermediate, double eps, double scale,
                       int64_t sliding_window, const std::vector<std::vector<std::tuple<Tensor, Tensor>>>& int8) {
             TORCH_CHECK_VALUE(qkv_biases.size() == layers.size(), "DecoderStack: ", layers.size(), " layers but ",
                               qkv_biases.size(), " qkv biases");
             TORCH_CHECK_VALUE(int8.empty() || int8.size() == layers.size(), "DecoderStack: ", layers.size(),
                               " layers but ", int8.size(), " entries of int8 scales");
             std::vector<batchgen::DecoderLayerWeights> weights;
             for (size_t i = 0; i < layers.size(); ++i) {
               const std::vector<Tensor>& l = layers[i];
               TORCH_CHECK_VALUE(l.size() == 7 || l.size() == 9, "DecoderStack: layer ", i,
                                 " needs 7 tensors (input_norm, qkv, o, post_norm, gate, up, down) and optionally "
                                 "q_norm and k_norm, got ", l.size());
               TORCH_CHECK_VALUE(int8.empty() || int8[i].size() == 4, "DecoderStack: layer ", i,
                                 " needs the int8 (compensation, w_scale) of qkv, o, gate_up and down, got ",
                                 int8[i].size());
               // The projection in slot `at` of l, the `which`-th int8 one.
               auto weight = [&](size_t at, size_t which) {
                 if (int8.empty()) return batchgen::PackedWeight{l[at]};
                 const auto& [compensation, w_scale] = int8[i][which];
                 return batchgen::PackedWeight{l[at], compensation, w_scale};
               };
               weights.push_back({l[0], weight(1, 0), weight(2, 1), l[3], weight(4, 2),
                                  batchgen::PackedWeight{l[5]}, weight(6, 3), qkv_biases[i]});
               if (l.size() == 9) {
                 weights.back().q_norm = l[7];
                 weights.back().k_norm = l[8];
               }
             }
             TORCH_CHECK_VALUE(sliding_window >= 0, "DecoderStack: sliding_window must be >= 0 (0 for none), got ",
                               sliding_window);
             return batchgen::DecoderStack(
                 std::move(weights),
                 {num_heads, num_kv_heads, head_dim, hidden, intermediate, eps, scale, sliding_window});
           }),
           py::arg("layers"), py::arg("qkv_biases"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"), py::arg("eps"), py::arg("scale"),
           py::arg("sliding_window") = 0, py::arg("int8") = std::vector<std::vector<std::tuple<Tensor, Tensor>>>{})
      .def("forward", &batchgen::DecoderStack::forward, py::arg("x"), py::arg("positions"), py::arg("cos_sin"),
           py::arg("key_caches"), py::arg("value_caches"), py::arg("slot_mapping"), py::arg("num_decode_tokens"),
           py::arg("decode_block_tables"), py::arg("decode_seq_lens"), py::arg("decode_seq_groups"),
           py::arg("prefill_block_tables"), py::arg("prefill_seq_lens"), py::arg("prefill_query_start_loc"),
           py::arg("lora_segments") = py::none(), py::arg("key_scales") = std::vector<Tensor>{},
           py::arg("value_scales") = std::vector<Tensor>{}, no_gil)
      .def(
          "set_lora",
          [](batchgen::DecoderStack& stack,
             const std::vector<std::vector<std::vector<std::tuple<int64_t, Tensor, Tensor, Tensor>>>>& layers) {
            std::vector<batchgen::DecoderLayerLoRA> lora;
            for (size_t i = 0; i < layers.size(); ++i) {
              const auto& l = layers[i];
              TORCH_CHECK_VALUE(l.size() == 4, "DecoderStack.set_lora: layer ", i,
                                " needs the pieces of qkv, o, gate_up and down, got ", l.size(), " projections");
              auto projection = [](const std::vector<std::tuple<int64_t, Tensor, Tensor, Tensor>>& pieces) {
                batchgen::LoRAProjection p;
                for (const auto& [first, a, b_t, ranks] : pieces) p.push_back({first, a, b_t, ranks});
                return p;
              };
              lora.push_back({projection(l[0]), projection(l[1]), projection(l[2]), projection(l[3])});
            }
            stack.set_lora(std::move(lora));
          },
          py::arg("layers"),
          "Every layer's LoRA pieces of qkv, o, gate_up and down: (first column, a, b_t, ranks) each "
          "(see decoder_stack.h)")
      .def_property_readonly("num_layers", &batchgen::DecoderStack::num_layers)
      .def("op_seconds", &batchgen::DecoderStack::op_seconds,
           "Seconds spent in each kind of op since construction (for profiles such as scripts/bench.py's)");
  m.attr("INT8_DEPTH_STEP") = batchgen::cpu::kInt8DepthStep;
  m.def("supported_int8_kernels", &batchgen::cpu::supported_int8_kernels, "int8 GEMM loops usable on this processor");
  m.def("int8_kernel", &batchgen::cpu::int8_kernel, "The int8 GEMM loop in use");
  m.def("set_int8_kernel", &batchgen::cpu::set_int8_kernel,
        "Force an int8 GEMM loop ('' follows the kernel table again; tests, benchmarks)", py::arg("name"));
  m.def("quantize_int8_rows", &batchgen::cpu::quantize_int8_rows, "Per-row int8 quantization (offset by 128)",
        py::arg("x"), py::arg("q"), py::arg("x_scale"), no_gil);
  m.def("gemm_int8", &batchgen::cpu::gemm_int8, "out = x_scale w_scale (q - 128) w^T (+ bias) on int8 panels",
        py::arg("out"), py::arg("q"), py::arg("x_scale"), py::arg("weight"), py::arg("compensation"),
        py::arg("w_scale"), py::arg("bias") = py::none(), no_gil);
  m.def("linear_int8", &batchgen::cpu::linear_int8, "quantize_int8_rows then gemm_int8 in one call", py::arg("out"),
        py::arg("x"), py::arg("weight"), py::arg("compensation"), py::arg("w_scale"), py::arg("bias") = py::none(),
        no_gil);
  m.def("linear_silu_mul_int8", &batchgen::cpu::linear_silu_mul_int8,
        "out = silu(x gate^T) * (x up^T) on int8 panels alternating gate and up", py::arg("out"), py::arg("x"),
        py::arg("weight"), py::arg("compensation"), py::arg("w_scale"), no_gil);
  m.def("moe_silu_experts_int8", &batchgen::cpu::moe_silu_experts_int8,
        "A mixture of experts' SiLU-gated experts on int8 panels ((panels, compensation, w_scale) an expert), each "
        "token's k outputs weighted and summed in float32 in ascending expert order", py::arg("out"),
        py::arg("hidden"), py::arg("expert_ids"), py::arg("weights"), py::arg("gate_ups"), py::arg("downs"),
        py::arg("intermediate"), no_gil);
  m.def("has_cuda", &has_cuda, "Whether the module was built with the CUDA kernels");
  m.def("cpu_isa", [] { return std::string(batchgen::cpu::active_kernels().name); },
        "The instruction set the CPU kernels use");
  m.def("supported_cpu_isas", &batchgen::cpu::supported_isas, "Instruction sets usable on this processor");
  m.def("set_cpu_isa", &batchgen::cpu::set_isa, "Switch the CPU kernels' instruction set (tests, benchmarks)",
        py::arg("name"));
  m.def("emulated_tile_products", &batchgen::cpu::emulated_tile_products,
        "Tile products computed on the emulated AMX unit (the amx_emulated table) in this process");
}
