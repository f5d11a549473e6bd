// The segmented LoRA kernel (kernels.h: LoRAArgs), compiled once per instruction set by
// kernel_table_impl.h. A row's shrink t = scale * x A^T is `rank` dot products along the input, each
// summed lane-wise then reduced; its expand walks the output columns a vector at a time, adding t[r] *
// B^T[r] rank by rank. Tiles of up to kLoRATileRows rows share each load of A and B; every row still runs
// the same operations in the same order as alone (batch invariance, tests/test_lora_kernels.py).
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including lora_impl.h"
#endif

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <type_traits>

#include "cpu/dtype.h"
#include "cpu/kernels.h"
#ifdef BATCHGEN_AMX
#include "cpu/amx_tiles.h"
#endif

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

// t[row][r] = scale * sum_k x[row][k] a[r][k] for the tile's MR rows (x in float32).
template <int MR>
inline void lora_shrink(const LoRAArgs& p, const float* const (&x)[MR], const float* a, int64_t rank,
                        float (&t)[MR][kMaxLoRARank]) {
  const int64_t whole = p.in / Vec::N * Vec::N;
  for (int64_t r = 0; r < rank; ++r) {
    const float* ar = a + r * p.in;
    Vec acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    for (int64_t k = 0; k < whole; k += Vec::N) {
      const Vec w = Vec::load(ar + k);
      for (int m = 0; m < MR; ++m) acc[m] = fma(Vec::load(x[m] + k), w, acc[m]);
    }
    for (int m = 0; m < MR; ++m) {
      float sum = reduce_add(acc[m]);
      for (int64_t k = whole; k < p.in; ++k) sum += x[m][k] * ar[k];
      t[m][r] = p.scale * sum;
    }
  }
}

// Finishes `count` columns of one row from their float32 sums: stores or adds them into y.
template <typename Y>
inline void lora_finish(const LoRAArgs& p, Y* y, const float* sums, int64_t count) {
  if (p.store) {
    for (int64_t j = 0; j < count; ++j) y[j] = from_float<Y>(sums[j]);
  } else {
    for (int64_t j = 0; j < count; ++j) y[j] = from_float<Y>(to_float(y[j]) + sums[j]);
  }
}

// A whole vector of one row's columns (float32 y: straight from the register).
template <typename Y>
inline void lora_finish_vec(const LoRAArgs& p, Y* y, Vec sums) {
  if constexpr (std::is_same_v<Y, float>) {
    (p.store ? sums : Vec::load(y) + sums).store(y);
  } else {
    float lanes[Vec::N];
    sums.store(lanes);
    lora_finish(p, y, lanes, Vec::N);
  }
}

// y[row][o] (+)= sum_r t[row][r] b[r][o] for the tile's MR rows.
template <typename Y, int MR>
inline void lora_expand(const LoRAArgs& p, Y* const (&y)[MR], const float* b, int64_t rank,
                        const float (&t)[MR][kMaxLoRARank]) {
  const int64_t whole = p.out / Vec::N * Vec::N;
  for (int64_t o = 0; o < whole; o += Vec::N) {
    Vec acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = Vec::zero();
    for (int64_t r = 0; r < rank; ++r) {
      const Vec w = Vec::load(b + r * p.out + o);
      for (int m = 0; m < MR; ++m) acc[m] = fma(Vec::set1(t[m][r]), w, acc[m]);
    }
    for (int m = 0; m < MR; ++m) lora_finish_vec(p, y[m] + o, acc[m]);
  }
  for (int64_t o = whole; o < p.out; ++o) {
    for (int m = 0; m < MR; ++m) {
      float sum = 0.0f;
      for (int64_t r = 0; r < rank; ++r) sum += t[m][r] * b[r * p.out + o];
      lora_finish(p, y[m] + o, &sum, 1);
    }
  }
}

