// Torch-facing entry points of the CUDA kernels; bindings.cpp calls these for CUDA tensors when
// the module is built WITH_CUDA. Implemented in torch_glue.cpp, which validates nothing the
// caller already checked and forwards raw pointers to the torch-free launchers in kernels.h.
#pragma once
#include <torch/extension.h>

#include <vector>

namespace batchgen::cuda {

// k_scale, v_scale: the per-kv-head float32 scales of fp8 caches (float8_e4m3fn, float8_e5m2), optional.
void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
                       const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale);

void paged_attention_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale, int64_t sliding_window,
                            double logits_soft_cap, const c10::optional<torch::Tensor>& k_scale,
                            const c10::optional<torch::Tensor>& v_scale, const c10::optional<torch::Tensor>& sinks);

void paged_attention_prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                             const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                             int64_t sliding_window, double logits_soft_cap, const c10::optional<torch::Tensor>& k_scale,
                             const c10::optional<torch::Tensor>& v_scale,
                             const c10::optional<torch::Tensor>& key_limit = c10::nullopt,
                             const c10::optional<torch::Tensor>& sinks = c10::nullopt);

void copy_blocks(std::vector<torch::Tensor>& key_caches, std::vector<torch::Tensor>& value_caches,
                 const torch::Tensor& block_mapping);

// src and dst may be on different devices (one of them CUDA); block_mapping is an int64 CPU tensor.
void swap_blocks(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& block_mapping);

// ops.h's lora_shrink_expand with its float32 a and b_t: segments and ranks may be CPU tensors (the launch
// reads the segments' lengths on the host first) or on x's device (no host read: x's rows bound the grid).
void lora_shrink_expand(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& segments,
                        const torch::Tensor& a, const torch::Tensor& b_t, const c10::optional<torch::Tensor>& ranks,
                        double scale, bool store);

}  // namespace batchgen::cuda
