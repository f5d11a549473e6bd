// What the sampler needs of every row of logits, in one read of the model's own (bf16 or float32)
// logits: the greedy choice and the log of the softmax's normaliser. torch needs a float32 copy
// of the whole batch, then argmax and logsumexp over it (~2 ms a step at 40 rows of a 49k
// vocabulary on 2 cores).
//
// Plain C++ loops that GCC vectorises on the library's AVX2 baseline.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/dtype.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// exp(x) for x <= 0 (relative error ~1e-7): 2^n * e^r with |r| <= ln2 / 2 and a degree-7 Taylor
// polynomial. No library call and no float comparison, so that GCC vectorises it (a float clamp
// made it emit blends around the work, 4x slower): x is clamped to -100 on its bits, and 2^n to
// at least 2^-126, so exp(x) for x < -87 comes out ~1e-38 instead of a denormal or 0, which
// changes no sum of terms near 1.
inline float exp_nonpositive(float x) {
  constexpr uint32_t kMinusHundred = 0xc2c80000u;
  const uint32_t bits = float_bits(x);
  x = bits_float(bits > kMinusHundred ? kMinusHundred : bits);  // for negative floats, more bits = smaller
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t e = static_cast<int32_t>(n);
  e = e < -126 ? -126 : e;
  return p * bits_float(static_cast<uint32_t>(e + 127) << 23);
}

// Index of the first maximum of row[0 .. n) (the first NaN if there is one, as torch.argmax),
// and log(sum(exp(row))).
template <typename T>
void summarise_row(const T* row, int64_t n, int64_t& argmax, float& log_total) {
  float best = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(row[i]);
    best = v > best ? v : best;
    nan |= v != v;
  }
  // The first index holding `best` (or a NaN): chunks are tested whole, vectorised, then one is
  // searched element by element.
  constexpr int64_t kChunk = 64;
  argmax = 0;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t end = c + kChunk < n ? c + kChunk : n;
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c; i < end; ++i) {
      const float v = to_float(row[i]);
      hit |= nan ? v != v : v == best;
    }
    if (!hit) continue;
    for (int64_t i = c; i < end; ++i) {
      const float v = to_float(row[i]);
      if (nan ? v != v : v == best) {
        argmax = i;
        break;
      }
    }
    break;
  }
  if (nan || best == -std::numeric_limits<float>::infinity() || best == std::numeric_limits<float>::infinity()) {
    log_total = nan ? std::numeric_limits<float>::quiet_NaN() : best;
    return;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += exp_nonpositive(to_float(row[i]) - best);
  log_total = best + std::log(sum);
}

template <typename T>
void summarise(const torch::Tensor& logits, torch::Tensor& argmax, torch::Tensor& log_total) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* data = reinterpret_cast<const T*>(logits.data_ptr());
  int64_t* index = argmax.data_ptr<int64_t>();
  float* total = log_total.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) summarise_row(data + r * stride, n, index[r], total[r]);
  });
}

}  // namespace

void argmax_logsumexp(const torch::Tensor& logits, torch::Tensor& argmax, torch::Tensor& log_total) {
  if (logits.scalar_type() == torch::kBFloat16) {
    summarise<BF16>(logits, argmax, log_total);
  } else {
    summarise<float>(logits, argmax, log_total);
  }
}

}  // namespace batchgen::cpu
