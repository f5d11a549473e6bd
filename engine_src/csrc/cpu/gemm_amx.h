// The bf16 GEMM of gemm_impl.h on the AMX tile unit (the amx_bf16 kernel table): same panels, same
// epilogue, same contract. On processors with AMX the bf16 dot product of AVX512-BF16 is slow (this
// VM's Xeon: one instruction per two cycles, a quarter of its float32 FMA rate), and oneDNN's AMX GEMMs
// ran 3-10x faster than gemm_impl.h's loop, but round a row differently with the number of rows.
//
// A panel's [pairs][48][2] layout is already what a tile's B operand wants: 16 pairs of the depth
// by 16 columns are 16 rows of 64 bytes, 192 bytes apart. A block of 16 rows of x is the A operand
// as it lies in memory. Each output is summed in one order, 32 elements of the depth per tile step
// and then the odd pairs past the last whole step with the vector dot product, whatever the rows:
// a row's result does not depend on the other rows (the last block of a call reads a zero-padded
// copy of its rows).
#ifndef BATCHGEN_AMX
#error "gemm_amx.h is for the amx_bf16 kernel table"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/amx_tiles.h"
#include "cpu/gemm_impl.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int64_t kPanelRowBytes = 2 * kGemmPanelCols * static_cast<int64_t>(sizeof(BF16));  // one pair, 48 columns
// x's rows per pass over the panels (gemm_row_blocks): the tiles read x's blocks again for every
// panel, from L2 when the rows fit there beside the panel. 2,048 rows, best of 5 interleaved rounds,
// GFLOP/s for 576 x 960 / 576 x 3,072 / 1,536 x 576: 4 MiB of rows 1,147 / 1,111 / 1,563, 512 KiB
// 1,555 / 1,331 / 1,649 (1 MiB and 256 KiB about the same, 128 KiB worse).
constexpr int64_t kAmxRowBlockBytes = int64_t{512} << 10;

// sums[r][c] = x row r . panel column c over the depth's first `steps` tile steps (32 elements each),
// then the remaining pairs [steps * kAmxPairs, pairs) with the vector dot product. Tiles 0-2 hold the
// sums of the panel's three 16-column slices, 3 the block of x, 4-6 the slices of the panel's step.
inline void multiply_block(const BF16* x, int64_t x_stride, const BF16* panel, int64_t pairs, float* sums) {
  const int64_t steps = pairs / kAmxPairs;
  const int64_t x_bytes = x_stride * static_cast<int64_t>(sizeof(BF16));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t s = 0; s < steps; ++s) {
    const BF16* w = panel + s * kAmxPairs * 2 * kGemmPanelCols;
    _tile_loadd(3, x + s * 2 * kAmxPairs, x_bytes);
    _tile_loadd(4, w, kPanelRowBytes);
    _tile_loadd(5, w + 2 * Vec::N, kPanelRowBytes);
    _tile_loadd(6, w + 4 * Vec::N, kPanelRowBytes);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  constexpr int64_t kSumsRowBytes = kGemmPanelCols * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, sums, kSumsRowBytes);
  _tile_stored(1, sums + Vec::N, kSumsRowBytes);
  _tile_stored(2, sums + 2 * Vec::N, kSumsRowBytes);
  if (steps * kAmxPairs == pairs) return;
  for (int r = 0; r < kAmxRows; ++r) {
    Vec acc[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) acc[v] = Vec::load(sums + r * kGemmPanelCols + v * Vec::N);
    for (int64_t i = steps * kAmxPairs; i < pairs; ++i) {
      const BF16Pairs a = BF16Pairs::broadcast_pair(x + r * x_stride + 2 * i);
      for (int v = 0; v < kPanelVecs; ++v) {
        acc[v] = dot_pairs(a, BF16Pairs::load(panel + i * 2 * kGemmPanelCols + v * 2 * Vec::N, 2 * Vec::N), acc[v]);
      }
    }
    for (int v = 0; v < kPanelVecs; ++v) acc[v].store(sums + r * kGemmPanelCols + v * Vec::N);
  }
}

// Panels [panel_begin, panel_end) for every row, each panel through all the row blocks while it is
// in cache.
void gemm_panels_amx(const GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  const int64_t pairs = a.depth / 2;
  const int64_t panel_size = pairs * 2 * kGemmPanelCols;
  const int64_t whole = a.rows / kAmxRows * kAmxRows;  // rows in whole blocks
  std::vector<BF16> last_block;                        // the rest, zero-padded to a block
  if (whole < a.rows) {
    last_block.assign(kAmxRows * a.depth, BF16{});
    for (int64_t r = whole; r < a.rows; ++r) {
      std::memcpy(&last_block[(r - whole) * a.depth], a.x + r * a.x_stride, a.depth * sizeof(BF16));
    }
  }
  alignas(64) float sums[kAmxRows * kGemmPanelCols];
  alignas(64) float up_sums[kAmxRows * kGemmPanelCols];
  configure_tiles();
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int64_t col = panel * kGemmPanelCols;
    const int width = static_cast<int>(std::min<int64_t>(kGemmPanelCols, a.cols - col));
    for (int64_t row = 0; row < a.rows; row += kAmxRows) {
      const bool padded = row == whole;
      const BF16* x = padded ? last_block.data() : a.x + row * a.x_stride;
      const int64_t x_stride = padded ? a.depth : a.x_stride;
      multiply_block(x, x_stride, a.weight + panel * panel_size, pairs, sums);
      if (a.up != nullptr) multiply_block(x, x_stride, a.up + panel * panel_size, pairs, up_sums);
      const int64_t rows = std::min<int64_t>(kAmxRows, a.rows - row);
      for (int64_t r = 0; r < rows; ++r) {
        Vec acc[kPanelVecs], up[kPanelVecs];
        for (int v = 0; v < kPanelVecs; ++v) {
          acc[v] = Vec::load(sums + r * kGemmPanelCols + v * Vec::N);
          if (a.up != nullptr) up[v] = Vec::load(up_sums + r * kGemmPanelCols + v * Vec::N);
        }
        finish_row(a, row + r, col, width, acc, a.up != nullptr ? up : nullptr);
      }
    }
  }
  _tile_release();
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
