// C entry points over the CUDA launchers, for tests/test_cuda_emulated.py. Built by g++ with
// emu.h emulating the CUDA execution model; the kernels' sources come in as translated copies
// (gen/*.cpp: launches and dynamic shared memory rewritten for emu.h).
#include "emu.h"

#include "gen/cache_kernels.cpp"
#include "gen/attention_decode.cpp"
#include "gen/attention_prefill.cpp"
#include "gen/lora_kernels.cpp"
#include "mma.cuh"

using namespace batchgen::kernels;

namespace {

uint32_t pair_of(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16); }

// One warp: fragments built straight from the PTX ISA's layouts (no ldmatrix), one MMA, d = a b + c.
// a [16][16] and b [16][8] (k rows, n columns) of 16-bit elements, c and d [16][8] float, row major.
template <typename T>
__global__ void mma_fragments_kernel(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  const uint32_t af[4] = {pair_of(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]),
                          pair_of(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]),
                          pair_of(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]),
                          pair_of(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9])};
  const uint32_t bf[2] = {pair_of(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]),
                          pair_of(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g])};
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  mma_m16n8k16<T>(acc, af, bf);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// One warp: four 8 x 8 matrices m [4][8][8] placed in shared memory in reverse order with rows 48
// bytes apart; out [32 lanes][8]: the four registers of ldmatrix_x4, then of ldmatrix_x4_trans.
__global__ void ldmatrix_kernel(const uint16_t* m, uint32_t* out) {
  uint16_t* smem = reinterpret_cast<uint16_t*>(emu::dynamic_smem());
  const int lane = threadIdx.x;
  constexpr int kStride = 24;  // elements between rows
  auto row_at = [&](int matrix, int row) { return smem + ((3 - matrix) * 8 + row) * kStride; };
  for (int i = lane; i < 32; i += 32) {
    for (int e = 0; e < 8; ++e) row_at(i / 8, i % 8)[e] = m[i * 8 + e];
  }
  __syncwarp();
  uint32_t r[4], rt[4];
  ldmatrix_x4(r, row_at(lane / 8, lane % 8));
  ldmatrix_x4_trans(rt, row_at(lane / 8, lane % 8));
  for (int i = 0; i < 4; ++i) {
    out[lane * 8 + i] = r[i];
    out[lane * 8 + 4 + i] = rt[i];
  }
}

// One warp, ldmatrix and MMA as the prefill kernel pairs them: x = a bt^T and y = a v, a [16][32],
// bt [16][32] (n rows, like K), v [32][16] (k rows, like V), all row major, copied into shared memory
// with cp.async; x and y [16][16] float.
template <typename T>
__global__ void ldmatrix_mma_kernel(const uint16_t* a, const uint16_t* bt, const uint16_t* v, float* x, float* y) {
  uint16_t* a_s = reinterpret_cast<uint16_t*>(emu::dynamic_smem());
  uint16_t* bt_s = a_s + 16 * 32;
  uint16_t* v_s = bt_s + 16 * 32;
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 3 * 64; i += 32) {  // 64 chunks of 16 bytes each
    const uint16_t* src = i < 64 ? a : i < 128 ? bt : v;
    cp_async_16(a_s + i * 8, src + (i % 64) * 8, true);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  float xa[2][4] = {}, ya[2][4] = {};
  for (int ks = 0; ks < 2; ++ks) {
    uint32_t af[4], bf[4], vf[4];
    ldmatrix_x4(af, a_s + (lane % 16) * 32 + ks * 16 + (lane / 16) * 8);
    ldmatrix_x4(bf, bt_s + (lane % 8 + 8 * (lane / 16)) * 32 + ks * 16 + (lane / 8 % 2) * 8);
    ldmatrix_x4_trans(vf, v_s + (ks * 16 + lane % 8 + 8 * (lane / 8 % 2)) * 16 + (lane / 16) * 8);
    mma_m16n8k16<T>(xa[0], af, bf);
    mma_m16n8k16<T>(xa[1], af, bf + 2);
    mma_m16n8k16<T>(ya[0], af, vf);
    mma_m16n8k16<T>(ya[1], af, vf + 2);
  }
  for (int n = 0; n < 2; ++n) {
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = n * 8 + 2 * t + i % 2;
      x[row * 16 + col] = xa[n][i];
      y[row * 16 + col] = ya[n][i];
    }
  }
}

}  // namespace

