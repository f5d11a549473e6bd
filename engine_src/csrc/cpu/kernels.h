// Torch-free interface of the CPU attention, element-wise layer and sampler kernels.
//
// The kernel sources (attention_impl.h and layer_impl.h, tabled by kernel_table_impl.h) are
// compiled once per instruction set (kernels_scalar.cpp,
// kernels_avx2.cpp, kernels_avx512.cpp, kernels_avx512_bf16.cpp, kernels_amx_bf16.cpp and
// kernels_amx_emulated.cpp), each copy in its own namespace
// so the copies never clash at link time; isa.cpp picks one table at run time. No torch header
// is included on this side: a torch header compiled under an AVX-512 target pragma could leak
// AVX-512 code into inline functions that the rest of the library shares.
#pragma once
#include <cstdint>

#include "fp8.h"

namespace batchgen::cpu {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };
constexpr int kNumDTypes = 3;

// Storage of the 16-bit element types, so that overloads can tell them apart.
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// One attention call: shapes and pointers shared by all of its tasks. Caches and block tables
// are contiguous; query and out rows are head_dim contiguous elements at the given strides.
struct AttnArgs {
  const void* query;            // [num_tokens, num_heads, head_dim]
  int64_t query_token_stride;   // in elements
  int64_t query_head_stride;
  void* out;                    // [num_tokens, num_heads, head_dim]
  int64_t out_token_stride;
  int64_t out_head_stride;
  const void* key_cache;        // [num_blocks, num_kv_heads, block_size, head_dim]
  const void* value_cache;      // same
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  float scale;
  int64_t sliding_window;  // 0: off; else the query at position p sees keys (p - sliding_window, p]
  float soft_cap;          // 0: off; else each scaled score s becomes soft_cap * tanh(s / soft_cap)
  float inv_soft_cap;      // 1 / soft_cap
  // The caches' elements: the query's dtype (same), or fp8 bytes (fp8.h) read as k * k_scale[kv head] and
  // v * v_scale[kv head] (float32 [num_kv_heads]). The kernels convert fp8 in registers, or on the paths that
  // need the tile in memory widen it to the query's dtype first (exactly either way: both formats fit in
  // float32, bf16 and fp16), and fold the scales into the scores' scale and the output's normalisation.
  KVFormat kv_format = KVFormat::same;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  // Prefill only, optional: query token t (a row of `query`) sees keys up to position key_limit[t] instead of
  // its own (Gemma 3's image tokens see their whole image); the sliding window still starts from its own.
  const int32_t* key_limit = nullptr;
  // Optional, float32 [num_heads]: each query head's attention sink (GPT-OSS), a logit in the scaled scores' units
  // that joins every row's softmax with a zero value: the row's output is sum_j p_j v_j with p_j = exp(s_j) /
  // (exp(sink) + sum_i exp(s_i)).
  const float* sinks = nullptr;
};

