// The bf16 attention of the amx_bf16 table on the AMX tile unit, for every path (decode, prefill,
// chunked prefill, shared-prefix decode), so that a row's bits never depend on the path or the batch
// (batch invariance, see attention_impl.h). Included by attention_impl.h; float32 and float16 caches
// keep the vector path there (one path per table and dtype).
//
// Scores are computed transposed, S^T = K Q^T: the A operand is 16 keys x 32 dims as they lie in a
// cache block, the B operand the 16 query rows of a row group in pair layout (prepared once per walk),
// a sum tile 16 keys x 16 rows. A tile product sums each output over the depth in the hardware's one
// order from that output's row and column alone, so a row's score does not depend on the rows beside
// it in the tile. Values: P (the probabilities rounded to bf16, as the pair path does) times V with
// consecutive keys interleaved into pairs (once per tile), always over the tile's whole 64 keys (keys
// a row does not see have p = 0, keys nobody reads are zero V), so a row's sums take the same tile
// steps in every task. The online softmax per row is the vector path's (softmax_rows).
#ifndef BATCHGEN_AMX
#error "attention_amx.h is for the amx_bf16 kernel table"
#endif

#include "cpu/amx_tiles.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int kKeyChunks = kTileKeys / kAmxRows;          // score tiles of 16 keys per K/V tile
constexpr int kPairChunks = kTileKeys / (2 * kAmxPairs);  // value steps of 32 keys per K/V tile
static_assert(kAmxRows == kMaxGroupRows, "a row group fills the columns of a score tile");
static_assert(kKeyChunks == 4 && kPairChunks == 2, "the tile registers below are laid out for 64-key tiles");

inline int padded_dim(int D) { return (D + 2 * kAmxPairs - 1) / (2 * kAmxPairs) * (2 * kAmxPairs); }

// Where the A operand of key chunk c (keys 16c .. 16c + 15 of the tile) lies: a cache block's rows as
// they are, or a copy (blocks of 8 keys; head dims that are not whole 32-element steps, zero-padded).
struct KeySource {
  const BF16* k[kKeyChunks];
  int stride;  // bytes between two keys
};

// The tile path's scratch (see attend_tile_floats), per task.
struct AmxWork {
  uint32_t* qt;  // per row group of a walk: [padded_dim / 32][16 pairs][16 rows], zero past the group's rows
  float* sums;   // [kKeyChunks][16 keys][16 rows]
  BF16* p;       // [16 rows][kTileKeys]
  float* pv;     // [16 rows][D], permuted within 32-element chunks as the pair path's accumulators
  BF16* vi;      // [kTileKeys / 2 key pairs][2 D]: per 16-dim column chunk, the pairs of its dims
  BF16* keys;    // [kTileKeys][padded_dim], the copy behind KeySource where one is needed
};

inline uintptr_t align64(uintptr_t p) { return (p + 63) / 64 * 64; }

// Carves an AmxWork from the scratch after the scores, for a task of `rows` rows over `heads` kv heads.
inline AmxWork amx_work(float* after_scores, int64_t rows, int64_t heads, int D) {
  const int64_t Dp = padded_dim(D);
  AmxWork w;
  uintptr_t at = align64(reinterpret_cast<uintptr_t>(after_scores));
  auto take = [&](int64_t floats) {
    void* p = reinterpret_cast<void*>(at);
    at = align64(at + static_cast<uintptr_t>(floats) * sizeof(float));
    return p;
  };
  w.sums = static_cast<float*>(take(kKeyChunks * kAmxRows * kAmxRows));
  w.p = static_cast<BF16*>(take(kAmxRows * kTileKeys / 2));
  w.pv = static_cast<float*>(take(int64_t{kAmxRows} * D));
  w.vi = static_cast<BF16*>(take(int64_t{kTileKeys} * D / 2));
  w.keys = static_cast<BF16*>(take(int64_t{kTileKeys} * Dp / 2));
  w.qt = static_cast<uint32_t*>(take((rows + (kAmxRows - 1) * heads) * Dp / 2));
  return w;
}