extern "C" {

void emu_mma_fragments(int bf16, const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  if (bf16) {
    emu::launch(mma_fragments_kernel<__nv_bfloat16>, dim3(1), dim3(32))(a, b, c, d);
  } else {
    emu::launch(mma_fragments_kernel<__half>, dim3(1), dim3(32))(a, b, c, d);
  }
}

void emu_ldmatrix(const uint16_t* m, uint32_t* out) {
  emu::launch(ldmatrix_kernel, dim3(1), dim3(32), 32 * 24 * 2)(m, out);
}

void emu_ldmatrix_mma(int bf16, const uint16_t* a, const uint16_t* bt, const uint16_t* v, float* x, float* y) {
  if (bf16) {
    emu::launch(ldmatrix_mma_kernel<__nv_bfloat16>, dim3(1), dim3(32), 3 * 16 * 32 * 2)(a, bt, v, x, y);
  } else {
    emu::launch(ldmatrix_mma_kernel<__half>, dim3(1), dim3(32), 3 * 16 * 32 * 2)(a, bt, v, x, y);
  }
}

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
               void* workspace, const float* sinks) {
  return launch_paged_attention_decode(static_cast<DType>(dtype), out, out_s0, out_s1, query, query_s0, query_s1,
                                       key_cache, value_cache, block_tables, table_stride, seq_lens, num_seqs,
                                       num_heads, num_kv_heads, head_dim, block_size, max_context_len, scale, window,
                                       soft_cap, workspace, nullptr, batchgen::KVFormat::same, nullptr, nullptr,
                                       sinks);
}

int emu_prefill(int dtype, void* out, int64_t out_s0, int64_t out_s1, const void* query, int64_t query_s0,
                int64_t query_s1, const void* key_cache, const void* value_cache, const int* block_tables,
                int64_t table_stride, const int* seq_lens, const int* query_start_loc, int num_seqs,
                int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                int window, float soft_cap, const float* sinks) {
  return launch_paged_attention_prefill(static_cast<DType>(dtype), out, out_s0, out_s1, query, query_s0, query_s1,
                                        key_cache, value_cache, block_tables, table_stride, seq_lens,
                                        query_start_loc, num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                                        block_size, scale, window, soft_cap, nullptr, batchgen::KVFormat::same,
                                        nullptr, nullptr, nullptr, sinks);
}

// The same with key limits (int32 [num_tokens], the last key each query token sees). sinks (float32 [num_heads],
// or null) in both.
int emu_prefill_limits(int dtype, void* out, int64_t out_s0, int64_t out_s1, const void* query, int64_t query_s0,
                       int64_t query_s1, const void* key_cache, const void* value_cache, const int* block_tables,
                       int64_t table_stride, const int* seq_lens, const int* query_start_loc, int num_seqs,
                       int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                       int window, float soft_cap, const float* sinks, const int* key_limit) {
  return launch_paged_attention_prefill(static_cast<DType>(dtype), out, out_s0, out_s1, query, query_s0, query_s1,
                                        key_cache, value_cache, block_tables, table_stride, seq_lens,
                                        query_start_loc, num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                                        block_size, scale, window, soft_cap, nullptr, batchgen::KVFormat::same,
                                        nullptr, nullptr, key_limit, sinks);
}

// The fp8 cache's launches: format 1 (e4m3) or 2 (e5m2), per-kv-head scales (or null).
int emu_reshape_and_cache_fp8(int dtype, int format, const void* key, const void* value, void* key_cache,
                              void* value_cache, const int64_t* slots, int64_t num_tokens, int num_kv_heads,
                              int head_dim, int block_size, const float* k_scale, const float* v_scale) {
  return launch_reshape_and_cache(static_cast<DType>(dtype), key, value, key_cache, value_cache, slots, num_tokens,
                                  num_kv_heads, head_dim, block_size, int64_t{num_kv_heads} * head_dim, head_dim,
                                  int64_t{num_kv_heads} * head_dim, head_dim, nullptr,
                                  static_cast<batchgen::KVFormat>(format), k_scale, v_scale);
}

int emu_decode_fp8(int dtype, int format, void* out, const void* query, const void* key_cache,
                   const void* value_cache, const int* block_tables, int64_t table_stride, const int* seq_lens,
                   int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_context_len,
                   float scale, const float* k_scale, const float* v_scale, void* workspace, const float* sinks) {
  const int64_t row = int64_t{num_heads} * head_dim;
  return launch_paged_attention_decode(static_cast<DType>(dtype), out, row, head_dim, query, row, head_dim,
                                       key_cache, value_cache, block_tables, table_stride, seq_lens, num_seqs,
                                       num_heads, num_kv_heads, head_dim, block_size, max_context_len, scale, 0, 0.f,
                                       workspace, nullptr, static_cast<batchgen::KVFormat>(format), k_scale, v_scale,
                                       sinks);
}

int emu_prefill_fp8(int dtype, int format, void* out, const void* query, const void* key_cache,
                    const void* value_cache, const int* block_tables, int64_t table_stride, const int* seq_lens,
                    const int* query_start_loc, int num_seqs, int64_t num_tokens, int num_heads, int num_kv_heads,
                    int head_dim, int block_size, float scale, const float* k_scale, const float* v_scale,
                    const float* sinks) {
  const int64_t row = int64_t{num_heads} * head_dim;
  return launch_paged_attention_prefill(static_cast<DType>(dtype), out, row, head_dim, query, row, head_dim,
                                        key_cache, value_cache, block_tables, table_stride, seq_lens,
                                        query_start_loc, num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                                        block_size, scale, 0, 0.f, nullptr, static_cast<batchgen::KVFormat>(format),
                                        k_scale, v_scale, nullptr, sinks);
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
