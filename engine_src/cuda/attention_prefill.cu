// Paged attention for a flat, variable-length batch of query tokens (prefill, chunked prefill,
// prefix-cache hits), causal, every key and value read from the cache through the block tables.
//
// Query rows of one sequence and one kv head are the (token j, head h of the GQA group) pairs,
// numbered j * group + h, so the heads that share a kv head also share every key/value tile a
// thread block loads. Row j of sequence i sits at position context + j and sees keys 0 .. context + j;
// with a sliding window W only keys context + j - W < key <= context + j, and a thread block starts
// at the tile of its first row's window, not reading the keys before that window. Two kernels:
//
// fp16 and bf16: tensor cores, in the manner of FlashAttention-2. A thread block of 4 warps takes 128
// consecutive rows of one sequence and one kv head, 32 rows a warp: two M-tiles of 16 (the M of one
// m16n8k16 MMA), so each K and V fragment read from shared memory feeds two MMAs; at head_dim 256,
// 64 rows and one M-tile a warp (registers). A sequence's row tiles are launched last first.
//   1. The rows' queries and then, tile by tile, 64 keys and their values (32 at head_dim 128 and
//      256) are copied into shared memory with 16-byte cp.async copies, each key's row found through the
//      block table, double-buffered: tile t + 1's copies are in flight while tile t is used. Rows are
//      unpadded, their 16-byte chunks XOR-swizzled by row (mma.cuh's ldmatrix reads 8 rows at one
//      chunk, which land in 8 different bank groups).
//   2. Each warp computes its rows' scores S = Q K^T on tensor cores: ldmatrix.x4 fragments of Q
//      and K, k-steps of 16 over head_dim (80 and 96 are 5 and 6 steps), 8-key column tiles.
//   3. Scores are scaled into base 2, soft-capped, masked (only on tiles that straddle a row's
//      diagonal or window edge: a tile every row of the warp sees wholly needs no mask; tiles past all
//      of a warp's rows, or before all their windows, are skipped), and go through an online softmax
//      in fp32: a row's max over its quad of lanes, its accumulator rescaled.
//   4. The probabilities, rounded to fp16/bf16, are the A fragments of O += P V as they lie in
//      registers (two 8-key C fragments make one 16-key A fragment); V's fragments come from
//      ldmatrix.x4.trans.
//   5. Rows are normalized, staged in the warp's own rows of the query tile and stored 16 bytes at a
//      time.
// Batch invariance: tile t always covers keys t * K .. t * K + K - 1 (K = 64, or 32: absolute
// positions), a row meets its tiles in order from its first visible one, and each score and
// output element is one MMA chain over its own row. A tile a row sees nothing of leaves its state bit
// for bit (probabilities 0, rescale factor exactly 1, exact zeros added), so a row's bits do not
// depend on the rows beside it in its thread block or launch, nor on how its prompt was chunked.
// Needs sm_80 and 16-byte aligned query/out rows and caches; otherwise the CUDA-core kernel runs.
// Key limits (Gemma 3's image tokens, which see their whole image): with key_limit set, row j sees keys up to
// key_limit[query_start + j] instead of its position (the window still counted from its position); a thread
// block reads keys up to its rows' largest limit, a warp skips tiles past its rows' largest limit, and the
// mask is applied on tiles past its rows' smallest.
//
// float32 (true fp32 products, for parity with transformers): CUDA cores. A thread block takes kRows
// consecutive rows of one sequence and one kv head (warp w owns kRowsPerWarp of them) and walks the
// keys in tiles of 32:
//   1. the tile's keys and values are gathered from the cache into shared memory;
//   2. each lane scores one key against each of its warp's rows (keys padded in shared memory so
//      the 32 lanes read 32 different banks);
//   3. an online softmax per row (fp32, base 2) rescales the row's accumulator, and the
//      probabilities go through shared memory so that, for step 4, lanes switch to owning
//      head_dim elements instead of keys;
//   4. each lane accumulates its elements of probs x values.
// fp8 caches: the tensor-core kernel (fp16 and bf16 activations) copies each tile's bytes into shared memory
// with cp.async as they lie in the cache, double-buffered as above, then widens the tile to the activations'
// dtype (exact: every fp8 value is an fp16 and a bf16 value) into the swizzled tile the MMAs read; the key
// scale multiplies the scores' scale, the value scale the rows' normalisation. With scales of 1 the bits are
// those of a cache of T holding the same values. The CUDA-core kernel (float32, or below sm_80) widens the
// tile's keys and values as it gathers them, the key scale folded into the queries' scale.
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