// Rows [row, row + MR): x converted to float32 once (into `scratch`, MR * in floats) unless it is float32.
template <typename T, typename Y, int MR>
void lora_tile(const LoRAArgs& p, int64_t row, const float* a, const float* b, int64_t rank, float* scratch) {
  const float* x[MR];
  Y* y[MR];
  for (int m = 0; m < MR; ++m) {
    const T* xm = static_cast<const T*>(p.x) + (row + m) * p.x_stride;
    if constexpr (std::is_same_v<T, float>) {
      x[m] = xm;
    } else {
      float* converted = scratch + m * p.in;
      for (int64_t k = 0; k < p.in; ++k) converted[k] = to_float(xm[k]);
      x[m] = converted;
    }
    y[m] = static_cast<Y*>(p.y) + (row + m) * p.y_stride;
  }
  float t[MR][kMaxLoRARank];
  lora_shrink<MR>(p, x, a, rank, t);
  lora_expand<Y, MR>(p, y, b, rank, t);
}

template <typename T, typename Y>
void lora_rows_as(const LoRAArgs& p, int64_t begin, int64_t end, int64_t slot, float* scratch) {
  using TileFn = void (*)(const LoRAArgs&, int64_t, const float*, const float*, int64_t, float*);
  static constexpr TileFn kTiles[kLoRATileRows + 1] = {
      nullptr, &lora_tile<T, Y, 1>, &lora_tile<T, Y, 2>, &lora_tile<T, Y, 3>, &lora_tile<T, Y, 4>,
      &lora_tile<T, Y, 5>, &lora_tile<T, Y, 6>, &lora_tile<T, Y, 7>, &lora_tile<T, Y, 8>};
  static_assert(kLoRATileRows == 8);
  const float* a = static_cast<const float*>(p.a) + slot * p.rank * p.in;
  const float* b = static_cast<const float*>(p.b) + slot * p.rank * p.out;
  const int64_t rank = p.ranks != nullptr ? p.ranks[slot] : p.rank;
  for (int64_t row = begin; row < end; row += kLoRATileRows) {
    const int64_t rows = std::min<int64_t>(kLoRATileRows, end - row);
    kTiles[rows](p, row, a, b, rank, scratch);
  }
}

template <typename T>
void lora_rows(const LoRAArgs& p, int64_t begin, int64_t end, int64_t slot, float* scratch) {
  if (p.y_float) {
    lora_rows_as<T, float>(p, begin, end, slot, scratch);
  } else {
    lora_rows_as<T, T>(p, begin, end, slot, scratch);
  }
}


// The bf16 form (kernels.h: LoRAArgs). A row's shrink sums each of its ranks' pairs in four chains (pair k in
// chain k % 4), added as (c0 + c1) + (c2 + c3), then scales and rounds t to bf16; its expand sums t's pairs of
// ranks into each output column in rank order. Within a pair the odd element's product goes first, as the bf16
// dot product (vdpbf16ps) adds them; each product of two bf16 values is exact in float32.
constexpr int kLoRAChains = 4;

// The bf16 pair (x[2k], x[2k + 1]) of a row as one 32-bit word, the second element zero past `in`.
inline uint32_t lora_x_pair(const BF16* x, int64_t k, int64_t in) {
  if (2 * k + 1 < in) {
    uint32_t pair;
    std::memcpy(&pair, x + 2 * k, sizeof pair);
    return pair;
  }
  return x[2 * k].bits;
}

#if defined(BATCHGEN_AMX)
// On the AMX tile unit (processors with AMX run the bf16 dot product at a quarter of their float32 FMA rate):
// blocks of 16 rows, the shrink 32 elements of the input a tile step and the expand 16 ranks a step. Each sum
// runs in one order whatever the rows (a short block reads a copy of its rows, whose other tile rows hold
// whatever scratch held: a tile's rows never mix, and those rows' sums are never stored); the pairs past the
// input's last whole step, and the columns past the last whole 16, take the vector dot product.
constexpr int64_t kLoRAAmxCols = 16;  // output columns of an expand tile

