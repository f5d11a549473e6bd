// Row kernels of the element-wise layer ops (layer_ops.cpp) and of the sampler's row summary,
// weights and candidates (sampling_ops.cpp), compiled once per instruction set by kernel_table_impl.h after
// attention_impl.h, whose vector exp the sampler's kernels use. Mostly plain loops, vectorised by the
// compiler for the target at hand: AVX-512 runs the bf16 conversions, which dominate these
// memory-light loops, twice as wide as the AVX2 baseline.
//
// Every intermediate that transformers rounds to the activation dtype is rounded here too
// (round(w * round(x * inv_rms)), round(round(a * cos) - round(b * sin))), so bf16 results follow
// transformers' own arithmetic rather than float32 math rounded once.
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including layer_impl.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/dtype.h"
#include "cpu/gemm_int8.h"
#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

#ifdef BATCHGEN_DOT_BF16
// The bf16 rows of the kernels below in whole vectors with the processor's rounding (vcvtneps2bf16: one
// instruction for from_float's seven, the same bits, NaN included, but for subnormals, which it flushes to zero):
// each returns how many elements it did, stopping before the first vector where a rounding meets a subnormal,
// for the exact loop to go on from there. A vector is read before it is written, so out may be x.

// norm_row's second pass: out = round(w * round(x * inv)).
inline int64_t norm_vectors(const BF16* x, const BF16* w, BF16* out, int64_t n, float inv) {
  int64_t i = 0;
  for (; i + Vec::N <= n; i += Vec::N) {
    __mmask16 subnormal = 0;
    const Vec y = Vec::load(w + i) * round_bf16(Vec::load(x + i) * Vec::set1(inv), subnormal);
    if ((subnormal | subnormal_lanes(y)) != 0) break;
    store_bf16(y, out + i);
  }
  return i;
}

// add_norm_row's sum: residual = round(residual + x).
inline int64_t add_vectors(BF16* residual, const BF16* x, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::N <= n; i += Vec::N) {
    const Vec y = Vec::load(residual + i) + Vec::load(x + i);
    if (subnormal_lanes(y) != 0) break;
    store_bf16(y, residual + i);
  }
  return i;
}

// rotary_row's rotation (below).
inline int64_t rotary_vectors(BF16* x1, BF16* x2, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
  for (; i + Vec::N <= half; i += Vec::N) {
    __mmask16 subnormal = 0;
    const Vec a = Vec::load(x1 + i), b = Vec::load(x2 + i), c = Vec::load(cos + i), s = Vec::load(sin + i);
    const Vec y1 = round_bf16(a * c, subnormal) - round_bf16(b * s, subnormal);
    const Vec y2 = round_bf16(b * c, subnormal) + round_bf16(a * s, subnormal);
    if ((subnormal | subnormal_lanes(y1) | subnormal_lanes(y2)) != 0) break;
    store_bf16(y1, x1 + i);
    store_bf16(y2, x2 + i);
  }
  return i;
}

// silu_mul_row's: out = round(round(silu(round(gate))) * round(up)).
inline int64_t silu_mul_vectors(const float* gate, const float* up, BF16* out, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::N <= n; i += Vec::N) {
    __mmask16 subnormal = 0;
    const Vec g = round_bf16(Vec::load(gate + i), subnormal);
    const Vec product = round_bf16(silu(g), subnormal) * round_bf16(Vec::load(up + i), subnormal);
    if ((subnormal | subnormal_lanes(product)) != 0) break;
    store_bf16(product, out + i);
  }
  return i;
}
#endif

// out = round(w * round(x * inv_rms(x))); out may be x.
template <typename T>
void norm_row(const void* x_, const void* w_, void* out_, int64_t n, float eps) {
  const T* x = static_cast<const T*>(x_);
  const T* w = static_cast<const T*>(w_);
  T* out = static_cast<T*>(out_);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  int64_t done = 0;
#ifdef BATCHGEN_DOT_BF16
  if constexpr (std::is_same_v<T, BF16>) done = norm_vectors(x, w, out, n, inv);
#endif
#pragma omp simd
  for (int64_t i = done; i < n; ++i) out[i] = from_float<T>(to_float(w[i]) * round_to<T>(to_float(x[i]) * inv));
}

