// The bf16 GEMM of the linear layers (kernels.h: GemmArgs), for the AVX-512 kernel tables.
//
// A tile of up to 8 rows x one 48-column panel keeps its 24 accumulators in registers while the
// panel streams through once, front to back; the tiles of a panel prefetch the next one meanwhile.
// SmolLM2's 30 layers' projections with every weight from memory (bf16, 2 threads): 40 rows 10.3
// ms (830 GFLOP/s) where oneDNN's packed GEMMs take 15.3 (550), 16 rows 6.3 vs 9.9, 1024 rows 223
// vs 228. Decoding's small batches were where oneDNN lost most: 58% of its large-batch rate at 40
// rows, this loop 85%.
//
// With AVX512-BF16 each pair of the depth is one bf16 dot product. Without it (the avx512 table: Intel's
// Skylake-SP, Cascade Lake and Ice Lake Xeons) the panel's pairs are widened in registers, each bf16 a float's
// high half, and x's rows are widened to float32 once per call: two float32 FMAs a pair, the even element's
// product first. oneDNN, which took these weights before, emulates bf16 there at a third of its float32 rate.
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

#include "cpu/gemm_rows.h"
#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int kPanelVecs = kGemmPanelCols / Vec::N;
static_assert(kPanelVecs * Vec::N == kGemmPanelCols);

template <int MR>
struct GemmTile {
  Vec acc[MR][kPanelVecs];
};

// A row tile's share of the next panel's lines, requested while it reads its own panel: the tiles of
// a panel split the next one between them, so the requests spread over the whole panel's time
// (requested all during the first tile, many were dropped: 40 rows, 9.2 instead of 11.4 ms for 30
// layers). PF lines per pair of the depth, from `lines` on, in the first `pairs` pairs.
struct PanelPrefetch {
  const char* lines;
  int64_t pairs;
};

// One pair of the depth of a panel, its kPanelVecs vectors as the tile's products take them, and x's rows as
// those products read them (XRow): bf16 for the dot product, float32 where the pairs are widened.
#ifdef BATCHGEN_DOT_BF16
using XRow = BF16;
struct PanelPair {
  BF16Pairs w[kPanelVecs];

  explicit PanelPair(const BF16* pair) {
    for (int v = 0; v < kPanelVecs; ++v) w[v] = BF16Pairs::load(pair + v * 2 * Vec::N, 2 * Vec::N);
  }
  // acc[v] += the pair x[0], x[1] of one row times the panel's pair, column by column.
  void accumulate(const BF16* x, Vec (&acc)[kPanelVecs]) const {
    const BF16Pairs a = BF16Pairs::broadcast_pair(x);
    for (int v = 0; v < kPanelVecs; ++v) acc[v] = dot_pairs(a, w[v], acc[v]);
  }
};
#else
using XRow = float;
struct PanelPair {
  Vec even[kPanelVecs], odd[kPanelVecs];

  explicit PanelPair(const BF16* pair) {
    const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int v = 0; v < kPanelVecs; ++v) {
      const __m512i pairs = _mm512_loadu_si512(pair + v * 2 * Vec::N);
      even[v] = {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16))};
      odd[v] = {_mm512_castsi512_ps(_mm512_and_si512(pairs, high_halves))};
    }
  }
  void accumulate(const float* x, Vec (&acc)[kPanelVecs]) const {
    const Vec first = Vec::set1(x[0]), second = Vec::set1(x[1]);
    for (int v = 0; v < kPanelVecs; ++v) acc[v] = fma(second, odd[v], fma(first, even[v], acc[v]));
  }
};
#endif

// t = x[0 .. MR) x panel^T over `pairs` pairs of the depth. The prefetch's count of lines per pair is
// a template parameter: loop variables of its own cost registers, and the compiler then spilled the
// panel's operands (1.5x slower).
template <int MR, int PF>
inline void multiply_tile(const XRow* x, int64_t x_stride, const BF16* panel, int64_t pairs, PanelPrefetch prefetch,
                          GemmTile<MR>& t) {
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) t.acc[r][v] = Vec::zero();
  }
  constexpr int64_t kPairStride = 2 * kGemmPanelCols;
  for (int64_t i = 0; i < pairs; ++i) {
    const PanelPair w(panel + i * kPairStride);
    if (i < prefetch.pairs) {
      for (int j = 0; j < PF; ++j) _mm_prefetch(prefetch.lines + 64 * (PF * i + j), _MM_HINT_T0);
    }
    for (int r = 0; r < MR; ++r) w.accumulate(x + r * x_stride + 2 * i, t.acc[r]);
  }
}

