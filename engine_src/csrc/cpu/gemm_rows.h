// What the bf16 GEMM loops of every kernel table share (gemm_impl.h on AVX-512, gemm_avx2.h, gemm_amx.h): x's
// rows as a tile reads them, widened to float32 where the loop widens the panels' pairs, the rows' epilogue, and
// the rows taken a block at a time.
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including gemm_rows.h"
#endif

#include <algorithm>
#include <cstdint>

#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

// x's rows as the tiles read them: T elements (bf16 for the dot product, float32 where the pairs are widened),
// rows `stride` elements apart.
template <typename T>
struct RowsOf {
  const T* x;
  int64_t stride;
};

// x widened to float32 (GemmArgs::x_wide, made once per call by gemm_ops.cpp), rows `depth` apart.
inline RowsOf<float> widened_rows(const GemmArgs& a) { return {a.x_wide, a.depth}; }

// Finishes one row of NV vectors of columns from col on, `width` of them real, from their float32 sums: the SiLU
// product with the up projection's sums (`up`, or nullptr), or the bias, then the store. Every loop ends its rows
// here, so the epilogue's order of operations, and with it the bits, is one.
template <int NV>
__attribute__((always_inline)) inline void finish_row(const GemmArgs& a, int64_t row, int64_t col, int width,
                                                      const Vec (&acc)[NV], const Vec* up) {
  for (int v = 0; v < NV; ++v) {
    const int count = std::clamp(width - v * Vec::N, 0, Vec::N);
    if (count == 0) break;
    Vec y = acc[v];
    if (a.addend != nullptr) {  // -0.0 where nothing is to be added: y then stays y, bit for bit
      const float* addend = a.addend + row * a.addend_stride + col + v * Vec::N;
      y = y + load_first(addend, count);
      if (up != nullptr) y = silu(y) * (up[v] + load_first(addend + a.cols, count));
    } else if (up != nullptr) {
      y = silu(y) * up[v];
    }
    if (up == nullptr && a.bias != nullptr) y = y + load_first(a.bias + col + v * Vec::N, count);
    const int64_t offset = row * a.out_stride + col + v * Vec::N;
    if (a.float_out) {
      store_first(y, static_cast<float*>(a.out) + offset, count);
    } else if (count == Vec::N) {
      store_bf16(y, static_cast<BF16*>(a.out) + offset);
    } else {
      store_bf16(y, static_cast<BF16*>(a.out) + offset, count);
    }
  }
}

// Rows in blocks of about BlockBytes of x, each through every panel of the range (`Panels`) before the next: x
// then stays in cache while the panels pass. Without the blocks, an x larger than the cache (2,048 rows x 8,192)
// came from memory again for every panel: 858 instead of 966 GFLOP/s. Where x is widened, half as many bytes of
// bf16 rows a block (`kWidenedRowBlockBytes`), so that the float32 copy takes the same room.
constexpr int64_t kRowBlockBytes = int64_t{4} << 20;
constexpr int64_t kWidenedRowBlockBytes = kRowBlockBytes / 2;

template <GemmFn Panels, int64_t BlockBytes>
void gemm_row_blocks(const GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  const int64_t row_bytes = a.depth * static_cast<int64_t>(sizeof(BF16));
  const int64_t block = std::max<int64_t>(1, BlockBytes / row_bytes / kGemmTileRows) * kGemmTileRows;
  for (int64_t first = 0; first < a.rows; first += block) {
    Panels(gemm_rows(a, first, std::min(block, a.rows - first)), panel_begin, panel_end);
  }
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
