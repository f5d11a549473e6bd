// CPU element-wise ops of a decoder layer: RMSNorm (with the residual add fused in) and the rotary
// embedding. Each is one pass over its rows where torch needs 4-8 ops and as many trips through
// memory. (SiLU-and-multiply runs in the epilogue of the packed GEMMs, layers/linear.py.) Every intermediate the Hugging Face models round to the
// activation dtype is rounded here too (round(w * round(x * inv_rms)) and so on), so bf16 and
// fp16 results follow transformers' own arithmetic, not just float32 math rounded once.
//
// Plain C++ loops: the library's AVX2 baseline lets the compiler vectorise them, and these ops
// are bound by memory, not arithmetic. float32 and bfloat16 only: float16's portable conversions
// do not vectorise, and batchgen.ops runs torch for float16.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/dtype.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// Round a float through the activation dtype, as a separate torch op would.
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Rows of `cols` elements at (i0 * stride0 + i1 * stride1) for a 2-D or 3-D tensor whose last
// dimension is contiguous; a 2-D tensor is a 3-D one with a single middle index.
struct Rows {
  int64_t n0, n1, stride0, stride1, cols;

  static Rows of(const torch::Tensor& t) {
    if (t.dim() == 2) return {t.size(0), 1, t.stride(0), 0, t.size(1)};
    return {t.size(0), t.size(1), t.stride(0), t.stride(1), t.size(2)};
  }
  int64_t offset(int64_t row) const { return (row / n1) * stride0 + (row % n1) * stride1; }
  int64_t count() const { return n0 * n1; }
  // Rows per parallel chunk: about 16k elements, so small calls stay on one thread.
  int64_t grain() const { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1)); }
};

template <typename T>
T* ptr(torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}
template <typename T>
const T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

// out = round(w * round(x * inv_rms(x))); out may be x itself.
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(w[i]) * round_to<T>(to_float(x[i]) * inv));
}

template <typename T>
void rms_norm_impl(torch::Tensor& out, const torch::Tensor& input, const torch::Tensor& weight, float eps) {
  const Rows in = Rows::of(input), to = Rows::of(out);
  const T* x = ptr<T>(input);
  const T* w = ptr<T>(weight);
  T* y = ptr<T>(out);
  at::parallel_for(0, in.count(), in.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x + in.offset(r), w, y + to.offset(r), in.cols, eps);
  });
}

template <typename T>
void fused_add_rms_norm_impl(torch::Tensor& input, torch::Tensor& residual, const torch::Tensor& weight,
                             float eps) {
  const Rows in = Rows::of(input), res = Rows::of(residual);
  T* x = ptr<T>(input);
  T* r = ptr<T>(residual);
  const T* w = ptr<T>(weight);
  at::parallel_for(0, in.count(), in.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* xr = x + in.offset(row);
      T* rr = r + res.offset(row);
#pragma omp simd
      for (int64_t i = 0; i < in.cols; ++i) rr[i] = from_float<T>(to_float(rr[i]) + to_float(xr[i]));
      norm_row(rr, w, xr, in.cols, eps);
    }
  });
}

// x[:half], x[half:] -> x1 * cos - x2 * sin, x2 * cos + x1 * sin: Llama's rotate-half layout, with
// cos and sin rounded to the activation dtype and each product and sum rounded, as transformers
// computes `x * cos + rotate_half(x) * sin`.
// The table is float32 or x's dtype (a model cast to bf16 takes its buffers along; rounding
// twice to bf16 is rounding once).
template <typename T, typename Table>
void rotary_impl(const torch::Tensor& positions, torch::Tensor& x, const torch::Tensor& cos_sin_cache) {
  const Rows rows = Rows::of(x);
  const int64_t num_heads = rows.n1, half = rows.cols / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const Table* cache = ptr<Table>(cos_sin_cache);
  T* data = ptr<T>(x);
  at::parallel_for(0, rows.n0, std::max<int64_t>(1, rows.grain() / num_heads), [&](int64_t begin, int64_t end) {
    float cos[512], sin[512];  // head_dim <= 1024 (checked by the caller)
    for (int64_t t = begin; t < end; ++t) {
      const Table* angles = cache + pos[t] * rows.cols;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        cos[i] = round_to<T>(to_float(angles[i]));
        sin[i] = round_to<T>(to_float(angles[half + i]));
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x1 = data + t * rows.stride0 + h * rows.stride1;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]);
          x1[i] = from_float<T>(round_to<T>(a * cos[i]) - round_to<T>(b * sin[i]));
          x2[i] = from_float<T>(round_to<T>(b * cos[i]) + round_to<T>(a * sin[i]));
        }
      }
    }
  });
}

// Calls body(T{}) with T the storage type of `dtype`.
template <typename Body>
void dispatch(torch::ScalarType dtype, const Body& body) {
  switch (dtype) {
    case torch::kFloat32: return body(float{});
    case torch::kBFloat16: return body(BF16{});
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", dtype);
  }
}

}  // namespace

void rms_norm(torch::Tensor& out, const torch::Tensor& input, const torch::Tensor& weight, double eps) {
  dispatch(input.scalar_type(), [&](auto tag) { rms_norm_impl<decltype(tag)>(out, input, weight, eps); });
}

void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  dispatch(input.scalar_type(),
           [&](auto tag) { fused_add_rms_norm_impl<decltype(tag)>(input, residual, weight, eps); });
}

void rotary_embedding(const torch::Tensor& positions, torch::Tensor& x, const torch::Tensor& cos_sin_cache) {
  const int64_t num_positions = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < num_positions, "rotary_embedding: positions[", t, "] = ", pos[t],
                      " is outside the cache's ", num_positions, " positions");
  }
  const bool float_table = cos_sin_cache.scalar_type() == torch::kFloat32;
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    float_table ? rotary_impl<T, float>(positions, x, cos_sin_cache) : rotary_impl<T, T>(positions, x, cos_sin_cache);
  });
}

}  // namespace batchgen::cpu
