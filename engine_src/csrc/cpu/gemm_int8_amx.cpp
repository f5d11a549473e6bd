// The int8 GEMM on AMX tiles (tdpbusd; gemm_int8.h), called only where the processor has AMX-INT8
// (gemm_int8.cpp).
//
// A panel's [depth / 4][48][4] bytes are already what a tile's B operand wants: 16 groups of 4 depth
// elements by 16 columns are 16 rows of 64 bytes, 192 bytes apart. A block of 16 rows of x is the A
// operand as it lies in memory (the last block of a call reads a zero-padded copy of its rows). Tiles
// 0-2 hold the int32 sums of the panel's three 16-column slices, 3 the block of x, 4-6 the slices.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/gemm_int8.h"
#include "cpu/kernels.h"

#ifdef BATCHGEN_HAVE_AVX512
#define BATCHGEN_INT8_TARGET "avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-int8"
#include "cpu/int8_target_begin.inc"
#define BATCHGEN_ISA_NS int8_amx
#define BATCHGEN_AMX 1
#include "cpu/amx_tiles.h"

namespace batchgen::cpu::int8_amx {
namespace {

constexpr int64_t kPanelRowBytes = kInt8PanelCols * kInt8GroupBytes;
constexpr int kSliceCols = 16;
static_assert(kAmxRows == kInt8BlockRows && 3 * kSliceCols == kInt8PanelCols);

void multiply_block(const uint8_t* x, int64_t x_stride, const int8_t* panel, int64_t steps, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* w = panel + s * (kInt8DepthStep / kInt8GroupBytes) * kPanelRowBytes;
    _tile_loadd(3, x + s * kInt8DepthStep, x_stride);
    _tile_loadd(4, w, kPanelRowBytes);
    _tile_loadd(5, w + kSliceCols * kInt8GroupBytes, kPanelRowBytes);
    _tile_loadd(6, w + 2 * kSliceCols * kInt8GroupBytes, kPanelRowBytes);
    _tile_dpbusd(0, 3, 4);
    _tile_dpbusd(1, 3, 5);
    _tile_dpbusd(2, 3, 6);
  }
  constexpr int64_t kSumsRowBytes = kInt8PanelCols * static_cast<int64_t>(sizeof(int32_t));
  _tile_stored(0, sums, kSumsRowBytes);
  _tile_stored(1, sums + kSliceCols, kSumsRowBytes);
  _tile_stored(2, sums + 2 * kSliceCols, kSumsRowBytes);
}

}  // namespace

void gemm_int8(const Int8GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  const int64_t steps = a.depth / kInt8DepthStep;
  const int64_t panel_bytes = a.depth * kInt8PanelCols;
  const int64_t whole = a.rows / kAmxRows * kAmxRows;  // rows in whole blocks
  std::vector<uint8_t> last_block;                     // the rest, zero-padded to a block
  if (whole < a.rows) {
    last_block.assign(kAmxRows * a.depth, uint8_t{0});
    for (int64_t r = whole; r < a.rows; ++r) {
      std::memcpy(&last_block[(r - whole) * a.depth], a.x + r * a.x_stride, a.depth);
    }
  }
  alignas(64) int32_t sums[kInt8BlockRows * kInt8PanelCols];
  configure_tiles();
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    for (int64_t row = 0; row < a.rows; row += kAmxRows) {
      const bool padded = row == whole;
      const uint8_t* x = padded ? last_block.data() : a.x + row * a.x_stride;
      multiply_block(x, padded ? a.depth : a.x_stride, a.weight + panel * panel_bytes, steps, sums);
      finish_int8_rows(a, row, std::min<int64_t>(kAmxRows, a.rows - row), panel * kInt8PanelCols, sums, true);
    }
  }
  _tile_release();
}

}  // namespace batchgen::cpu::int8_amx

#include "cpu/int8_target_end.inc"
#endif
