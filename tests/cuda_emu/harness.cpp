// C entry points over the CUDA launchers, for tests/test_cuda_emulated.py. Built by g++ with
// emu.h emulating the CUDA execution model; the kernels' sources come in as translated copies
// (gen/*.cpp: launches and dynamic shared memory rewritten for emu.h).
#include "emu.h"

#include "gen/cache_kernels.cpp"
#include "gen/attention_decode.cpp"
#include "gen/attention_prefill.cpp"
#include "gen/lora_kernels.cpp"

using namespace batchgen::kernels;

extern "C" {

int emu_reshape_and_cache(int dtype, const void* key, const void* value, void* key_cache, void* value_cache,
                          const int64_t* slots, int64_t num_tokens, int num_kv_heads, int head_dim, int block_size,
                          int64_t key_s0, int64_t key_s1, int64_t value_s0, int64_t value_s1) {
  return launch_reshape_and_cache(static_cast<DType>(dtype), key, value, key_cache, value_cache, slots, num_tokens,
                                  num_kv_heads, head_dim, block_size, key_s0, key_s1, value_s0, value_s1, nullptr);
}

int emu_copy_blocks(void** key_caches, void** value_caches, int num_layers, const int64_t* mapping,
                    int64_t num_pairs, int64_t block_bytes) {
  return launch_copy_blocks(key_caches, value_caches, num_layers, mapping, num_pairs, block_bytes, nullptr);
}

size_t emu_decode_workspace_bytes(int num_seqs, int num_heads, int head_dim, int max_context_len, int window) {
  return paged_attention_decode_workspace_bytes(num_seqs, num_heads, head_dim, max_context_len, window);
}

int emu_decode(int dtype, void* out, int64_t out_s0, int64_t out_s1, const void* query, int64_t query_s0,
               int64_t query_s1, const void* key_cache, const void* value_cache, const int* block_tables,
               int64_t table_stride, const int* seq_lens, int num_seqs, int num_heads, int num_kv_heads,
               int head_dim, int block_size, int max_context_len, float scale, int window, float soft_cap,
               void* workspace) {
  return launch_paged_attention_decode(static_cast<DType>(dtype), out, out_s0, out_s1, query, query_s0, query_s1,
                                       key_cache, value_cache, block_tables, table_stride, seq_lens, num_seqs,
                                       num_heads, num_kv_heads, head_dim, block_size, max_context_len, scale, window,
                                       soft_cap, workspace, nullptr);
}

int emu_prefill(int dtype, void* out, int64_t out_s0, int64_t out_s1, const void* query, int64_t query_s0,
                int64_t query_s1, const void* key_cache, const void* value_cache, const int* block_tables,
                int64_t table_stride, const int* seq_lens, const int* query_start_loc, int num_seqs,
                int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                int window, float soft_cap) {
  return launch_paged_attention_prefill(static_cast<DType>(dtype), out, out_s0, out_s1, query, query_s0, query_s1,
                                        key_cache, value_cache, block_tables, table_stride, seq_lens,
                                        query_start_loc, num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                                        block_size, scale, window, soft_cap, nullptr);
}

size_t emu_lora_workspace_bytes(int64_t num_rows, int capacity) { return lora_workspace_bytes(num_rows, capacity); }

int emu_lora(int dtype, int y_float, void* y, int64_t y_stride, const void* x, int64_t x_stride, int64_t num_rows,
             const int* segments, int num_segments, int max_segment_rows, const float* a, const float* b_t,
             const int* ranks, int capacity, int in, int out, float scale, int store, void* workspace) {
  return launch_lora_shrink_expand(static_cast<DType>(dtype), y_float != 0, y, y_stride, x, x_stride, num_rows,
                                   segments, num_segments, max_segment_rows, a, b_t, ranks, capacity, in, out, scale,
                                   store != 0, workspace, nullptr);
}

}  // extern "C"