// residual = round(residual + x), then x = norm(residual).
template <typename T>
void add_norm_row(void* x_, void* residual_, const void* w, int64_t n, float eps) {
  T* x = static_cast<T*>(x_);
  T* residual = static_cast<T*>(residual_);
  int64_t done = 0;
#ifdef BATCHGEN_DOT_BF16
  if constexpr (std::is_same_v<T, BF16>) done = add_vectors(residual, x, n);
#endif
#pragma omp simd
  for (int64_t i = done; i < n; ++i) residual[i] = from_float<T>(to_float(residual[i]) + to_float(x[i]));
  norm_row<T>(residual, w, x, n, eps);
}

// x[:half], x[half:] -> round(round(a * cos) - round(b * sin)), round(round(b * cos) + round(a * sin)):
// Llama's rotate-half layout, as transformers computes x * cos + rotate_half(x) * sin. cos and
// sin hold the token's values already rounded to the activation dtype.
template <typename T>
void rotary_row(void* x_, const float* cos, const float* sin, int64_t half) {
  T* x1 = static_cast<T*>(x_);
  T* x2 = x1 + half;
  int64_t done = 0;
#ifdef BATCHGEN_DOT_BF16
  if constexpr (std::is_same_v<T, BF16>) done = rotary_vectors(x1, x2, cos, sin, half);
#endif
#pragma omp simd
  for (int64_t i = done; i < half; ++i) {
    const float a = to_float(x1[i]), b = to_float(x2[i]);
    x1[i] = from_float<T>(round_to<T>(a * cos[i]) - round_to<T>(b * sin[i]));
    x2[i] = from_float<T>(round_to<T>(b * cos[i]) + round_to<T>(a * sin[i]));
  }
}

// The summary of row[begin, end) (see BlockSummary), in passes over a block small enough to stay in
// the level-1 cache: the maximum (and whether a NaN is there), the first index holding it, the sum of
// exp(x - max). end - begin is a multiple of Vec::N except in a row's last block.
template <typename T>
void summarise_block(const void* row_, int64_t begin, int64_t end, BlockSummary* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const T* row = static_cast<const T*>(row_);
  const int64_t whole = begin + (end - begin) / Vec::N * Vec::N;
  Vec vmax = Vec::set1(kNegInf);
  uint32_t nan = 0;
  for (int64_t i = begin; i < whole; i += Vec::N) {
    const Vec x = Vec::load(row + i);
    vmax = max(vmax, x);
    nan |= lanes_nan(x);
  }
  float best = reduce_max(vmax);
  for (int64_t i = whole; i < end; ++i) {
    const float v = to_float(row[i]);
    best = v > best ? v : best;
    nan |= v != v;
  }
  out->nan = nan != 0;
  out->max = best;
  out->sum = 0.0f;
  out->argmax = begin;
  if (nan != 0) {  // the first NaN, as torch.argmax
    for (int64_t i = begin; i < end; ++i) {
      const float v = to_float(row[i]);
      if (v != v) {
        out->argmax = i;
        return;
      }
    }
  }
  // The first index holding `best`: x >= best only there.
  int64_t i = begin;
  uint32_t hits = 0;
  for (; i < whole; i += Vec::N) {
    hits = lanes_at_least(Vec::load(row + i), best);
    if (hits != 0) break;
  }
  if (hits != 0) {
    out->argmax = i + __builtin_ctz(hits);
  } else {
    for (; i < end && !(to_float(row[i]) >= best); ++i) {
    }
    out->argmax = i < end ? i : begin;
  }
  if (std::isinf(best)) return;  // -inf: nothing allowed; +inf: the row's logsumexp is +inf
  const Vec shift = Vec::set1(-best);
  Vec sum = Vec::zero();
  for (i = begin; i < whole; i += Vec::N) sum = sum + exp_nonpositive(Vec::load(row + i) + shift);
  if (whole < end) {
    float tail[Vec::N];
    for (int j = 0; j < Vec::N; ++j) tail[j] = whole + j < end ? to_float(row[whole + j]) : kNegInf;
    sum = sum + exp_nonpositive(Vec::load(tail) + shift);  // exp(-inf) is 0
  }
  out->sum = reduce_add(sum);
}