namespace batchgen::kernels {
namespace {

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = kPrefillWarps * kWarpSize;
constexpr int kKeyTile = kWarpSize;  // keys per tile: one per lane while scoring
constexpr size_t kDefaultSmemLimit = 48 * 1024;

template <typename T, int HEAD_DIM>
struct PrefillConfig {
  // Fewer rows for fp32 at head_dim 256 keeps shared memory under the 99 KB of sm_86/sm_89.
  static constexpr int kRowsPerWarp = sizeof(T) * HEAD_DIM >= 1024 ? 4 : 8;
  static constexpr int kRows = kRowsPerWarp * kPrefillWarps;
  static constexpr int kSteps = ceil_div(HEAD_DIM, 2 * kWarpSize);  // element pairs per lane
  static constexpr int kKeyStride = HEAD_DIM + 2;  // odd stride in 4-byte words (8-byte for fp32)
  // Shared memory: fp32 parts first so that float4 reads are aligned.
  static constexpr size_t kQueryFloats = static_cast<size_t>(kRows) * HEAD_DIM;  // scaled queries
  static constexpr size_t kProbFloats = static_cast<size_t>(kRows) * kKeyTile;   // probabilities
  static constexpr size_t kKeyElems = static_cast<size_t>(kKeyTile) * kKeyStride;
  static constexpr size_t kValueElems = static_cast<size_t>(kKeyTile) * HEAD_DIM;
  static constexpr size_t kSmemBytes =
      (kQueryFloats + kProbFloats) * sizeof(float) + (kKeyElems + kValueElems) * sizeof(T);
};

struct PrefillParams {
  void* out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  const void* query;
  int64_t query_token_stride;
  int64_t query_head_stride;
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;
  int64_t block_table_stride;
  const int* seq_lens;
  const int* query_start_loc;
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int block_size;
  float scale_log2;  // softmax scale times log2(e): scores come out in base 2
  int sliding_window;   // 0 off
  float soft_cap_log2;  // logits_soft_cap times log2(e), 0 off
  const float* k_scale;  // an fp8 cache's per-kv-head scales, or null
  const float* v_scale;
  const int* key_limit;  // [num_tokens]: the last key each query token sees; null: its own position
  const float* sinks;    // [num_heads]: each head's attention sink, or null
};

// The last key query token `token` (of the flat batch) at `position` of a sequence of seq_len keys sees: its
// key limit, kept within [position, seq_len - 1] (the device's limits are not checked on the host), or its
// position.
__device__ __forceinline__ int last_key(const PrefillParams& p, int64_t token, int position, int seq_len) {
  return p.key_limit != nullptr ? min(max(p.key_limit[token], position), seq_len - 1) : position;
}

// One past the last key any of a sequence's query tokens first .. last (counted from its first, query_start in
// the flat batch, at positions from context on) sees: context + last + 1 when causal. Every thread computes it
// alike.
__device__ __forceinline__ int keys_end(const PrefillParams& p, int query_start, int context, int seq_len, int first,
                                        int last) {
  if (p.key_limit == nullptr) return context + last + 1;
  int end = 0;
  for (int j = first; j <= last; ++j) end = max(end, last_key(p, query_start + j, context + j, seq_len) + 1);
  return end;
}

// Tiles are numbered so that sequence i's tiles start at first_tile(i) = qsl[i] * group / kRows + i,
// which leaves each sequence at least ceil(q_len * group / kRows) tiles and needs no prefix sum.
// The grid has floor(num_tokens * group / kRows) + num_seqs blocks; spare ones find no rows.
template <int kRows>
__device__ __forceinline__ int64_t first_tile(const PrefillParams& p, int seq, int group) {
  return static_cast<int64_t>(p.query_start_loc[seq]) * group / kRows + seq;
}

// Sequence of tile `block`: the last one whose first tile is <= block.
template <int kRows>
__device__ int find_sequence(const PrefillParams& p, int64_t block, int group) {
  int lo = 0;
  int hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_tile<kRows>(p, mid, group) <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ float component(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Gathers keys key0 .. key0 + kKeyTile - 1 of one kv head into shared memory. Keys before kv_begin
// (outside every row's sliding window) or at or past kv_end are zero-filled, not read: their
// probabilities are 0, but 0 * NaN (stale shared memory) is not.
// Cache elements C (T, or an fp8 format's bytes, widened exactly) at src[0..1] into dst[0..1].
template <typename T, typename C>
__device__ __forceinline__ void copy_pair(const C* src, T* dst) {
  if constexpr (IsFp8<C>::value) {
    const float2 f = fp8_pair_to_float2<C::kFormat>(src[0].bits | (uint32_t{src[1].bits} << 16));
    dst[0] = from_float<T>(f.x);
    dst[1] = from_float<T>(f.y);
  } else {
    using PairT = typename Pair<T>::type;
    *reinterpret_cast<PairT*>(dst) = *reinterpret_cast<const PairT*>(src);
  }
}

template <typename T, typename C, int HEAD_DIM>
__device__ void load_kv_tile(const PrefillParams& p, const int* block_table, int kv_head, int key0, int kv_begin,
                             int kv_end, T* key_s, T* value_s) {
  using Config = PrefillConfig<T, HEAD_DIM>;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const C* key_cache = static_cast<const C*>(p.key_cache);
  const C* value_cache = static_cast<const C*>(p.value_cache);
  for (int n = warp; n < kKeyTile; n += kPrefillWarps) {
    const int key = key0 + n;
    T* key_dst = key_s + n * Config::kKeyStride;
    T* value_dst = value_s + n * HEAD_DIM;
    if (key >= kv_begin && key < kv_end) {
      const int64_t block = block_table[key / p.block_size];
      const int64_t row = ((block * p.num_kv_heads + kv_head) * p.block_size + key % p.block_size) * HEAD_DIM;
      for (int d = 2 * lane; d < HEAD_DIM; d += 2 * kWarpSize) {
        copy_pair(key_cache + row + d, key_dst + d);
        copy_pair(value_cache + row + d, value_dst + d);
      }
    } else {
      for (int d = lane; d < HEAD_DIM; d += kWarpSize) {
        key_dst[d] = from_float<T>(0.f);
        value_dst[d] = from_float<T>(0.f);
      }
    }
  }
}

template <typename T, typename C, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads) paged_attention_prefill_kernel(const PrefillParams p) {
  using Config = PrefillConfig<T, HEAD_DIM>;
  constexpr int kRows = Config::kRows;
  constexpr int kRowsPerWarp = Config::kRowsPerWarp;
  constexpr int kSteps = Config::kSteps;

  extern __shared__ __align__(16) unsigned char smem[];
  float* query_s = reinterpret_cast<float*>(smem);  // [kRows][HEAD_DIM]
  float* prob_s = query_s + Config::kQueryFloats;   // [kRows][kKeyTile]
  T* key_s = reinterpret_cast<T*>(prob_s + Config::kProbFloats);  // [kKeyTile][kKeyStride]
  T* value_s = key_s + Config::kKeyElems;                         // [kKeyTile][HEAD_DIM]

  // Which rows: every early return below is taken by the whole block.
  const int kv_head = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  const int seq = find_sequence<kRows>(p, blockIdx.x, group);
  const int64_t tile = blockIdx.x - first_tile<kRows>(p, seq, group);
  const int query_start = p.query_start_loc[seq];
  const int query_len = p.query_start_loc[seq + 1] - query_start;
  const int num_rows = query_len * group;
  if (tile < 0 || tile * kRows >= num_rows) return;
  const int first_row = static_cast<int>(tile) * kRows;
  const int context = p.seq_lens[seq] - query_len;
  const int last_row = min(first_row + kRows, num_rows) - 1;
  // keys the block's rows see (its last row's when causal)
  const int kv_end = keys_end(p, query_start, context, p.seq_lens[seq], first_row / group, last_row / group);
  const int kv_begin = window_begin(context + first_row / group, p.sliding_window);  // its first row's first

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  // Scaled queries of the block's rows (zeros past the sequence's rows).
  const T* query = static_cast<const T*>(p.query);
  const float query_scale = p.k_scale != nullptr ? p.scale_log2 * p.k_scale[kv_head] : p.scale_log2;
  for (int i = threadIdx.x; i < kRows * HEAD_DIM / 2; i += kPrefillThreads) {
    const int r = i / (HEAD_DIM / 2);
    const int d = 2 * (i % (HEAD_DIM / 2));
    const int row = first_row + r;
    float2 q = make_float2(0.f, 0.f);
    if (row < num_rows) {
      const int head = kv_head * group + row % group;
      const T* src = query + (query_start + row / group) * p.query_token_stride + head * p.query_head_stride;
      q = make_float2(to_float(src[d]) * query_scale, to_float(src[d + 1]) * query_scale);
    }
    *reinterpret_cast<float2*>(query_s + r * HEAD_DIM + d) = q;
  }

  // Per-warp row state. position -1 marks a row past the sequence's rows: it sees no key.
  const int warp_row0 = warp * kRowsPerWarp;
  int position[kRowsPerWarp];
  int limit[kRowsPerWarp];  // the row's last key (its position when causal)
  float row_max[kRowsPerWarp];
  float row_sum[kRowsPerWarp];  // this lane's share; the lanes are summed at the end
  float2 acc[kRowsPerWarp][kSteps];
  int warp_last_key = -1;  // the last key any of the warp's rows sees
  int warp_first_key = 0x7fffffff;  // the first key any of the warp's rows sees
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = first_row + warp_row0 + i;
    position[i] = row < num_rows ? context + row / group : -1;
    limit[i] = row < num_rows ? last_key(p, query_start + row / group, position[i], p.seq_lens[seq]) : -1;
    warp_last_key = max(warp_last_key, limit[i]);
    if (position[i] >= 0) warp_first_key = min(warp_first_key, window_begin(position[i], p.sliding_window));
    row_max[i] = -INFINITY;
    row_sum[i] = 0.f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) acc[i][s] = make_float2(0.f, 0.f);
  }