// Tiles: the shrink's sums in 0 (16 rows x 16 ranks), a step of x in 1 (16 rows x 32 elements), a step of A in 2
// (16 pairs x 16 ranks); the expand's block of t in 3 (16 rows x 16 ranks), steps of B in 4, 5 and 7 (8 pairs of
// ranks x 16 columns) and its sums of four 16-column slices in 0, 1, 2 and 6.
inline void configure_lora_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kAmxRows;
  }
  config.bytes_per_row[3] = kLoRARankGroup * sizeof(BF16);
  config.rows[4] = config.rows[5] = config.rows[7] = kLoRARankGroup / 2;
  _tile_loadconfig(&config);
}

// t (`t_stride` apart) = bf16(scale * x A^T) for a block's first `rows` rows, the rest of t's ranks zero.
inline void lora_shrink_amx(const LoRAArgs& p, const BF16* x, int64_t x_stride, int64_t rows, const BF16* a,
                            int64_t rank, BF16* t, int64_t t_stride) {
  const int64_t groups = t_stride / kLoRARankGroup, steps = p.in / (2 * kAmxPairs), pairs = (p.in + 1) / 2;
  const int64_t a_pair_bytes = 2 * p.rank * static_cast<int64_t>(sizeof(BF16));
  alignas(64) float sums[kAmxRows * kLoRARankGroup];
  for (int64_t g = 0; g < groups; ++g) {
    const BF16* ag = a + g * 2 * kLoRARankGroup;
    _tile_zero(0);
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(1, x + s * 2 * kAmxPairs, x_stride * static_cast<int64_t>(sizeof(BF16)));
      _tile_loadd(2, ag + s * kAmxPairs * 2 * p.rank, a_pair_bytes);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sums, kLoRARankGroup * sizeof(float));
    for (int64_t r = 0; r < rows; ++r) {
      Vec acc = Vec::load(sums + r * kLoRARankGroup);
      for (int64_t k = steps * kAmxPairs; k < pairs; ++k) {
        const BF16Pairs xk{_mm512_set1_epi32(static_cast<int32_t>(lora_x_pair(x + r * x_stride, k, p.in)))};
        acc = dot_pairs(xk, BF16Pairs::load(ag + k * 2 * p.rank, 32), acc);
      }
      store_bf16(Vec::set1(p.scale) * acc, t + r * t_stride + g * kLoRARankGroup);
    }
  }
  for (int64_t r = 0; r < rows; ++r) std::fill(t + r * t_stride + rank, t + (r + 1) * t_stride, BF16{0});
}