// The top k of row[begin, end) into `list`: a vector compare against the list's worst value skips every
// vector with nothing to offer, which once the list is full is almost all of them (random order: about
// k ln(n / k) offers in all).
template <typename T>
void top_k_block(const void* row_, int64_t begin, int64_t end, TopKList* list) {
  const T* row = static_cast<const T*>(row_);
  constexpr uint32_t kAllLanes = (1u << Vec::N) - 1u;
  const int64_t whole = begin + (end - begin) / Vec::N * Vec::N;
  for (int64_t i = begin; i < whole; i += Vec::N) {
    const Vec x = Vec::load(row + i);
    uint32_t hits = list->full() ? lanes_at_least(x, list->worst_value()) | lanes_nan(x) : kAllLanes;
    for (; hits != 0; hits &= hits - 1) {
      const int lane = __builtin_ctz(hits);
      list->offer(to_float(row[i + lane]), i + lane);
    }
  }
  for (int64_t i = whole; i < end; ++i) list->offer(to_float(row[i]), i);
}

// The sampler's weights of a row of logits (float32, or bf16 read as float32): w = exp((x - max x)
// / temperature), 1 at the maximum and 0 for -inf logits (banned tokens); returns their sum.
// temperature > 0.
template <typename T>
float weights_row(const void* logits, int64_t n, float temperature, float* w) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const T* x = static_cast<const T*>(logits);
  Vec vmax = Vec::set1(kNegInf);
  int64_t i = 0;
  for (; i + Vec::N <= n; i += Vec::N) vmax = max(vmax, Vec::load(x + i));
  float best = reduce_max(vmax);
  for (; i < n; ++i) best = to_float(x[i]) > best ? to_float(x[i]) : best;
  const float inv = 1.0f / temperature;
  const Vec vinv = Vec::set1(inv), shift = Vec::set1(-best * inv);
  Vec sum = Vec::zero();
  for (i = 0; i + Vec::N <= n; i += Vec::N) {
    const Vec p = exp_nonpositive(fma(Vec::load(x + i), vinv, shift));
    p.store(w + i);
    sum = sum + p;
  }
  float tail[Vec::N];
  for (int j = 0; j < Vec::N; ++j) tail[j] = i + j < n ? to_float(x[i + j]) : kNegInf;
  const Vec p = exp_nonpositive(fma(Vec::load(tail), vinv, shift));  // exp(-inf) is 0
  p.store(tail);
  for (int j = 0; i + j < n; ++j) w[i + j] = tail[j];
  return reduce_add(sum + p);
}

// One row of a cache write into fp8 (reshape_and_cache): float_to_fp8 of x / scale, whose branch-free form the
// loop vectorizes (on AVX2 given -fno-trapping-math, setup.py). Out of line, the format fixed per copy: inlined
// into quantize_fp8_row's dispatch, GCC left the e4m3 loop scalar (the cache write of 2,048 SmolLM2 tokens on
// Zen 4: scripts/PERF.md).
template <typename T, KVFormat F>
__attribute__((noinline)) void quantize_fp8_row_as(const T* x, uint8_t* dst, int64_t n, float scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_fp8(to_float(x[i]) / scale, F);
}

template <typename T>
void quantize_fp8_row(const void* x, uint8_t* dst, int64_t n, float scale, KVFormat f) {
  const T* src = static_cast<const T*>(x);
  if (f == KVFormat::fp8_e5m2) return quantize_fp8_row_as<T, KVFormat::fp8_e5m2>(src, dst, n, scale);
  quantize_fp8_row_as<T, KVFormat::fp8_e4m3>(src, dst, n, scale);
}

