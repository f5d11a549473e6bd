// Paged attention for decode: one query token per sequence.
//
// A thread block handles one (sequence, KV head, split of the context) and serves every query head
// of the KV head's group from one read of each key and value: a GQA group's heads share the bytes,
// so K/V is fetched once per KV head, not once per query head. Groups with more heads than a lane's
// accumulator registers hold (kAccFloats) are cut into head chunks, one block each; a KV head's
// chunks are neighbours in the grid, so all but the first mostly read its K/V from L2.
//
// The block's 128 threads form lane groups of 8 or 16 lanes (DecodeShape). A lane group takes 2-4
// consecutive tokens at a time (they share a cache block: every block_size is a multiple of 8 and
// token groups start at multiples of 4), and its lanes read the tokens' key and value rows side by
// side in 16-byte pieces, every load of the group's tokens issued before any arithmetic. A token's
// score is the lanes' partial dot products summed over the group (3-4 shuffles); each lane group
// keeps its own online softmax (running max, running sum, rescaled accumulator, fp32, base 2) per
// head, and the lane groups are merged at the end: those of a warp by shuffles, the 4 warps through
// shared memory.
//
// Splits are a fixed kSplitTokens keys long, counted from the sequence's first key, so a sequence's
// split, and with it every bit of its output, depends on its own length only, never on what else
// is in the step (batch invariance, as on the CPU). A sequence with one split writes its output
// directly; one with several writes per-split (max, sum, normalized output) triples that a second
// kernel merges in split order. With a sliding window a sequence's keys start at the window's first
// key rounded down to a token group (inside that key's cache block); the keys before the window are
// neither read nor counted.
//
// fp8 caches (C = Fp8<format>) are read 8 bytes (8 elements) a piece, so a row spreads over as many lanes
// as a 16-bit one, and widened in registers through fp16 bits (fp8_pair_to_float2); the key scale is folded
// into the queries' scale, the value scale into the output's normalisation.
#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace batchgen::kernels {
namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
constexpr int kTokenAlign = 4;     // token groups start at multiples of this: one cache block each
constexpr int kSplitTokens = 256;  // fixed split length: never a function of the batch
constexpr int kAccFloats = 32;     // accumulator registers per lane, all heads of a block together
constexpr int kMergeThreads = 128;

__host__ __device__ constexpr int floor_pow2(int n) { return n >= 2 ? 2 * floor_pow2(n / 2) : 1; }

// How a lane loads its pieces of a cached row: 16 bytes of T, or 8 bytes of fp8.
template <typename C>
struct CacheLoad {
  using Raw = uint4;
  static constexpr int kVec = 16 / static_cast<int>(sizeof(C));
};
template <KVFormat F>
struct CacheLoad<Fp8<F>> {
  using Raw = uint2;
  static constexpr int kVec = 8;
};

// How one head_dim row of cache elements C is spread over a lane group: 8 or 16 lanes read a token's row
// side by side in pieces of one load (lane l takes pieces l, l + kLanes, ...).
template <typename C, int HEAD_DIM>
struct DecodeShape {
  static constexpr int kVec = CacheLoad<C>::kVec;  // elements in one load
  static constexpr int kPieces = HEAD_DIM / kVec;                 // 16-byte pieces of a row
  static constexpr int kLanes = floor_pow2(kPieces) < 16 ? floor_pow2(kPieces) : 16;
  static constexpr int kPiecesPerLane = ceil_div(kPieces, kLanes);
  static constexpr int kLaneFloats = kPiecesPerLane * kVec;  // a lane's share of a row, as floats
  static constexpr int kMaxHeads = kAccFloats / kLaneFloats > 0 ? kAccFloats / kLaneFloats : 1;
  static constexpr int kGroupTokens = kPiecesPerLane <= 2 ? 4 : 2;  // consecutive tokens a group takes
  static constexpr int kLaneGroups = kDecodeThreads / kLanes;
  static constexpr int kStepTokens = kLaneGroups * kGroupTokens;  // tokens a block reads per step
  // Blocks an SM should hold, asked of the register allocator: 4 (at most 128 registers) where the rows need
  // little (fp8, 16-bit with one piece a lane), else 3.
  static constexpr int kMinBlocks = sizeof(C) == 1 || (sizeof(C) == 2 && kPiecesPerLane == 1) ? 4 : 3;
  static_assert(HEAD_DIM % kVec == 0, "rows are whole 16-byte pieces");
  static_assert(kLanes >= 8 && kTokenAlign % kGroupTokens == 0 && kSplitTokens % kStepTokens == 0);
};