  const int* block_table = p.block_tables + seq * p.block_table_stride;
  const T* key_row = key_s + lane * Config::kKeyStride;
  float* warp_prob_s = prob_s + warp_row0 * kKeyTile;

  for (int key0 = kv_begin / kKeyTile * kKeyTile; key0 < kv_end; key0 += kKeyTile) {
    __syncthreads();  // the previous tile is no longer read
    load_kv_tile<T, C, HEAD_DIM>(p, block_table, kv_head, key0, kv_begin, kv_end, key_s, value_s);
    __syncthreads();  // tile (and, the first time, the queries) visible to all warps
    // The whole tile in this warp's future, or past the windows of all its rows.
    if (key0 > warp_last_key || key0 + kKeyTile <= warp_first_key) continue;

    // Step 2: lane scores key key0 + lane against each row.
    float score[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) score[i] = 0.f;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; d += 4) {
      const float2 k01 = load_pair(key_row + d);
      const float2 k23 = load_pair(key_row + d + 2);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float4 q = *reinterpret_cast<const float4*>(query_s + (warp_row0 + i) * HEAD_DIM + d);
        score[i] += q.x * k01.x + q.y * k01.y + q.z * k23.x + q.w * k23.y;
      }
    }

    // Step 3: soft cap, causal (and window) mask and online softmax, one row at a time.
    const int key = key0 + lane;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const bool seen = key <= limit[i] && key >= window_begin(position[i], p.sliding_window);
      const float s = seen ? soft_capped(score[i], p.soft_cap_log2) : -INFINITY;
      const float new_max = fmaxf(row_max[i], warp_max(s));
      const float alpha = exp2_shifted(row_max[i], new_max);
      const float prob = exp2_shifted(s, new_max);
      row_sum[i] = row_sum[i] * alpha + prob;
      row_max[i] = new_max;
#pragma unroll
      for (int st = 0; st < kSteps; ++st) acc[i][st] = make_float2(acc[i][st].x * alpha, acc[i][st].y * alpha);
      warp_prob_s[i * kKeyTile + lane] = prob;
    }
    __syncwarp();

    // Step 4: lane owns elements pair_index(st, lane) of every row's accumulator.