// out = round(round(silu(round(gate))) * round(up)): transformers' MLP in the activation dtype (gate and up
// projected to it, silu rounded, then the product), from float32 gate and up (silu: attention_impl.h).
template <typename T>
void silu_mul_row(const float* gate, const float* up, void* out_, int64_t n) {
  constexpr int64_t kChunk = 64;  // a panel's row (48 columns) in one pass
  static_assert(kChunk % Vec::N == 0);
  T* out = static_cast<T*>(out_);
  int64_t i = 0;
#ifdef BATCHGEN_DOT_BF16
  if constexpr (std::is_same_v<T, BF16>) i = silu_mul_vectors(gate, up, out, n);
#endif
  alignas(64) float g[kChunk], s[kChunk];
  for (; i < n; i += kChunk) {
    const int64_t count = n - i < kChunk ? n - i : kChunk, vectors = (count + Vec::N - 1) / Vec::N * Vec::N;
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) g[j] = round_to<T>(gate[i + j]);
    for (int64_t j = count; j < vectors; ++j) g[j] = 0.0f;
    for (int64_t j = 0; j < vectors; j += Vec::N) silu(Vec::load(g + j)).store(s + j);
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) out[i + j] = from_float<T>(round_to<T>(s[j]) * round_to<T>(up[i + j]));
  }
}

// The int8 GEMM's activations, one row (kernels.h's QuantizeInt8RowFn). The largest magnitude is taken on the
// bits (a float's magnitude orders as its bits do, NaN's above infinity's), so a NaN anywhere shows in the
// result whatever the lanes; whole vectors in the table's magnitude_bits_max and quantize_int8_vectors, the rest
// here with the same arithmetic.
template <typename T>
float quantize_int8_row(const void* x_, int64_t depth, int64_t padded_depth, uint8_t* q) {
  const T* x = static_cast<const T*>(x_);
  int64_t k = 0;
  uint32_t bits = magnitude_bits_max(x, depth, k);
  for (; k < depth; ++k) bits = std::max(bits, float_bits(to_float(x[k])) & 0x7fffffffu);
  const float amax = bits_float(bits);
  const float scale = bits <= 0x7f800000u && amax > 0.0f ? amax / 127.0f : 1.0f;  // a NaN: torch's amax is NaN
  k = quantize_int8_vectors(x, depth, scale, kInt8ZeroPoint, q);
  for (; k < depth; ++k) {
    float v = std::rint(to_float(x[k]) / scale);  // the default rounding mode, half to even
    v = v > 127.0f ? 127.0f : (v >= -127.0f ? v : -127.0f);  // NaN to -127
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(v) + kInt8ZeroPoint);
  }
  std::fill(q + depth, q + padded_depth, static_cast<uint8_t>(kInt8ZeroPoint));
  return scale;
}

#ifdef BATCHGEN_DOT_BF16
// finish_int8_row into bf16 with the processor's rounding (as norm_vectors and the others), the same arithmetic;
// false, having written nothing, where any result is subnormal (which the instruction flushes to zero).
template <bool kBias>
inline bool finish_int8_row_bf16(const int32_t* sums, const int32_t* compensation, float x_scale,
                                 const float* w_scale, const float* bias, BF16* out) {
  constexpr int kVectors = kInt8PanelCols / Vec::N;
  static_assert(kVectors * Vec::N == kInt8PanelCols);
  Vec y[kVectors];
  __mmask16 subnormal = 0;
  for (int v = 0; v < kVectors; ++v) {
    const __m512i diff = _mm512_sub_epi32(_mm512_loadu_si512(sums + v * Vec::N),
                                          _mm512_loadu_si512(compensation + v * Vec::N));
    y[v] = Vec{_mm512_cvtepi32_ps(diff)} * Vec::set1(x_scale) * Vec::load(w_scale + v * Vec::N);
    if constexpr (kBias) y[v] = y[v] + Vec::load(bias + v * Vec::N);
    subnormal |= subnormal_lanes(y[v]);
  }
  if (subnormal != 0) return false;
  for (int v = 0; v < kVectors; ++v) store_bf16(y[v], out + v * Vec::N);
  return true;
}
#endif