// One load of cache elements C as floats.
template <typename C>
__device__ __forceinline__ void unpack(const typename CacheLoad<C>::Raw& raw, float* out) {
  if constexpr (IsFp8<C>::value) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = fp8_piece_pair<C::kFormat>(raw, i);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
    const C* e = reinterpret_cast<const C*>(&raw);
#pragma unroll
    for (int i = 0; i < CacheLoad<C>::kVec; i += 2) {
      const float2 f = load_pair(e + i);
      out[i] = f.x;
      out[i + 1] = f.y;
    }
  }
}

// The first key a sequence's splits cover: its window's first key rounded down to a token group.
__host__ __device__ __forceinline__ int first_group_key(int seq_len, int sliding_window) {
  return window_begin(seq_len - 1, sliding_window) / kTokenAlign * kTokenAlign;
}

__host__ __device__ __forceinline__ int num_splits(int seq_len, int sliding_window) {
  return ceil_div(seq_len - first_group_key(seq_len, sliding_window), kSplitTokens);
}

struct DecodePlan {
  int head_chunks;      // blocks per KV head
  int heads_per_chunk;  // query heads a block serves (the last chunk may have fewer)
  int max_splits;       // splits of the longest context the block tables can hold
};

DecodePlan plan_decode(int group, int max_heads, int max_context_len, int sliding_window) {
  int context = std::max(max_context_len, 1);
  if (sliding_window > 0) context = std::min(context, sliding_window + kTokenAlign - 1);  // a window from mid-group
  const int chunks = ceil_div(group, max_heads);
  return {chunks, ceil_div(group, chunks), ceil_div(context, kSplitTokens)};
}

// kMaxHeads of the kernel that runs head_dim for dtype and the cache's format, or 0 for an unsupported pair.
int max_heads_per_block(DType dtype, KVFormat kv_format, int head_dim) {
  int heads = 0;
  dispatch_dtype(dtype, [&](auto dtype_tag) {
    using T = typename decltype(dtype_tag)::type;
    return dispatch_cache<T>(kv_format, [&](auto cache_tag) {
      using C = typename decltype(cache_tag)::type;
      return dispatch_head_dim(head_dim, [&](auto head_dim_tag) {
        heads = DecodeShape<C, decltype(head_dim_tag)::value>::kMaxHeads;
        return cudaSuccess;
      });
    });
  });
  return heads;
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
  int head_chunks;
  int heads_per_chunk;
  int max_splits;
  float scale_log2;     // softmax scale times log2(e): scores come out in base 2
  int sliding_window;   // 0 off
  float soft_cap_log2;  // logits_soft_cap times log2(e), 0 off
  const float* k_scale;  // an fp8 cache's per-kv-head scales, or null
  const float* v_scale;
  const float* sinks;  // [num_heads]: each head's attention sink, or null
  // Per (seq, head, split) results of sequences with several splits.
  float* partial_out;  // [num_seqs * num_heads * max_splits, head_dim], normalized
  float* partial_max;  // [num_seqs * num_heads * max_splits]
  float* partial_sum;  // [num_seqs * num_heads * max_splits]
};