// The first key a query at position `pos` sees: 0, or with a sliding window pos - window + 1 (transformers'
// `kv_idx > q_idx - sliding_window`).
inline int64_t window_begin(int64_t pos, int64_t window) {
  return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

// One unit of work: the query tokens [q_begin, q_begin + q_count) of sequence `seq`, all query
// heads of kv heads [kv_head, kv_head + kv_head_count). Query token q_begin + j sits at position q_pos + j and reads the
// keys at positions [kv_begin, min(kv_end, q_pos + j + 1)), with a sliding window only those from
// window_begin(q_pos + j) on; kv_begin is a multiple of kTileKeys, or with a sliding window of the
// block size (the first block of its first row's window): the walk starts its tiles at multiples of
// kTileKeys whatever kv_begin, so that a row's tiles start at the same absolute positions in every
// task (batch invariance, see attention_impl.h), and does not read the blocks before kv_begin. A task over several kv heads walks each K/V block through all of
// them: the heads of a block lie side by side in the cache, so its reads are long contiguous
// runs, which the processor's prefetchers follow far better than one head's scattered tiles.
// With `member_lens` set (decode of samples sharing their first blocks), the task's query tokens are
// sequences q_begin + j, which all read the shared keys [kv_begin, kv_end) of sequence `seq`, and then
// each its own keys [kv_end, member_lens[q_begin + j]) from its own block table (kv_end a multiple of
// kTileKeys too). With AttnArgs::key_limit, row j reads up to min(kv_end, key_limit[q_begin + j] + 1) and
// keys_end is one past the largest of its rows' limits (the task's tiles end there).
struct AttnTask {
  int64_t seq;
  int64_t kv_head;
  int64_t q_begin;
  int64_t q_count;
  int64_t q_pos;
  int64_t kv_begin;
  int64_t kv_end;
  int64_t kv_head_count = 1;
  const int32_t* member_lens = nullptr;
  int64_t keys_end = 0;  // 0: q_pos + q_count (causal)
};

// `next`, the task the calling thread runs after this one (or null), has its first K/V tile prefetched
// during this task's last: a task's first tile would otherwise start cold (decode, 256-token
// contexts: ~1/15 of a task's reads, waited on at full memory latency).
using AttendFn = void (*)(const AttnArgs& args, const AttnTask& task, const AttnTask* next, float* scratch);

constexpr int kTileKeys = 64;  // keys per online-softmax step of the CPU attention (attention_impl.h)
constexpr int kGroupRows = 4;  // query rows sharing one pass over a K/V tile
constexpr int kMaxGroupRows = 16;  // the same on the tile unit (attention_amx.h)

// Floats of scratch memory that one task with `rows` query rows (q_count * heads per kv head) needs:
// queries, accumulators, maxima and sums per row, the scores of one row group x one tile, and one
// tile's K transposed into pairs of 4 bytes (on a 64-byte boundary).
// The tile path of the amx_bf16 table (attention_amx.h) takes the scores of kMaxGroupRows rows instead,
// and then the queries as tile operands (each kv head's rows padded to whole groups of 16), one tile's
// sums, probabilities, value sums, interleaved V and copied K, each on a 64-byte boundary.
inline int64_t attend_base_floats(int64_t rows, int64_t head_dim) {
  const int64_t padded = (head_dim + 31) / 32 * 32;
  const int64_t vector_path = 2 * rows * head_dim + 2 * rows + kGroupRows * kTileKeys + kTileKeys * head_dim / 2 + 16;
  const int64_t tile_path = 2 * rows * head_dim + 2 * rows + kMaxGroupRows * kTileKeys + 8 * rows * padded +
                            4 * 16 * 16 + 16 * kTileKeys / 2 + 16 * head_dim + kTileKeys * head_dim / 2 +
                            kTileKeys * padded / 2 + 7 * 16;
  return vector_path > tile_path ? vector_path : tile_path;
}
// Then, for fp8 caches on the paths that widen them (attention_impl.h), one tile's K and V widened to the
// query's dtype (at most float32), on a 64-byte boundary.
inline int64_t fp8_staging_floats(int64_t head_dim) { return 2 * kTileKeys * head_dim + 16; }
inline int64_t attend_scratch_floats(int64_t rows, int64_t head_dim) {
  return attend_base_floats(rows, head_dim) + fp8_staging_floats(head_dim);
}

// Row kernels of the element-wise layer ops and the sampler (layer_impl.h); float16 has none (nullptr).
using NormRowFn = void (*)(const void* x, const void* weight, void* out, int64_t n, float eps);
using AddNormRowFn = void (*)(void* x, void* residual, const void* weight, int64_t n, float eps);
using RotaryRowFn = void (*)(void* x, const float* cos, const float* sin, int64_t half);
// out[i] = silu(gate[i]) * up[i] for i < n with gate, up and the silu rounded to the activation dtype first, as
// transformers' MLP rounds them: the int8 MLP's epilogue (gemm_int8_ops.cpp's linear_silu_mul_int8).
using SiluMulRowFn = void (*)(const float* gate, const float* up, void* out, int64_t n);
// The sampler's summary of one block of a row of logits, [begin, end): its maximum, the index of its first
// maximum (of its first NaN where it holds one) and sum(exp(x - max)) over it (0 when max is -inf).
// sampling_ops.cpp combines a row's blocks in order, so a row's argmax and logsumexp depend on its data alone.
struct BlockSummary {
  float max;
  float sum;
  int64_t argmax;
  bool nan;
};
using SummariseBlockFn = void (*)(const void* row, int64_t begin, int64_t end, BlockSummary* out);
// The sampler's weights of one row of logits: w = exp(x / temperature - max(x) / temperature); returns their sum.
using WeightsRowFn = float (*)(const void* x, int64_t n, float temperature, float* w);
// One row of a cache write into fp8 (reshape_and_cache): dst[i] = float_to_fp8(x[i] / scale) for i < n.
using QuantizeFp8RowFn = void (*)(const void* x, uint8_t* dst, int64_t n, float scale, KVFormat f);
// The int8 GEMM's activations, one row (gemm_int8.h): q[k] = round_half_even(x[k] / s) clamped to [-127, 127],
// plus the zero point, for k < depth, the zero point up to padded_depth; s = max_k |x[k]| / 127 (1 for a row of
// zeros, or one holding a NaN, as torch's amax makes it NaN); NaN elements to -127. Returns s. The same bytes on
// every table.
using QuantizeInt8RowFn = float (*)(const void* x, int64_t depth, int64_t padded_depth, uint8_t* q);
// The int8 GEMM's float epilogue (gemm_int8.h): rows [row, row + count) of the panel starting at column `col` from
// their int32 sums, sums[r * kInt8PanelCols + c]; `offset_sums`: the sums are of the offset bytes, so the
// compensation is subtracted first. One arithmetic on every table (the same bits), vectorized for each.
struct Int8GemmArgs;
using FinishInt8RowsFn = void (*)(const Int8GemmArgs& args, int64_t row, int64_t count, int64_t col,
                                  const int32_t* sums, bool offset_sums);
// The sampler's candidates: ids of the weights >= threshold (and > 0) in id order, their sum; returns their count.
using CollectRowFn = int64_t (*)(const float* w, int64_t n, float threshold, int32_t* ids, float* mass);

// The k most likely tokens of a row: larger values first, NaN above everything (as torch.sort orders them),
// ties broken by the lower index. Up to kSortedTopK of them stay sorted while offers come in: a new one lands
// near the end, a few moves (the sampler's top logprobs). More are a heap with the worst kept token at [0], so
// that an offer costs log k, not k (a beam step's 2k-11k candidates; sorted, 704 took 4x torch.topk's time).
// Either way the bar a new token must pass is worst_value(), and `sort()` leaves them best first.
struct TopKList {
  static constexpr int64_t kSortedTopK = 32;
  float* values;  // room for k
  int64_t* ids;
  int64_t k;
  int64_t count = 0;

  static bool before(float a, int64_t ia, float b, int64_t ib) {
    if (a != a) return b == b || ia < ib;
    if (b != b) return false;
    return a > b || (a == b && ia < ib);
  }
  bool full() const { return count == k; }
  bool heap() const { return k > kSortedTopK; }
  int64_t worst() const { return heap() ? 0 : k - 1; }  // where a full list's worst token is
  float worst_value() const { return values[worst()]; }  // full lists only
  void offer(float v, int64_t i) {
    if (full() && !before(v, i, values[worst()], ids[worst()])) return;
    if (!heap()) {  // into its place from the end (the last one drops out of a full list)
      int64_t at = full() ? k - 1 : count++;
      for (; at > 0 && before(v, i, values[at - 1], ids[at - 1]); --at) move(at - 1, at);
      put(at, v, i);
    } else if (full()) {  // in place of the worst, then down past any child it is better than
      sift_down(0, count, v, i);
    } else {  // at the end, then up past any parent it is worse than
      int64_t at = count++;
      for (int64_t up = (at - 1) / 2; at > 0 && before(values[up], ids[up], v, i); at = up, up = (at - 1) / 2) {
        move(up, at);
      }
      put(at, v, i);
    }
  }
  // Best first: a heap's worst goes to the last place, the heap shrinks by one, and so on.
  void sort() {
    if (!heap()) return;
    for (int64_t end = count - 1; end > 0; --end) {
      const float v = values[end];
      const int64_t i = ids[end];
      move(0, end);
      sift_down(0, end, v, i);
    }
  }

 private:
  void move(int64_t from, int64_t to) {
    values[to] = values[from];
    ids[to] = ids[from];
  }
  void put(int64_t at, float v, int64_t i) {
    values[at] = v;
    ids[at] = i;
  }
  // (v, i) placed from `at` down the heap of [0, size): below any child it is better than.
  void sift_down(int64_t at, int64_t size, float v, int64_t i) {
    for (int64_t child = 2 * at + 1; child < size; at = child, child = 2 * at + 1) {
      if (child + 1 < size && before(values[child], ids[child], values[child + 1], ids[child + 1])) ++child;
      if (!before(v, i, values[child], ids[child])) break;
      move(child, at);
    }
    put(at, v, i);
  }
};
// The sampler's top k of one block of a row, row[begin, end), into `list` (empty, k >= 1).
using TopKBlockFn = void (*)(const void* row, int64_t begin, int64_t end, TopKList* list);

// One bf16 GEMM call (gemm_impl.h): out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for m < rows, n < cols;
// or, with `up` set, silu(x w^T) * (x up^T). out is bf16, or float32 (the sums unrounded) with
// `float_out`. Weights are packed in panels of kGemmPanelCols output columns, each panel
// [depth / 2][kGemmPanelCols][2]: the pair (w[n, 2i], w[n, 2i + 1]) of every column side by side, the
// operand layout of the bf16 dot product, so a panel is read front to back exactly once per row tile.
// The last panel is padded with zero columns.
constexpr int kGemmPanelCols = 48;
constexpr int kGemmTileRows = 8;  // rows that share a panel's pass in registers

struct GemmArgs {
  const BF16* x;  // [rows, depth], rows `x_stride` elements apart
  int64_t x_stride;
  // x widened to float32, rows `depth` apart, where the table's GEMM widens bf16 (gemm_widens_bf16): made once per
  // call (gemm_ops.cpp), before the call is cut into tasks, so that no two threads widen the same rows.
  const float* x_wide;
  const BF16* weight;  // panels, as above
  const BF16* up;      // panels of the up projection, or nullptr
  const float* bias;   // [cols] or nullptr
  // float32 added to the sums before the bias or the SiLU (LoRA's terms), or nullptr: [rows, cols], with
  // `up` [rows, 2 * cols] (the gate's columns, then the up projection's), rows `addend_stride` apart.
  const float* addend;
  int64_t addend_stride;
  void* out;           // [rows, cols], rows `out_stride` elements apart
  int64_t out_stride;
  bool float_out;
  int64_t rows, cols, depth;
};

// The same call restricted to rows [first, first + count).
inline GemmArgs gemm_rows(const GemmArgs& args, int64_t first, int64_t count) {
  GemmArgs part = args;
  part.x = args.x + first * args.x_stride;
  if (args.x_wide != nullptr) part.x_wide = args.x_wide + first * args.depth;
  part.out = static_cast<char*>(args.out) + first * args.out_stride * (args.float_out ? 4 : 2);
  if (args.addend != nullptr) part.addend = args.addend + first * args.addend_stride;
  part.rows = count;
  return part;
}

// Computes the columns of panels [panel_begin, panel_end) for every row.
using GemmFn = void (*)(const GemmArgs& args, int64_t panel_begin, int64_t panel_end);

// One segmented LoRA call (lora_impl.h): for rows of one adapter slot, y[row] (+)= scale * (x[row] A^T) B^T,
// summed in float32. A is [slots, rank, in] and B is stored transposed, [slots, rank, out], so that the
// expand runs along contiguous output columns. A slot's adapter uses its first ranks[slot] ranks (all `rank`
// without `ranks`); the rest are zero rows, which would add exact zeros: padding changes nothing but time.
// y is x's dtype, or float32; `store` writes float32 y instead of adding.
//
// The bf16 form (`lora_rows_bf16`, x bf16): A and B in bf16, laid out for the bf16 dot product, which
// multiplies pairs: a [slots, ceil(in / 2), rank, 2], a[s, k, r, j] = A[s, r, 2k + j] (zero past `in`), and b
// [slots, rank / 2, out, 2], b[s, i, o, j] = B^T[s, 2i + j, o]; rank a multiple of kLoRARankGroup. The shrink's
// t = scale * x A^T is rounded to bf16 before the expand (as the Python layers round it).
struct LoRAArgs {
  const void* x;  // [rows, in], rows `x_stride` elements apart
  int64_t x_stride;
  const void* a;  // float32, or bf16 pairs (above)
  const void* b;
  const int32_t* ranks;  // [slots] or nullptr
  void* y;  // [rows, out], rows `y_stride` elements apart
  int64_t y_stride;
  bool y_float;
  bool store;
  int64_t in, out, rank;
  float scale;
};
constexpr int64_t kMaxLoRARank = 512;
constexpr int64_t kLoRARankGroup = 16;  // ranks a shrink of the bf16 form sums side by side (one vector)

// Rows [begin, end), all of adapter slot `slot`; scratch: kLoRATileRows * in floats. Each row's sums run in one
// fixed order, whatever rows it is called with, so a row's result never depends on its segment's size or
// neighbours.
constexpr int kLoRATileRows = 8;
constexpr int kLoRABlockRows = 16;  // rows of the bf16 form's AMX blocks: its chunks come in multiples of these
using LoRARowsFn = void (*)(const LoRAArgs& args, int64_t begin, int64_t end, int64_t slot, float* scratch);

struct KernelTable {
  const char* name;
  AttendFn attend[kNumDTypes];  // indexed by DType
  NormRowFn norm_row[kNumDTypes];
  AddNormRowFn add_norm_row[kNumDTypes];
  RotaryRowFn rotary_row[kNumDTypes];
  SiluMulRowFn silu_mul_row[kNumDTypes];
  SummariseBlockFn summarise_block[kNumDTypes];
  WeightsRowFn weights_row[kNumDTypes];
  CollectRowFn collect_row;
  TopKBlockFn top_k_block[kNumDTypes];
  GemmFn gemm_bf16;  // nullptr on the scalar table
  bool gemm_widens_bf16;  // gemm_bf16 reads GemmArgs::x_wide (no bf16 dot product: the pairs widen to float32)
  LoRARowsFn lora_rows[kNumDTypes];  // float32 A and B
  LoRARowsFn lora_rows_bf16;  // bf16 x, A and B in pairs
  QuantizeFp8RowFn quantize_fp8_row[kNumDTypes];
  QuantizeInt8RowFn quantize_int8_row[kNumDTypes];
  FinishInt8RowsFn finish_int8_rows;
};

namespace scalar {
const KernelTable& kernel_table();
}
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BATCHGEN_HAVE_AVX2 1
namespace avx2 {
const KernelTable& kernel_table();
}
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BATCHGEN_HAVE_AVX512 1
namespace avx512 {
const KernelTable& kernel_table();
}
namespace avx512_bf16 {  // avx512 plus the bf16 dot product
const KernelTable& kernel_table();
}
namespace amx_bf16 {  // avx512_bf16 with the GEMM on the AMX tile unit
const KernelTable& kernel_table();
}
namespace amx_emulated {  // amx_bf16 on an emulated tile unit (amx_emulated.h), for tests
const KernelTable& kernel_table();
}
#endif

// The tile products the emulated tile unit has computed in this process (amx_emulated.h counts them; tests
// check that the emulated tables ran on tiles).
int64_t emulated_tile_products();
void count_emulated_tile_product();

}  // namespace batchgen::cpu