#pragma unroll 2
    for (int n0 = 0; n0 < kKeyTile; n0 += 4) {
      float4 prob4[kRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        prob4[i] = *reinterpret_cast<const float4*>(warp_prob_s + i * kKeyTile + n0);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const T* value_row = value_s + (n0 + u) * HEAD_DIM;
#pragma unroll
        for (int st = 0; st < kSteps; ++st) {
          const int d = pair_index(st, lane);
          if (d < HEAD_DIM) {
            const float2 v = load_pair(value_row + d);
#pragma unroll
            for (int i = 0; i < kRowsPerWarp; ++i) {
              const float pr = component(prob4[i], u);
              acc[i][st] = make_float2(acc[i][st].x + pr * v.x, acc[i][st].y + pr * v.y);
            }
          }
        }
      }
    }
  }

  // Normalize and write. Every real row saw its own key, so its sum is positive.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const float total = warp_sum(row_sum[i]);
    const int row = first_row + warp_row0 + i;
    if (row >= num_rows) continue;
    const int head = kv_head * group + row % group;
    T* dst = out + (query_start + row / group) * p.out_token_stride + head * p.out_head_stride;
    float inv_total = 1.f / with_sink(total, p.sinks, head, row_max[i]);
    if (p.v_scale != nullptr) inv_total *= p.v_scale[kv_head];  // an fp8 cache's values, scaled once
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      const int d = pair_index(st, lane);
      if (d < HEAD_DIM) {
        dst[d] = from_float<T>(acc[i][st].x * inv_total);
        dst[d + 1] = from_float<T>(acc[i][st].y * inv_total);
      }
    }
  }
}

// Launches a prefill kernel over (tile, kv head) with `smem_bytes` of dynamic shared memory, opting in past the
// default 48 KB (per device and cheap, so it is done on every launch).
inline cudaError_t launch_over_tiles(void (*kernel)(PrefillParams), const PrefillParams& p, int64_t num_tiles,
                                     int threads, size_t smem_bytes, cudaStream_t stream) {
  if (smem_bytes > kDefaultSmemLimit) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(num_tiles), static_cast<unsigned>(p.num_kv_heads));
  kernel<<<grid, threads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename C, int HEAD_DIM>
cudaError_t launch_prefill(const PrefillParams& p, int64_t num_tiles, cudaStream_t stream) {
  return launch_over_tiles(paged_attention_prefill_kernel<T, C, HEAD_DIM>, p, num_tiles, kPrefillThreads,
                           PrefillConfig<T, HEAD_DIM>::kSmemBytes, stream);
}


// ---- Tensor-core kernel (fp16, bf16) ------------------------------------------------------------

constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * kWarpSize;

// A warp owns kMTiles x 16 rows (each 16 the M of one MMA): two below head_dim 256, so that each K and
// V fragment read from shared memory feeds two MMAs (FlashAttention-2's 128-row tiles), one at 256,
// where two would not fit the registers. Key tiles of 64, or 32 where the accumulators are large.
template <typename T, int HEAD_DIM>
struct TcConfig {
  static constexpr int kMTiles = HEAD_DIM > 128 ? 1 : 2;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kRows = kTcWarps * kWarpRows;    // rows of a thread block: 128, or 64 at 256
  static constexpr int kKeys = HEAD_DIM >= 128 ? 32 : 64;  // keys per tile
  static constexpr int kChunks = HEAD_DIM / 8;            // 16-byte chunks in a row of head_dim
  static constexpr int kDimSteps = HEAD_DIM / 16;         // k-steps of Q K^T, column-tile pairs of P V
  static constexpr int kKeySteps = kKeys / 16;            // k-steps of P V, column-tile pairs of Q K^T
  static constexpr size_t kQueryElems = static_cast<size_t>(kRows) * HEAD_DIM;
  static constexpr size_t kTileElems = static_cast<size_t>(kKeys) * HEAD_DIM;
  // Over a cache of T: the queries, then two stages of keys, then two of values. Over an fp8 cache (C): the
  // queries, one stage of keys and one of values widened to T, then two stages of each as the cache's bytes
  // (the copies in flight). The same bytes at every head_dim.
  template <typename C>
  static constexpr size_t smem_bytes() {
    if constexpr (std::is_same_v<C, T>) return (kQueryElems + 4 * kTileElems) * sizeof(T);
    return (kQueryElems + 2 * kTileElems) * sizeof(T) + 4 * kTileElems * sizeof(C);
  }
};

// Element offset of 16-byte chunk `chunk` of row `row` in a shared-memory tile of HEAD_DIM-wide rows,
// unpadded: within each group of 8 chunks the chunk index is XORed with row % 8, so that the 8 rows one
// ldmatrix matrix reads at the same chunk fall in 8 different bank groups. The 2 or 4 chunks past the
// last full group (head_dim 80, 96) are XORed with row % 2 or row % 4 (2-way conflicts there).
template <int HEAD_DIM>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  constexpr int kChunks = HEAD_DIM / 8;
  constexpr int kFull = kChunks / 8 * 8;
  constexpr int kTail = kChunks - kFull;
  int c = chunk ^ (row & 7);
  if constexpr (kTail > 0) {
    if (chunk >= kFull) c = kFull + ((chunk - kFull) ^ (row & (kTail - 1)));
  }
  return row * HEAD_DIM + c * 8;
}

// The cache block of the tile's b-th block of keys (keys key0 + b * block_size ..), read from the block table;
// 0 past the tile's blocks and for a block with no key in [kv_begin, kv_end) (its table entry may be invalid).
// Tiles start at multiples of kKeys, which block sizes (8, 16, 32: powers of two up to kKeys) divide.
template <int kKeys>
__device__ __forceinline__ int tile_block(const PrefillParams& p, const int* block_table, int key0, int b,
                                          int kv_begin, int kv_end) {
  const int first = key0 + b * p.block_size;
  if (b * p.block_size >= kKeys || first >= kv_end || first + p.block_size <= kv_begin) return 0;
  return block_table[first / p.block_size];
}

