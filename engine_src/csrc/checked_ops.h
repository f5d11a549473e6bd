// The ops as Python calls them (bindings.cpp): arguments checked, then the CPU or CUDA
// implementation. For C++ callers that must behave exactly like the Python ones (decoder_stack.cpp).
#pragma once
#include <torch/extension.h>

namespace batchgen::checked {

// k_scale, v_scale: float32 [num_kv_heads] of fp8 caches (engine_src/README.md), optional.
void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
                       const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                       const c10::optional<torch::Tensor>& v_scale = c10::nullopt);
void paged_attention_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale,
                            const c10::optional<torch::Tensor>& seq_groups, int64_t sliding_window = 0,
                            double logits_soft_cap = 0.0, const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                            const c10::optional<torch::Tensor>& v_scale = c10::nullopt,
                            const c10::optional<torch::Tensor>& sinks = c10::nullopt);
void paged_attention_prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                             const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                             int64_t sliding_window = 0, double logits_soft_cap = 0.0,
                             const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                             const c10::optional<torch::Tensor>& v_scale = c10::nullopt,
                             const c10::optional<torch::Tensor>& key_limit = c10::nullopt,
                             const c10::optional<torch::Tensor>& sinks = c10::nullopt);
void rms_norm(torch::Tensor& out, const torch::Tensor& input, const torch::Tensor& weight, double eps);
void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual, const torch::Tensor& weight, double eps);
void rotary_embedding(const torch::Tensor& positions, torch::Tensor& x, const torch::Tensor& cos_sin_cache);
void gemm_bf16(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
               const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& addend = c10::nullopt);
void gemm_silu_mul_bf16(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate,
                        const torch::Tensor& up, const c10::optional<torch::Tensor>& addend = c10::nullopt);
void lora_shrink_expand(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& segments,
                        const torch::Tensor& a, const torch::Tensor& b_t,
                        const c10::optional<torch::Tensor>& ranks, double scale, bool store);

}  // namespace batchgen::checked