template <typename T, typename C, int HEAD_DIM>
__global__ void __launch_bounds__(kDecodeThreads, DecodeShape<C, HEAD_DIM>::kMinBlocks)
    paged_attention_decode_kernel(const DecodeParams p) {
  using Shape = DecodeShape<C, HEAD_DIM>;
  using Raw = typename CacheLoad<C>::Raw;
  constexpr int kMaxHeads = Shape::kMaxHeads;
  constexpr int kPieces = Shape::kPiecesPerLane;
  constexpr int kVec = Shape::kVec;
  constexpr int kFloats = Shape::kLaneFloats;
  constexpr int kLanes = Shape::kLanes;
  constexpr int kGroupTokens = Shape::kGroupTokens;

  const int chunk = blockIdx.x % p.head_chunks;
  const int kv_head = (blockIdx.x / p.head_chunks) % p.num_kv_heads;
  const int seq = blockIdx.x / (p.head_chunks * p.num_kv_heads);
  const int split = blockIdx.y;
  const int seq_len = p.seq_lens[seq];
  const int first_key = first_group_key(seq_len, p.sliding_window);
  const int begin = first_key + split * kSplitTokens;
  if (begin >= seq_len) return;  // the whole block leaves: no __syncthreads is skipped by part of it
  const int end = min(seq_len, begin + kSplitTokens);
  const int window_start = window_begin(seq_len - 1, p.sliding_window);
  const int group = p.num_heads / p.num_kv_heads;
  const int first_head = kv_head * group + chunk * p.heads_per_chunk;
  const int heads = min(p.heads_per_chunk, group - chunk * p.heads_per_chunk);

  // The block's queries, scaled to base 2, as floats.
  __shared__ __align__(16) float query_s[kMaxHeads][HEAD_DIM];
  const T* query = static_cast<const T*>(p.query) + seq * p.query_seq_stride;
  const float query_scale = p.k_scale != nullptr ? p.scale_log2 * p.k_scale[kv_head] : p.scale_log2;
  for (int i = threadIdx.x; i < heads * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    query_s[h][d] = to_float(query[(first_head + h) * p.query_head_stride + d]) * query_scale;
  }
  __syncthreads();

  const int lane_group = threadIdx.x / kLanes;
  const int sub = threadIdx.x % kLanes;  // this lane's pieces: sub, sub + kLanes, ...
  float acc[kMaxHeads][kFloats];
  float running_max[kMaxHeads];
  float running_sum[kMaxHeads];  // the same on the 8 lanes of a group: built from reduced scores
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    running_max[h] = -INFINITY;
    running_sum[h] = 0.f;
#pragma unroll
    for (int f = 0; f < kFloats; ++f) acc[h][f] = 0.f;
  }

  const C* key_cache = static_cast<const C*>(p.key_cache);
  const C* value_cache = static_cast<const C*>(p.value_cache);
  const int* block_table = p.block_tables + seq * p.block_table_stride;
  const int64_t block_stride = static_cast<int64_t>(p.num_kv_heads) * p.block_size * HEAD_DIM;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.block_size * HEAD_DIM;

  // Every lane runs every step (the shuffles below need whole warps); a lane group past the end
  // reads nothing. The next step's cache block id is fetched a step ahead, so that the K/V loads
  // never wait on the block table.
  const auto block_of = [&](int token) { return token < end ? block_table[token / p.block_size] : 0; };
  int block = block_of(begin + lane_group * kGroupTokens);
  for (int step = begin; step < end; step += Shape::kStepTokens) {
    const int token = step + lane_group * kGroupTokens;
    const int next_block = block_of(token + Shape::kStepTokens);
    // Every load of the group's tokens is issued before any arithmetic. Tokens past the end or before
    // the window are not read (their slots may hold anything) and load as zeros.
    const int64_t row = static_cast<int64_t>(block) * block_stride + head_offset +
                        static_cast<int64_t>(token % p.block_size) * HEAD_DIM;
    block = next_block;
    Raw key_raw[kGroupTokens][kPieces];
    Raw value_raw[kGroupTokens][kPieces];
    bool valid[kGroupTokens];
#pragma unroll
    for (int t = 0; t < kGroupTokens; ++t) {
      valid[t] = token + t < end && token + t >= window_start;
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int piece = sub + i * kLanes;
        const bool read = valid[t] && piece < Shape::kPieces;
        const int64_t at = row + t * HEAD_DIM + piece * kVec;
        key_raw[t][i] = read ? *reinterpret_cast<const Raw*>(key_cache + at) : Raw{};
        value_raw[t][i] = read ? *reinterpret_cast<const Raw*>(value_cache + at) : Raw{};
      }
    }

    // Scores of the 4 tokens for each head, summed over the lane group. A token's key is widened to floats
    // once for all heads (their queries read from shared memory per token: fewer registers than holding every
    // widened key, fewer instructions than widening a key per head).
    float score[kMaxHeads][kGroupTokens];
