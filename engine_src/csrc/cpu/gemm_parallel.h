// How the panel GEMMs (gemm_ops.cpp's bf16, gemm_int8_ops.cpp's int8) cut a call into tasks for torch's
// threads: whole panels and every row, so that each weight is read from memory once per call; where the
// panels are too few for the threads (12 panels of a 576-wide projection on 16 threads), the rows are
// cut into runs of `row_unit` rows as well.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace batchgen::cpu {

// Calls run(first_row, row_count, panel_begin, panel_end) over tasks covering rows x panels, on torch's
// threads; the panels of one call follow each other, so each can prefetch the next.
template <typename Run>
void parallel_panels(int64_t rows, int64_t panels, int64_t row_unit, const Run& run) {
  if (rows == 0 || panels == 0) return;
  const int64_t units = (rows + row_unit - 1) / row_unit;
  const int64_t threads = at::get_num_threads();
  const int64_t row_runs = std::clamp<int64_t>((2 * threads + panels - 1) / panels, 1, units);
  at::parallel_for(0, row_runs * panels, 1, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t part = begin / panels, panel = begin % panels;
      const int64_t last = std::min(end, (part + 1) * panels);
      const int64_t first_row = part * units / row_runs * row_unit;
      const int64_t end_row = std::min(rows, (part + 1) * units / row_runs * row_unit);
      run(first_row, end_row - first_row, panel, panel + (last - begin));
      begin = last;
    }
  });
}

}  // namespace batchgen::cpu
