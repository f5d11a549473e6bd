// CPU cache writes and block copies: plain memcpy of contiguous rows or whole blocks, except the writes
// into fp8 caches, which quantize each row (fp8.h's float_to_fp8, in the active kernel table's row loop).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// Copies `count` chunks of `bytes` bytes: chunk i from src(i) to dst(i), in parallel.
template <typename Src, typename Dst>
void parallel_memcpy(int64_t count, int64_t bytes, const Src& src, const Dst& dst) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(bytes, 1));  // ~64 KiB a chunk
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst(i), src(i), bytes);
  });
}

// Calls write(t, h, row) for each kv head h of each token t that has a slot (a negative slot is padding), in
// parallel over tokens; `row` numbers the token's row of head h in the cache, whose rows are
// ((block * kv_heads + h) * block_size + offset).
template <typename Write>
void for_each_slot_row(int64_t num_tokens, int64_t kv_heads, int64_t block_size, const int64_t* slots,
                       int64_t grain, const Write& write) {
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) write(t, h, (block * kv_heads + h) * block_size + offset);
    }
  });
}

// reshape_and_cache into fp8 caches: each (token, kv head) row quantized with its head's scale.
void quantize_into_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                         torch::Tensor& value_cache, const int64_t* slots, const KVScales& scales) {
  const int64_t head_dim = key.size(2);
  const KVFormat format = kv_format_of(key_cache);
  const QuantizeFp8RowFn quantize = active_kernels().quantize_fp8_row[static_cast<int>(dtype_of(key))];
  const float* k_scale = scales.k.has_value() ? scales.k->data_ptr<float>() : nullptr;
  const float* v_scale = scales.v.has_value() ? scales.v->data_ptr<float>() : nullptr;
  const int64_t element = key.element_size();
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<uint8_t*>(key_cache.data_ptr());
  auto* v_dst = static_cast<uint8_t*>(value_cache.data_ptr());
  for_each_slot_row(key.size(0), key.size(1), key_cache.size(2), slots, 16, [&](int64_t t, int64_t h, int64_t row) {
    quantize(k_src + (t * key.stride(0) + h * key.stride(1)) * element, k_dst + row * head_dim, head_dim,
             k_scale != nullptr ? k_scale[h] : 1.0f, format);
    quantize(v_src + (t * value.stride(0) + h * value.stride(1)) * element, v_dst + row * head_dim, head_dim,
             v_scale != nullptr ? v_scale[h] : 1.0f, format);
  });
}

}  // namespace

void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping, const KVScales& scales) {
  const int64_t num_tokens = key.size(0), kv_heads = key.size(1);
  const int64_t block_size = key_cache.size(2), num_slots = key_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ", slots[t],
                      " is past the end of the cache (", num_slots, " slots)");
  }
  if (kv_format_of(key_cache) != KVFormat::same) {
    return quantize_into_cache(key, value, key_cache, value_cache, slots, scales);
  }
  // One row of head_dim elements per (token, kv head), copied.
  const int64_t element = key.element_size(), row_bytes = key.size(2) * element;
  const int64_t k_token = key.stride(0) * element, k_head = key.stride(1) * element;
  const int64_t v_token = value.stride(0) * element, v_head = value.stride(1) * element;
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(key_cache.data_ptr());
  auto* v_dst = static_cast<char*>(value_cache.data_ptr());
  for_each_slot_row(num_tokens, kv_heads, block_size, slots, 64, [&](int64_t t, int64_t h, int64_t row) {
    std::memcpy(k_dst + row * row_bytes, k_src + t * k_token + h * k_head, row_bytes);
    std::memcpy(v_dst + row * row_bytes, v_src + t * v_token + h * v_head, row_bytes);
  });
}

// Block ids were checked by the caller (bindings.cpp): CPU caches take a host block_mapping.
void copy_blocks(std::vector<torch::Tensor>& key_caches, std::vector<torch::Tensor>& value_caches,
                 const torch::Tensor& block_mapping) {
  if (key_caches.empty()) return;
  std::vector<char*> caches;  // cache c: layer c / 2, key (even c) or value (odd c)
  for (size_t layer = 0; layer < key_caches.size(); ++layer) {
    caches.push_back(static_cast<char*>(key_caches[layer].data_ptr()));
    caches.push_back(static_cast<char*>(value_caches[layer].data_ptr()));
  }
  const int64_t pairs = block_mapping.size(0);
  const int64_t block_bytes = key_caches[0].stride(0) * key_caches[0].element_size();
  const int64_t* map = block_mapping.data_ptr<int64_t>();
  // Copy i moves pair i % pairs within cache i / pairs.
  parallel_memcpy(
      static_cast<int64_t>(caches.size()) * pairs, block_bytes,
      [&](int64_t i) { return caches[i / pairs] + map[2 * (i % pairs)] * block_bytes; },
      [&](int64_t i) { return caches[i / pairs] + map[2 * (i % pairs) + 1] * block_bytes; });
}

void swap_blocks(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& block_mapping) {
  const int64_t block_bytes = src.stride(0) * src.element_size();
  const int64_t* map = block_mapping.data_ptr<int64_t>();
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(dst.data_ptr());
  parallel_memcpy(
      block_mapping.size(0), block_bytes, [&](int64_t i) { return from + map[2 * i] * block_bytes; },
      [&](int64_t i) { return to + map[2 * i + 1] * block_bytes; });
}

}  // namespace batchgen::cpu