#pragma unroll
    for (int t = 0; t < kGroupTokens; ++t) {
      float key[kFloats];
#pragma unroll
      for (int i = 0; i < kPieces; ++i) unpack<C>(key_raw[t][i], key + i * kVec);
#pragma unroll
      for (int h = 0; h < kMaxHeads; ++h) {
        if (h >= heads) continue;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < kPieces; ++i) {
          const int piece = sub + i * kLanes;
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            s += (piece < Shape::kPieces ? query_s[h][piece * kVec + e] : 0.f) * key[i * kVec + e];
          }
        }
#pragma unroll
        for (int mask = kLanes / 2; mask > 0; mask >>= 1) s += __shfl_xor_sync(0xffffffffu, s, mask);
        score[h][t] = s;
      }
    }
    // The soft cap behind one branch that the whole launch takes the same way: without a cap (nearly every model)
    // none of its instructions issue (per score they were predicated off, yet issued).
    if (p.soft_cap_log2 > 0.f) {
#pragma unroll
      for (int h = 0; h < kMaxHeads; ++h) {
        if (h >= heads) continue;
#pragma unroll
        for (int t = 0; t < kGroupTokens; ++t) score[h][t] = soft_capped(score[h][t], p.soft_cap_log2);
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      if (h >= heads) continue;
#pragma unroll
      for (int t = 0; t < kGroupTokens; ++t) score[h][t] = valid[t] ? score[h][t] : -INFINITY;
    }

    // Online softmax per head: one rescale for the 4 tokens.
    float prob[kMaxHeads][kGroupTokens];
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      if (h >= heads) continue;
      float new_max = running_max[h];
#pragma unroll
      for (int t = 0; t < kGroupTokens; ++t) new_max = fmaxf(new_max, score[h][t]);
      const float alpha = exp2_shifted(running_max[h], new_max);  // 0 on the first tokens
      running_sum[h] *= alpha;
#pragma unroll
      for (int f = 0; f < kFloats; ++f) acc[h][f] *= alpha;
#pragma unroll
      for (int t = 0; t < kGroupTokens; ++t) {
        prob[h][t] = exp2_shifted(score[h][t], new_max);
        running_sum[h] += prob[h][t];
      }
      running_max[h] = new_max;
    }
#pragma unroll
    for (int t = 0; t < kGroupTokens; ++t) {
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        float v[kVec];
        unpack<C>(value_raw[t][i], v);
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) {
          if (h >= heads) continue;
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[h][i * kVec + e] += prob[h][t] * v[e];
        }
      }
    }
  }

  // Merge the 4 lane groups of a warp (a butterfly: every lane ends with the same bits). A group
  // that read no token has max -inf, sum 0 and a zero accumulator.
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    if (h >= heads) continue;
    float warp_max = running_max[h];
