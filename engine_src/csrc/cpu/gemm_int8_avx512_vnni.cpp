// The int8 GEMM on AVX512-VNNI (gemm_int8.h), called only where the processor has it (gemm_int8_ops.cpp).
//
// A tile of up to 4 rows x one panel (48 columns, three vectors of 16 sums) keeps its 12 sums in
// registers while the panel streams through once; one vpdpbusd adds 4 products of the depth to each sum.
// Not 8 rows as the bf16 GEMM's tiles: GCC 12 keeps a 6-8-row tile's sums in registers but also stores
// them to the stack at every step of the depth, which made the loop 0.9x the bf16 GEMM instead of faster.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/gemm_int8.h"
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_INT8_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#include "cpu/int8_target_begin.inc"

namespace batchgen::cpu::int8_avx512_vnni {
namespace {

constexpr int kLanes = 16;
constexpr int kPanelVecs = kInt8PanelCols / kLanes;
constexpr int kTileRows = 4;
static_assert(kPanelVecs * kLanes == kInt8PanelCols && kInt8BlockRows % kTileRows == 0);

template <int MR>
void multiply_tile(const uint8_t* x, int64_t x_stride, const int8_t* w, int64_t groups, int32_t* sums) {
  __m512i acc[MR][kPanelVecs];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) {
      b[v] = _mm512_loadu_si512(w + (g * kInt8PanelCols + v * kLanes) * kInt8GroupBytes);
    }
    for (int r = 0; r < MR; ++r) {
      int32_t group;
      std::memcpy(&group, x + r * x_stride + g * kInt8GroupBytes, sizeof group);
      const __m512i a = _mm512_set1_epi32(group);
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) _mm512_storeu_si512(sums + r * kInt8PanelCols + v * kLanes, acc[r][v]);
  }
}

using MultiplyTileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t*);
constexpr MultiplyTileFn kTiles[kTileRows + 1] = {nullptr, &multiply_tile<1>, &multiply_tile<2>, &multiply_tile<3>,
                                                  &multiply_tile<4>};

}  // namespace

void gemm_int8(const Int8GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  const int64_t groups = a.depth / kInt8GroupBytes;
  const int64_t panel_bytes = groups * kInt8PanelCols * kInt8GroupBytes;
  alignas(64) int32_t sums[kInt8BlockRows * kInt8PanelCols];
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int8_t* w = a.weight + panel * panel_bytes;
    for (int64_t row = 0; row < a.rows; row += kInt8BlockRows) {
      const int64_t count = std::min<int64_t>(kInt8BlockRows, a.rows - row);
      for (int64_t r = 0; r < count; r += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, count - r));
        kTiles[rows](a.x + (row + r) * a.x_stride, a.x_stride, w, groups, sums + r * kInt8PanelCols);
      }
      a.finish(a, row, count, panel * kInt8PanelCols, sums, true);
    }
  }
}

}  // namespace batchgen::cpu::int8_avx512_vnni

#include "cpu/int8_target_end.inc"
#endif
