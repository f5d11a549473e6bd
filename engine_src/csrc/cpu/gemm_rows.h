// What the bf16 GEMM loops of every kernel table share (gemm_impl.h on AVX-512, gemm_avx2.h, gemm_amx.h): x's
// rows as a tile reads them, widened to float32 where the loop widens the panels' pairs, and the rows taken a
// block at a time.
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including gemm_rows.h"
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

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

// x widened to float32, in a buffer of the calling thread's, rows `depth` apart: once per call, not once per panel.
inline RowsOf<float> widened_rows(const GemmArgs& a) {
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(a.rows * a.depth));
  for (int64_t r = 0; r < a.rows; ++r) {
    const BF16* src = a.x + r * a.x_stride;
    float* dst = widened.data() + r * a.depth;
    int64_t k = 0;
    for (; k + Vec::N <= a.depth; k += Vec::N) Vec::load(src + k).store(dst + k);
    for (; k < a.depth; ++k) dst[k] = to_float(src[k]);
  }
  return {widened.data(), a.depth};
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