#pragma unroll
    for (int mask = kLanes; mask < kWarpSize; mask <<= 1) {
      warp_max = fmaxf(warp_max, __shfl_xor_sync(0xffffffffu, warp_max, mask));
    }
    const float weight = exp2_shifted(running_max[h], warp_max);
    running_max[h] = warp_max;
    running_sum[h] *= weight;
#pragma unroll
    for (int f = 0; f < kFloats; ++f) acc[h][f] *= weight;
#pragma unroll
    for (int mask = kLanes; mask < kWarpSize; mask <<= 1) {
      running_sum[h] += __shfl_xor_sync(0xffffffffu, running_sum[h], mask);
#pragma unroll
      for (int f = 0; f < kFloats; ++f) acc[h][f] += __shfl_xor_sync(0xffffffffu, acc[h][f], mask);
    }
  }

  // Then the 4 warps, through shared memory.
  __shared__ float warp_max_s[kDecodeWarps][kMaxHeads];
  __shared__ float warp_sum_s[kDecodeWarps][kMaxHeads];
  __shared__ float warp_acc_s[kDecodeWarps][kMaxHeads][HEAD_DIM];
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize < kLanes) {  // lane group 0 of each warp
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      if (h >= heads) continue;
      if (sub == 0) {
        warp_max_s[warp][h] = running_max[h];
        warp_sum_s[warp][h] = running_sum[h];
      }
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int piece = sub + i * kLanes;
        if (piece < Shape::kPieces) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) warp_acc_s[warp][h][piece * kVec + e] = acc[h][i * kVec + e];
        }
      }
    }
  }
  __syncthreads();

  const bool split_sequence = num_splits(seq_len, p.sliding_window) > 1;
  T* out = static_cast<T*>(p.out) + seq * p.out_seq_stride;
  for (int i = threadIdx.x; i < heads * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    float block_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) block_max = fmaxf(block_max, warp_max_s[w][h]);  // warp 0 read keys
    float total = 0.f;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float weight = exp2_shifted(warp_max_s[w][h], block_max);
      total += warp_sum_s[w][h] * weight;
      o += warp_acc_s[w][h][d] * weight;
    }
    const int head = first_head + h;
    o /= split_sequence ? total : with_sink(total, p.sinks, head, block_max);  // a split's sink joins at the merge
    if (p.v_scale != nullptr) o *= p.v_scale[kv_head];  // an fp8 cache's values, scaled once
    if (!split_sequence) {
      out[head * p.out_head_stride + d] = from_float<T>(o);
    } else {
      const int64_t partial = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_splits + split;
      p.partial_out[partial * HEAD_DIM + d] = o;
      if (d == 0) {
        p.partial_max[partial] = block_max;
        p.partial_sum[partial] = total;
      }
    }
  }
}

// One thread block per (sequence, head) of a sequence with several splits: merges them in order.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) paged_attention_decode_merge_kernel(const DecodeParams p,
                                                                                      int head_dim) {
  __shared__ float max_s;
  __shared__ float total_s;
  const int head = blockIdx.x % p.num_heads;
  const int seq = blockIdx.x / p.num_heads;
  const int splits = num_splits(p.seq_lens[seq], p.sliding_window);
  if (splits == 1) return;  // written by the first kernel
  const int64_t first = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_splits;

  if (threadIdx.x < kWarpSize) {
    const int lane = threadIdx.x;
    float global_max = -INFINITY;
    for (int i = lane; i < splits; i += kWarpSize) global_max = fmaxf(global_max, p.partial_max[first + i]);
    global_max = warp_max(global_max);
    float total = 0.f;
    for (int i = lane; i < splits; i += kWarpSize) {
      total += p.partial_sum[first + i] * exp2f(p.partial_max[first + i] - global_max);
    }
    total = warp_sum(total);
    if (lane == 0) {
      max_s = global_max;
      total_s = total;
    }
  }
  __syncthreads();

  const float inv_total = 1.f / with_sink(total_s, p.sinks, head, max_s);
  T* out = static_cast<T*>(p.out) + seq * p.out_seq_stride + head * p.out_head_stride;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < splits; ++i) {
      const float weight = p.partial_sum[first + i] * exp2f(p.partial_max[first + i] - max_s);
      o += weight * p.partial_out[(first + i) * head_dim + d];
    }
    out[d] = from_float<T>(o * inv_total);
  }
}

}  // namespace