// Starts copying keys key0 .. key0 + kKeys - 1 of one kv head, and their values, into shared memory
// (cp.async, 16 bytes a copy), each key's row in the cache block `tile_blocks` (shared memory, tile_block's)
// names for it. Keys before kv_begin or at or past kv_end are zero-filled and not read: their blocks may be
// poisoned or their table entries invalid. A cache of T lands in the swizzled tiles the MMAs read; an fp8
// cache's bytes (C) as they lie in the cache, [kKeys][HEAD_DIM] bytes, for widen_fp8_tile.
template <typename T, typename C, int HEAD_DIM>
__device__ __forceinline__ void load_kv_tile_async(const PrefillParams& p, const int* tile_blocks, int kv_head,
                                                   int key0, int kv_begin, int kv_end, C* key_s, C* value_s) {
  constexpr int kPerCopy = 16 / sizeof(C);  // elements
  static_assert(HEAD_DIM % kPerCopy == 0, "rows of whole 16-byte copies");
  constexpr int kCopies = HEAD_DIM / kPerCopy;  // a row's
  const C* key_cache = static_cast<const C*>(p.key_cache);
  const C* value_cache = static_cast<const C*>(p.value_cache);
  const int block_shift = __ffs(p.block_size) - 1;
  for (int i = threadIdx.x; i < TcConfig<T, HEAD_DIM>::kKeys * kCopies; i += kTcThreads) {
    const int n = i / kCopies;
    const int c = i % kCopies;
    const int key = key0 + n;
    const bool read = key >= kv_begin && key < kv_end;
    int64_t offset = 0;
    if (read) {  // block sizes are powers of two (is_supported_block_size): a shift and a mask, not a division
      const int64_t block = tile_blocks[n >> block_shift];
      offset = ((block * p.num_kv_heads + kv_head) * p.block_size + (key & (p.block_size - 1))) * HEAD_DIM +
               c * kPerCopy;
    }
    const int dst = std::is_same_v<C, T> ? swizzle<HEAD_DIM>(n, c) : n * HEAD_DIM + c * kPerCopy;
    cp_async_16(key_s + dst, key_cache + offset, read);
    cp_async_16(value_s + dst, value_cache + offset, read);
  }
}

// Widens a tile of fp8 bytes (load_kv_tile_async's layout for them) into the swizzled tile of T the MMAs read, 8
// elements (one 16-byte chunk of T) a step; exact, zero bytes to zeros.
template <typename T, typename C, int HEAD_DIM>
__device__ __forceinline__ void widen_fp8_tile(const C* bytes, T* tile) {
  using Config = TcConfig<T, HEAD_DIM>;
  for (int i = threadIdx.x; i < Config::kKeys * Config::kChunks; i += kTcThreads) {
    const int n = i / Config::kChunks;
    const int c = i % Config::kChunks;
    const uint2 piece = *reinterpret_cast<const uint2*>(bytes + n * HEAD_DIM + c * 8);
    uint32_t pairs[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = fp8_piece_pair<C::kFormat>(piece, e);
      pairs[e] = pack_pair<T>(f.x, f.y);
    }
    *reinterpret_cast<uint4*>(tile + swizzle<HEAD_DIM>(n, c)) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
  }
}

