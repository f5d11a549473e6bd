// The segmented LoRA kernel (kernels.h: LoRAArgs), compiled once per instruction set by
// kernel_table_impl.h. A row's shrink t = scale * x A^T is `rank` dot products along the input, each
// summed lane-wise then reduced; its expand walks the output columns a vector at a time, adding t[r] *
// B^T[r] rank by rank. Tiles of up to kLoRATileRows rows share each load of A and B; every row still runs
// the same operations in the same order as alone (batch invariance, tests/test_lora_kernels.py).
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including lora_impl.h"
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/dtype.h"
#include "cpu/kernels.h"

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
  const float* a = p.a + slot * p.rank * p.in;
  const float* b = p.b + slot * p.rank * p.out;
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

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
