// The torch-free part of the int8 GEMM shared by every loop (gemm_int8.h): the per-row quantization of the
// activations, compiled for the library's baseline. (The float epilogue is the kernel table's, layer_impl.h.)
#include "cpu/gemm_int8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu/dtype.h"
#include "cpu/int8_quantize.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace batchgen::cpu {

namespace {

#ifdef __AVX2__
// x[k .. k + 8) as float32.
template <typename T>
__m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, BF16>) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else {
    return _mm256_loadu_ps(x);
  }
}
#endif

template <typename T>
float max_magnitude(const T* x, int64_t depth) {
  float amax = 0.0f;
  int64_t k = 0;
#ifdef __AVX2__
  __m256 vmax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; k + 8 <= depth; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float lane : lanes) amax = std::max(amax, lane);
#endif
  for (; k < depth; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
  return amax;
}

}  // namespace

template <typename T>
float quantize_int8_row(const T* x, int64_t depth, int64_t padded_depth, uint8_t* q) {
  const float amax = max_magnitude(x, depth);
  const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
  int64_t k = 0;
#ifdef __AVX2__
  // The loop below, 8 at a time: the same IEEE quotient, the same rounding (half to even), the same clamp
  // (minps/maxps return their second operand for NaN: 127 first, so NaN passes, then -127 takes it), the zero
  // point added exactly in float32. 32 at a time, four vectors narrow to bytes in three packs and a permute
  // (the packs work within 128-bit lanes), where one vector took an extract and two packs for 8 bytes.
  const __m256 divisor = _mm256_set1_ps(scale), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
  const __m256 zero_point = _mm256_set1_ps(static_cast<float>(kInt8ZeroPoint));
  const auto offset = [&](int64_t at) {
    const __m256 v = _mm256_round_ps(_mm256_div_ps(load8(x + at), divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_add_ps(_mm256_max_ps(_mm256_min_ps(top, v), bottom), zero_point));
  };
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; k + 32 <= depth; k += 32) {
    const __m256i words = _mm256_packus_epi32(offset(k), offset(k + 8));
    const __m256i bytes = _mm256_packus_epi16(words, _mm256_packus_epi32(offset(k + 16), offset(k + 24)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; k + 8 <= depth; k += 8) {
    const __m256i words = offset(k);
    const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packus_epi16(halves, halves));
  }
#endif
  for (; k < depth; ++k) {
    float v = std::rint(to_float(x[k]) / scale);  // the default rounding mode, half to even
    v = v > 127.0f ? 127.0f : (v >= -127.0f ? v : -127.0f);  // NaN to -127
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(v) + kInt8ZeroPoint);
  }
  std::fill(q + depth, q + padded_depth, static_cast<uint8_t>(kInt8ZeroPoint));
  return scale;
}

template float quantize_int8_row<float>(const float*, int64_t, int64_t, uint8_t*);
template float quantize_int8_row<BF16>(const BF16*, int64_t, int64_t, uint8_t*);

}  // namespace batchgen::cpu