template <typename T, typename C, int HEAD_DIM>
__global__ void __launch_bounds__(kTcThreads) paged_attention_prefill_tc_kernel(const PrefillParams p) {
  using Config = TcConfig<T, HEAD_DIM>;
  constexpr int kRows = Config::kRows;
  constexpr int kM = Config::kMTiles;
  constexpr int kKeys = Config::kKeys;
  constexpr int kChunks = Config::kChunks;
  constexpr bool kFp8 = IsFp8<C>::value;
  static_assert(kFp8 || std::is_same_v<C, T>, "a cache of T or of fp8 bytes");

  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kStages = kFp8 ? 1 : 2;           // of the tiles the MMAs read
  T* query_s = reinterpret_cast<T*>(smem);        // [kRows][HEAD_DIM], swizzled
  T* key_s = query_s + Config::kQueryElems;       // [kStages][kKeys][HEAD_DIM], swizzled
  T* value_s = key_s + kStages * Config::kTileElems;
  // Where the copies' two stages land: in those tiles, or over an fp8 cache as its bytes, after them.
  C* key_copies = kFp8 ? reinterpret_cast<C*>(value_s + kStages * Config::kTileElems) : reinterpret_cast<C*>(key_s);
  C* value_copies = kFp8 ? key_copies + 2 * Config::kTileElems : reinterpret_cast<C*>(value_s);

  // Which rows (as in the CUDA-core kernel): every early return here is taken by the whole block. A
  // sequence's row tiles run from its last to its first, so the longest (causal) go out first.
  const int kv_head = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  const int seq = find_sequence<kRows>(p, blockIdx.x, group);
  const int query_start = p.query_start_loc[seq];
  const int query_len = p.query_start_loc[seq + 1] - query_start;
  const int num_rows = query_len * group;
  const int64_t local = blockIdx.x - first_tile<kRows>(p, seq, group);
  const int64_t num_row_tiles = (static_cast<int64_t>(num_rows) + kRows - 1) / kRows;
  if (local < 0 || local >= num_row_tiles) return;
  const int first_row = static_cast<int>(num_row_tiles - 1 - local) * kRows;
  const int context = p.seq_lens[seq] - query_len;
  const int last_row = min(first_row + kRows, num_rows) - 1;
  // keys the block's rows see (its last row's when causal)
  const int kv_end = keys_end(p, query_start, context, p.seq_lens[seq], first_row / group, last_row / group);
  const int kv_begin = window_begin(context + first_row / group, p.sliding_window);  // its first row's first

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int* block_table = p.block_tables + seq * p.block_table_stride;

  // The block's queries (zeros past the sequence's rows), in the first cp.async group with the first tile.
  const T* query = static_cast<const T*>(p.query);
  for (int i = threadIdx.x; i < kRows * kChunks; i += kTcThreads) {
    const int r = i / kChunks;
    const int c = i % kChunks;
    const int row = first_row + r;
    const bool real = row < num_rows;
    const T* src = query;
    if (real) {
      const int head = kv_head * group + row % group;
      src = query + (query_start + row / group) * p.query_token_stride + head * p.query_head_stride + c * 8;
    }
    cp_async_16(query_s + swizzle<HEAD_DIM>(r, c), src, real);
  }
  // Tiles at absolute key positions: tile t holds keys t * kKeys .. (t + 1) * kKeys - 1, whichever rows
  // share the block, so each row meets its keys in the same tiles and order however it is batched.
  int key0 = kv_begin / kKeys * kKeys;
  const int last_key0 = (kv_end - 1) / kKeys * kKeys;
  // Each tile's cache block ids, read from the block table a tile ahead of its copies (as decode reads its next
  // block id a step ahead): a tile's copies take their addresses from shared memory and never wait on a global
  // load. Stage s holds the ids of the tiles whose copies land in stage s: the first two tiles' now.
  constexpr int kTileBlocks = kKeys / 8;  // the most a tile spans (the smallest block size)
  __shared__ int tile_blocks[2][kTileBlocks];
  if (threadIdx.x < 2 * kTileBlocks) {
    const int t = threadIdx.x / kTileBlocks;
    tile_blocks[t][threadIdx.x % kTileBlocks] =
        tile_block<kKeys>(p, block_table, key0 + t * kKeys, threadIdx.x % kTileBlocks, kv_begin, kv_end);
  }
  __syncthreads();
  load_kv_tile_async<T, C, HEAD_DIM>(p, tile_blocks[0], kv_head, key0, kv_begin, kv_end, key_copies, value_copies);
  cp_async_commit();
  // An fp8 cache's key scale goes into the scores' scale, its value scale into the rows' normalisation.
  const float score_scale = p.k_scale != nullptr ? p.scale_log2 * p.k_scale[kv_head] : p.scale_log2;

  // The warp's rows are block rows warp * kWarpRows + 16 m + (0 .. 15) for M-tile m; this lane holds rows
  // g and g + 8 of each M-tile (the MMA's C layout), their scores and outputs at columns 2t and 2t + 1
  // of every 8-wide fragment.
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_s0 = warp * Config::kWarpRows;  // the warp's first row in query_s
  const int warp_row0 = first_row + warp_s0;
  const bool warp_has_rows = warp_row0 < num_rows;
  // The warp's rows see keys warp_first_key .. warp_last_key; all of them see the keys from
  // warp_last_first_key to warp_min_key (a tile inside that range needs no mask). Causal: the last key is the
  // last row's position, the smallest last key the first row's.
  const int warp_first_position = context + warp_row0 / group;
  const int warp_last_position = context + (min(warp_row0 + Config::kWarpRows - 1, num_rows - 1)) / group;
  int warp_min_key = warp_first_position;
  int warp_last_key = warp_last_position;
  if (p.key_limit != nullptr && warp_has_rows) {
    warp_min_key = 0x7fffffff;
    const int seq_len = p.seq_lens[seq];
    warp_last_key = keys_end(p, query_start, context, seq_len, warp_row0 / group, warp_last_position - context) - 1;
    for (int j = warp_row0 / group; j <= warp_last_position - context; ++j) {
      warp_min_key = min(warp_min_key, last_key(p, query_start + j, context + j, seq_len));
    }
  }
  const int warp_first_key = window_begin(warp_first_position, p.sliding_window);
  const int warp_last_first_key = window_begin(warp_last_position, p.sliding_window);

  // A row's attention sink (GPT-OSS) starts its softmax as a key of score `sink` and value zero: max = sink, and
  // exp(sink - max) = 1 in the sum (in the quad's first lane's share), rescaled with it as the max grows. Added at
  // the end instead, it kept the row's max and head live past the key loop and spilled at head_dim 96 on sm_80.
  float row_max[kM][2];
  float row_sum[kM][2];  // this lane's share of the row's sum; the quad's are added at the end
  float acc[kM][HEAD_DIM / 8][4];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool sink = p.sinks != nullptr;
      row_max[m][h] = sink ? sink_log2(p.sinks, kv_head * group + (warp_row0 + 16 * m + g + 8 * h) % group) : -INFINITY;
      row_sum[m][h] = sink && t == 0 ? 1.f : 0.f;
    }
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][dt][e] = 0.f;
    }
  }

  for (int stage = 0; key0 <= last_key0; key0 += kKeys, stage ^= 1) {
    // Double buffering: the next tile's copies start before this one is used.
    if (key0 + kKeys <= last_key0) {
      load_kv_tile_async<T, C, HEAD_DIM>(p, tile_blocks[stage ^ 1], kv_head, key0 + kKeys, kv_begin, kv_end,
                                         key_copies + (stage ^ 1) * Config::kTileElems,
                                         value_copies + (stage ^ 1) * Config::kTileElems);
    }
    cp_async_commit();
    // The block ids of the tile after the next, read now, stored in this stage's ids after the MMAs (no
    // instruction waits on the load meanwhile).
    const int prefetched_block = threadIdx.x < kTileBlocks
        ? tile_block<kKeys>(p, block_table, key0 + 2 * kKeys, threadIdx.x, kv_begin, kv_end) : 0;
    cp_async_wait<1>();  // every group but the newest: this tile (and the queries) arrived
    __syncthreads();     // ... for every thread's copies
    const T* key_tile = key_s + (kFp8 ? 0 : stage) * Config::kTileElems;
    const T* value_tile = value_s + (kFp8 ? 0 : stage) * Config::kTileElems;
    if constexpr (kFp8) {  // the bytes widened into the one stage of T (read by no warp since the last barrier)
      widen_fp8_tile<T, C, HEAD_DIM>(key_copies + stage * Config::kTileElems, key_s);
      widen_fp8_tile<T, C, HEAD_DIM>(value_copies + stage * Config::kTileElems, value_s);
      __syncthreads();
    }

    // A warp skips tiles wholly past its rows or before their windows (no row of it sees a key there).
    if (warp_has_rows && key0 <= warp_last_key && key0 + kKeys > warp_first_key) {

      // Scores S = Q K^T: per M-tile 16 rows x kKeys keys, kKeys / 8 fragments of 16 x 8; each K
      // fragment serves every M-tile.
      float score[kM][kKeys / 8][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) score[m][j][e] = 0.f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < Config::kDimSteps; ++ks) {
        uint32_t a[kM][4];  // rows 16 m + lane % 16, columns 16 ks + 8 (lane / 16) ..
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          ldmatrix_x4(a[m], query_s + swizzle<HEAD_DIM>(warp_s0 + 16 * m + lane % 16, 2 * ks + lane / 16));
        }
#pragma unroll
        for (int np = 0; np < Config::kKeySteps; ++np) {
          uint32_t b[4];  // keys 16 np + lane % 8 + 8 (lane / 16), columns 16 ks + 8 (lane / 8 % 2) ..
          ldmatrix_x4(b, key_tile + swizzle<HEAD_DIM>(16 * np + lane % 8 + 8 * (lane / 16), 2 * ks + lane / 8 % 2));
#pragma unroll
          for (int m = 0; m < kM; ++m) {
            mma_m16n8k16<T>(score[m][2 * np], a[m], b);
            mma_m16n8k16<T>(score[m][2 * np + 1], a[m], b + 2);
          }
        }
      }

      // Scale to base 2, soft cap (behind a branch the whole launch takes the same way: without a cap none of
      // its instructions issue), and the causal / window mask where some row does not see some key (only then:
      // the comparisons are skipped on tiles every row of the warp sees whole).
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) score[m][j][e] *= score_scale;
        }
      }
      if (p.soft_cap_log2 > 0.f) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
          for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) score[m][j][e] = soft_capped(score[m][j][e], p.soft_cap_log2);
          }
        }
      }
      if (key0 + kKeys - 1 > warp_min_key || key0 < warp_last_first_key) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // The row's position (-1 past the sequence's rows: it sees nothing) and its first key, worked
            // out here rather than kept in registers across the loop.
            const int row = warp_row0 + 16 * m + g + 8 * h;
            const int position = row < num_rows ? context + row / group : -1;
            const int limit = row < num_rows ? last_key(p, query_start + row / group, position, p.seq_lens[seq]) : -1;
            const int first_key = window_begin(position, p.sliding_window);
