// The segmented LoRA kernel (kernels.h: LoRAArgs), compiled once per instruction set by
// kernel_table_impl.h. A row's shrink t = scale * x A^T is `rank` dot products along the input, each
// summed lane-wise then reduced; its expand walks the output columns a vector at a time, adding t[r] *
// B^T[r] rank by rank. Tiles of kLoRATileRows rows share each load of A and B; every row still runs the
// same operations in the same order as alone (batch invariance, tests/test_lora_kernels.py).
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including lora_impl.h"
#endif

#include <cstdint>

#include "cpu/dtype.h"
#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int kLoRATileRows = 4;

// t[row][r] = scale * sum_k x[row][k] a[r][k] for the tile's MR rows.
template <typename T, int MR>
inline void lora_shrink(const LoRAArgs& p, const T* const (&x)[MR], const float* a, int64_t rank,
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
      for (int64_t k = whole; k < p.in; ++k) sum += to_float(x[m][k]) * ar[k];
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
    for (int m = 0; m < MR; ++m) {
      float sums[Vec::N];
      acc[m].store(sums);
      lora_finish(p, y[m] + o, sums, Vec::N);
    }
  }
  for (int64_t o = whole; o < p.out; ++o) {
    for (int m = 0; m < MR; ++m) {
      float sum = 0.0f;
      for (int64_t r = 0; r < rank; ++r) sum += t[m][r] * b[r * p.out + o];
      lora_finish(p, y[m] + o, &sum, 1);
    }
  }
}

template <typename T, typename Y, int MR>
void lora_tile(const LoRAArgs& p, int64_t row, const float* a, const float* b, int64_t rank) {
  const T* x[MR];
  Y* y[MR];
  for (int m = 0; m < MR; ++m) {
    x[m] = static_cast<const T*>(p.x) + (row + m) * p.x_stride;
    y[m] = static_cast<Y*>(p.y) + (row + m) * p.y_stride;
  }
  float t[MR][kMaxLoRARank];
  lora_shrink<T, MR>(p, x, a, rank, t);
  lora_expand<Y, MR>(p, y, b, rank, t);
}

template <typename T, typename Y>
void lora_rows_as(const LoRAArgs& p, int64_t begin, int64_t end, int64_t slot) {
  const float* a = p.a + slot * p.rank * p.in;
  const float* b = p.b + slot * p.rank * p.out;
  const int64_t rank = p.ranks != nullptr ? p.ranks[slot] : p.rank;
  int64_t row = begin;
  for (; row + kLoRATileRows <= end; row += kLoRATileRows) lora_tile<T, Y, kLoRATileRows>(p, row, a, b, rank);
  for (; row < end; ++row) lora_tile<T, Y, 1>(p, row, a, b, rank);
}

template <typename T>
void lora_rows(const LoRAArgs& p, int64_t begin, int64_t end, int64_t slot) {
  if (p.y_float) {
    lora_rows_as<T, float>(p, begin, end, slot);
  } else {
    lora_rows_as<T, T>(p, begin, end, slot);
  }
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
