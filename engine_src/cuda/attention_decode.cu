// Paged attention for decode: one query token per sequence.
//
// A thread block handles one (sequence, query head, partition of the context). Its warps take
// 8-token chunks of the partition in turn (a chunk never straddles a cache block, since every
// block_size is a multiple of 8). Each lane holds two query elements per 64 of head_dim, so a
// token's score is a lane-local dot product plus a warp reduction; each warp keeps an online
// softmax (running max, running sum, rescaled accumulator) in fp32 registers. The warps are merged
// through shared memory at the end. Long contexts are split into several partitions when there
// are too few (sequence, head) pairs to fill the GPU; a second kernel then merges the partitions'
// (max, sum, normalized output) triples. With a sliding window a sequence's partitions cover its
// window only (from the window's first key rounded down to a chunk, which stays inside that key's
// cache block); the first chunk's keys before the window are neither read nor counted.
#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace batchgen::kernels {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
constexpr int kChunk = 8;              // tokens a warp scores together; divides every block_size
constexpr int kMinPartition = 256;     // shortest partition worth a merge
constexpr int kTargetBlocks = 2048;    // thread blocks to aim for when splitting contexts
constexpr int kMaxPartitions = kTargetBlocks;  // plan_decode never exceeds this
constexpr int kReduceThreads = 128;

struct DecodePlan {
  int num_partitions;
  int partition_size;  // tokens, a multiple of kChunk
};

// The keys a sequence's partitions cover: from its window's first key rounded down to a chunk.
__host__ __device__ __forceinline__ int first_chunk_key(int seq_len, int sliding_window) {
  return window_begin(seq_len - 1, sliding_window) / kChunk * kChunk;
}

DecodePlan plan_decode(int num_seqs, int num_heads, int max_context_len, int sliding_window) {
  int context = std::max(max_context_len, 1);
  if (sliding_window > 0) context = std::min(context, sliding_window + kChunk - 1);  // a window from mid-chunk
  const int64_t pairs = static_cast<int64_t>(num_seqs) * num_heads;
  int parts = 1;
  if (pairs > 0 && pairs < kTargetBlocks) {
    parts = std::min(ceil_div(context, kMinPartition), ceil_div(kTargetBlocks, static_cast<int>(pairs)));
  }
  const int size = ceil_div(ceil_div(context, parts), kChunk) * kChunk;
  return {ceil_div(context, size), size};
}