template <int MR>
inline void multiply_tile(const XRow* x, int64_t x_stride, const BF16* panel, int64_t pairs, int lines_per_pair,
                          PanelPrefetch prefetch, GemmTile<MR>& t) {
  if (lines_per_pair == 1) {
    multiply_tile<MR, 1>(x, x_stride, panel, pairs, prefetch, t);
  } else if (lines_per_pair == 2) {
    multiply_tile<MR, 2>(x, x_stride, panel, pairs, prefetch, t);
  } else {
    multiply_tile<MR, 3>(x, x_stride, panel, pairs, prefetch, t);
  }
}

using TileRows = RowsOf<XRow>;

#ifdef BATCHGEN_DOT_BF16
constexpr bool kGemmWidensBF16 = false;
// The rows as the tiles read them: x itself.
inline TileRows tile_rows(const GemmArgs& a) { return {a.x, a.x_stride}; }
#else
constexpr bool kGemmWidensBF16 = true;
// The rows as the tiles read them: x widened to float32 once per call (gemm_ops.cpp).
inline TileRows tile_rows(const GemmArgs& a) { return widened_rows(a); }
#endif

// Rows [row, row + MR) of a panel. The tile requests the next panel's lines [first_line, first_line +
// line_count), lines_per_pair at a time.
template <int MR>
void gemm_tile(const GemmArgs& a, TileRows x_rows, int64_t row, int64_t panel, int64_t first_line,
               int64_t line_count, int lines_per_pair) {
  const int64_t pairs = a.depth / 2;
  const int64_t panel_size = pairs * 2 * kGemmPanelCols;
  const int64_t col = panel * kGemmPanelCols;
  const int width = static_cast<int>(std::min<int64_t>(kGemmPanelCols, a.cols - col));
  const XRow* x = x_rows.x + row * x_rows.stride;
  const BF16* weight = a.weight + panel * panel_size;
  auto next_of = [&](const BF16* current) {
    return PanelPrefetch{reinterpret_cast<const char*>(current + panel_size) + 64 * first_line,
                         (line_count + lines_per_pair - 1) / lines_per_pair};
  };
  GemmTile<MR> t;
  multiply_tile<MR>(x, x_rows.stride, weight, pairs, lines_per_pair, next_of(weight), t);
  if (a.up != nullptr) {
    GemmTile<MR> u;
    const BF16* up = a.up + panel * panel_size;
    multiply_tile<MR>(x, x_rows.stride, up, pairs, lines_per_pair, next_of(up), u);
    for (int r = 0; r < MR; ++r) finish_row(a, row + r, col, width, t.acc[r], u.acc[r]);
  } else {
    for (int r = 0; r < MR; ++r) finish_row(a, row + r, col, width, t.acc[r], nullptr);
  }
}

using GemmTileFn = void (*)(const GemmArgs&, TileRows, int64_t, int64_t, int64_t, int64_t, int);
constexpr GemmTileFn kGemmTiles[kGemmTileRows + 1] = {nullptr,        &gemm_tile<1>, &gemm_tile<2>,
                                                      &gemm_tile<3>,  &gemm_tile<4>, &gemm_tile<5>,
                                                      &gemm_tile<6>,  &gemm_tile<7>, &gemm_tile<8>};

inline void gemm_panels(const GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  const TileRows x_rows = tile_rows(a);
  constexpr int64_t kLinesPerPair = 2 * kGemmPanelCols * static_cast<int64_t>(sizeof(BF16)) / 64;
  const int64_t tiles = (a.rows + kGemmTileRows - 1) / kGemmTileRows;
  const int64_t pairs = a.depth / 2;
  const int64_t panel_lines = pairs * kLinesPerPair;
  const int64_t share = (panel_lines + tiles - 1) / tiles;
  const int lines_per_pair = static_cast<int>(std::min<int64_t>(kLinesPerPair, (share + pairs - 1) / pairs));
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const bool prefetch_next = panel + 1 < panel_end;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t row = tile * kGemmTileRows, rows = std::min<int64_t>(kGemmTileRows, a.rows - row);
      const int64_t first = tile * share;
      const int64_t count = prefetch_next ? std::clamp<int64_t>(panel_lines - first, 0, share) : 0;
      kGemmTiles[rows](a, x_rows, row, panel, first, count, lines_per_pair);
    }
  }
}

// x's bytes a block of rows takes through the panels (gemm_rows.h's gemm_row_blocks).
#ifdef BATCHGEN_DOT_BF16
constexpr int64_t kPanelRowBlockBytes = kRowBlockBytes;
#else
constexpr int64_t kPanelRowBlockBytes = kWidenedRowBlockBytes;
#endif

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