// y (+)= t B^T for a block's first `rows` rows, four 16-column slices a pass (sums in tiles 0, 1, 2 and 6, so
// that one slice's multiply overlaps the next one's loads and stores).
template <typename Y>
void lora_expand_amx(const LoRAArgs& p, Y* y, int64_t rows, const BF16* b, const BF16* t, int64_t t_stride) {
  const int64_t groups = t_stride / kLoRARankGroup, whole = p.out / kLoRAAmxCols;
  const int64_t b_pair_bytes = 2 * p.out * static_cast<int64_t>(sizeof(BF16));
  const int64_t t_bytes = t_stride * static_cast<int64_t>(sizeof(BF16));
  constexpr int64_t kSlices = 4, kSumsCols = kSlices * kLoRAAmxCols, kSumsBytes = kSumsCols * sizeof(float);
  alignas(64) float sums[kAmxRows * kSumsCols];
  for (int64_t c = 0; c < whole; c += kSlices) {
    const int64_t slices = std::min<int64_t>(kSlices, whole - c);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(6);
    for (int64_t g = 0; g < groups; ++g) {
      const BF16* bg = b + 2 * (g * (kLoRARankGroup / 2) * p.out + c * kLoRAAmxCols);
      _tile_loadd(3, t + g * kLoRARankGroup, t_bytes);
      _tile_loadd(4, bg, b_pair_bytes);
      _tile_dpbf16ps(0, 3, 4);
      if (slices > 1) {
        _tile_loadd(5, bg + 2 * kLoRAAmxCols, b_pair_bytes);
        _tile_dpbf16ps(1, 3, 5);
      }
      if (slices > 2) {
        _tile_loadd(7, bg + 4 * kLoRAAmxCols, b_pair_bytes);
        _tile_dpbf16ps(2, 3, 7);
      }
      if (slices > 3) {
        _tile_loadd(4, bg + 6 * kLoRAAmxCols, b_pair_bytes);
        _tile_dpbf16ps(6, 3, 4);
      }
    }
    _tile_stored(0, sums, kSumsBytes);
    _tile_stored(1, sums + kLoRAAmxCols, kSumsBytes);
    _tile_stored(2, sums + 2 * kLoRAAmxCols, kSumsBytes);
    _tile_stored(6, sums + 3 * kLoRAAmxCols, kSumsBytes);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t slice = 0; slice < slices; ++slice) {
        lora_finish_vec(p, y + r * p.y_stride + (c + slice) * kLoRAAmxCols,
                        Vec::load(sums + r * kSumsCols + slice * kLoRAAmxCols));
      }
    }
  }
  const int cols = static_cast<int>(p.out - whole * kLoRAAmxCols);
  if (cols == 0) return;
  const BF16* bt = b + 2 * whole * kLoRAAmxCols;
  for (int64_t r = 0; r < rows; ++r) {
    Vec acc = Vec::zero();
    for (int64_t i = 0; i < t_stride / 2; ++i) {
      acc = dot_pairs(BF16Pairs::broadcast_pair(t + r * t_stride + 2 * i), BF16Pairs::load_pairs(bt + 2 * i * p.out, cols), acc);
    }
    float lanes[Vec::N];
    acc.store(lanes);
    lora_finish(p, y + r * p.y_stride + whole * kLoRAAmxCols, lanes, cols);
  }
}

// scratch: a short block of x copied into 16 rows (kLoRATileRows * in floats hold them).
template <typename Y>
void lora_rows_bf16_as(const LoRAArgs& p, int64_t begin, int64_t end, const BF16* a, const BF16* b, int64_t rank,
                       float* scratch) {
  static_assert(kLoRATileRows * sizeof(float) >= kAmxRows * sizeof(BF16));
  const int64_t t_stride = (rank + kLoRARankGroup - 1) / kLoRARankGroup * kLoRARankGroup;
  alignas(64) BF16 t[kAmxRows * kMaxLoRARank];
  configure_lora_tiles();
  for (int64_t row = begin; row < end; row += kAmxRows) {
    const int64_t rows = std::min<int64_t>(kAmxRows, end - row);
    const BF16* x = static_cast<const BF16*>(p.x) + row * p.x_stride;
    int64_t x_stride = p.x_stride;
    if (rows < kAmxRows) {
      BF16* padded = reinterpret_cast<BF16*>(scratch);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(padded + r * p.in, x + r * p.x_stride, p.in * sizeof(BF16));
      x = padded;
      x_stride = p.in;
    }
    lora_shrink_amx(p, x, x_stride, rows, a, rank, t, t_stride);
    lora_expand_amx(p, static_cast<Y*>(p.y) + row * p.y_stride, rows, b, t, t_stride);
  }
  _tile_release();
}
#elif defined(BATCHGEN_DOT_BF16)
constexpr int kLoRABF16TileRows = 4;  // rows sharing each load of A and B (four chains or vectors a row)
constexpr int kLoRAExpandVecs = 4;    // output vectors an expand pass sums side by side

