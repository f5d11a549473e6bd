// CPU element-wise ops of a decoder layer: RMSNorm (with the residual add fused in) and the rotary
// embedding. Each is one pass over its rows where torch needs 4-8 ops and as many trips through
// memory. (SiLU-and-multiply runs in the epilogue of the packed GEMMs, layers/linear.py.) This
// file walks the rows on torch's threads; the row kernels (layer_impl.h) come from the kernel
// table of the active instruction set. float32 and bfloat16 only: float16's portable
// conversions do not vectorise, and batchgen.ops runs torch for float16.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "cpu/dtype.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// Rows of `cols` elements at (i0 * stride0 + i1 * stride1) for a 2-D or 3-D tensor whose last
// dimension is contiguous; a 2-D tensor is a 3-D one with a single middle index.
struct Rows {
  int64_t n0, n1, stride0, stride1, cols;
  char* data;
  int64_t element;

  static Rows of(const torch::Tensor& t) {
    char* data = static_cast<char*>(t.data_ptr());
    if (t.dim() == 2) return {t.size(0), 1, t.stride(0), 0, t.size(1), data, t.element_size()};
    return {t.size(0), t.size(1), t.stride(0), t.stride(1), t.size(2), data, t.element_size()};
  }
  void* row(int64_t r) const { return data + ((r / n1) * stride0 + (r % n1) * stride1) * element; }
  int64_t count() const { return n0 * n1; }
  // Rows per parallel chunk: about 16k elements, so small calls stay on one thread.
  int64_t grain() const { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1)); }
};

template <typename T, typename Table>
void rotary_impl(const int64_t* positions, const Rows& rows, const Table* table, RotaryRowFn rotate) {
  const int64_t half = rows.cols / 2;
  at::parallel_for(0, rows.n0, std::max<int64_t>(1, rows.grain() / rows.n1), [&](int64_t begin, int64_t end) {
    float cos[512], sin[512];  // head_dim <= 1024 (checked by the caller)
    for (int64_t t = begin; t < end; ++t) {
      const Table* angles = table + positions[t] * rows.cols;
      for (int64_t i = 0; i < half; ++i) {
        cos[i] = to_float(from_float<T>(to_float(angles[i])));
        sin[i] = to_float(from_float<T>(to_float(angles[half + i])));
      }
      for (int64_t h = 0; h < rows.n1; ++h) rotate(rows.row(t * rows.n1 + h), cos, sin, half);
    }
  });
}

}  // namespace

void rms_norm(torch::Tensor& out, const torch::Tensor& input, const torch::Tensor& weight, double eps) {
  const Rows in = Rows::of(input), to = Rows::of(out);
  const NormRowFn norm = active_kernels().norm_row[static_cast<int>(dtype_of(input))];
  const void* w = weight.data_ptr();
  at::parallel_for(0, in.count(), in.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm(in.row(r), w, to.row(r), in.cols, static_cast<float>(eps));
  });
}

void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  const Rows in = Rows::of(input), res = Rows::of(residual);
  const AddNormRowFn add_norm = active_kernels().add_norm_row[static_cast<int>(dtype_of(input))];
  const void* w = weight.data_ptr();
  at::parallel_for(0, in.count(), in.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) add_norm(in.row(r), res.row(r), w, in.cols, static_cast<float>(eps));
  });
}

// The table is float32 or x's dtype (a model cast to bf16 takes its buffers along; rounding
// twice to bf16 is rounding once).
void rotary_embedding(const torch::Tensor& positions, torch::Tensor& x, const torch::Tensor& cos_sin_cache) {
  const int64_t num_positions = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < num_positions, "rotary_embedding: positions[", t, "] = ", pos[t],
                      " is outside the cache's ", num_positions, " positions");
  }
  const Rows rows = Rows::of(x);
  const RotaryRowFn rotate = active_kernels().rotary_row[static_cast<int>(dtype_of(x))];
  const void* table = cos_sin_cache.data_ptr();
  const bool float_table = cos_sin_cache.scalar_type() == torch::kFloat32;
  if (x.scalar_type() == torch::kFloat32) {
    rotary_impl<float>(pos, rows, static_cast<const float*>(table), rotate);
  } else if (float_table) {
    rotary_impl<BF16>(pos, rows, static_cast<const float*>(table), rotate);
  } else {
    rotary_impl<BF16>(pos, rows, static_cast<const BF16*>(table), rotate);
  }
}

}  // namespace batchgen::cpu