// The B operand of the scores for rows r .. r + ng - 1 of q (row-major bf16, D elements each): for each
// 32-element step s, pair i of the step of row g at qt[s][i][g].
inline void queries_to_tiles(const BF16* q, int ng, int D, uint32_t* qt) {
  const int steps = padded_dim(D) / (2 * kAmxPairs);
  std::memset(qt, 0, sizeof(uint32_t) * steps * kAmxPairs * kAmxRows);
  for (int g = 0; g < ng; ++g) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q + g * D);
    for (int i = 0; i < D / 2; ++i) qt[(i / kAmxPairs) * kAmxPairs * kAmxRows + (i % kAmxPairs) * kAmxRows + g] = row[i];
  }
}

inline int64_t qt_group_size(int D) { return int64_t{padded_dim(D)} / 2 * kAmxRows; }

// Interleaves the V of the tile's keys [0, valid) into key pairs (keys past `valid` and of blocks not
// read are zeros: V there may be NaN, and 0 * NaN is not 0), prefetching the next tile's K and V.
inline void interleave_values(Tile<BF16>& tile, int D, int BS, int valid, BF16* vi) {
  const int prefetch = lines_for(int64_t{2} * D * sizeof(BF16));  // a key pair's bytes
  const __m512i in_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int i = 0; i < kTileKeys / 2; ++i) {
    const int t = 2 * i, b = t / BS;
    BF16* row = vi + int64_t{i} * 2 * D;
    if (b >= tile.count || tile.block[b].v == nullptr || t >= valid) {
      std::memset(row, 0, sizeof(BF16) * 2 * D);
      continue;
    }
    tile.block[b].next_k.lines(prefetch);
    tile.block[b].next_v.lines(prefetch);
    const BF16* x = tile.block[b].v + (t % BS) * D;
    const bool second = t + 1 < valid;
    int c = 0;
    for (; c + 2 * kAmxPairs <= D; c += 2 * kAmxPairs) {
      const BF16Pairs xs = BF16Pairs::load(x + c, 32);
      const BF16Pairs ys = second ? BF16Pairs::load(x + D + c, 32) : BF16Pairs::zero();
      _mm512_storeu_si512(row + 2 * c, interleave_lo(xs, ys).v);
      _mm512_storeu_si512(row + 2 * c + 32, interleave_hi(xs, ys).v);
    }
    if (c < D) {  // a last 16 elements, in order
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c));
      const __m256i ys = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + D + c)) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(xs), ys, 1);
      _mm512_storeu_si512(row + 2 * c, _mm512_permutexvar_epi16(in_order, both));
    }
  }
}

// The A operands of the tile's key chunks: the blocks as they lie where they can be (blocks of 16 or
// more keys, whole 32-element steps), else a zero-padded copy of the keys (zeros for blocks not read).
inline KeySource key_source(const Tile<BF16>& tile, int D, int BS, BF16* copy) {
  KeySource src;
  if (BS % kAmxRows == 0 && D % (2 * kAmxPairs) == 0) {
    src.stride = D * static_cast<int>(sizeof(BF16));
    for (int c = 0; c < kKeyChunks; ++c) {
      const int t = c * kAmxRows, b = t / BS;
      src.k[c] = b < tile.count && tile.block[b].k != nullptr ? tile.block[b].k + (t % BS) * D : nullptr;
    }
    return src;
  }
  const int Dp = padded_dim(D);
  src.stride = Dp * static_cast<int>(sizeof(BF16));
  for (int t = 0; t < kTileKeys; ++t) {
    const int b = t / BS;
    BF16* dst = copy + int64_t{t} * Dp;
    const bool read = b < tile.count && tile.block[b].k != nullptr;
    if (read) std::memcpy(dst, tile.block[b].k + (t % BS) * D, sizeof(BF16) * D);
    std::memset(dst + (read ? D : 0), 0, sizeof(BF16) * (read ? Dp - D : Dp));
  }
  for (int c = 0; c < kKeyChunks; ++c) src.k[c] = copy + int64_t{c} * kAmxRows * Dp;
  return src;
}