struct DecodeParams {
  void* out;
  int64_t out_seq_stride;
  int64_t out_head_stride;
  const void* query;
  int64_t query_seq_stride;
  int64_t query_head_stride;
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;
  int64_t block_table_stride;
  const int* seq_lens;
  int num_heads;
  int num_kv_heads;
  int block_size;
  int partition_size;
  int num_partitions;
  float scale_log2;  // softmax scale times log2(e): scores come out in base 2
  int sliding_window;     // 0 off
  float soft_cap_log2;    // logits_soft_cap times log2(e), 0 off
  // Per (seq, head, partition) results; used only when num_partitions > 1.
  float* partial_out;  // [num_seqs * num_heads * num_partitions, head_dim], normalized
  float* partial_max;  // [num_seqs * num_heads * num_partitions]
  float* partial_sum;  // [num_seqs * num_heads * num_partitions]
};

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kDecodeThreads) paged_attention_decode_kernel(const DecodeParams p) {
  constexpr int kSteps = ceil_div(HEAD_DIM, 2 * kWarpSize);
  const int head = blockIdx.x % p.num_heads;
  const int seq = blockIdx.x / p.num_heads;
  const int partition = blockIdx.y;
  const int seq_len = p.seq_lens[seq];
  const int window_start = window_begin(seq_len - 1, p.sliding_window);  // the first key seen
  const int start = first_chunk_key(seq_len, p.sliding_window) + partition * p.partition_size;
  if (start >= seq_len) return;  // the whole block leaves: no __syncthreads is skipped by part of it
  const int end = min(seq_len, start + p.partition_size);
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  const T* query = static_cast<const T*>(p.query) + seq * p.query_seq_stride + head * p.query_head_stride;
  float2 q[kSteps];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int d = pair_index(s, lane);
    q[s] = d < HEAD_DIM ? make_float2(to_float(query[d]) * p.scale_log2, to_float(query[d + 1]) * p.scale_log2)
                        : make_float2(0.f, 0.f);
  }

  float2 acc[kSteps];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) acc[s] = make_float2(0.f, 0.f);
  float running_max = -INFINITY;
  float running_sum = 0.f;  // the same on every lane: it is built from warp-reduced scores

  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int* block_table = p.block_tables + seq * p.block_table_stride;
  const int64_t block_stride = static_cast<int64_t>(p.num_kv_heads) * p.block_size * HEAD_DIM;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.block_size * HEAD_DIM;

  for (int chunk = start + warp * kChunk; chunk < end; chunk += kDecodeWarps * kChunk) {
    const int64_t block = block_table[chunk / p.block_size];
    const int64_t row = block * block_stride + head_offset + static_cast<int64_t>(chunk % p.block_size) * HEAD_DIM;
    const T* keys = key_cache + row;
    const T* values = value_cache + row;
    const int valid = min(kChunk, end - chunk);  // tokens past the end are never read or counted
    const int first = max(0, window_start - chunk);  // nor those before the window

    float score[kChunk];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      score[t] = 0.f;
      if (t >= first && t < valid) {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          const int d = pair_index(s, lane);
          if (d < HEAD_DIM) {
            const float2 k = load_pair(keys + t * HEAD_DIM + d);
            score[t] += q[s].x * k.x + q[s].y * k.y;
          }
        }
      }
    }
    float chunk_max = -INFINITY;
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      score[t] = soft_capped(warp_sum(score[t]), p.soft_cap_log2);
      if (t >= first && t < valid) chunk_max = fmaxf(chunk_max, score[t]);
    }

    const float new_max = fmaxf(running_max, chunk_max);  // finite: first < valid
    const float alpha = exp2f(running_max - new_max);     // 0 on the first chunk
    running_sum *= alpha;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) acc[s] = make_float2(acc[s].x * alpha, acc[s].y * alpha);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t >= first && t < valid) {
        const float prob = exp2f(score[t] - new_max);
        running_sum += prob;
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          const int d = pair_index(s, lane);
          if (d < HEAD_DIM) {
            const float2 v = load_pair(values + t * HEAD_DIM + d);
            acc[s] = make_float2(acc[s].x + prob * v.x, acc[s].y + prob * v.y);
          }
        }
      }
    }
    running_max = new_max;
  }

  // Merge the warps. A warp that got no chunk has max -inf, sum 0 and a zero accumulator.
  __shared__ float warp_max_s[kDecodeWarps];
  __shared__ float warp_sum_s[kDecodeWarps];
  __shared__ float warp_acc_s[kDecodeWarps][HEAD_DIM];
  if (lane == 0) {
    warp_max_s[warp] = running_max;
    warp_sum_s[warp] = running_sum;
  }
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int d = pair_index(s, lane);
    if (d < HEAD_DIM) {
      warp_acc_s[warp][d] = acc[s].x;
      warp_acc_s[warp][d + 1] = acc[s].y;
    }
  }
  __syncthreads();

  float block_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) block_max = fmaxf(block_max, warp_max_s[w]);  // warp 0 had a chunk
  float weight[kDecodeWarps];
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    weight[w] = exp2f(warp_max_s[w] - block_max);
    total += warp_sum_s[w] * weight[w];
  }
  const float inv_total = 1.f / total;

  const int64_t partial = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions + partition;
  T* out = static_cast<T*>(p.out) + seq * p.out_seq_stride + head * p.out_head_stride;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kDecodeThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) o += warp_acc_s[w][d] * weight[w];
    o *= inv_total;
    if (p.num_partitions == 1) {
      out[d] = from_float<T>(o);
    } else {
      p.partial_out[partial * HEAD_DIM + d] = o;
    }
  }
  if (p.num_partitions > 1 && threadIdx.x == 0) {
    p.partial_max[partial] = block_max;
    p.partial_sum[partial] = total;
  }
}