size_t paged_attention_decode_workspace_bytes(int num_seqs, int num_heads, int head_dim, int max_context_len,
                                              int sliding_window) {
  const DecodePlan plan = plan_decode(1, 1, max_context_len, std::max(sliding_window, 0));
  if (plan.max_splits == 1) return 0;
  const size_t results = static_cast<size_t>(num_seqs) * num_heads * plan.max_splits;
  return results * (head_dim + 2) * sizeof(float);
}

cudaError_t launch_paged_attention_decode(DType dtype, void* out, int64_t out_seq_stride, int64_t out_head_stride,
                                          const void* query, int64_t query_seq_stride, int64_t query_head_stride,
                                          const void* key_cache, const void* value_cache, const int* block_tables,
                                          int64_t block_table_stride, const int* seq_lens, int num_seqs,
                                          int num_heads, int num_kv_heads, int head_dim, int block_size,
                                          int max_context_len, float scale, int sliding_window,
                                          float logits_soft_cap, void* workspace, cudaStream_t stream,
                                          KVFormat kv_format, const float* k_scale, const float* v_scale,
                                          const float* sinks) {
  if (num_seqs == 0) return cudaSuccess;
  const int max_heads = max_heads_per_block(dtype, kv_format, head_dim);
  if (max_heads == 0 || !is_supported_block_size(block_size) || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      sliding_window < 0 || !(logits_soft_cap >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  const DecodePlan plan = plan_decode(num_heads / num_kv_heads, max_heads, max_context_len, sliding_window);
  const int64_t blocks = static_cast<int64_t>(num_seqs) * num_kv_heads * plan.head_chunks;
  if (blocks > 0x7fffffff || static_cast<int64_t>(num_seqs) * num_heads > 0x7fffffff || plan.max_splits > 65535 ||
      (plan.max_splits > 1 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }

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
  p.head_chunks = plan.head_chunks;
  p.heads_per_chunk = plan.heads_per_chunk;
  p.max_splits = plan.max_splits;
  p.scale_log2 = scale * kLog2e;
  p.sliding_window = sliding_window;
  p.soft_cap_log2 = logits_soft_cap * kLog2e;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.sinks = sinks;
  if (plan.max_splits > 1) {
    const int64_t results = static_cast<int64_t>(num_seqs) * num_heads * plan.max_splits;
    p.partial_out = static_cast<float*>(workspace);
    p.partial_max = p.partial_out + results * head_dim;
    p.partial_sum = p.partial_max + results;
  }

  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(plan.max_splits));
  return dispatch_dtype(dtype, [&](auto dtype_tag) {
    using T = typename decltype(dtype_tag)::type;
    return dispatch_cache<T>(kv_format, [&](auto cache_tag) {
      using C = typename decltype(cache_tag)::type;
      return dispatch_head_dim(head_dim, [&](auto head_dim_tag) {
        constexpr int kHeadDim = decltype(head_dim_tag)::value;
        paged_attention_decode_kernel<T, C, kHeadDim><<<grid, kDecodeThreads, 0, stream>>>(p);
        if (plan.max_splits > 1) {
          const unsigned pairs = static_cast<unsigned>(static_cast<int64_t>(num_seqs) * num_heads);
          paged_attention_decode_merge_kernel<T><<<pairs, kMergeThreads, 0, stream>>>(p, kHeadDim);
        }
        return cudaGetLastError();
      });
    });
  });
}

}  // namespace batchgen::kernels