// Tile registers: sums in 0-3, A operands in 4 and 6, B operands in 5 and 7 (alternating, so that a
// load need not wait for the product reading the register before). The tile intrinsics take register
// numbers as literals, hence macros.
#define BATCHGEN_SCORE_STEP(B)                                                              \
  for (int c = c0; c < c1; ++c) {                                                           \
    const BF16* a = src.k[c] + s * 2 * kAmxPairs;                                           \
    switch (c) {                                                                            \
      case 0: _tile_loadd(4, a, src.stride); _tile_dpbf16ps(0, 4, B); break;                \
      case 1: _tile_loadd(6, a, src.stride); _tile_dpbf16ps(1, 6, B); break;                \
      case 2: _tile_loadd(4, a, src.stride); _tile_dpbf16ps(2, 4, B); break;                \
      default: _tile_loadd(6, a, src.stride); _tile_dpbf16ps(3, 6, B); break;               \
    }                                                                                       \
  }

// sums[c][t][g] = k_{16c + t} . q_g for the key chunks [c0, c1), over the depth's 32-element steps in order.
inline void score_tiles(const KeySource& src, const uint32_t* qt, int D, int c0, int c1, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int steps = padded_dim(D) / (2 * kAmxPairs);
  constexpr int kRowBytes = kAmxRows * sizeof(float);
  for (int s = 0; s < steps; ++s) {
    const uint32_t* b = qt + s * kAmxPairs * kAmxRows;
    if (s % 2 == 0) {
      _tile_loadd(5, b, kRowBytes);
      BATCHGEN_SCORE_STEP(5)
    } else {
      _tile_loadd(7, b, kRowBytes);
      BATCHGEN_SCORE_STEP(7)
    }
  }
  for (int c = c0; c < c1; ++c) {
    float* dst = sums + c * kAmxRows * kAmxRows;
    switch (c) {
      case 0: _tile_stored(0, dst, kRowBytes); break;
      case 1: _tile_stored(1, dst, kRowBytes); break;
      case 2: _tile_stored(2, dst, kRowBytes); break;
      default: _tile_stored(3, dst, kRowBytes); break;
    }
  }
}

// s[g][t] = sums[t / 16][t % 16][g] for rows g < ng and the chunks [c0, c1).
inline void scores_to_rows(const float* sums, int ng, int c0, int c1, float* s) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kAmxRows));
  for (int g = 0; g < ng; ++g)
    for (int c = c0; c < c1; ++c)
      _mm512_storeu_ps(s + g * kTileKeys + c * kAmxRows,
                       _mm512_i32gather_ps(column, sums + c * kAmxRows * kAmxRows + g, sizeof(float)));
}

// The products of one value step (32 keys, A operand in register A) for column chunks q0 .. q0 + count - 1.
#define BATCHGEN_VALUE_STEP(A, vi)                                                          \
  for (int i = 0; i < count; ++i) {                                                         \
    const BF16* b = (vi) + (q0 + i) * 2 * kAmxPairs;                                        \
    switch (i) {                                                                            \
      case 0: _tile_loadd(5, b, vi_stride); _tile_dpbf16ps(0, A, 5); break;                 \
      case 1: _tile_loadd(7, b, vi_stride); _tile_dpbf16ps(1, A, 7); break;                 \
      case 2: _tile_loadd(5, b, vi_stride); _tile_dpbf16ps(2, A, 5); break;                 \
      default: _tile_loadd(7, b, vi_stride); _tile_dpbf16ps(3, A, 7); break;                \
    }                                                                                       \
  }

