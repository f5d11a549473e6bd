// The bf16 GEMM of the linear layers (kernels.h: GemmArgs) on AVX2, for processors without AVX-512 (AMD Zen 2
// and Zen 3: AWS c5a/c6a, GCP n2d). The weights stay bf16 in the same panels as on AVX-512, where a float32 copy
// for oneDNN took twice their memory.
//
// The panels' pairs are widened in registers, each bf16 a float's high half (a shift and a mask), and x's rows are
// widened to float32 once per call (gemm_ops.cpp): two float32 FMAs a pair, the even element's product first, as
// the avx512 table's loop does (gemm_impl.h), so every output has the same bits under both. Sixteen ymm registers
// hold a tile of 4 rows x 16 columns (8 accumulators), the pair's 4 widened vectors and one broadcast x: a
// 48-column panel is three such column strips, each streaming its 64 bytes a pair.
//
// Every output element is the sum over the depth in one order, pair after pair, into one float32 accumulator: a
// row's result never depends on how many rows the call has, on the tile it lands in or on the number of threads.
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including gemm_avx2.h"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/gemm_rows.h"
#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int kStripCols = 2 * Vec::N;  // a tile's columns
constexpr int kPanelStrips = kGemmPanelCols / kStripCols;
constexpr int kStripTileRows = 4;
constexpr bool kGemmWidensBF16 = true;
static_assert(kPanelStrips * kStripCols == kGemmPanelCols);
static_assert(kGemmTileRows % kStripTileRows == 0);

template <int MR>
struct StripTile {
  Vec acc[MR][2];
};

// Lines a pass requests while it reads its own: `count` of them from `lines` on, one a pair.
struct LinePrefetch {
  const char* lines;
  int64_t count;
};

// t (+)= x[0 .. MR) x strip^T over `pairs` pairs of the depth: from zero, or with `resume` from t's sums (the
// depth's earlier blocks, see gemm_strips). `strip` is the strip's first pair, its pairs a panel's row
// (2 * kGemmPanelCols elements) apart. With Prefetch, pair i also requests prefetch's line i.
template <int MR, bool Prefetch>
inline void multiply_strip(const float* x, int64_t x_stride, const BF16* strip, int64_t pairs, LinePrefetch prefetch,
                           bool resume, StripTile<MR>& t) {
  // The sums in locals, copied in and out once: summed into t's members, GCC stored all eight every pair.
  Vec acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = resume ? t.acc[r][0] : Vec::zero();
    acc[r][1] = resume ? t.acc[r][1] : Vec::zero();
  }
  const __m256i high_halves = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t i = 0; i < pairs; ++i) {
    const BF16* pair = strip + i * 2 * kGemmPanelCols;
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 2 * Vec::N));
    const Vec even0{_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16))};
    const Vec odd0{_mm256_castsi256_ps(_mm256_and_si256(w0, high_halves))};
    const Vec even1{_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
    const Vec odd1{_mm256_castsi256_ps(_mm256_and_si256(w1, high_halves))};
    if constexpr (Prefetch) {
      if (i < prefetch.count) _mm_prefetch(prefetch.lines + 64 * i, _MM_HINT_T0);
    }
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * x_stride + 2 * i;
      const Vec first = Vec::set1(xr[0]);
      acc[r][0] = fma(first, even0, acc[r][0]);
      acc[r][1] = fma(first, even1, acc[r][1]);
      const Vec second = Vec::set1(xr[1]);
      acc[r][0] = fma(second, odd0, acc[r][0]);
      acc[r][1] = fma(second, odd1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) t.acc[r][0] = acc[r][0], t.acc[r][1] = acc[r][1];
}

// The pairs of the depth a pass over a panel takes at a time: 192 KB of a panel, which stays in L2 (512 KB a core
// on Zen 2) while the row tiles pass. A deeper panel came from L3 again for every row tile: 14,336 deep, 256 rows,
// 0.81x oneDNN's float32 rate on Zen 4 (1 MB of L2).
constexpr int64_t kDepthBlockPairs = 1024;

// One pass: pairs [first, first + count) of a panel, for the rows of a tile.
struct DepthBlock {
  int64_t first, count;
  bool resume;  // the sums so far are in `partial`, not zero
  bool last;    // finish the rows; otherwise leave the sums in `partial`
};

// t (+)= one strip of the block of `matrix`'s panel (its first element at `panel`), as multiply_strip; the first
// tile's strip s requests lines [s * count, (s + 1) * count) of `next` (three strips: as many lines as pairs).
template <int MR>
inline void multiply_block(const float* x, int64_t x_stride, const BF16* panel, int strip, const DepthBlock& block,
                           LinePrefetch next, StripTile<MR>& t) {
  const BF16* first = panel + block.first * 2 * kGemmPanelCols + strip * 2 * kStripCols;
  const float* xb = x + 2 * block.first;
  if (next.lines == nullptr) {
    multiply_strip<MR, false>(xb, x_stride, first, block.count, next, block.resume, t);
  } else {
    const int64_t skip = strip * block.count;
    const LinePrefetch mine{next.lines + 64 * skip, std::clamp<int64_t>(next.count - skip, 0, block.count)};
    multiply_strip<MR, true>(xb, x_stride, first, block.count, mine, block.resume, t);
  }
}