#pragma unroll
            for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
              for (int e = 2 * h; e < 2 * h + 2; ++e) {
                const int key = key0 + 8 * j + 2 * t + e % 2;
                if (key > limit || key < first_key) score[m][j][e] = -INFINITY;
              }
            }
          }
        }
      }

      // Online softmax per row (fp32, base 2); a row's max is shared by the 4 lanes of its quad.
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float new_max = row_max[m][h];
#pragma unroll
          for (int j = 0; j < kKeys / 8; ++j) {
            new_max = fmaxf(new_max, fmaxf(score[m][j][2 * h], score[m][j][2 * h + 1]));
          }
          new_max = fmaxf(new_max, __shfl_xor_sync(0xffffffffu, new_max, 1));
          new_max = fmaxf(new_max, __shfl_xor_sync(0xffffffffu, new_max, 2));
          // 1 exactly when the max stays, so a tile a row sees nothing of changes none of its bits.
          const float alpha = new_max == row_max[m][h] ? 1.f : exp2_shifted(row_max[m][h], new_max);
          row_max[m][h] = new_max;
          row_sum[m][h] *= alpha;
#pragma unroll
          for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            acc[m][dt][2 * h] *= alpha;
            acc[m][dt][2 * h + 1] *= alpha;
          }
#pragma unroll
          for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
              const float prob = exp2_shifted(score[m][j][e], new_max);
              row_sum[m][h] += prob;
              score[m][j][e] = prob;
            }
          }
        }
      }

      // O += P V: the probabilities' C fragments of two 8-key tiles are the A fragment of a 16-key step;
      // each V fragment serves every M-tile.