// t[row] = bf16(scale * x[row] A^T) for the tile's MR rows, the slot's first `groups` groups of ranks.
template <int MR>
inline void lora_shrink_bf16(const LoRAArgs& p, const BF16* const (&x)[MR], const BF16* a, int64_t groups,
                             BF16 (&t)[MR][kMaxLoRARank]) {
  const int64_t pairs = (p.in + 1) / 2, stride = 2 * p.rank;
  for (int64_t g = 0; g < groups; ++g) {
    const BF16* ag = a + g * 2 * kLoRARankGroup;
    Vec acc[MR][kLoRAChains];
    for (int m = 0; m < MR; ++m) {
      for (int c = 0; c < kLoRAChains; ++c) acc[m][c] = Vec::zero();
    }
    int64_t k = 0;
    for (; k + kLoRAChains <= p.in / 2; k += kLoRAChains) {
      for (int c = 0; c < kLoRAChains; ++c) {
        const BF16Pairs w = BF16Pairs::load(ag + (k + c) * stride, 32);
        for (int m = 0; m < MR; ++m) acc[m][c] = dot_pairs(BF16Pairs::broadcast_pair(x[m] + 2 * (k + c)), w, acc[m][c]);
      }
    }
    for (; k < pairs; ++k) {
      const BF16Pairs w = BF16Pairs::load(ag + k * stride, 32);
      for (int m = 0; m < MR; ++m) {
        const BF16Pairs xk{_mm512_set1_epi32(static_cast<int32_t>(lora_x_pair(x[m], k, p.in)))};
        acc[m][k % kLoRAChains] = dot_pairs(xk, w, acc[m][k % kLoRAChains]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const Vec sum = (acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]);
      store_bf16(Vec::set1(p.scale) * sum, t[m] + g * kLoRARankGroup);
    }
  }
}

// y[row] (+)= t[row] B^T for the tile's MR rows, over the slot's first `rank_pairs` pairs of ranks.
template <typename Y, int MR>
inline void lora_expand_bf16(const LoRAArgs& p, Y* const (&y)[MR], const BF16* b, int64_t rank_pairs,
                             const BF16 (&t)[MR][kMaxLoRARank]) {
  constexpr int V = kLoRAExpandVecs;
  for (int64_t o = 0; o < p.out; o += V * Vec::N) {
    int cols[V];
    for (int v = 0; v < V; ++v) cols[v] = static_cast<int>(std::clamp<int64_t>(p.out - o - v * Vec::N, 0, Vec::N));
    Vec acc[MR][V];
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < V; ++v) acc[m][v] = Vec::zero();
    }
    for (int64_t i = 0; i < rank_pairs; ++i) {
      const BF16* bi = b + 2 * (i * p.out + o);
      BF16Pairs w[V];
      for (int v = 0; v < V; ++v) w[v] = BF16Pairs::load_pairs(bi + 2 * v * Vec::N, cols[v]);
      for (int m = 0; m < MR; ++m) {
        const BF16Pairs ti = BF16Pairs::broadcast_pair(t[m] + 2 * i);
        for (int v = 0; v < V; ++v) acc[m][v] = dot_pairs(ti, w[v], acc[m][v]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < V && cols[v] > 0; ++v) {
        Y* out = y[m] + o + v * Vec::N;
        if (cols[v] == Vec::N) {
          lora_finish_vec(p, out, acc[m][v]);
        } else {
          float lanes[Vec::N];
          acc[m][v].store(lanes);
          lora_finish(p, out, lanes, cols[v]);
        }
      }
    }
  }
}

template <typename Y, int MR>
void lora_tile_bf16(const LoRAArgs& p, int64_t row, const BF16* a, const BF16* b, int64_t rank) {
  const BF16* x[MR];
  Y* y[MR];
  for (int m = 0; m < MR; ++m) {
    x[m] = static_cast<const BF16*>(p.x) + (row + m) * p.x_stride;
    y[m] = static_cast<Y*>(p.y) + (row + m) * p.y_stride;
  }
  BF16 t[MR][kMaxLoRARank];
  lora_shrink_bf16<MR>(p, x, a, (rank + kLoRARankGroup - 1) / kLoRARankGroup, t);
  if (rank % 2 != 0) {  // the last pair's partner is past the slot's rank
    for (int m = 0; m < MR; ++m) t[m][rank] = BF16{0};
  }
  lora_expand_bf16<Y, MR>(p, y, b, (rank + 1) / 2, t);
}