// Sums carried between a panel's depth blocks: per row, the weight's 48 columns, then the up projection's 48.
inline void keep_sums(float* partial, int64_t row, int strip, int mr, const Vec (*acc)[2]) {
  for (int r = 0; r < mr; ++r) {
    float* p = partial + (row + r) * 2 * kGemmPanelCols + strip * kStripCols;
    acc[r][0].store(p);
    acc[r][1].store(p + Vec::N);
  }
}
inline void take_sums(const float* partial, int64_t row, int strip, int mr, Vec (*acc)[2]) {
  for (int r = 0; r < mr; ++r) {
    const float* p = partial + (row + r) * 2 * kGemmPanelCols + strip * kStripCols;
    acc[r][0] = Vec::load(p);
    acc[r][1] = Vec::load(p + Vec::N);
  }
}

// Rows [row, row + MR) of a panel's depth block, strip by strip. `partial`: the sums between blocks (rows of
// 2 * kGemmPanelCols floats, row 0 the call's first). `next`, `next_up`: lines to request (the first tile's).
template <int MR>
void panel_tile(const GemmArgs& a, RowsOf<float> x_rows, int64_t row, int64_t panel, const DepthBlock& block,
                float* partial, LinePrefetch next, LinePrefetch next_up) {
  const int64_t panel_size = (a.depth / 2) * 2 * kGemmPanelCols;
  const float* x = x_rows.x + row * x_rows.stride;
  for (int strip = 0; strip < kPanelStrips; ++strip) {
    const int64_t col = panel * kGemmPanelCols + strip * kStripCols;
    if (col >= a.cols) break;  // padding columns only
    const int width = static_cast<int>(std::min<int64_t>(kStripCols, a.cols - col));
    StripTile<MR> t, u;
    if (block.resume) take_sums(partial, row, strip, MR, t.acc);
    multiply_block<MR>(x, x_rows.stride, a.weight + panel * panel_size, strip, block, next, t);
    if (a.up != nullptr) {
      if (block.resume) take_sums(partial + kGemmPanelCols, row, strip, MR, u.acc);
      multiply_block<MR>(x, x_rows.stride, a.up + panel * panel_size, strip, block, next_up, u);
    }
    if (!block.last) {
      keep_sums(partial, row, strip, MR, t.acc);
      if (a.up != nullptr) keep_sums(partial + kGemmPanelCols, row, strip, MR, u.acc);
      continue;
    }
    for (int r = 0; r < MR; ++r) {
      finish_row(a, row + r, col, width, t.acc[r], a.up != nullptr ? u.acc[r] : nullptr);
    }
  }
}

using PanelTileFn = void (*)(const GemmArgs&, RowsOf<float>, int64_t, int64_t, const DepthBlock&, float*,
                             LinePrefetch, LinePrefetch);
constexpr PanelTileFn kPanelTiles[kStripTileRows + 1] = {nullptr, &panel_tile<1>, &panel_tile<2>, &panel_tile<3>,
                                                         &panel_tile<4>};

// Panels [panel_begin, panel_end) for every row, each a depth block at a time: a block's row tiles in turn, each
// through the panel's strips, so the block stays in cache while the tiles pass and a tile's rows of x while its
// strips do. The first tile requests the next block's lines (the same panel's, or the next panel's first), one a
// pair, so that they come from memory while this block's arithmetic runs. 30 SmolLM2 layers' projections, each
// weight from memory, on Zen 4 with AVX2 only: 1 row 9.0 ms with the requests, 14.1 without; 16 rows 23.5 and
// 28.4. Carrying the sums between blocks in memory changes no bit: each is still one float32 accumulator, pair
// after pair.
inline void gemm_strips(const GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  const RowsOf<float> x_rows = widened_rows(a);
  const int64_t pairs = a.depth / 2;
  const int64_t panel_size = pairs * 2 * kGemmPanelCols;
  thread_local std::vector<float> partial;
  if (pairs > kDepthBlockPairs) partial.resize(static_cast<size_t>(a.rows * 2 * kGemmPanelCols));
  // The lines of `matrix`'s block starting at pair `first` of `panel` (3 a pair), if the call reads it.
  auto lines_of = [&](const BF16* matrix, int64_t panel, int64_t first) {
    if (matrix == nullptr || panel >= panel_end) return LinePrefetch{nullptr, 0};
    const BF16* start = matrix + panel * panel_size + first * 2 * kGemmPanelCols;
    return LinePrefetch{reinterpret_cast<const char*>(start), kPanelStrips * std::min(kDepthBlockPairs, pairs - first)};
  };
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    for (int64_t first = 0; first < pairs; first += kDepthBlockPairs) {
      const DepthBlock block{first, std::min(kDepthBlockPairs, pairs - first), first > 0,
                             first + kDepthBlockPairs >= pairs};
      const int64_t next_panel = block.last ? panel + 1 : panel, next_first = block.last ? 0 : first + block.count;
      const LinePrefetch next = lines_of(a.weight, next_panel, next_first);
      const LinePrefetch next_up = lines_of(a.up, next_panel, next_first);
      for (int64_t row = 0; row < a.rows; row += kStripTileRows) {
        const bool lead = row == 0;
        kPanelTiles[std::min<int64_t>(kStripTileRows, a.rows - row)](
            a, x_rows, row, panel, block, partial.data(), lead ? next : LinePrefetch{nullptr, 0},
            lead ? next_up : LinePrefetch{nullptr, 0});
      }
    }
  }
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