#pragma unroll
      for (int kk = 0; kk < Config::kKeySteps; ++kk) {
        uint32_t a[kM][4];
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          a[m][0] = pack_pair<T>(score[m][2 * kk][0], score[m][2 * kk][1]);
          a[m][1] = pack_pair<T>(score[m][2 * kk][2], score[m][2 * kk][3]);
          a[m][2] = pack_pair<T>(score[m][2 * kk + 1][0], score[m][2 * kk + 1][1]);
          a[m][3] = pack_pair<T>(score[m][2 * kk + 1][2], score[m][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < Config::kDimSteps; ++dp) {
          // Transposed: keys 16 kk + lane % 8 + 8 (lane / 8 % 2), columns 16 dp + 8 (lane / 16) ..
          uint32_t b[4];
          const int key = 16 * kk + lane % 8 + 8 * (lane / 8 % 2);
          ldmatrix_x4_trans(b, value_tile + swizzle<HEAD_DIM>(key, 2 * dp + lane / 16));
#pragma unroll
          for (int m = 0; m < kM; ++m) {
            mma_m16n8k16<T>(acc[m][2 * dp], a[m], b);
            mma_m16n8k16<T>(acc[m][2 * dp + 1], a[m], b + 2);
          }
        }
      }
    }
    if (threadIdx.x < kTileBlocks) tile_blocks[stage][threadIdx.x] = prefetched_block;  // read since the last barrier
    __syncthreads();  // this stage is read before the next iteration's copies refill it
  }
  if (!warp_has_rows) return;

  // Normalize, stage the warp's rows in its own rows of query_s (no other warp reads them) and store
  // them 16 bytes at a time. Every real row saw its own key, so its sum is positive.
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float total = row_sum[m][h] + __shfl_xor_sync(0xffffffffu, row_sum[m][h], 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      float inv_total = 1.f / total;
      if (p.v_scale != nullptr) inv_total *= p.v_scale[kv_head];
#pragma unroll
      for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
        T* dst = query_s + swizzle<HEAD_DIM>(warp_s0 + 16 * m + g + 8 * h, dt) + 2 * t;
        *reinterpret_cast<uint32_t*>(dst) =
            pack_pair<T>(acc[m][dt][2 * h] * inv_total, acc[m][dt][2 * h + 1] * inv_total);
      }
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
  for (int i = lane; i < Config::kWarpRows * kChunks; i += kWarpSize) {
    const int r = i / kChunks;
    const int c = i % kChunks;
    const int row = warp_row0 + r;
    if (row < num_rows) {
      const int head = kv_head * group + row % group;
      T* dst = out + (query_start + row / group) * p.out_token_stride + head * p.out_head_stride + c * 8;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(query_s + swizzle<HEAD_DIM>(warp_s0 + r, c));
    }
  }
}

template <typename T, typename C, int HEAD_DIM>
cudaError_t launch_prefill_tc(const PrefillParams& p, int64_t num_tiles, cudaStream_t stream) {
  return launch_over_tiles(paged_attention_prefill_tc_kernel<T, C, HEAD_DIM>, p, num_tiles, kTcThreads,
                           TcConfig<T, HEAD_DIM>::template smem_bytes<C>(), stream);
}

// The tensor-core kernel needs sm_80 (mma.sync with bf16, cp.async) and 16-byte aligned rows: query and
// out pointers and strides, and the caches, on 8-element boundaries. Otherwise the CUDA-core kernel runs.
bool tensor_cores_fit(const void* out, int64_t out_token_stride, int64_t out_head_stride, const void* query,
                      int64_t query_token_stride, int64_t query_head_stride, const void* key_cache,
                      const void* value_cache) {
  int device = 0;
  int major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 8) {
    return false;
  }
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return aligned(out) && aligned(query) && aligned(key_cache) && aligned(value_cache) && out_token_stride % 8 == 0 &&
         out_head_stride % 8 == 0 && query_token_stride % 8 == 0 && query_head_stride % 8 == 0;
}
}  // namespace

cudaError_t launch_paged_attention_prefill(DType dtype, void* out, int64_t out_token_stride,
                                           int64_t out_head_stride, const void* query, int64_t query_token_stride,
                                           int64_t query_head_stride, const void* key_cache,
                                           const void* value_cache, const int* block_tables,
                                           int64_t block_table_stride, const int* seq_lens,
                                           const int* query_start_loc, int num_seqs, int64_t num_tokens,
                                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                                           float scale, int sliding_window, float logits_soft_cap,
                                           cudaStream_t stream, KVFormat kv_format, const float* k_scale,
                                           const float* v_scale, const int* key_limit, const float* sinks) {
  if (num_seqs == 0 || num_tokens == 0) return cudaSuccess;
  if (!is_supported_block_size(block_size) || num_kv_heads <= 0 || num_kv_heads > 65535 ||
      num_heads % num_kv_heads != 0 || sliding_window < 0 || !(logits_soft_cap >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  const int64_t group = num_heads / num_kv_heads;
  if (num_tokens * group > 0x7fffffff - 1024) return cudaErrorInvalidValue;  // rows are int

  PrefillParams p{};
  p.out = out;
  p.out_token_stride = out_token_stride;
  p.out_head_stride = out_head_stride;
  p.query = query;
  p.query_token_stride = query_token_stride;
  p.query_head_stride = query_head_stride;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.block_table_stride = block_table_stride;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.block_size = block_size;
  p.scale_log2 = scale * kLog2e;
  p.sliding_window = sliding_window;
  p.soft_cap_log2 = logits_soft_cap * kLog2e;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.key_limit = key_limit;
  p.sinks = sinks;
  const bool tensor_cores = dtype != DType::kFloat32 &&
                            tensor_cores_fit(out, out_token_stride, out_head_stride, query, query_token_stride,
                                             query_head_stride, key_cache, value_cache);

  return dispatch_dtype(dtype, [&](auto dtype_tag) {
    using T = typename decltype(dtype_tag)::type;
    return dispatch_head_dim(head_dim, [&](auto head_dim_tag) {
      constexpr int kHeadDim = decltype(head_dim_tag)::value;
      if constexpr (!std::is_same_v<T, float>) {  // float32 stays on CUDA cores: true fp32 products
        if (tensor_cores) {
          const int64_t num_tiles = num_tokens * group / TcConfig<T, kHeadDim>::kRows + num_seqs;
          return dispatch_cache<T>(kv_format, [&](auto cache_tag) {
            return launch_prefill_tc<T, typename decltype(cache_tag)::type, kHeadDim>(p, num_tiles, stream);
          });
        }
      }
      const int64_t num_tiles = num_tokens * group / PrefillConfig<T, kHeadDim>::kRows + num_seqs;
      return dispatch_cache<T>(kv_format, [&](auto cache_tag) {
        return launch_prefill<T, typename decltype(cache_tag)::type, kHeadDim>(p, num_tiles, stream);
      });
    });
  });
}

}  // namespace batchgen::kernels