// One row of the int8 GEMM's epilogue over a whole panel: y = float(sum - compensation) * x_scale * w_scale
// (+ bias), rounded left to right as the torch reference rounds it, into out[0 .. kInt8PanelCols). A bias of
// zero is not the same as none: -0 + 0 is +0.
template <typename Out, bool kBias>
inline void finish_int8_row(const int32_t* sums, const int32_t* compensation, float x_scale, const float* w_scale,
                            const float* bias, Out* out) {
#ifdef BATCHGEN_DOT_BF16
  if constexpr (std::is_same_v<Out, BF16>) {
    if (finish_int8_row_bf16<kBias>(sums, compensation, x_scale, w_scale, bias, out)) return;
  }
#endif
#pragma omp simd
  for (int c = 0; c < kInt8PanelCols; ++c) {
    float y = static_cast<float>(sums[c] - compensation[c]) * x_scale * w_scale[c];
    if constexpr (kBias) y = y + bias[c];
    out[c] = from_float<Out>(y);
  }
}

template <typename Out, bool kBias>
void finish_int8_rows_as(const Int8GemmArgs& a, int64_t row, int64_t count, int64_t col, const int32_t* sums,
                         const int32_t* compensation) {
  const int64_t width = std::min<int64_t>(kInt8PanelCols, a.cols - col);
  alignas(64) float padded_bias[kInt8PanelCols];  // the last panel's bias ends with the columns
  const float* bias = kBias ? a.bias + col : nullptr;
  if (kBias && width < kInt8PanelCols) {
    std::fill(std::copy(bias, bias + width, padded_bias), padded_bias + kInt8PanelCols, 0.0f);
    bias = padded_bias;
  }
  for (int64_t r = 0; r < count; ++r) {
    Out* out = static_cast<Out*>(a.out) + (row + r) * a.out_stride + col;
    const int32_t* row_sums = sums + r * kInt8PanelCols;
    const float x_scale = a.x_scale[row + r];
    if (width == kInt8PanelCols) {
      finish_int8_row<Out, kBias>(row_sums, compensation, x_scale, a.w_scale + col, bias, out);
    } else {
      alignas(64) Out part[kInt8PanelCols];
      finish_int8_row<Out, kBias>(row_sums, compensation, x_scale, a.w_scale + col, bias, part);
      std::copy(part, part + width, out);
    }
  }
}

void finish_int8_rows(const Int8GemmArgs& a, int64_t row, int64_t count, int64_t col, const int32_t* sums,
                      bool offset_sums) {
  static constexpr int32_t kNoCompensation[kInt8PanelCols] = {};
  const int32_t* compensation = offset_sums ? a.compensation + col : kNoCompensation;
  if (a.out_kind == Int8Out::i32) {
    const int64_t width = std::min<int64_t>(kInt8PanelCols, a.cols - col);
    for (int64_t r = 0; r < count; ++r) {
      int32_t* out = static_cast<int32_t*>(a.out) + (row + r) * a.out_stride + col;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) out[c] = sums[r * kInt8PanelCols + c] - compensation[c];
    }
  } else if (a.out_kind == Int8Out::f32) {
    if (a.bias != nullptr) return finish_int8_rows_as<float, true>(a, row, count, col, sums, compensation);
    finish_int8_rows_as<float, false>(a, row, count, col, sums, compensation);
  } else {
    if (a.bias != nullptr) return finish_int8_rows_as<BF16, true>(a, row, count, col, sums, compensation);
    finish_int8_rows_as<BF16, false>(a, row, count, col, sums, compensation);
  }
}

// The sampler's candidates of a row of weights (from weights_row): the ids of the weights >= threshold
// and > 0, in id order, into ids; their sum into *mass (summed in id order); returns their count.
// The comparison is vectorised and only the hits are visited, so a low threshold (thousands of
// candidates spread over the vocabulary) costs about what a high one does.
int64_t collect_row(const float* w, int64_t n, float threshold, int32_t* ids, float* mass) {
  int64_t count = 0;
  float sum = 0.0f;
  auto take = [&](int64_t id) {
    if (!(w[id] > 0.0f)) return;  // threshold 0: zero weights (banned tokens) are no candidates
    ids[count++] = static_cast<int32_t>(id);
    sum += w[id];
  };
  int64_t i = 0;
  for (; i + Vec::N <= n; i += Vec::N) {
    for (uint32_t bits = lanes_at_least(Vec::load(w + i), threshold); bits != 0; bits &= bits - 1) {
      take(i + __builtin_ctz(bits));
    }
  }
  for (; i < n; ++i) {
    if (w[i] >= threshold) take(i);
  }
  *mass = sum;
  return count;
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
