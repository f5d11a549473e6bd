// CPU cache writes and block copies: all plain memcpy of contiguous rows or whole blocks.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

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

}  // namespace

void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0), kv_heads = key.size(1);
  const int64_t block_size = key_cache.size(2), num_slots = key_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ", slots[t],
                      " is past the end of the cache (", num_slots, " slots)");
  }
  // One row of head_dim elements per (token, kv head); a row's place in the cache is
  // ((block * kv_heads + head) * block_size + offset) * head_dim.
  const int64_t element = key.element_size(), row_bytes = key.size(2) * element;
  const int64_t k_token = key.stride(0) * element, k_head = key.stride(1) * element;
  const int64_t v_token = value.stride(0) * element, v_head = value.stride(1) * element;
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(key_cache.data_ptr());
  auto* v_dst = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t dst = ((block * kv_heads + h) * block_size + offset) * row_bytes;
        std::memcpy(k_dst + dst, k_src + t * k_token + h * k_head, row_bytes);
        std::memcpy(v_dst + dst, v_src + t * v_token + h * v_head, row_bytes);
      }
    }
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
