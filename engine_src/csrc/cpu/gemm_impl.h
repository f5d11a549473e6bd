// The bf16 GEMM of the linear layers (kernels.h: GemmArgs), for the AVX512-BF16 kernel table only.
//
// A tile of up to 8 rows x one 48-column panel keeps its 24 accumulators in registers while the
// panel streams through once, front to back; the next panel is prefetched meanwhile. At the row
// counts of decoding (16-64) oneDNN's packed GEMMs reach 55-60% of their large-batch rate with a
// model's weights coming from memory; this loop reaches 75-85% (engine_src/README.md has numbers).
//
// Every output element is the sum over the depth in one order, pair after pair, into one float32
// accumulator: a row's result never depends on how many rows the call has, on the tile it lands in
// or on the number of threads, so batch composition cannot change a sequence's logits.
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including gemm_impl.h"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int kGemmTileRows = 8;
constexpr int kPanelVecs = kGemmPanelCols / Vec::N;
static_assert(kPanelVecs * Vec::N == kGemmPanelCols);

template <int MR>
struct GemmTile {
  Vec acc[MR][kPanelVecs];
};

// t = x[0 .. MR) x panel^T over `pairs` pairs of the depth. With `prefetch` set, the same offsets
// of the next panel are requested as this one is read.
template <int MR>
inline void multiply_tile(const BF16* x, int64_t x_stride, const BF16* panel, int64_t pairs, const BF16* prefetch,
                          GemmTile<MR>& t) {
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) t.acc[r][v] = Vec::zero();
  }
  constexpr int64_t kPairStride = 2 * kGemmPanelCols;
  for (int64_t i = 0; i < pairs; ++i) {
    const BF16* w = panel + i * kPairStride;
    BF16Pairs b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) b[v] = BF16Pairs::load(w + v * 2 * Vec::N, 2 * Vec::N);
    if (prefetch != nullptr) {
      for (int v = 0; v < kPanelVecs; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * kPairStride + v * 2 * Vec::N), _MM_HINT_T1);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const BF16Pairs a = BF16Pairs::broadcast_pair(x + r * x_stride + 2 * i);
      for (int v = 0; v < kPanelVecs; ++v) t.acc[r][v] = dot_pairs(a, b[v], t.acc[r][v]);
    }
  }
}

// g * sigmoid(g), with exp only ever of -|g| (exp_nonpositive).
inline Vec silu(Vec g) {
  const __m512 e = exp_nonpositive(Vec{_mm512_abs_ps(g.v)} * Vec::set1(-1.0f)).v;
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  const __mmask16 negative = _mm512_cmp_ps_mask(g.v, _mm512_setzero_ps(), _CMP_LT_OQ);
  return {_mm512_mul_ps(g.v, _mm512_mask_mul_ps(inv, negative, inv, e))};
}

// Rows [row, row + MR) of the panel's `width` (<= kGemmPanelCols) real columns.
template <int MR>
void gemm_tile(const GemmArgs& a, int64_t row, int64_t panel, bool prefetch_next) {
  const int64_t pairs = a.depth / 2;
  const int64_t panel_size = pairs * 2 * kGemmPanelCols;
  const int64_t col = panel * kGemmPanelCols;
  const int width = static_cast<int>(std::min<int64_t>(kGemmPanelCols, a.cols - col));
  const BF16* x = a.x + row * a.x_stride;
  const BF16* weight = a.weight + panel * panel_size;
  GemmTile<MR> t;
  multiply_tile<MR>(x, a.x_stride, weight, pairs, prefetch_next ? weight + panel_size : nullptr, t);
  if (a.up != nullptr) {
    const BF16* up = a.up + panel * panel_size;
    GemmTile<MR> u;
    multiply_tile<MR>(x, a.x_stride, up, pairs, prefetch_next ? up + panel_size : nullptr, u);
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < kPanelVecs; ++v) t.acc[r][v] = silu(t.acc[r][v]) * u.acc[r][v];
    }
  } else if (a.bias != nullptr) {
    for (int v = 0; v < kPanelVecs; ++v) {
      const int count = std::clamp(width - v * Vec::N, 0, Vec::N);
      const Vec b{_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), a.bias + col + v * Vec::N)};
      for (int r = 0; r < MR; ++r) t.acc[r][v] = t.acc[r][v] + b;
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) {
      const int count = std::clamp(width - v * Vec::N, 0, Vec::N);
      const int64_t offset = (row + r) * a.out_stride + col + v * Vec::N;
      if (a.float_out) {
        _mm512_mask_storeu_ps(static_cast<float*>(a.out) + offset, static_cast<__mmask16>((1u << count) - 1u),
                              t.acc[r][v].v);
      } else if (count == Vec::N) {
        store_bf16(t.acc[r][v], static_cast<BF16*>(a.out) + offset);
      } else if (count > 0) {
        store_bf16(t.acc[r][v], static_cast<BF16*>(a.out) + offset, count);
      }
    }
  }
}

using GemmTileFn = void (*)(const GemmArgs&, int64_t, int64_t, bool);
constexpr GemmTileFn kGemmTiles[kGemmTileRows + 1] = {nullptr,        &gemm_tile<1>, &gemm_tile<2>,
                                                      &gemm_tile<3>,  &gemm_tile<4>, &gemm_tile<5>,
                                                      &gemm_tile<6>,  &gemm_tile<7>, &gemm_tile<8>};

void gemm_bf16(const GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const bool prefetch_next = panel + 1 < panel_end;
    for (int64_t row = 0; row < a.rows; row += kGemmTileRows) {
      const int64_t rows = std::min<int64_t>(kGemmTileRows, a.rows - row);
      kGemmTiles[rows](a, row, panel, prefetch_next && row == 0);
    }
  }
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