// pv[g] = sum over the tile's 64 keys of p[g][t] * v_t, for all 16 rows, in 16-dim column chunks.
inline void value_tiles(const BF16* p, const BF16* vi, int D, float* pv) {
  constexpr int kPRowBytes = kTileKeys * sizeof(BF16);
  _tile_loadd(4, p, kPRowBytes);
  _tile_loadd(6, p + 2 * kAmxPairs, kPRowBytes);
  const int columns = D / kAmxRows;
  const int pv_stride = D * static_cast<int>(sizeof(float));
  const int vi_stride = 2 * D * static_cast<int>(sizeof(BF16));
  const int64_t pair_rows = int64_t{kAmxPairs} * 2 * D;  // one value step's rows of vi
  for (int q0 = 0; q0 < columns; q0 += 4) {
    const int count = columns - q0 < 4 ? columns - q0 : 4;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    BATCHGEN_VALUE_STEP(4, vi)
    BATCHGEN_VALUE_STEP(6, vi + pair_rows)
    for (int i = 0; i < count; ++i) {
      float* dst = pv + (q0 + i) * kAmxRows;
      switch (i) {
        case 0: _tile_stored(0, dst, pv_stride); break;
        case 1: _tile_stored(1, dst, pv_stride); break;
        case 2: _tile_stored(2, dst, pv_stride); break;
        default: _tile_stored(3, dst, pv_stride); break;
      }
    }
  }
}

// Query rows r0 .. r0 + ng - 1 (ng <= 16) against one tile on the tile unit; row g sees the tile's keys
// [keys.low[g], keys.limit[g]). qt: the group's queries as B operands; src, vi: the tile's K and V.
inline void attend_tile_amx(const AttnArgs& a, int ng, const Rows<BF16>& rows, int64_t r0, const GroupKeys& keys,
                            const KeySource& src, const uint32_t* qt, const AmxWork& w) {
  const int D = a.head_dim, BS = a.block_size;
  int n = 0;
  for (int g = 0; g < ng; ++g) n = keys.limit[g] > n ? keys.limit[g] : n;
  const int c0 = keys.fb * BS / kAmxRows, c1 = (n + kAmxRows - 1) / kAmxRows;
  score_tiles(src, qt, D, c0, c1, w.sums);
  scores_to_rows(w.sums, ng, c0, c1, rows.s);
  const int width = c1 * kAmxRows;
  float scale = a.scale;
  if (a.soft_cap > 0.0f || keys.any_low) {
    score_variants(a, keys, ng, width, rows.s);
    scale = 1.0f;
  }
  float correction[kMaxGroupRows];
  for (int g0 = 0; g0 < ng; g0 += kGroupRows) {
    float* s = rows.s + g0 * kTileKeys;
    float* m = rows.m + r0 + g0;
    float* l = rows.l + r0 + g0;
    switch (ng - g0 < kGroupRows ? ng - g0 : kGroupRows) {
      case 1: softmax_rows<1>(s, keys.limit + g0, width, scale, m, l, correction + g0); break;
      case 2: softmax_rows<2>(s, keys.limit + g0, width, scale, m, l, correction + g0); break;
      case 3: softmax_rows<3>(s, keys.limit + g0, width, scale, m, l, correction + g0); break;
      default: softmax_rows<4>(s, keys.limit + g0, width, scale, m, l, correction + g0); break;
    }
  }
  for (int g = 0; g < ng; ++g) {
    BF16* p = w.p + g * kTileKeys;
    int t = 0;
    for (; t < width; t += Vec::N) store_bf16(Vec::load(rows.s + g * kTileKeys + t), p + t);
    for (; t < kTileKeys; ++t) p[t] = BF16{0};
  }
  value_tiles(w.p, w.vi, D, w.pv);
  for (int g = 0; g < ng; ++g) {
    float* acc = rows.acc + (r0 + g) * D;
    const float* pv = w.pv + g * D;
    const Vec factor = Vec::set1(correction[g]);
    for (int c = 0; c < D; c += Vec::N) (Vec::load(acc + c) * factor + Vec::load(pv + c)).store(acc + c);
  }
}

#undef BATCHGEN_SCORE_STEP
#undef BATCHGEN_VALUE_STEP

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