// One thread block per (sequence, head): merges the partitions that hold part of the context.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads) paged_attention_decode_merge_kernel(const DecodeParams p,
                                                                                      int head_dim) {
  __shared__ float weight_s[kMaxPartitions];
  __shared__ float total_s;
  const int head = blockIdx.x % p.num_heads;
  const int seq = blockIdx.x / p.num_heads;
  const int seq_len = p.seq_lens[seq];
  const int parts = ceil_div(seq_len - first_chunk_key(seq_len, p.sliding_window), p.partition_size);
  const int64_t first = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions;

  if (threadIdx.x < kWarpSize) {
    const int lane = threadIdx.x;
    float global_max = -INFINITY;
    for (int i = lane; i < parts; i += kWarpSize) global_max = fmaxf(global_max, p.partial_max[first + i]);
    global_max = warp_max(global_max);
    float total = 0.f;
    for (int i = lane; i < parts; i += kWarpSize) {
      const float w = p.partial_sum[first + i] * exp2f(p.partial_max[first + i] - global_max);
      weight_s[i] = w;
      total += w;
    }
    total = warp_sum(total);
    if (lane == 0) total_s = total;
  }
  __syncthreads();

  const float inv_total = 1.f / total_s;
  T* out = static_cast<T*>(p.out) + seq * p.out_seq_stride + head * p.out_head_stride;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < parts; ++i) o += weight_s[i] * p.partial_out[(first + i) * head_dim + d];
    out[d] = from_float<T>(o * inv_total);
  }
}

}  // namespace

size_t paged_attention_decode_workspace_bytes(int num_seqs, int num_heads, int head_dim, int max_context_len,
                                              int sliding_window) {
  const DecodePlan plan = plan_decode(num_seqs, num_heads, max_context_len, std::max(sliding_window, 0));
  if (plan.num_partitions == 1) return 0;
  const size_t results = static_cast<size_t>(num_seqs) * num_heads * plan.num_partitions;
  return results * (head_dim + 2) * sizeof(float);
}

cudaError_t launch_paged_attention_decode(DType dtype, void* out, int64_t out_seq_stride, int64_t out_head_stride,
                                          const void* query, int64_t query_seq_stride, int64_t query_head_stride,
                                          const void* key_cache, const void* value_cache, const int* block_tables,
                                          int64_t block_table_stride, const int* seq_lens, int num_seqs,
                                          int num_heads, int num_kv_heads, int head_dim, int block_size,
                                          int max_context_len, float scale, int sliding_window,
                                          float logits_soft_cap, void* workspace, cudaStream_t stream) {
  if (num_seqs == 0) return cudaSuccess;
  const int64_t pairs = static_cast<int64_t>(num_seqs) * num_heads;
  if (!is_supported_block_size(block_size) || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      pairs > 0x7fffffff || sliding_window < 0 || !(logits_soft_cap >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  const DecodePlan plan = plan_decode(num_seqs, num_heads, max_context_len, sliding_window);
  if (plan.num_partitions > 1 && workspace == nullptr) return cudaErrorInvalidValue;

  DecodeParams p{};
  p.out = out;
  p.out_seq_stride = out_seq_stride;
  p.out_head_stride = out_head_stride;
  p.query = query;
  p.query_seq_stride = query_seq_stride;
  p.query_head_stride = query_head_stride;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.block_table_stride = block_table_stride;
  p.seq_lens = seq_lens;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.block_size = block_size;
  p.partition_size = plan.partition_size;
  p.num_partitions = plan.num_partitions;
  p.scale_log2 = scale * kLog2e;
  p.sliding_window = sliding_window;
  p.soft_cap_log2 = logits_soft_cap * kLog2e;
  if (plan.num_partitions > 1) {
    const int64_t results = pairs * plan.num_partitions;
    p.partial_out = static_cast<float*>(workspace);
    p.partial_max = p.partial_out + results * head_dim;
    p.partial_sum = p.partial_max + results;
  }

  const dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(plan.num_partitions));
  return dispatch_dtype(dtype, [&](auto dtype_tag) {
    using T = typename decltype(dtype_tag)::type;
    return dispatch_head_dim(head_dim, [&](auto head_dim_tag) {
      constexpr int kHeadDim = decltype(head_dim_tag)::value;
      paged_attention_decode_kernel<T, kHeadDim><<<grid, kDecodeThreads, 0, stream>>>(p);
      if (plan.num_partitions > 1) {
        paged_attention_decode_merge_kernel<T>
            <<<static_cast<unsigned>(pairs), kReduceThreads, 0, stream>>>(p, kHeadDim);
      }
      return cudaGetLastError();
    });
  });
}

}  // namespace batchgen::kernels
