// The int8 GEMM in plain C++: the reference loop, on every processor (gemm_int8.h).
#include <algorithm>
#include <cstdint>

#include "cpu/gemm_int8.h"

namespace batchgen::cpu::int8_scalar {

void gemm_int8(const Int8GemmArgs& a, int64_t panel_begin, int64_t panel_end) {
  const int64_t groups = a.depth / kInt8GroupBytes;
  const int64_t panel_bytes = groups * kInt8PanelCols * kInt8GroupBytes;
  int32_t sums[kInt8BlockRows * kInt8PanelCols];
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int8_t* w = a.weight + panel * panel_bytes;
    for (int64_t row = 0; row < a.rows; row += kInt8BlockRows) {
      const int64_t count = std::min<int64_t>(kInt8BlockRows, a.rows - row);
      for (int64_t r = 0; r < count; ++r) {
        const uint8_t* x = a.x + (row + r) * a.x_stride;
        for (int c = 0; c < kInt8PanelCols; ++c) {
          int32_t acc = 0;
          for (int64_t g = 0; g < groups; ++g) {
            for (int j = 0; j < kInt8GroupBytes; ++j) {
              const int32_t q = int32_t{x[g * kInt8GroupBytes + j]} - kInt8ZeroPoint;
              acc += q * w[(g * kInt8PanelCols + c) * kInt8GroupBytes + j];
            }
          }
          sums[r * kInt8PanelCols + c] = acc;
        }
      }
      a.finish(a, row, count, panel * kInt8PanelCols, sums, false);
    }
  }
}

}  // namespace batchgen::cpu::int8_scalar
