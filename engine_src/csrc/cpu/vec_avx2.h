// 8 floats in an AVX2 register (with FMA and F16C), the x86-64 baseline of the build.
#pragma once
#include <immintrin.h>

#include "cpu/kernels.h"

namespace batchgen::cpu::avx2 {

struct Vec {
  static constexpr int N = 8;
  static constexpr int kRegisters = 16;  // ymm0-15: what the loops' accumulators are sized by
  __m256 v;

  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float a) { return {_mm256_set1_ps(a)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const BF16* p) {  // bf16 is the high half of a float: widen and shift
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  static Vec load(const F16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  // N fp8 bytes placed in fp16 bits (sign to bit 15, the rest shifted left by `shift`, 7 or 8), as floats
  // (attention_impl.h's CachedLoad). Sign-extended to 16 bits and shifted, a byte's sign lands in bit 15;
  // the mask clears the sign's copies shifted in between it and the other bits (bit 14 for shift 7). One
  // shift and one mask instead of two each (separate sign and rest): the fp8 loops convert every element
  // they read, and this shortened them measurably on Zen 2 (scripts/PERF.md).
  static Vec load_fp8_as_half(const uint8_t* p, int shift) {
    const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i keep = _mm_set1_epi16(static_cast<int16_t>(0x8000 | (0xffff >> (9 - shift))));
    return {_mm256_cvtph_ps(_mm_and_si128(_mm_sll_epi16(wide, _mm_cvtsi32_si128(shift)), keep))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(F16* p) const {  // rounded to nearest even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }

inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float first_lane(Vec a) { return _mm256_cvtss_f32(a.v); }

// Sums of four vectors: a and b go to ab[0], ab[1], c and d to cd[0], cd[1].
inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* ab, float* cd) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a.v, b.v), _mm256_hadd_ps(c.v, d.v));  // [a b c d] per half
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  _mm_storel_pi(reinterpret_cast<__m64*>(ab), sums);
  _mm_storeh_pi(reinterpret_cast<__m64*>(cd), sums);
}

inline Vec round_nearest(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

// p * 2^n for integral n in [-126, 127]: n + 127 is the exponent field of 2^n.
inline Vec scale_pow2(Vec p, Vec n) {
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_mul_ps(p.v, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)))};
}

// Bit i set where lane i of x is >= limit.
inline uint32_t lanes_at_least(Vec x, float limit) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.v, _mm256_set1_ps(limit), _CMP_GE_OQ)));
}

// Bit i set where lane i of x is NaN.
inline uint32_t lanes_nan(Vec x) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q)));
}

inline Vec zero_if_below(Vec value, Vec x, float limit) {
  return {_mm256_and_ps(value.v, _mm256_cmp_ps(x.v, _mm256_set1_ps(limit), _CMP_GE_OQ))};
}

// Lane i of `below` where lane i of x < limit, else of `other`.
inline Vec blend_below(Vec x, float limit, Vec below, Vec other) {
  return {_mm256_blendv_ps(other.v, below.v, _mm256_cmp_ps(x.v, _mm256_set1_ps(limit), _CMP_LT_OQ))};
}

// The largest of the unsigned 32-bit lanes of m.
inline uint32_t reduce_max_u32(__m256i m) {
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1))));
}

// The largest of |x[j]|'s float32 bits for j < k, k advanced over the whole vectors of x[0 .. n) (float32 or
// bf16): the sign cleared, an unsigned maximum, two operations a vector (layer_impl.h's quantize_int8_row).
inline uint32_t magnitude_bits_max(const float* x, int64_t n, int64_t& k) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i m = _mm256_setzero_si256();
  for (k = 0; k + 8 <= n; k += 8) {
    m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)), magnitude));
  }
  return reduce_max_u32(m);
}

inline uint32_t magnitude_bits_max(const BF16* x, int64_t n, int64_t& k) {
  const __m256i magnitude = _mm256_set1_epi16(0x7fff);
  __m256i m = _mm256_setzero_si256();
  for (k = 0; k + 16 <= n; k += 16) {
    m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)), magnitude));
  }
  const __m256i wide = _mm256_max_epu32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(m)),
                                        _mm256_cvtepu16_epi32(_mm256_extracti128_si256(m, 1)));
  return reduce_max_u32(wide) << 16;
}

// q[k] = round_half_even(clamp(x[k] / scale, -127, 127)) + zero_point for k below the returned count (whole
// vectors; NaN to -127: minps and maxps return their second operand for NaN, 127 first, so NaN passes, then -127
// takes it): the int8 GEMM's activations (layer_impl.h's quantize_int8_row). The zero point is added exactly in
// float32. 32 at a time, four vectors narrow to bytes in three packs and a permute (the packs work within
// 128-bit lanes), where one vector took an extract and two packs for 8 bytes.
template <typename T>
inline int64_t quantize_int8_vectors(const T* x, int64_t n, float scale, int zero_point, uint8_t* q) {
  const Vec divisor = Vec::set1(scale);
  const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
  const __m256 offset = _mm256_set1_ps(static_cast<float>(zero_point));
  const auto bytes_of = [&](int64_t at) {
    const __m256 v = round_nearest(Vec::load(x + at) / divisor).v;
    return _mm256_cvtps_epi32(_mm256_add_ps(_mm256_max_ps(_mm256_min_ps(top, v), bottom), offset));
  };
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m256i words = _mm256_packus_epi32(bytes_of(k), bytes_of(k + 8));
    const __m256i bytes = _mm256_packus_epi16(words, _mm256_packus_epi32(bytes_of(k + 16), bytes_of(k + 24)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; k + 8 <= n; k += 8) {
    const __m256i words = bytes_of(k);
    const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packus_epi16(halves, halves));
  }
  return k;
}

// The mask of lanes [0, count), count 0 to 8; the first `count` floats of p (zeros after), and a store of x's first
// `count` lanes: nothing past them is touched.
inline __m256i first_lanes(int count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load_first(const float* p, int count) { return {_mm256_maskload_ps(p, first_lanes(count))}; }
inline void store_first(Vec x, float* p, int count) { _mm256_maskstore_ps(p, first_lanes(count), x.v); }

// x's bf16 bits, rounded as from_float rounds (nearest even, subnormals kept, a NaN quieted): the bf16 GEMM's
// stores (gemm_avx2.h). The 32-bit results fit 16 bits, so the unsigned pack keeps them; it packs within 128-bit
// halves, and the permute brings the two halves' four together.
inline __m128i bf16_bits(Vec x) {
  const __m256i u = _mm256_castps_si256(x.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
}

inline void store_bf16(Vec x, BF16* dst) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bf16_bits(x)); }

inline void store_bf16(Vec x, BF16* dst, int count) {
  alignas(16) BF16 bits[Vec::N];
  _mm_store_si128(reinterpret_cast<__m128i*>(bits), bf16_bits(x));
  for (int i = 0; i < count; ++i) dst[i] = bits[i];
}

}  // namespace batchgen::cpu::avx2