template <typename Y>
void lora_rows_bf16_as(const LoRAArgs& p, int64_t begin, int64_t end, const BF16* a, const BF16* b, int64_t rank,
                       float*) {
  using TileFn = void (*)(const LoRAArgs&, int64_t, const BF16*, const BF16*, int64_t);
  static constexpr TileFn kTiles[kLoRABF16TileRows + 1] = {nullptr, &lora_tile_bf16<Y, 1>, &lora_tile_bf16<Y, 2>,
                                                           &lora_tile_bf16<Y, 3>, &lora_tile_bf16<Y, 4>};
  static_assert(kLoRABF16TileRows == 4 && kLoRAChains == 4);
  for (int64_t row = begin; row < end; row += kLoRABF16TileRows) {
    kTiles[std::min<int64_t>(kLoRABF16TileRows, end - row)](p, row, a, b, rank);
  }
}
#else
// Without the bf16 dot product: the same sums a lane at a time, in the same order.
inline float lora_dot_pair(float acc, uint32_t x, uint32_t w) {
  acc += to_float(BF16{static_cast<uint16_t>(x >> 16)}) * to_float(BF16{static_cast<uint16_t>(w >> 16)});
  return acc + to_float(BF16{static_cast<uint16_t>(x)}) * to_float(BF16{static_cast<uint16_t>(w)});
}

template <typename Y>
void lora_rows_bf16_as(const LoRAArgs& p, int64_t begin, int64_t end, const BF16* a, const BF16* b, int64_t rank,
                       float*) {
  const int64_t pairs = (p.in + 1) / 2, groups = (rank + kLoRARankGroup - 1) / kLoRARankGroup;
  const uint32_t* aw = reinterpret_cast<const uint32_t*>(a);  // one word a pair
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(b);
  for (int64_t row = begin; row < end; ++row) {
    const BF16* x = static_cast<const BF16*>(p.x) + row * p.x_stride;
    Y* y = static_cast<Y*>(p.y) + row * p.y_stride;
    uint32_t t[kMaxLoRARank / 2];  // t's pairs of bf16
    for (int64_t r = 0; r < groups * kLoRARankGroup; ++r) {
      float chains[kLoRAChains] = {};
      for (int64_t k = 0; k < pairs; ++k) {
        chains[k % kLoRAChains] = lora_dot_pair(chains[k % kLoRAChains], lora_x_pair(x, k, p.in), aw[k * p.rank + r]);
      }
      const uint32_t bits =
          r < rank ? from_float<BF16>(p.scale * ((chains[0] + chains[1]) + (chains[2] + chains[3]))).bits : 0u;
      t[r / 2] = r % 2 == 0 ? bits : t[r / 2] | (bits << 16);
    }
    for (int64_t o = 0; o < p.out; ++o) {
      float sum = 0.0f;
      for (int64_t i = 0; i < (rank + 1) / 2; ++i) sum = lora_dot_pair(sum, t[i], bw[i * p.out + o]);
      lora_finish(p, y + o, &sum, 1);
    }
  }
}
#endif

// The bf16 form's rows [begin, end) of slot `slot`.
void lora_rows_bf16(const LoRAArgs& p, int64_t begin, int64_t end, int64_t slot, float* scratch) {
  const BF16* a = static_cast<const BF16*>(p.a) + slot * 2 * ((p.in + 1) / 2) * p.rank;
  const BF16* b = static_cast<const BF16*>(p.b) + slot * p.rank * p.out;
  const int64_t rank = p.ranks != nullptr ? p.ranks[slot] : p.rank;
  if (p.y_float) {
    lora_rows_bf16_as<float>(p, begin, end, a, b, rank, scratch);
  } else {
    lora_rows_bf16_as<BF16>(p, begin, end, a, b, rank, scratch);
  }
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
