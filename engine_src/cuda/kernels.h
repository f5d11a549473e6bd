// Torch-free launchers of the CUDA kernels (see engine_src/README.md for the cache layout and the
// op contracts). They take raw device pointers, sizes and element strides, enqueue on `stream`
// and return the launch status (cudaErrorInvalidValue for an unsupported dtype or head_dim).
// Caches are contiguous [num_blocks, num_kv_heads, block_size, head_dim]; query, key, value and
// out may have any strides for their first two dims but a unit stride for the last one.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../csrc/fp8.h"

namespace batchgen::kernels {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// key/value [num_tokens, num_kv_heads, head_dim]; slot_mapping int64 [num_tokens], negative = skip.
cudaError_t launch_reshape_and_cache(DType dtype, const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                                     int num_kv_heads, int head_dim, int block_size, int64_t key_token_stride,
                                     int64_t key_head_stride, int64_t value_token_stride,
                                     int64_t value_head_stride, cudaStream_t stream,
                                     KVFormat kv_format = KVFormat::same, const float* k_scale = nullptr,
                                     const float* v_scale = nullptr);

// key_caches/value_caches: host arrays of num_layers device pointers; block_mapping: device int64
// [num_pairs, 2] of (src, dst) block ids; block_bytes: bytes of one block of one cache.
cudaError_t launch_copy_blocks(void* const* key_caches, void* const* value_caches, int num_layers,
                               const int64_t* block_mapping, int64_t num_pairs, int64_t block_bytes,
                               cudaStream_t stream);

// Bytes of float32 scratch that launch_paged_attention_decode needs (0 when it splits no sequence).
// max_context_len bounds every seq_lens[i]; the same arguments must be given to the launcher.
size_t paged_attention_decode_workspace_bytes(int num_seqs, int num_heads, int head_dim, int max_context_len,
                                              int sliding_window);

// query/out [num_seqs, num_heads, head_dim]; block_tables int32 [num_seqs, block_table_stride];
// seq_lens int32 [num_seqs], each in 1..max_context_len. Both attention launchers take
// sliding_window (0 off: else a query at position p sees keys p - sliding_window < j <= p, and the
// keys before are not read) and logits_soft_cap (0 off: else each score s = scale * q.k becomes
// logits_soft_cap * tanh(s / logits_soft_cap) before the softmax).
// fp8 caches (kv_format, fp8.h): reshape_and_cache stores round(x / k_scale[kv head]) (v_scale for values)
// and the attention launchers read byte * scale; k_scale and v_scale are device float32 [num_kv_heads], or
// null for 1.0. `dtype` stays the activations' (query, key, value, out). sinks: device float32 [num_heads], each
// query head's attention sink (a logit in the scaled scores' units joining the softmax with a zero value), or null.
cudaError_t launch_paged_attention_decode(DType dtype, void* out, int64_t out_seq_stride, int64_t out_head_stride,
                                          const void* query, int64_t query_seq_stride, int64_t query_head_stride,
                                          const void* key_cache, const void* value_cache, const int* block_tables,
                                          int64_t block_table_stride, const int* seq_lens, int num_seqs,
                                          int num_heads, int num_kv_heads, int head_dim, int block_size,
                                          int max_context_len, float scale, int sliding_window,
                                          float logits_soft_cap, void* workspace, cudaStream_t stream,
                                          KVFormat kv_format = KVFormat::same, const float* k_scale = nullptr,
                                          const float* v_scale = nullptr, const float* sinks = nullptr);

// query/out [num_tokens, num_heads, head_dim]; query_start_loc int32 [num_seqs + 1];
// seq_lens int32 [num_seqs]: whole length after this step (cached context + new tokens).
cudaError_t launch_paged_attention_prefill(DType dtype, void* out, int64_t out_token_stride,
                                           int64_t out_head_stride, const void* query, int64_t query_token_stride,
                                           int64_t query_head_stride, const void* key_cache,
                                           const void* value_cache, const int* block_tables,
                                           int64_t block_table_stride, const int* seq_lens,
                                           const int* query_start_loc, int num_seqs, int64_t num_tokens,
                                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                                           float scale, int sliding_window, float logits_soft_cap,
                                           cudaStream_t stream, KVFormat kv_format = KVFormat::same,
                                           const float* k_scale = nullptr, const float* v_scale = nullptr,
                                           const int* key_limit = nullptr, const float* sinks = nullptr);

// Segmented LoRA (lora_kernels.cu; the CPU op's contract, engine_src/csrc/ops.h): for each segment of
// `segments` (device int32 [num_segments, 3]: first row, end row, slot; max_segment_rows bounds end - first),
// y[rows] += scale * (x[rows] A[slot]^T) B[slot] with a float32 [slots, capacity, in], b_t float32 [slots,
// capacity, out] (B transposed) and ranks (device int32 [slots], or null: capacity). x [num_rows, in] of
// `dtype`; y [num_rows, out] of `dtype`, or float32 with y_float. store (y_float): y = the terms, -0.0 in every
// other row. workspace: lora_workspace_bytes(num_rows, capacity) bytes.
size_t lora_workspace_bytes(int64_t num_rows, int capacity);
cudaError_t launch_lora_shrink_expand(DType dtype, bool y_float, void* y, int64_t y_stride, const void* x,
                                      int64_t x_stride, int64_t num_rows, const int* segments, int num_segments,
                                      int max_segment_rows, const float* a, const float* b_t, const int* ranks,
                                      int capacity, int in, int out, float scale, bool store, void* workspace,
                                      cudaStream_t stream);

}  // namespace batchgen::kernels
